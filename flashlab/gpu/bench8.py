"""``python -m flashlab.gpu.bench8 {bwd,decode,memory,train}``: chapter 8's benchmarks, written to data/ch8/NAME.json.

Same protocol and JSON/provenance format as ``flashlab.bench`` (CONVENTIONS section 5): every row of a table comes
from one run, references timed in the same run on the same random fp16 inputs, CUDA events, median of --repeat
runs after --warmup; each output is computed once (into fresh arrays) and compared with the first
implementation's before timing.

* ``bwd``: the backward pass (given the forward's o and lse), ours (``ours_<kernel>``, each main kernel of
  ``flashlab.gpu.backward``) against PyTorch SDPA's flash and cuDNN backends (autograd backward only) and naive
  CuPy (P materialised). FLOP = 2.5 x the forward's 4 n^2 d batch heads (half with the causal mask). Rows: pass
  "bwd".
* ``decode``: one query token (or a few) against a KV cache of m keys: each split kernel (``--kernels``; impl
  "<kernel>" with the default splits, "<kernel>_split_<S>" for the sweep, "<kernel>_unsplit" for num_splits=1),
  PyTorch SDPA on the same shapes, and a device-to-device copy of the cache, whose bandwidth gives the time to
  read the cache once. Rows: pass "decode", with kv_bytes and GB/s.
* ``memory``: what each way of training keeps between forward and backward (flash: o and lse; standard: o and
  P), and the extra memory of each backward, from CuPy's memory pool. Rows: pass "memory".
* ``train``: the toy model of ``flashlab.gpu.toytrain`` trained for --steps with the course's kernels and with
  PyTorch SDPA from the same seed: both loss curves. Rows: pass "train".
* ``selfcheck``: every kernel once at small ragged shapes against float64, nothing timed or written: the run to
  put under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck``.

Written to data/ch8/ (not data/benchmarks/, whose rows are forward-pass rows checked against the forward FLOP
count by tests/test_gpu_records.py). ``--table FILE`` prints a recorded file without a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import statistics
import sys

import numpy as np

from .. import bench, reference
from . import KERNEL_DIR, backward, decoding

OUT_DIR = bench.DATA_DIR / "ch8"


def bwd_flop(n: int, d: int, batch: int, heads: int, causal: bool) -> float:
    """Backward FLOP: 2.5 x the forward's (five n x n x d products instead of two)."""
    return 2.5 * bench.flop(n, d, batch, heads, causal)


def _provenance(argv: list[str]) -> dict:
    prov = bench._provenance(argv)
    prov["command"] = "python -m flashlab.gpu.bench8 " + shlex.join(argv)
    files = backward.KERNEL_FILES + decoding.KERNEL_FILES
    prov["kernel_sha256_ch8"] = {f: hashlib.sha256((KERNEL_DIR / f).read_bytes()).hexdigest()[:16] for f in files}
    return prov


def _median_ms(kind: str, fn, repeat: int, warmup: int) -> float:
    return statistics.median(bench._timer(kind)(fn, repeat, warmup))


def _max_diff(a, b) -> float:
    import cupy as cp

    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


# ---------------------------------------------------------------------------------------------------- backward
def _bwd_impl(name: str, q, k, v, do, causal: bool):
    """(kind, fn, result) where result() poisons, runs once and returns (dq, dk, dv) as CuPy arrays."""
    import cupy as cp

    import flashlab.gpu as fgpu

    if name.removeprefix("ours_") in backward.KERNELS:
        o, lse = fgpu.attention(q, k, v, causal=causal)
        kernel = name.removeprefix("ours_")

        def fn():
            return fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, kernel=kernel)

        return "cupy", fn, fn
    if name == "cupy_naive":
        def fn():
            return backward.naive_attention_backward(q, k, v, do, causal=causal)

        return "cupy", fn, fn
    if name in ("sdpa_flash", "sdpa_cudnn"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_(True) for x in (q, k, v))
        tdo = torch.from_dlpack(do)
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                                   enable_gqa=tq.shape[1] != tk.shape[1])

        def fn():
            return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)

        def result():
            grads = fn()
            torch.cuda.synchronize()
            return tuple(cp.from_dlpack(g.contiguous()) for g in grads)

        return "torch", fn, result
    raise ValueError(f"unknown backward implementation {name!r}")


def run_bwd(args, rows: list[dict]) -> None:
    import cupy as cp

    rng = cp.random.default_rng(0)
    pool = cp.get_default_memory_pool()
    for d in args.d:
        for n in args.n:
            batch = args.batch if args.batch else max(1, args.tokens // n)
            for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
                shape = (batch, args.heads, n, d)
                q, k, v, do = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(4))
                ref, ref_name = None, None
                for name in args.impls:
                    base = {"impl": name, "pass": "bwd", "dtype": "float16", "d": d, "n": n, "batch": batch,
                            "heads": args.heads, "causal": causal}
                    pool.free_all_blocks()
                    held = pool.total_bytes()
                    try:
                        kind, fn, result = _bwd_impl(name, q, k, v, do, causal)
                        grads = result()
                        extra = pool.total_bytes() - held
                        if ref is None:
                            ref, ref_name = grads, name
                            err = None
                        else:
                            err = max(_max_diff(a, b) for a, b in zip(grads, ref, strict=True))
                        del grads
                        ms = _median_ms(kind, fn, args.repeat, args.warmup)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, the table goes on
                        print(f"  {name:<12} d={d} n={n} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
                        rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        pool.free_all_blocks()
                        continue
                    f = bwd_flop(n, d, batch, args.heads, causal)
                    rows.append({**base, "median_ms": round(ms, 5), "tflops": round(f / (ms * 1e-3) / 1e12, 3),
                                 "repeat": args.repeat, "max_abs_diff": err, "diff_against": ref_name,
                                 "extra_bytes": int(extra)})
                    print(f"  {name:<12} d={d:<4} n={n:<6} causal={causal!s:<5} {ms:9.3f} ms "
                          f"{rows[-1]['tflops']:8.2f} TFLOP/s  max|diff vs {ref_name}|={err}", flush=True)
                del q, k, v, do, ref
                pool.free_all_blocks()


# ------------------------------------------------------------------------------------------------------ decode
def _copy_ms(nbytes: int, repeat: int, warmup: int) -> float:
    import cupy as cp

    src = cp.ones(nbytes // 2, dtype=cp.float16)
    dst = cp.empty_like(src)
    return _median_ms("cupy", lambda: cp.copyto(dst, src), repeat, warmup)


def run_decode(args, rows: list[dict]) -> None:
    import cupy as cp

    rng = cp.random.default_rng(0)
    for m in args.m:
        _decode_one(args, m, rows, rng)
        cp.get_default_memory_pool().free_all_blocks()


def _decode_one(args, m: int, rows: list[dict], rng) -> None:
    import cupy as cp

    import flashlab.gpu as fgpu

    d, B, H, Hk, nq = args.d[0], args.batch or 1, args.heads, args.kv_heads or args.heads, args.queries
    q = rng.standard_normal((B, H, nq, d), dtype=cp.float32).astype(cp.float16)
    k, v = (rng.standard_normal((B, Hk, m, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    kv_bytes = 2 * k.nbytes
    copy_ms = _copy_ms(k.nbytes, args.repeat, args.warmup)  # a copy of one of K, V reads and writes k.nbytes
    copy_gbps = 2 * k.nbytes / (copy_ms * 1e-3) / 1e9
    read_once_ms = kv_bytes / (copy_gbps * 1e9) * 1e3
    base = {"pass": "decode", "dtype": "float16", "d": d, "n": nq, "m": m, "batch": B, "heads": H,
            "kv_heads": Hk, "kv_bytes": kv_bytes, "copy_gbps": round(copy_gbps, 1),
            "read_once_ms": round(read_once_ms, 5)}
    print(f"# m={m}: KV cache {kv_bytes / 1e6:.1f} MB, copy bandwidth {copy_gbps:.0f} GB/s -> read once in "
          f"{read_once_ms * 1e3:.1f} us")
    ref, _ = fgpu.decode(q, k, v, num_splits=1, kernel="rows")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    # impl: "<kernel>" with the default split count, "<kernel>_unsplit", "<kernel>_split_<S>"
    runs = [(f"{kern}{suffix}", kern, splits) for kern in args.kernels
            for suffix, splits in [("", None), ("_unsplit", 1)] + [(f"_split_{s}", s) for s in args.splits]]
    for name, kern, splits in runs:
        try:
            def fn(splits=splits, kern=kern):
                return fgpu.decode(q, k, v, num_splits=splits, kernel=kern)

            err = _max_diff(fn()[0], ref)
            ms = _median_ms("cupy", fn, args.repeat, args.warmup)
        except Exception as e:  # noqa: BLE001
            rows.append({**base, "impl": name, "kernel": kern, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        used = decoding.resolve_num_splits(B, H, Hk, nq, m, splits, sms, kern)
        rows.append({**base, "impl": name, "kernel": kern, "num_splits": used, "median_ms": round(ms, 5),
                     "gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1), "x_read_once": round(ms / read_once_ms, 3),
                     "repeat": args.repeat, "max_abs_diff": err, "diff_against": "rows_unsplit"})
        print(f"  {name:<16} splits={used:<5} {ms * 1e3:9.1f} us  {rows[-1]['gbps']:7.0f} GB/s  "
              f"{rows[-1]['x_read_once']:.2f}x read-once  max|diff|={err:.1e}", flush=True)
    try:
        import torch
    except ImportError:
        return
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=H != Hk)

    try:
        err = _max_diff(cp.from_dlpack(sdpa().contiguous()), ref)
        ms = _median_ms("torch", sdpa, args.repeat, args.warmup)
    except Exception as e:  # noqa: BLE001
        rows.append({**base, "impl": "sdpa", "error": f"{type(e).__name__}: {str(e)[:200]}"})
        return
    rows.append({**base, "impl": "sdpa", "median_ms": round(ms, 5), "gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1),
                 "x_read_once": round(ms / read_once_ms, 3), "repeat": args.repeat, "max_abs_diff": err,
                 "diff_against": "rows_unsplit"})
    print(f"  {'sdpa':<10} {'':<12} {ms * 1e3:9.1f} us  {rows[-1]['gbps']:7.0f} GB/s", flush=True)


# ------------------------------------------------------------------------------------------------------ memory
def _standard_forward(q, k, v):
    """Eager attention as a training framework runs it: returns o and the P it keeps for the backward."""
    import cupy as cp

    s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * np.float32(1 / np.sqrt(q.shape[-1]))
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    P = (p / p.sum(axis=-1, keepdims=True)).astype(q.dtype)
    del s, p
    return cp.matmul(P, v), P


def run_memory(args, rows: list[dict]) -> None:
    """Bytes kept from forward to backward, and each backward's extra bytes, through CuPy's pool."""
    import cupy as cp

    import flashlab.gpu as fgpu

    rng = cp.random.default_rng(0)
    pool = cp.get_default_memory_pool()
    d, B, H = args.d[0], args.batch or 1, args.heads
    for n in args.n:
        shape = (B, H, n, d)
        q, k, v, do = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(4))
        base = {"pass": "memory", "dtype": "float16", "d": d, "n": n, "batch": B, "heads": H, "causal": False}
        for name in ("flash", "standard"):
            pool.free_all_blocks()
            start = pool.used_bytes()
            try:
                if name == "flash":
                    o, lse = fgpu.attention(q, k, v)
                    kept = o.nbytes + lse.nbytes
                    before_bwd = pool.used_bytes()
                    pool.free_all_blocks()  # drop cached blocks: what the pool holds from here on is the backward's
                    held = pool.total_bytes()
                    grads = fgpu.attention_backward(q, k, v, o, lse, do)
                else:
                    o, P = _standard_forward(q, k, v)  # P is what autograd keeps for the backward
                    kept = o.nbytes + P.nbytes
                    before_bwd = pool.used_bytes()
                    pool.free_all_blocks()
                    held = pool.total_bytes()
                    grads = backward.naive_attention_backward(q, k, v, do)
                cp.cuda.Device().synchronize()
                peak_bwd = pool.total_bytes() - held  # outputs and temporaries of the backward (pool growth)
                rows.append({**base, "impl": name, "kept_bytes": int(kept),
                             "pool_kept_bytes": int(before_bwd - start), "backward_extra_bytes": int(peak_bwd)})
                print(f"  {name:<9} n={n:<6} kept {kept / 1e6:10.1f} MB  backward extra {peak_bwd / 1e6:10.1f} MB")
                del grads, o
            except Exception as e:  # noqa: BLE001 - the standard path runs out of memory first: recorded
                rows.append({**base, "impl": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"  {name:<9} n={n:<6} {type(e).__name__}")
            pool.free_all_blocks()
        del q, k, v, do
        pool.free_all_blocks()


# ------------------------------------------------------------------------------------------------------- train
def run_train(args, rows: list[dict]) -> None:
    """The toy model of flashlab.gpu.toytrain, trained with the course's kernels and with SDPA (same seed)."""
    from . import toytrain

    curves = {}
    for name in ("flash", "sdpa"):
        curves[name] = toytrain.train(name, args.steps)
        rows.append({"pass": "train", "impl": name, "steps": args.steps, "batch": toytrain.BATCH, "n": toytrain.N,
                     "heads": toytrain.HEADS, "d": toytrain.MODEL // toytrain.HEADS, "vocab": toytrain.VOCAB,
                     "dtype": "bfloat16", "causal": True, "losses": curves[name], "final_loss": curves[name][-1]})
        print(f"  {name:<6} loss {curves[name][0]:.3f} -> {curves[name][-1]:.4f} after {args.steps} steps", flush=True)
    gap = max(abs(a - b) for a, b in zip(curves["flash"], curves["sdpa"], strict=True))
    print(f"  max |loss(flash) - loss(sdpa)| over the steps: {gap:.2e}")


# --------------------------------------------------------------------------------------------------- selfcheck
def selfcheck(quick: bool = False) -> int:
    """Every chapter-8 kernel once per dtype and d at small ragged shapes, against float64: for compute-sanitizer.

    ``compute-sanitizer --tool memcheck python -m flashlab.gpu.bench8 selfcheck`` (and ``--tool racecheck``).
    ``quick``: one shape instead of three. Returns the number of failures.
    """
    import cupy as cp

    import flashlab.gpu as fgpu

    rng = np.random.default_rng(3)
    bad = 0
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
                    grads = fgpu.attention_backward(*dev[:3], o, lse, dev[3], causal=causal, bf16=bf, kernel=kernel)
                    errs = [float(np.abs(host(g) - w).max() / max(1.0, np.abs(w).max()))
                            for g, w in zip(grads, want, strict=True)]
                    ok = max(errs) < (3e-2 if bf else 4e-3)
                    bad += not ok
                    print(f"backward {kernel:<4} {dt:<4} d={d:<4} n={n:<4} m={m:<4} causal={causal!s:<5} rel errors "
                          f"{', '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'FAIL'}", flush=True)
                qd = dev[0][:, :, :3].copy()  # three new tokens
                for splits, kernel in ((1, "rows"), (3, "rows"), (1, "keys"), (3, "keys")):
                    od, ld = fgpu.decode(qd, dev[1], dev[2], num_splits=splits, lengths=[m - 5], causal=causal,
                                         bf16=bf, kernel=kernel)
                    O, _ = reference.attention(q[:, :, :3], k[:, :, : m - 5], v[:, :, : m - 5], causal=causal)
                    err = float(np.abs(host(od) - O).max())
                    ok = err < (3e-2 if bf else 4e-3)
                    bad += not ok
                    print(f"decode   {kernel:<4} {dt:<4} d={d:<4} m={m:<4} splits={splits} causal={causal!s:<5} "
                          f"max error {err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    cp.cuda.Device().synchronize()
    print("selfcheck:", "all ok" if not bad else f"{bad} FAILED")
    return bad


# -------------------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.gpu.bench8", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("bwd", "decode", "memory", "train", "selfcheck"))
    p.add_argument("--name", default=None, help="output file data/ch8/NAME.json (default: the benchmark's name)")
    p.add_argument("--impls", nargs="+",
                   default=["sdpa_flash", "ours_pipe", "ours_mma", "ours_smem", "sdpa_cudnn", "cupy_naive"],
                   help="bwd: ours_pipe, ours_mma, ours_smem, sdpa_flash, sdpa_cudnn, cupy_naive (differences "
                   "against the first)")
    p.add_argument("--d", nargs="+", type=int, default=[128])
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384], help="bwd/memory: sequence lengths")
    p.add_argument("--m", nargs="+", type=int, default=[4096, 16384, 65536], help="decode: cache lengths")
    p.add_argument("--queries", type=int, default=1, help="decode: query tokens per step")
    p.add_argument("--splits", nargs="*", type=int, default=[4, 16, 64, 256], help="decode: extra split counts")
    p.add_argument("--kernels", nargs="+", default=list(decoding.KERNELS), choices=decoding.KERNELS,
                   help="decode: split kernels to time")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="bwd: batch x n (batch = tokens // n)")
    p.add_argument("--heads", type=int, default=None, help="default 16 (bwd, memory) or 32 (decode)")
    p.add_argument("--kv-heads", type=int, default=None, help="decode: K/V heads (default: heads)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="train: optimiser steps")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--table", metavar="JSON", help="print a recorded file and exit (no GPU)")
    return p


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row (decode: time, GB/s, x read-once; bwd: TFLOP/s and % of sdpa_flash)."""
    lines = []
    flash = {(r["d"], r["n"], r["causal"]): r["tflops"] for r in rows
             if r.get("pass") == "bwd" and r.get("impl") == "sdpa_flash" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r.get('n')} {r.get('m', '')}  {r['error'][:80]}")
        elif r["pass"] == "bwd":
            f = flash.get((r["d"], r["n"], r["causal"]))
            pct = f"{100 * r['tflops'] / f:6.1f}%" if f else "      -"
            lines.append(f"{r['impl']:<12} d={r['d']:<4} n={r['n']:<6} causal={r['causal']!s:<5} "
                         f"{r['median_ms']:9.3f} ms {r['tflops']:8.2f} TFLOP/s {pct} of sdpa_flash")
        elif r["pass"] == "train":
            lines.append(f"{r['impl']:<16} loss {r['losses'][0]:.3f} -> {r['final_loss']:.4f} after {r['steps']} steps")
        elif r["pass"] == "decode":
            lines.append(f"{r['impl']:<16} m={r['m']:<7} splits={r.get('num_splits', '-')!s:<5} "
                         f"{r['median_ms'] * 1e3:9.1f} us {r['gbps']:8.0f} GB/s {r['x_read_once']:6.2f}x read-once")
        else:
            lines.append(f"{r['impl']:<12} n={r['n']:<6} kept {r['kept_bytes'] / 1e6:10.1f} MB, backward extra "
                         f"{r['backward_extra_bytes'] / 1e6:10.1f} MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one of chapter 8's benchmarks; print it; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.table:
        bench.print_recorded(args.table, format_rows)
        return 0
    if args.what == "selfcheck":
        return 1 if selfcheck() else 0
    bench.check_repeat(args.repeat)
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise SystemExit("the benchmark needs CuPy and an NVIDIA GPU") from None
    if args.heads is None:
        args.heads = 32 if args.what == "decode" else 16
    if args.what == "bwd":
        try:
            import torch  # noqa: F401
        except ImportError:
            args.impls = [i for i in args.impls if not i.startswith("sdpa")]
    if args.what == "train":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise SystemExit("bench8 train needs PyTorch (the toy model is a torch module)") from None
    prov = _provenance(argv)
    print(f"# {prov['gpu']}  CuPy {prov['cupy']}  torch {prov.get('torch')}  {prov['date_utc']}")
    rows: list[dict] = []
    {"bwd": run_bwd, "decode": run_decode, "memory": run_memory, "train": run_train}[args.what](args, rows)
    print()
    print(format_rows(rows))
    if not args.no_write:
        bench.write_record(args.out, args.name or args.what, prov, rows)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
