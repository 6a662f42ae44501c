"""``python -m flashlab bench forward``: time the kernel ladder against naive CuPy and PyTorch SDPA.

Every row of a table comes from one run: the references (naive CuPy attention with S materialised, PyTorch SDPA
with the flash and the cuDNN backends when PyTorch is present) are timed in the same run, on the same random fp16
inputs, with CUDA events, as the median of --repeat runs after --warmup runs, under each protocol of --protocols
(one row each; the course's kernels through ``flashlab.gpu.attention`` into preallocated outputs). Before timing,
each implementation's output is poisoned, computed once and compared with a reference, and the error is recorded
in its row. FLOP = 4 n^2 d batch heads for the forward pass (half that with a causal mask). Written to
data/benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from .. import records
from . import add_dtypes, add_protocols, add_rounds, gpu_main, record_parser, run_grid, without_torch

REFERENCES = ("cupy_naive", "sdpa_flash", "sdpa_cudnn")
OUT_DIR = records.DATA_DIR / "benchmarks"
SLOW_RUNGS = ("scalar", "smem_tiles")


def flop(n: int, d: int, batch: int, heads: int, causal: bool) -> float:
    """Forward-pass FLOP of attention: two n x n x d matrix products (QK^T and PV), 2 FLOP per multiply-add."""
    return 4.0 * n * n * d * batch * heads * (0.5 if causal else 1.0)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    import flashlab.gpu as fgpu

    p = record_parser("forward", __doc__.splitlines()[0], name="ladder", out=OUT_DIR)
    p.add_argument("--impls", nargs="+", default=list(fgpu.RUNGS) + list(REFERENCES),
                   help=f"rungs {list(fgpu.RUNGS)}, Hopper rungs {list(fgpu.HOPPER_RUNGS)} (sm_90 only) and/or "
                        f"references {list(REFERENCES)}")
    p.add_argument("--d", nargs="+", type=int, default=[64, 128], help="head dimensions")
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384], help="sequence lengths")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch x n (batch = tokens // n)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="fixed batch size (overrides --tokens): memory sweeps")
    p.add_argument("--slow-max-n", type=int, default=4096,
                   help=f"time the slow rungs {SLOW_RUNGS} only up to this n (they take seconds per call)")
    add_dtypes(p)
    add_protocols(p)
    add_rounds(p)
    return p


def _impl(name: str, arrays: list, causal: bool):
    """(kind, fn, result-as-cupy-float32) for one implementation on fixed inputs q, k, v."""
    import cupy as cp

    import flashlab.gpu as fgpu

    q, k, v = arrays
    bf16 = q.dtype == cp.uint16  # bfloat16 bit patterns (run_grid's --dtypes bfloat16)
    if name in fgpu.RUNGS or name in fgpu.HOPPER_RUNGS:
        o = cp.empty_like(q)
        lse = cp.empty(q.shape[:-1], cp.float32)

        def fn():
            fgpu.attention(q, k, v, causal=causal, kernel=name, bf16=bf16, out=(o, lse))

        def result():
            o.fill(0x7FC0 if bf16 else np.nan)  # NaN in either format: a row the kernel skips shows
            lse.fill(np.nan)
            fn()
            return fgpu.from_bf16(o) if bf16 else o.astype(cp.float32)

        return "cupy", fn, result
    if name == "cupy_naive":
        if bf16:
            raise ValueError("cupy_naive takes float16 or float32 (CuPy has no bfloat16 matrix product)")

        def fn():
            return fgpu.naive_attention(q, k, v, causal=causal)

        return "cupy", fn, lambda: fn()[0].astype(cp.float32)
    if name in ("sdpa_flash", "sdpa_cudnn"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        tq, tk, tv = (torch.from_dlpack(x).view(torch.bfloat16) if bf16 else torch.from_dlpack(x) for x in (q, k, v))

        # the backend is picked once, outside the timed calls (records.Pinned)
        fn = records.Pinned(lambda: sdpa_kernel(backend),
                            lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))

        def result():
            out = fn()
            torch.cuda.synchronize()
            return cp.from_dlpack(out.float().contiguous())

        return "torch", fn, result
    raise ValueError(f"unknown implementation {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write data/benchmarks/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def prepare(args: argparse.Namespace) -> None:
        args.impls = without_torch(args.impls)

    return gpu_main("forward", argv, parser(), run, format_rows, prepare=prepare,
                    format_recorded=lambda rows: ladder_markdown(rows) + "\n\n" + markdown_table(rows))


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time every implementation of ``args.impls`` at each (d, n, causal) of ``args`` under each protocol; append
    one row each. Differences are taken against sdpa_flash, else cupy_naive (the first that runs)."""
    run_grid(args, rows, pass_name="fwd", inputs=3, impl=_impl, flop=flop, references=("sdpa_flash", "cupy_naive"),
             skip=lambda name, n: name in SLOW_RUNGS and n > args.slow_max_n)


def format_rows(rows: list[dict]) -> str:
    """What a run prints at its end: :func:`format_table`, then one line per failed row."""
    lines = [format_table(rows)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r['d']:>4} {r['n']:>6} {r['causal']!s:>6}  {r['error'][:80]}")
    return "\n".join(lines)


def dtype_of(row: dict) -> str:
    """A row's input precision (rows recorded before bfloat16 was timed carry "float16")."""
    return row.get("dtype", "float16")


def _percents(rows: list[dict]) -> dict:
    """(impl, protocol, dtype, d, n, causal) -> TFLOP/s of every timed row."""
    return {(r["impl"], records.protocol_of(r), dtype_of(r), r["d"], r["n"], r["causal"]): r["tflops"] for r in rows}


def _pct(rows_t: dict, r: dict, ref: str, fmt: str = "{:.1f}") -> str | None:
    """``r``'s TFLOP/s in percent of ``ref``'s at the same shape and dtype under the same protocol, or None."""
    t = rows_t.get((ref, records.protocol_of(r), dtype_of(r), r["d"], r["n"], r["causal"]))
    return fmt.format(100 * r["tflops"] / t) if t else None


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per row, with its protocol and % of sdpa_flash and sdpa_cudnn for the same
    (dtype, d, n, causal) under the same protocol."""
    rows = [r for r in rows if "error" not in r]
    refs = _percents(rows)
    lines = [f"{'impl':<12} {'dtype':>8} {'d':>4} {'n':>6} {'causal':>6} {'protocol':>10} {'ms':>9} {'TFLOP/s':>8} "
             f"{'%flash':>7} {'%cudnn':>7}"]
    for r in rows:
        pct = [f"{p:>6}%" if (p := _pct(refs, r, ref)) else f"{'-':>7}" for ref in ("sdpa_flash", "sdpa_cudnn")]
        lines.append(f"{r['impl']:<12} {dtype_of(r):>8} {r['d']:>4} {r['n']:>6} {r['causal']!s:>6} "
                     f"{records.protocol_of(r):>10} {r['median_ms']:>9.3f} {r['tflops']:>8.2f} {pct[0]} {pct[1]}")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """Markdown table of recorded rows: TFLOP/s and % of sdpa_flash / sdpa_cudnn for each (dtype, d, n, causal),
    the references timed under the row's own protocol."""
    rows = [r for r in rows if "error" not in r]
    refs = _percents(rows)
    out = ["| impl | dtype | d | n | causal | protocol | ms | TFLOP/s | % sdpa_flash | % sdpa_cudnn |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (dtype_of(r), r["d"], r["n"], r["causal"], records.protocol_of(r))):
        pct = [_pct(refs, r, ref) or "-" for ref in ("sdpa_flash", "sdpa_cudnn")]
        out.append(f"| {r['impl']} | {dtype_of(r)} | {r['d']} | {r['n']} | {r['causal']} | {records.protocol_of(r)} "
                   f"| {r['median_ms']:.3f} | {r['tflops']:.1f} | {pct[0]} | {pct[1]} |")
    return "\n".join(out)


LADDER_COLUMNS = [(128, 4096, False), (128, 16384, False), (128, 4096, True), (128, 16384, True),
                  (64, 4096, False), (64, 16384, False), (64, 4096, True), (64, 16384, True)]
# The run that timed rungs 10 and 11 beside rung 9 and both SDPA backends under both protocols, at n = 1024, 4096
# and 16384 (data/benchmarks/ladder.json was recorded before rungs 10 and 11 existed).
RUNG_PROBE = "benchmarks/r10_probe"
# The run that timed rung 12 beside rung 11 and both SDPA backends, fp16 and bf16, both protocols: where "best" was
# chosen (flashlab.gpu.BEST, by ``fastest_rung``).
BEST_PROBE = "benchmarks/r12_probe"
# The run that timed the Hopper rungs side by side on an H200 (flashlab.gpu.HOPPER_BEST, by ``fastest_rung``).
HOPPER_PROBE = "benchmarks/hopper"
# The run that timed rung H10 beside H9 and SDPA's backends (H10 came after HOPPER_PROBE's run): "best" takes H10
# where ``fastest_rung`` over this run prefers it to the rung HOPPER_PROBE chose.
HOPPER_MERGED_PROBE = "benchmarks/hopper_merged"
# The run that timed rung H11 beside H10, H2 and SDPA's backends: "best" takes H11 where ``fastest_rung`` over this
# run prefers it to the rung chosen before it.
HOPPER_STAGED_PROBE = "benchmarks/hopper_staged"
# The runs that timed rung H12 beside H11, H2 and SDPA's backends: H11 first within each shape, then H12 first, then
# both orders in one run (--rounds 2). A run times the implementations of a shape one after another, and on a GPU
# that heats up and lowers its clock under a power cap the one timed first gains: H12's causal kernels are H11's
# code, yet each came out ahead in the run that timed it first. "best" takes H12 where ``fastest_rung`` over the
# three runs prefers it.
HOPPER_STREAM_K_PROBES = ("benchmarks/hopper_stream_k", "benchmarks/hopper_stream_k_first",
                          "benchmarks/hopper_stream_k_rounds")
# The rungs that came after HOPPER_PROBE's run, in ladder order, each with the runs that timed it beside the rungs
# "best" chose before it.
HOPPER_LATER_PROBES = {"merged": (HOPPER_MERGED_PROBE,), "staged": (HOPPER_STAGED_PROBE,),
                       "stream_k": HOPPER_STREAM_K_PROBES}
# A later rung replaces an earlier one only if it is faster by more than this (geometric mean over a run's rows):
# two rungs of one run closer than that swap places from run to run.
TIE = 0.01


def fastest_rung(rows: list[dict], d: int, order: list[str], *more_runs: list[dict]) -> str:
    """The rung of ``order`` (earliest first) with the lowest geometric-mean time over the rows at head size ``d``
    that every rung of ``order`` has (every dtype, n, mask and protocol); a later rung must beat the choice so far
    by more than ``TIE``. ``more_runs``: other runs of the same rungs (e.g. timed in another order), whose rows count
    alike: the geometric mean runs over every run's rows."""
    runs = []
    for run in (rows, *more_runs):
        ms = {(r["impl"], dtype_of(r), records.protocol_of(r), r["n"], r["causal"]): r["median_ms"]
              for r in run if "error" not in r and r["d"] == d}
        keys = set.intersection(*({k[1:] for k in ms if k[0] == name} for name in order))
        if not keys:
            raise ValueError(f"no row at d = {d} has every rung of {order}")
        runs.append((ms, keys))

    def geomean(name: str) -> float:
        logs = [math.log(ms[(name, *k)]) for ms, keys in runs for k in keys]
        return math.exp(sum(logs) / len(logs))

    best = order[0]
    for name in order[1:]:
        if geomean(name) < (1 - TIE) * geomean(best):
            best = name
    return best


def columns_of(rows: list[dict], dtype: str = "float16") -> list[tuple[int, int, bool]]:
    """The (d, n, causal) of a record's timed rows of ``dtype``, in the ladder's order: d = 128 first, then mask,
    then n."""
    cols = {(r["d"], r["n"], r["causal"]) for r in rows if "error" not in r and dtype_of(r) == dtype}
    return sorted(cols, key=lambda c: (-c[0], c[2], c[1]))


def speedups(rows: list[dict], impl: str, ref: str, *, protocol: str | None = None, d: int | None = None,
             causal: bool | None = None, dtype: str = "float16") -> list[float]:
    """time(ref) / time(impl) at every (d, n, causal) where both were timed under the same protocol, in the order of
    ``columns_of`` (above 1: ``impl`` is the faster); ``protocol``, ``d``, ``causal``: only those rows (None: all);
    ``dtype``: the rows of that input precision."""
    ms = {(r["impl"], records.protocol_of(r), r["d"], r["n"], r["causal"]): r["median_ms"]
          for r in rows if "error" not in r and dtype_of(r) == dtype}
    return [ms[(ref, p, *c)] / ms[(impl, p, *c)] for c in columns_of(rows, dtype) for p in records.PROTOCOLS
            if (impl, p, *c) in ms and (ref, p, *c) in ms and protocol in (None, p) and d in (None, c[0])
            and causal in (None, c[2])]


def ladder_markdown(rows: list[dict], impls: list[str] | None = None,
                    columns: list[tuple[int, int, bool]] | None = None, dtype: str = "float16") -> str:
    """One line per implementation and protocol, one column per (d, n, causal) of ``columns`` (default
    ``LADDER_COLUMNS``): TFLOP/s (% of sdpa_flash in the same run under the same protocol; with both references
    timed, also % of sdpa_cudnn). ``dtype``: the rows of that input precision."""
    rows = [r for r in rows if "error" not in r and dtype_of(r) == dtype]
    t = {(im, p, d, n, c): v for (im, p, _, d, n, c), v in _percents(rows).items()}
    if impls is None:
        impls = list(dict.fromkeys(r["impl"] for r in rows))
    protocols = [p for p in records.PROTOCOLS if any(records.protocol_of(r) == p for r in rows)]
    cols = [c for c in (LADDER_COLUMNS if columns is None else columns)
            if any((i, p, *c) in t for i in impls for p in protocols)]
    head = " | ".join(f"d={d} n={n}{' causal' if c else ''}" for d, n, c in cols)
    lines = [f"| impl | protocol | {head} |", "|---" * (len(cols) + 2) + "|"]
    for p in protocols:
        for im in impls:
            if not any((im, p, *key) in t for key in cols):
                continue
            cells = []
            for key in cols:
                v = t.get((im, p, *key))
                pcts = [f"{100 * v / ref:.0f}%" for name in ("sdpa_flash", "sdpa_cudnn")
                        if v is not None and (ref := t.get((name, p, *key)))]
                cells.append("-" if v is None else f"{v:.1f} ({' / '.join(pcts)})" if pcts else f"{v:.1f}")
            lines.append(f"| {im} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
