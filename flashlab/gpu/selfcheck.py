"""``python -m flashlab selfcheck``: every GPU kernel once at small ragged shapes, against a reference.

Small enough to run under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` (``make sanitize``): ragged
shapes (n = 77, m = 131: neither a multiple of any tile), GQA (2 query heads on 1 K/V head), causal with n < m, and n
> m so that some rows see no key. ``forward [RUNG ...]``: the forward ladder against naive attention; ``backward-
decode [--quick]``: the backward and decoding kernels against float64; ``sparse [--quick]``: the block-sparse kernels
(``window=``, ``dilation=``, ``block_mask=``) against float64 with the same mask; no part: all three; ``decode``:
every decoding kernel alone at a few more shapes (GQA, ragged lengths, an empty cache, more rows than one block
holds), short enough for compute-sanitizer's racecheck. A kernel this GPU cannot run (its compute capability or
shared memory per block: the reasons of ``flashlab.gpu.plan``) is skipped with the reason. Nothing is timed or
written; the exit status is non-zero if any output is wrong.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import blocksparse, reference
from . import backward, decoding

PARTS = ("all", "forward", "backward-decode", "sparse", "decode")


def _verdict(bad: int) -> int:
    """Wait for the last kernel (so that a sanitizer reports it here), print the verdict, return ``bad``."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    print("selfcheck:", "all ok" if not bad else f"{bad} FAILED")
    return bad


def forward(names: list[str] | None = None) -> int:
    """Every forward rung of ``names`` (default: all) once per dtype and d at small ragged shapes, against naive
    attention in fp32 on the same rounded inputs. Returns the number of failures."""
    import cupy as cp

    from . import (
        HEAD_DIMS,
        HOPPER_RUNGS,
        RUNGS,
        attention,
        device_limits,
        forward_problem,
        from_bf16,
        naive_attention,
        to_bf16,
    )

    rungs = {**RUNGS, **HOPPER_RUNGS}  # the Hopper rungs report themselves skipped off sm_90
    names = names or list(rungs)
    rng = cp.random.default_rng(2)
    bad = 0
    for name in names:
        for dt in rungs[name].dtypes:
            for d in HEAD_DIMS:
                why = forward_problem(rungs[name], dt, d, True, device_limits(), avoid_spills=False)
                if why is not None:  # asked for by name, so a spill is no reason to skip it
                    print(f"{name:<12} {dt:<4} d={d:<4} skipped: {why}", flush=True)
                    continue
                for n, m, causal in ((77, 131, True), (131, 77, True), (77, 131, False)):
                    shape_q, shape_k = (1, 2, n, d), (1, 1, m, d)
                    q = rng.standard_normal(shape_q, dtype=cp.float32)
                    k = rng.standard_normal(shape_k, dtype=cp.float32)
                    v = rng.standard_normal(shape_k, dtype=cp.float32)
                    if dt == "bf16":
                        args = [to_bf16(x) for x in (q, k, v)]
                        q, k, v = (from_bf16(x) for x in args)
                    else:
                        args = [x.astype(np.float16 if dt == "f16" else np.float32) for x in (q, k, v)]
                    o, lse = attention(*args, causal=causal, kernel=name, bf16=dt == "bf16")
                    o = from_bf16(o) if dt == "bf16" else o.astype(cp.float32)
                    exact = (q, k, v) if dt == "bf16" else [x.astype(cp.float32) for x in args]
                    ref, lse_ref = naive_attention(*exact, causal=causal)  # fp32, on the rounded inputs
                    err = float(cp.abs(o - ref.astype(cp.float32)).max())
                    fin = cp.isfinite(lse_ref)
                    lerr = float(cp.abs(cp.where(fin, lse - lse_ref, 0)).max())
                    same_inf = bool((cp.isneginf(lse) == ~fin).all())
                    ok = err < 2e-2 and lerr < 1e-3 and same_inf
                    bad += not ok
                    print(f"{name:<12} {dt:<4} d={d:<4} n={n:<4} m={m:<4} causal={causal!s:<5} "
                          f"max|o-naive|={err:.1e} max|lse-naive|={lerr:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return _verdict(bad)


def backward_and_decode(quick: bool = False) -> int:
    """Every backward and decoding kernel once per dtype and d at small ragged shapes, against float64.

    ``quick``: one shape instead of three. Returns the number of failures.
    """
    import cupy as cp

    import flashlab.gpu as fgpu

    rng = np.random.default_rng(3)
    bad = 0
    try:
        backward._backward_plan(fgpu.HEAD_DIMS[0], "best", fgpu.device_limits())
    except ValueError as e:  # sm_75: no backward or decoding kernel runs here
        print(f"backward and decoding skipped: {e}", flush=True)
        return _verdict(bad)
    for dt in ("f16", "bf16"):
        for d in fgpu.HEAD_DIMS:
            shapes = ((77, 131, True), (131, 77, True), (77, 131, False))
            for n, m, causal in shapes[:1] if quick else shapes:
                x = [rng.standard_normal(s).astype(np.float32) for s in ((1, 2, n, d), (1, 1, m, d), (1, 1, m, d),
                                                                        (1, 2, n, d))]
                if dt == "bf16":
                    dev = [fgpu.to_bf16(cp.asarray(a)) for a in x]
                    x = [fgpu.from_bf16(a).get() for a in dev]
                else:
                    x = [a.astype(np.float16).astype(np.float32) for a in x]
                    dev = [cp.asarray(a.astype(np.float16)) for a in x]
                q, k, v, do = (a.astype(np.float64) for a in x)
                bf = dt == "bf16"

                def host(a, bf=bf):
                    return (fgpu.from_bf16(a) if bf else a.astype(cp.float32)).get().astype(np.float64)

                o, lse = fgpu.attention(*dev[:3], causal=causal, bf16=bf)
                want = reference.attention_backward(q, k, v, do, causal=causal)
                for kernel in backward.KERNELS:
                    try:
                        backward._backward_plan(d, kernel, fgpu.device_limits())
                    except ValueError as e:
                        print(f"backward {kernel:<13} {dt:<4} d={d:<4} skipped: {e}", flush=True)
                        continue
                    grads = fgpu.attention_backward(*dev[:3], o, lse, dev[3], causal=causal, bf16=bf, kernel=kernel)
                    errs = [float(np.abs(host(g) - w).max() / max(1.0, np.abs(w).max()))
                            for g, w in zip(grads, want, strict=True)]
                    ok = max(errs) < (3e-2 if bf else 4e-3)
                    bad += not ok
                    print(f"backward {kernel:<13} {dt:<4} d={d:<4} n={n:<4} m={m:<4} causal={causal!s:<5} rel errors "
                          f"{', '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'FAIL'}", flush=True)
                # three new tokens (6 rows of the 2-head group: the "keys" R = 8 kernel), and two (R = 4);
                # lengths=None: the kernels read every key through a null lengths pointer (the default call)
                for tok, splits, kernel, length in ((3, 1, "rows", m - 5), (3, 3, "rows", m - 5), (3, 1, "keys", m - 5),
                                                    (3, 3, "keys", m - 5), (3, 3, "rows", None), (3, 3, "keys", None),
                                                    (2, 3, "keys", m - 5), (2, None, "keys", None),
                                                    (3, 1, "mma", m - 5), (3, 3, "mma", None), (2, None, "mma", None)):
                    why = fgpu.cannot_run_here("decode", kernel, d=d)
                    if why is not None:
                        print(f"decode   {kernel:<4} {dt:<4} d={d:<4} skipped: {why}", flush=True)
                        continue
                    qd = dev[0][:, :, :tok].copy()
                    od, ld = fgpu.decode(qd, dev[1], dev[2], num_splits=splits, causal=causal, bf16=bf,
                                         kernel=kernel, lengths=None if length is None else [length])
                    used = m if length is None else length
                    O, _ = reference.attention(q[:, :, :tok], k[:, :, :used], v[:, :, :used], causal=causal)
                    err = float(np.abs(host(od) - O).max())
                    ok = err < (3e-2 if bf else 4e-3)
                    bad += not ok
                    print(f"decode   {kernel:<4} {dt:<4} d={d:<4} tokens={tok} m={used:<4} splits={splits} "
                          f"causal={causal!s:<5} max error {err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return _verdict(bad)


# (batch, heads, K/V heads, new tokens, cache length, d, causal, splits, lengths): GQA at the benchmark's group size,
# several tokens with ragged lengths, an empty cache, more rows than one mma holds (40 / 2 heads: 20 rows), and
# more split counts for the merge (70 of them, some empty under the ragged lengths).
DECODE_CASES = (
    (1, 32, 8, 1, 5000, 128, False, None, None),
    (2, 16, 2, 3, 777, 64, True, 5, [777, 100]),
    (1, 6, 1, 3, 300, 128, True, 7, [0]),
    (1, 40, 2, 1, 2000, 128, False, 3, None),
    (1, 8, 2, 2, 3000, 128, False, 16, None),
    (2, 4, 4, 1, 4500, 64, True, 17, [4500, 600]),
    (1, 8, 8, 1, 9000, 128, True, 70, [8000]),
)


def decode_only() -> int:
    """Every decoding kernel this GPU runs on DECODE_CASES, fp16 and bf16, against float64 (the merge kernel with
    them). Returns the number of failures."""
    import cupy as cp

    import flashlab.gpu as fgpu

    rng = np.random.default_rng(5)
    bad = 0
    for kernel in decoding.KERNELS:
        why = fgpu.cannot_run_here("decode", kernel, d=128)
        if why is not None:
            print(f"decode   {kernel:<4} skipped: {why}", flush=True)
            continue
        for dt in ("f16", "bf16"):
            for B, H, Hk, n, m, d, causal, splits, lengths in DECODE_CASES:
                x = [rng.standard_normal(s).astype(np.float32) for s in ((B, H, n, d), (B, Hk, m, d), (B, Hk, m, d))]
                dev = [fgpu.to_bf16(cp.asarray(a)) if dt == "bf16" else cp.asarray(a.astype(np.float16)) for a in x]
                q, k, v = ((fgpu.from_bf16(a).get() if dt == "bf16" else a.get()).astype(np.float64) for a in dev)
                o, lse = fgpu.decode(*dev, num_splits=splits, lengths=lengths, causal=causal, bf16=dt == "bf16",
                                     kernel=kernel)
                want = decoding.decode_numpy(q, k, v, lengths=lengths, causal=causal)[0]
                got = (fgpu.from_bf16(o) if dt == "bf16" else o.astype(cp.float32)).get().astype(np.float64)
                err = float(np.abs(got - want).max())
                ok = err < (3e-2 if dt == "bf16" else 4e-3)
                bad += not ok
                print(f"decode   {kernel:<4} {dt:<4} B={B} H={H} Hk={Hk} n={n} m={m:<4} d={d:<3} causal={causal!s:<5} "
                      f"splits={splits} lengths={lengths} max error {err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return _verdict(bad)


# (n, m, pattern, how the call says it): windows on both sides of a ragged shape, a dilated causal window with
# n > m, whose first 54 rows see no key, and one whose stride divides n and m (the Hopper window kernel runs its
# residue classes); block masks of a local + global pattern and of a dilated one with n > m.
SPARSE_CASES = (
    (77, 131, blocksparse.sliding_window(40, 3), {"window": (40, 3)}),
    (131, 77, blocksparse.dilated(3, left=20), {"window": (20, 0), "dilation": 3}),
    (399, 261, blocksparse.dilated(3, left=150, right=30), {"window": (150, 30), "dilation": 3}),
    (77, 131, blocksparse.local_global(17, 3, [0, 5]), "block_mask"),
    (131, 77, blocksparse.dilated(5, left=60), "block_mask"),
)


def sparse(quick: bool = False) -> int:
    """Every block-sparse kernel (``flashlab.gpu.SPARSE_KERNELS``) once per dtype and d with GQA (2 query heads on 1
    K/V head) at ragged shapes: the window kernels with windows, the list kernel with block masks, against float64
    with the same mask. Outputs are poisoned with NaN first, so an element never written fails. ``quick``: the first
    case of each kernel only. Returns the number of failures."""
    import cupy as cp

    import flashlab.gpu as fgpu

    rng = np.random.default_rng(4)
    bad = 0
    for name in fgpu.SPARSE_KERNELS:
        mode = "blocks" if name in fgpu.SPARSE_MODES["blocks"] else "window"
        cases = [c for c in SPARSE_CASES if (c[3] == "block_mask") == (mode == "blocks")]
        for dt in fgpu.SPARSE_KERNELS[name].dtypes:
            bf = dt == "bf16"
            for d in fgpu.HEAD_DIMS:
                why = fgpu.sparse_problem(name, dt, d, True, fgpu.device_limits())
                if why is not None:
                    print(f"sparse {name:<17} {dt:<4} d={d:<4} skipped: {why}", flush=True)
                    continue
                for n, m, pattern, how in cases[:1] if quick else cases:
                    x = [rng.standard_normal(s).astype(np.float32) for s in ((1, 2, n, d), (1, 1, m, d), (1, 1, m, d))]
                    dev = [fgpu.to_bf16(cp.asarray(a)) if bf else cp.asarray(a.astype(np.float16)) for a in x]
                    q, k, v = ((fgpu.from_bf16(a) if bf else a.astype(cp.float32)).get().astype(np.float64)
                               for a in dev)
                    call = (dict(how) if how != "block_mask"
                            else {"block_mask": pattern.block_mask(n, m, *fgpu.sparse_block(d))})
                    o = cp.full(dev[0].shape, 0xFFFF if bf else np.nan, dtype=dev[0].dtype)
                    lse = cp.full(dev[0].shape[:-1], np.nan, dtype=cp.float32)
                    fgpu.attention(*dev, bf16=bf, kernel=name, out=(o, lse), **call)
                    O, L = reference.attention(q, k, v, mask=pattern)
                    got = (fgpu.from_bf16(o) if bf else o.astype(cp.float32)).get()
                    lse = lse.get()
                    fin = np.isfinite(L)
                    err = float(np.abs(got - O).max())  # NaN, hence a failure, where an element was not written
                    lerr = float(np.abs(lse[fin] - L[fin]).max(initial=0))
                    ok = err < (3e-2 if bf else 4e-3) and lerr < 1e-3 and bool((np.isneginf(lse) == ~fin).all())
                    bad += not ok
                    what = ", ".join(f"{key}={value}" for key, value in how.items()) if how != "block_mask" else (
                        f"block_mask of {type(pattern).__name__}")
                    print(f"sparse {name:<17} {dt:<4} d={d:<4} n={n:<4} m={m:<4} {what:<34} max|o-ref|={err:.1e} "
                          f"max|lse-ref|={lerr:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return _verdict(bad)


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab selfcheck [forward [RUNG ...] | backward-decode [--quick] | sparse [--quick] | decode]``."""
    p = argparse.ArgumentParser(prog="python -m flashlab selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("part", nargs="?", choices=PARTS, default="all", help="which kernels (default: all)")
    p.add_argument("rungs", nargs="*", help="forward: the rungs to check (default: every rung)")
    p.add_argument("--quick", action="store_true", help="backward-decode and sparse: one shape instead of several")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.rungs and args.part != "forward":
        p.error("rung names go with the part 'forward'")
    bad = 0
    if args.part in ("all", "forward"):
        bad += forward(args.rungs)
    if args.part in ("all", "backward-decode"):
        bad += backward_and_decode(quick=args.quick)
    if args.part in ("all", "sparse"):
        bad += sparse(quick=args.quick)
    if args.part == "decode":
        bad += decode_only()
    return 1 if bad else 0
