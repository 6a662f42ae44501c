"""``python -m flashlab bench forward``: time the kernel ladder against naive CuPy and PyTorch SDPA.

Every row of a table comes from one run: the references (naive CuPy attention with S materialised, PyTorch SDPA
with the flash and the cuDNN backends when PyTorch is present) are timed in the same run, on the same random fp16
inputs, with CUDA events, as the median of --repeat runs after --warmup runs. Before timing, each implementation's
output is poisoned, computed once and compared with a reference, and the error is recorded in its row. FLOP =
4 n^2 d batch heads for the forward pass (half that with a causal mask). Written to data/benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import records
from . import failed_row, gpu_main, record_parser, timed_row, without_torch

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
                   help=f"rungs {list(fgpu.RUNGS)} and/or references {list(REFERENCES)}")
    p.add_argument("--d", nargs="+", type=int, default=[64, 128], help="head dimensions")
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384], help="sequence lengths")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch x n (batch = tokens // n)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="fixed batch size (overrides --tokens): memory sweeps")
    p.add_argument("--slow-max-n", type=int, default=4096,
                   help=f"time the slow rungs {SLOW_RUNGS} only up to this n (they take seconds per call)")
    return p


def _impl(name: str, q, k, v, causal: bool):
    """(kind, fn, result-as-cupy-float32) for one implementation on fixed inputs."""
    import cupy as cp

    import flashlab.gpu as fgpu

    if name in fgpu.RUNGS:
        o = cp.empty_like(q)
        lse = cp.empty(q.shape[:-1], cp.float32)

        def fn():
            fgpu.attention(q, k, v, causal=causal, kernel=name, out=(o, lse))

        def result():
            o.fill(np.nan)
            lse.fill(np.nan)
            fn()
            return o.astype(cp.float32)

        return "cupy", fn, result
    if name == "cupy_naive":
        def fn():
            return fgpu.naive_attention(q, k, v, causal=causal)

        return "cupy", fn, lambda: fn()[0].astype(cp.float32)
    if name in ("sdpa_flash", "sdpa_cudnn"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        def result():
            out = fn()
            torch.cuda.synchronize()
            return cp.from_dlpack(out.contiguous()).astype(cp.float32)

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
    """Time every implementation of ``args.impls`` at each (d, n, causal) of ``args``; append one row each."""
    import cupy as cp

    impls = list(args.impls)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rng = cp.random.default_rng(0)
    pool = cp.get_default_memory_pool()
    for d in args.d:
        for n in args.n:
            batch = args.batch if args.batch else max(1, args.tokens // n)
            for causal in causals:
                shape = (batch, args.heads, n, d)
                q, k, v = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(3))
                # Differences are taken against the first reference that runs: sdpa_flash, else cupy_naive.
                ref, ref_name = None, None
                for cand in [r for r in ("sdpa_flash", "cupy_naive") if r in impls]:
                    try:
                        ref, ref_name = _impl(cand, q, k, v, causal)[2](), cand
                        break
                    except Exception:  # noqa: BLE001 - e.g. naive attention out of memory at large n
                        pool.free_all_blocks()
                for name in impls:
                    if name in SLOW_RUNGS and n > args.slow_max_n:
                        continue
                    base = {"impl": name, "pass": "fwd", "dtype": "float16", "d": d, "n": n, "batch": batch,
                            "heads": args.heads, "causal": causal}
                    pool.free_all_blocks()
                    held = pool.total_bytes()
                    try:
                        kind, fn, result = _impl(name, q, k, v, causal)
                        out = result()
                        extra = pool.total_bytes() - held
                        err = float(cp.abs(out - ref).max()) if ref is not None else None
                        del out
                        ms = records.median_ms(fn, args.repeat, args.warmup, kind=kind)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, the table goes on
                        rows.append(failed_row(base, e))
                        pool.free_all_blocks()
                        continue
                    pool.free_all_blocks()
                    f = flop(n, d, batch, args.heads, causal)
                    # extra_bytes: what CuPy's pool held after one call beyond before it (outputs, temporaries and the
                    # float32 copy of the output made for the check above;
                    # PyTorch's own allocator is not seen, so 0 for sdpa_*): about the call's peak working memory.
                    rows.append(timed_row(base, ms, f, args.repeat, err, ref_name, extra))
                    print(f"  {name:<12} d={d:<4} n={n:<6} causal={causal!s:<5} {ms:9.3f} ms "
                          f"{rows[-1]['tflops']:8.2f} TFLOP/s  max|diff vs {ref_name}|={err}  "
                          f"+{extra / 2**20:.0f} MiB", flush=True)
                del q, k, v, ref
                pool.free_all_blocks()


def format_rows(rows: list[dict]) -> str:
    """What a run prints at its end: :func:`format_table`, then one line per failed row."""
    lines = [format_table(rows)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r['d']:>4} {r['n']:>6} {r['causal']!s:>6}  {r['error'][:80]}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per row, with % of sdpa_flash and sdpa_cudnn for the same (d, n, causal)."""
    rows = [r for r in rows if "error" not in r]
    refs = {(r["impl"], r["d"], r["n"], r["causal"]): r["tflops"] for r in rows}
    lines = [f"{'impl':<12} {'d':>4} {'n':>6} {'causal':>6} {'ms':>9} {'TFLOP/s':>8} {'%flash':>7} {'%cudnn':>7}"]
    for r in rows:
        key = (r["d"], r["n"], r["causal"])
        pct = []
        for ref in ("sdpa_flash", "sdpa_cudnn"):
            t = refs.get((ref, *key))
            pct.append(f"{100 * r['tflops'] / t:6.1f}%" if t else f"{'-':>7}")
        lines.append(f"{r['impl']:<12} {r['d']:>4} {r['n']:>6} {r['causal']!s:>6} {r['median_ms']:>9.3f} "
                     f"{r['tflops']:>8.2f} {pct[0]} {pct[1]}")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """Markdown table of recorded rows: TFLOP/s and % of sdpa_flash / sdpa_cudnn for each (d, n, causal)."""
    rows = [r for r in rows if "error" not in r]
    refs = {(r["impl"], r["d"], r["n"], r["causal"]): r["tflops"] for r in rows}
    out = ["| impl | d | n | causal | ms | TFLOP/s | % sdpa_flash | % sdpa_cudnn |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["d"], r["n"], r["causal"])):
        key = (r["d"], r["n"], r["causal"])
        pct = [f"{100 * r['tflops'] / refs[(ref, *key)]:.1f}" if refs.get((ref, *key)) else "-"
               for ref in ("sdpa_flash", "sdpa_cudnn")]
        out.append(f"| {r['impl']} | {r['d']} | {r['n']} | {r['causal']} | {r['median_ms']:.3f} | {r['tflops']:.1f} "
                   f"| {pct[0]} | {pct[1]} |")
    return "\n".join(out)


LADDER_COLUMNS = [(128, 4096, False), (128, 16384, False), (128, 4096, True), (128, 16384, True),
                  (64, 4096, False), (64, 16384, False), (64, 4096, True), (64, 16384, True)]


def ladder_markdown(rows: list[dict], impls: list[str] | None = None) -> str:
    """One line per implementation, one column per (d, n, causal): TFLOP/s (% of sdpa_flash in the same run)."""
    rows = [r for r in rows if "error" not in r]
    t = {(r["impl"], r["d"], r["n"], r["causal"]): r["tflops"] for r in rows}
    if impls is None:
        impls = list(dict.fromkeys(r["impl"] for r in rows))
    cols = [c for c in LADDER_COLUMNS if any((i, *c) in t for i in impls)]
    head = " | ".join(f"d={d} n={n}{' causal' if c else ''}" for d, n, c in cols)
    lines = [f"| impl | {head} |", "|---" * (len(cols) + 1) + "|"]
    for im in impls:
        cells = []
        for key in cols:
            v, f = t.get((im, *key)), t.get(("sdpa_flash", *key))
            cells.append("-" if v is None else f"{v:.1f} ({100 * v / f:.0f}%)" if f else f"{v:.1f}")
        lines.append(f"| {im} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
