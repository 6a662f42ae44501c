"""``python -m flashlab bench sparse``: block-sparse attention, time against the density of the pattern.

For each sequence length of --n (self-attention, n = m) and each pattern: causal sliding windows of --windows
tokens (``window=(w, 0)``: query i sees keys i - w .. i) and a dilated window (every --dilation-th of the last
--dilated-window keys), three implementations on the same random fp16 inputs, in one run:

* ``sparse_window``: ``flashlab.gpu.attention(..., window=, dilation=, kernel="sparse_window")``, the pattern as its
  numbers, on the sm_80 kernel (mma.sync, 128 x 64 tiles);
* ``sparse_blocks``: the same pattern as a block mask (``blocksparse`` pattern -> ``sparse_layout``, made once
  before the clock), the sm_80 kernel that takes any pattern;
* ``hopper_window``, ``hopper_blocks``: the same two calls on the Hopper kernels (wgmma, TMA, a persistent grid;
  128 x 128 tiles), what ``kernel="best"`` runs on an H100 or H200 (elsewhere their rows hold the plan's refusal);
* ``flex``: PyTorch's FlexAttention (``torch.nn.attention.flex_attention``, compiled with ``torch.compile``) with the
  same mask (``create_block_mask`` of a ``mask_mod`` meaning the same pairs), timed after its warm-up. Both are
  compiled once per n, before anything is timed, and serve every pattern (:class:`Flex`); the compile times are
  printed and kept in the ``flex_causal`` rows (``mask_compile_s``, ``compile_s``), each block mask's build time in
  its row (``mask_s``), and a recompilation is an error in the row rather than minutes of the run
  (``--flex-allow-recompile`` lets it through);

and, per n, dense causal attention by the course's own kernel (``causal``: ``attention(..., causal=True)``, the
fastest rung) and by FlexAttention (``flex_causal``). Each output is checked once against ``sparse_window``'s (the
causal ones against each other) before it is timed, under each protocol of --protocols. Every row carries the
pattern, its tile density (computed tiles over all tiles at the kernel's 128 x 64 tiles), the visible pairs
(``pairs``, per head) and the TFLOP/s of the visible pairs (4 d per pair); a ``hopper_window`` row of a dilated
pattern whose dilation divides n also carries ``computed_density``, the density of the tiles it computes when it runs
the dilation as residue classes (``computed_density``, ``flashlab.gpu.residue_classes``). The printed table adds time
per computed tile relative to dense causal (1.00 = time proportional to the computed tiles) and the speed against
flex.

Per n the run also times a copy of Q on the GPU, back to back: every row carries that copy bandwidth (``copy_gbps``),
the bytes a forward pass must move at least (``io_bytes``: Q, K and V read, O and the log-sum-exp written, once each)
and their time at that bandwidth (``floor_ms``, the memory floor). It estimates what no kernel can beat by much: a
copy reads and writes alike, and a pass that mostly reads may run somewhat faster. Where a pattern computes few tiles
the floor comes near the time its tiles take (``floor_ratios``, ``floor_over_tiles``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np

from .. import blocksparse, records
from . import add_protocols, copy_gbps, error_line, gpu_main, max_diff, record_parser

OUT_DIR = records.DATA_DIR / "benchmarks"
TILE = (128, 64)  # the window kernel's tiles (flashlab.gpu.SPARSE_TILES): what the density is counted in
IMPLS = ("hopper_window", "hopper_blocks", "sparse_window", "sparse_blocks", "flex")


def pattern_of(window: tuple[int | None, int | None], dilation: int = 1) -> blocksparse.Window:
    """The ``blocksparse`` pattern of ``attention(..., window=window, dilation=dilation)``."""
    return blocksparse.dilated(dilation, left=window[0], right=window[1])


def visible_pairs(pattern: blocksparse.Window, n: int, m: int) -> int:
    """The (query, key) pairs a window pattern lets through, counted row by row from its formula (never the n x m
    mask): the useful work of a call, 4 d FLOP per pair."""
    pattern.check(n, m)
    i = np.arange(n, dtype=np.int64)
    off = m - n
    lo = np.maximum(0, i + off - (m if pattern.left is None else pattern.left)) - (i + off)  # lowest delta seen
    hi = np.minimum(m - 1, i + off + (n if pattern.right is None else pattern.right)) - (i + off)
    r = pattern.stride
    # multiples of r in [lo, hi]: floor(hi / r) - ceil(lo / r) + 1 (none when hi < lo)
    count = np.floor_divide(hi, r) - (-np.floor_divide(-lo, r)) + 1
    return int(np.maximum(count, 0).sum())


def computed_density(impl: str, n: int, window: tuple[int | None, int | None], dilation: int) -> float | None:
    """The density (at ``TILE``) of the tiles ``impl`` computes for a self-attention window of n tokens when it runs
    the dilation as residue classes (``flashlab.gpu.residue_classes``): r classes of n / r tokens, each a plain
    window of floor(side / r) positions; None where it computes the pattern's own tiles."""
    import flashlab.gpu as fgpu

    r = fgpu.residue_classes(impl, dilation, n, n)
    if r == 1:
        return None
    nc, _, left, right = fgpu.class_window(n, n, *(2 * n if side is None else side for side in window), r)
    tiles = r * int(fgpu.window_tiles_per_block(nc, nc, left, right, *TILE).sum())
    return tiles / (-(-n // TILE[0]) * -(-n // TILE[1]))


def mask_mod(left, right, stride, offset: int = 0):
    """A FlexAttention ``mask_mod`` meaning ``pattern_of((left, right), stride)`` for n queries and m = n + offset
    keys. ``left``, ``right``, ``stride``: numbers, or 0-d tensors (FlexAttention then compiles one kernel for every
    window instead of one per value); None is no limit. Works on NumPy index arrays too (the tests use them)."""
    def mod(b, h, q_idx, kv_idx):
        delta = kv_idx - (q_idx + offset)
        seen = delta == delta  # all True, in whatever array type the indices are
        if left is not None:
            seen = seen & (delta >= -left)
        if right is not None:
            seen = seen & (delta <= right)
        if stride is not None:
            seen = seen & (delta % stride == 0)
        return seen

    return mod


def patterns(args: argparse.Namespace) -> list[tuple[str, tuple[int | None, int | None], int]]:
    """(label, window, dilation) of every sparse pattern the run times."""
    out = [(f"window {w}", (w, 0), 1) for w in args.windows]
    if args.dilation > 1:
        out.append((f"dilated {args.dilation} window {args.dilated_window}", (args.dilated_window, 0), args.dilation))
    return out


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Every n of ``args.n``: dense causal first (ours, FlexAttention), then every pattern, every implementation.
    FlexAttention is set up once for the whole run, so that its compiled functions serve every n and pattern."""
    import cupy as cp

    start = time.perf_counter()
    flex, why_not = _flex(args.flex_allow_recompile) if "flex" in args.impls else (None, None)
    rng = cp.random.default_rng(0)
    for n in args.n:
        shape = (args.batch, args.heads, n, args.d)
        q, k, v = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(3))
        _one_length(args, rows, q, k, v, flex, why_not)
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    compiling = sum(r.get("mask_compile_s", 0) + r.get("compile_s", 0) for r in rows
                    if r["impl"] == "flex_causal" and r.get("protocol", args.protocols[0]) == args.protocols[0])
    print(f"  run: {time.perf_counter() - start:.0f} s in all, {compiling:.0f} s of it compiling FlexAttention",
          flush=True)


class Flex:
    """FlexAttention as its users run it, compiled (``torch.compile``; uncompiled it materialises the scores), with
    one ``mask_mod`` for every pattern. The window and the stride live in three 0-d tensors that ``mask`` overwrites:
    torch.compile guards on a number's value but only on a tensor's shape and dtype, so a new window would recompile
    and a new tensor value does not. Both compiled functions, ``flex_attention`` and ``create_block_mask`` (compiled,
    it never holds the n x n mask: 4 GB of booleans and 34 GB per int64 index grid at n = 65536), are made once and
    compiled once per sequence length (static shapes, as for any fixed-length model): ``compile`` does it, timed,
    before anything is measured, and ``frozen`` turns any later recompilation into an error instead of minutes."""

    def __init__(self, allow_recompile: bool = False) -> None:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.torch = torch
        self.attend = torch.compile(flex_attention, dynamic=False)
        self.make_mask = torch.compile(create_block_mask, dynamic=False)
        self.left, self.right, self.stride = (torch.zeros((), dtype=torch.int32, device="cuda") for _ in range(3))
        self.mod = mask_mod(self.left, self.right, self.stride)
        self.allow_recompile = allow_recompile

    def mask(self, n: int, window: tuple[int | None, int | None], dilation: int):
        """The block mask (128 x 128 blocks) of ``pattern_of(window, dilation)`` for n = m tokens, built by the
        compiled ``create_block_mask`` with the one mask_mod pointed at this pattern."""
        self.left.fill_(n if window[0] is None else window[0])
        self.right.fill_(n if window[1] is None else window[1])
        self.stride.fill_(dilation)
        with self.torch.no_grad():
            return self.make_mask(self.mod, None, None, n, n, device="cuda")

    def __call__(self, q, k, v, block_mask):
        """The compiled flex_attention (without autograd: a forward benchmark, and grad mode is part of its guards)."""
        with self.torch.no_grad():
            return self.attend(q, k, v, block_mask=block_mask)

    def compile(self, q, k, v) -> dict[str, float]:
        """Compile both functions for q's length: build the dense causal block mask and run flex_attention once,
        each timed to its end (seconds; what a first call costs, compilation included)."""
        sync = self.torch.cuda.synchronize
        sync()
        t0 = time.perf_counter()
        bm = self.mask(q.shape[-2], (None, 0), 1)
        sync()
        t1 = time.perf_counter()
        self(q, k, v, bm)
        sync()
        t2 = time.perf_counter()
        return {"mask_compile_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2)}

    def frozen(self):
        """A context in which a recompilation raises (``torch.compiler.set_stance("fail_on_recompile")``, PyTorch
        2.6 on) instead of costing minutes; none where PyTorch lacks it or ``allow_recompile`` was asked for."""
        stance = getattr(self.torch.compiler, "set_stance", None)
        if stance is None or self.allow_recompile:
            return contextlib.nullcontext()
        return stance("fail_on_recompile")


def _flex(allow_recompile: bool = False):
    """A :class:`Flex`, or None and the reason why not."""
    try:
        return Flex(allow_recompile), None
    except Exception as e:  # noqa: BLE001 - no PyTorch, no FlexAttention: recorded as such
        return None, _why(e)


def _why(e: Exception) -> str:
    """An exception as a row's error: its type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:200]}"


def _one_length(args, rows: list[dict], q, k, v, flex: Flex | None, why_not: str | None) -> None:
    import cupy as cp

    import flashlab.gpu as fgpu

    B, H, n, d = q.shape
    o = cp.empty_like(q)
    lse = cp.empty(q.shape[:-1], dtype=cp.float32)
    gbps = copy_gbps(q.nbytes, args.repeat, args.warmup)
    io_bytes = 4 * q.nbytes + lse.nbytes  # Q, K, V read and O, lse written, once each
    base = {"pass": "forward", "dtype": "float16", "d": d, "n": n, "batch": B, "heads": H, "copy_gbps": round(gbps, 1),
            "io_bytes": io_bytes, "floor_ms": round(io_bytes / (gbps * 1e9) * 1e3, 5)}
    print(f"  memory floor   n={n:<6} {io_bytes / 1e6:.0f} MB read and written at the copy bandwidth of "
          f"{gbps:.0f} GB/s: {base['floor_ms']:.3f} ms", flush=True)
    causal_pattern = blocksparse.causal()
    dense = {"pattern": "causal", "window": [None, 0], "dilation": 1,
             "density": causal_pattern.block_mask(n, n, *TILE).density, "pairs": visible_pairs(causal_pattern, n, n)}
    ref = fgpu.attention(q, k, v, causal=True)[0].copy()
    _time(args, rows, {**base, **dense, "impl": "causal"}, lambda: fgpu.attention(q, k, v, causal=True, out=(o, lse)),
          "cupy", lambda: fgpu.attention(q, k, v, causal=True)[0], ref, "causal")
    if flex is not None:
        tq, tk, tv = (flex.torch.from_dlpack(x) for x in (q, k, v))
        try:
            compiled = flex.compile(tq, tk, tv)
        except Exception as e:  # noqa: BLE001 - recorded; FlexAttention sits out this length
            why_not, flex = _why(e), None
            print(f"  flex           n={n:<6} not compiled: {why_not[:100]}", flush=True)
        else:
            print(f"  flex           n={n:<6} compiled for this length: create_block_mask "
                  f"{compiled['mask_compile_s']:.1f} s, flex_attention {compiled['compile_s']:.1f} s "
                  "(first calls, not in any timing)", flush=True)
            _time_flex(args, rows, {**base, **dense, "impl": "flex_causal", **compiled}, flex, (None, 0), 1,
                       tq, tk, tv, ref, "causal")
    if flex is None and why_not:
        rows.append({**base, **dense, "impl": "flex_causal", "error": why_not})
    del ref
    for label, window, dilation in patterns(args):
        pattern = pattern_of(window, dilation)
        info = {"pattern": label, "window": list(window), "dilation": dilation,
                "density": pattern.block_mask(n, n, *TILE).density, "pairs": visible_pairs(pattern, n, n)}

        ref = fgpu.attention(q, k, v, window=window, dilation=dilation, kernel="sparse_window")[0]
        for impl in ("hopper_window", "sparse_window"):
            computed = computed_density(impl, n, window, dilation)
            extra = {} if computed is None else {"computed_density": computed}
            def ours(window=window, dilation=dilation, impl=impl, out=(o, lse)):
                return fgpu.attention(q, k, v, window=window, dilation=dilation, kernel=impl, out=out)

            _time(args, rows, {**base, **info, **extra, "impl": impl}, ours, "cupy",
                  lambda ours=ours: ours(out=None)[0], ref, "sparse_window")
        bm = pattern.block_mask(n, n, *fgpu.sparse_block(d))
        for impl in ("hopper_blocks", "sparse_blocks"):
            if impl not in args.impls:
                continue
            try:
                layout = fgpu.sparse_layout(bm, kernel=impl)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, the table goes on
                rows.append({**base, **info, "impl": impl, "error": _why(e)})
            else:
                _time(args, rows, {**base, **info, "impl": impl, "layout_bytes": layout.nbytes},
                      lambda layout=layout, impl=impl: fgpu.attention(q, k, v, block_mask=layout, kernel=impl,
                                                                      out=(o, lse)), "cupy",
                      lambda layout=layout, impl=impl: fgpu.attention(q, k, v, block_mask=layout, kernel=impl)[0],
                      ref, "sparse_window")
                del layout
        del bm
        if flex is not None:
            _time_flex(args, rows, {**base, **info, "impl": "flex"}, flex, window, dilation, tq, tk, tv, ref,
                       "sparse_window")
        elif why_not:
            rows.append({**base, **info, "impl": "flex", "error": why_not})
        del ref
        cp.get_default_memory_pool().free_all_blocks()


def _time_flex(args, rows, base, flex: Flex, window, dilation, tq, tk, tv, ref, ref_name) -> None:
    """FlexAttention with the same pattern: its block mask (128 x 128 blocks) built before the clock, by the
    function compiled for this length (``mask_s``: how long it took), and no recompilation allowed."""
    import cupy as cp

    with flex.frozen():
        try:
            t0 = time.perf_counter()
            bm = flex.mask(tq.shape[-2], window, dilation)
            flex.torch.cuda.synchronize()
            base = {**base, "flex_density": round(1 - float(bm.sparsity()) / 100, 6),
                    "mask_s": round(time.perf_counter() - t0, 4)}
        except Exception as e:  # noqa: BLE001 - recorded, the table goes on
            rows.append({**base, "error": _why(e)})
            print(f"  {base['impl']:<14} {base['pattern']:<28} {rows[-1]['error'][:100]}", flush=True)
            return

        def call():
            return flex(tq, tk, tv, bm)

        _time(args, rows, base, call, "torch", lambda: cp.from_dlpack(call().contiguous()), ref, ref_name)


def _time(args, rows: list[dict], base: dict, fn, kind: str, result, ref, ref_name: str) -> None:
    """Check ``result()`` against ``ref`` once, then time ``fn`` under each protocol: one row each (or one row with
    the error)."""
    import cupy as cp

    if base["impl"] not in args.impls and base["impl"] not in ("causal", "flex_causal"):
        return
    try:
        err = max_diff(result(), ref)
        times = {p: records.median_ms(fn, args.repeat, args.warmup, kind=kind, protocol=p) for p in args.protocols}
    except Exception as e:  # noqa: BLE001 - recorded, the table goes on
        rows.append({**base, "error": _why(e)})
        print(f"  {base['impl']:<14} {base['pattern']:<28} {rows[-1]['error'][:100]}", flush=True)
        cp.get_default_memory_pool().free_all_blocks()
        return
    flop = 4 * base["d"] * base["pairs"] * base["batch"] * base["heads"]
    for protocol, ms in times.items():
        rows.append({**base, "protocol": protocol, "median_ms": round(ms, 5),
                     "tflops": round(flop / (ms * 1e-3) / 1e12, 3), "repeat": args.repeat, "max_abs_diff": err,
                     "diff_against": ref_name})
        print(f"  {base['impl']:<14} n={base['n']:<6} {base['pattern']:<28} density {base['density']:.4f} "
              f"{protocol:<10} {ms:9.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s  max|diff vs {ref_name}|={err:.1e}",
              flush=True)


def per_tile_ratios(rows: list[dict]) -> dict[tuple, float]:
    """(impl, protocol, n, pattern) -> time per computed tile over dense causal's (the course's kernel, same n and
    protocol): 1.0 when time is proportional to the computed tiles (``computed_density`` where a row has it: the
    tiles of its residue classes). FlexAttention rows are taken against FlexAttention's own dense causal row."""
    dense = {(r["impl"], records.protocol_of(r), r["n"]): r for r in rows
             if "error" not in r and r["impl"] in ("causal", "flex_causal")}
    out = {}
    for r in rows:
        if "error" in r:
            continue
        base = dense.get(("flex_causal" if r["impl"].startswith("flex") else "causal", records.protocol_of(r), r["n"]))
        if base is not None:
            out[(r["impl"], records.protocol_of(r), r["n"], r["pattern"])] = (
                (r["median_ms"] / r.get("computed_density", r["density"])) / (base["median_ms"] / base["density"]))
    return out


def floor_ratios(rows: list[dict]) -> dict[tuple, float]:
    """(impl, protocol, n, pattern) -> time over the memory floor of its run (``floor_ms``; rows without one are left
    out): 1.0 would move Q, K, V and O at the copy bandwidth and compute nothing on top."""
    return {(r["impl"], records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] / r["floor_ms"]
            for r in rows if "error" not in r and r.get("floor_ms")}


def floor_over_tiles(rows: list[dict]) -> dict[tuple, float]:
    """(protocol, n, pattern) -> the memory floor over the time proportional to the pattern's tiles (dense causal's time
    per tile, the course's kernel, times the pattern's tiles, counted at the pattern's density: a row's
    ``computed_density`` is not used). Above 1.15 the traffic alone, at the copy bandwidth, takes longer than time per
    tile within 15 % of dense causal's allows; below it, meeting that needs at least (floor - 0.15) of the
    tile-proportional time's worth of computing hidden under the traffic."""
    dense = {(records.protocol_of(r), r["n"]): r for r in rows if "error" not in r and r["impl"] == "causal"}
    out = {}
    for r in rows:
        base = dense.get((records.protocol_of(r), r["n"])) if "error" not in r else None
        if base is not None and r.get("floor_ms") and r["impl"] != "causal":
            out[(records.protocol_of(r), r["n"], r["pattern"])] = r["floor_ms"] / (
                base["median_ms"] / base["density"] * r["density"])
    return out


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row: time, TFLOP/s of the visible pairs, time per computed tile relative to dense
    causal (same implementation family, n and protocol), and the speed against FlexAttention with the same mask."""
    ratios, floors = per_tile_ratios(rows), floor_ratios(rows)
    flex = {(records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in rows
            if "error" not in r and r["impl"] in ("flex", "flex_causal")}
    lines = [f"{'impl':<14} {'n':>6} {'pattern':<28} {'density':>8} {'protocol':<10} {'ms':>9} {'TFLOP/s':>8} "
             f"{'per tile':>8} {'x flex':>7} {'x floor':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(error_line(r))
            continue
        p = records.protocol_of(r)
        ratio = ratios.get((r["impl"], p, r["n"], r["pattern"]))
        fl = flex.get((p, r["n"], r["pattern"]))
        per_tile = "-" if ratio is None else f"{ratio:.2f}"
        x_flex = "-" if fl is None else f"{fl / r['median_ms']:.2f}"
        floor = floors.get((r["impl"], p, r["n"], r["pattern"]))
        x_floor = "-" if floor is None else f"{floor:.2f}"
        lines.append(f"{r['impl']:<14} {r['n']:>6} {r['pattern']:<28} {r['density']:8.4f} {p:<10} "
                     f"{r['median_ms']:9.3f} {r['tflops']:8.1f} {per_tile:>8} {x_flex:>7} {x_floor:>7}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    """One line per (protocol, n, implementation) of a record: its time per computed tile over dense causal's (the
    range over the sliding windows, then the dilated pattern; 1.00 = time proportional to the computed tiles) and,
    where FlexAttention was timed, its speed against FlexAttention with the same mask (range over the patterns)."""
    ratios = per_tile_ratios(rows)
    flex = {(records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in rows
            if "error" not in r and r["impl"] == "flex"}
    timed = [r for r in rows if "error" not in r and r["impl"] in IMPLS]
    lines = []
    for protocol in records.PROTOCOLS:
        for n in sorted({r["n"] for r in timed}):
            for impl in IMPLS:
                mine = [r for r in timed if r["impl"] == impl and r["n"] == n and records.protocol_of(r) == protocol]
                per_tile = {r["dilation"] > 1: [] for r in mine}
                for r in mine:
                    if (impl, protocol, n, r["pattern"]) in ratios:
                        per_tile[r["dilation"] > 1].append(ratios[(impl, protocol, n, r["pattern"])])
                if not any(per_tile.values()):
                    continue
                parts = [f"{_span(v)} ({'dilated' if dilated else 'windows'})"
                         for dilated, v in sorted(per_tile.items()) if v]
                line = f"{protocol:<10} n = {n:<6} {impl:<13} time per tile / dense causal's: {', '.join(parts)}"
                speed = [flex[(protocol, n, r["pattern"])] / r["median_ms"] for r in mine
                         if (protocol, n, r["pattern"]) in flex]
                if speed and impl != "flex":
                    line += f"; speed / FlexAttention's: {_span(speed)}"
                lines.append(line)
    return lines


def markdown_table(rows: list[dict], n: int) -> str:
    """The docs' table of a record at sequence length ``n``: per pattern and protocol, each implementation's time in
    ms with its time per computed tile over dense causal's and FlexAttention's time over its own ("ms (per tile,
    x flex)"; FlexAttention's own cell: ms (per tile)), after a line with dense causal's times."""
    ratios = per_tile_ratios(rows)
    ok = [r for r in rows if "error" not in r and r["n"] == n]
    ms = {(r["impl"], records.protocol_of(r), r["pattern"]): r["median_ms"] for r in ok}
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    dense = "; ".join(f"{p}: the course's kernel {ms[('causal', p, 'causal')]:.3f} ms, FlexAttention "
                      + (f"{ms[('flex_causal', p, 'causal')]:.3f} ms" if ("flex_causal", p, "causal") in ms else "–")
                      for p in records.PROTOCOLS if ("causal", p, "causal") in ms)
    lines = [f"n = {n}, dense causal ({dense}):", "",
             "| pattern | tile density | protocol | " + " | ".join(f"`{i}`" for i in impls) + " |",
             "|---|---|---|" + "---|" * len(impls)]
    patterns = [r["pattern"] for r in ok if r["pattern"] != "causal"]
    for pattern in dict.fromkeys(patterns):
        density = next(r["density"] for r in ok if r["pattern"] == pattern)
        for p in records.PROTOCOLS:
            cells = []
            for impl in impls:
                t = ms.get((impl, p, pattern))
                if t is None:
                    cells.append("–")
                    continue
                tile = ratios.get((impl, p, n, pattern))
                fl = ms.get(("flex", p, pattern))
                extra = [f"{tile:.2f}"] if tile is not None else []
                if impl != "flex" and fl is not None:
                    extra.append(f"{fl / t:.2f}")
                cells.append(f"{t:.3f} ({', '.join(extra)})" if extra else f"{t:.3f}")
            lines.append(f"| {pattern} | {density:.4f} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    """A range of ratios to two decimals, one number when both ends print alike."""
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("sparse", __doc__.splitlines()[0], name="sparse", out=OUT_DIR, repeat=20, warmup=3)
    p.add_argument("--n", nargs="+", type=int, default=[16384, 65536], help="sequence lengths (n = m)")
    p.add_argument("--windows", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096, 8192],
                   help="causal sliding windows: keys i - w .. i")
    p.add_argument("--dilation", type=int, default=4, help="the dilated pattern's stride (1: none)")
    p.add_argument("--dilated-window", type=int, default=8192, help="how far back the dilated pattern reaches")
    p.add_argument("--d", type=int, default=128, choices=(64, 128), help="head dimension")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS,
                   help="implementations of each pattern (dense causal is always timed)")
    p.add_argument("--flex-allow-recompile", action="store_true",
                   help="let FlexAttention recompile for a pattern instead of recording an error (minutes each)")
    add_protocols(p)
    return p


def kernel_hashes() -> dict:
    """Provenance of a sparse record: the hash of the block-sparse kernel's source (the rungs' are there already)."""
    from ..gpu import HOPPER_SPARSE_FILE, KERNEL_DIR, SPARSE_FILE

    return {"kernel_sha256_sparse": records.file_hashes([KERNEL_DIR / SPARSE_FILE, KERNEL_DIR / HOPPER_SPARSE_FILE])}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print it; write data/benchmarks/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("sparse", argv, parser(), run, format_rows, extra_provenance=kernel_hashes)
