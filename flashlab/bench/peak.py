"""``python -m flashlab bench peak``: the tensor-core ceiling of mma.sync on this GPU, in TFLOP/s.

kernels/peak_mma.cu issues m16n8k16 mma after mma (fp16 or bf16 inputs, fp32 accumulators) into independent
accumulators from registers, with no memory traffic, on every SM: the most any rung built from mma.sync can
reach. Rows for each dtype, each number of warps per SM of --warps and each protocol (a launch of --iters
iterations per warp, one call then synchronize, or calls back to back); chapter 7 sets each rung's TFLOP/s
against the best of them. Written to data/benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import records
from . import add_protocols, gpu_main, record_parser

OUT_DIR = records.DATA_DIR / "benchmarks"
FLOP_PER_MMA = 2 * 16 * 8 * 16
ACC = 8  # independent accumulators per warp (the kernel's default)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("peak", __doc__.splitlines()[0], name="peak", out=OUT_DIR, repeat=30, warmup=5)
    p.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16, 32], help="warps per SM (blocks of 4 warps)")
    p.add_argument("--iters", type=int, default=4096, help="loop iterations per warp (ACC mma each)")
    p.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16"), default=["float16", "bfloat16"])
    add_protocols(p)
    return p


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time the kernel for each dtype and warps per SM under each protocol; one row each."""
    import cupy as cp

    import flashlab.gpu as fgpu

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for dtype in args.dtypes:
        kern = fgpu.kernel_function("peak_mma.cu", "mma_peak_" + ("bf16" if dtype == "bfloat16" else "f16"))
        for warps in args.warps:
            if warps % 4:
                raise SystemExit(f"--warps must be multiples of 4 (blocks of 4 warps); got {warps}")
            blocks = sms * warps // 4
            out = cp.empty(blocks * 128, cp.float32)

            def fn(kern=kern, blocks=blocks, out=out):
                kern((blocks,), (128,), (out, np.int32(args.iters), np.uint32(12345)))

            fn()
            if not bool(cp.isfinite(out).all()):
                raise SystemExit("the peak kernel produced non-finite sums: its fragments are not small numbers")
            flop = blocks * 4 * args.iters * ACC * FLOP_PER_MMA
            for protocol in args.protocols:
                ms = records.median_ms(fn, args.repeat, args.warmup, protocol=protocol)
                rows.append({"impl": "mma_sync_m16n8k16", "dtype": dtype, "warps_per_sm": warps, "sms": sms,
                             "iters": args.iters, "protocol": protocol, "median_ms": round(ms, 5),
                             "tflops": round(flop / (ms * 1e-3) / 1e12, 2), "repeat": args.repeat})
                print(f"  {dtype:<9} warps/SM={warps:<3} {protocol:<10} {ms:8.3f} ms {rows[-1]['tflops']:8.1f} TFLOP/s",
                      flush=True)


def ceiling(rows: list[dict], dtype: str = "float16") -> float:
    """The best TFLOP/s of a record's rows of ``dtype``: the mma.sync ceiling the rungs are set against."""
    return max(r["tflops"] for r in rows if r.get("dtype") == dtype)


def format_rows(rows: list[dict]) -> str:
    """One line per row, and the ceiling of each dtype."""
    lines = [f"{r['impl']} {r['dtype']:<9} warps/SM={r['warps_per_sm']:<3} {r['protocol']:<10} "
             f"{r['median_ms']:8.3f} ms {r['tflops']:8.1f} TFLOP/s" for r in rows]
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        lines.append(f"ceiling {dt}: {ceiling(rows, dt):.1f} TFLOP/s")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """Markdown: TFLOP/s per (dtype, warps per SM) under each protocol, as docs/kernels.md shows the record."""
    tf = {(r["dtype"], r["warps_per_sm"], r["protocol"]): r["tflops"] for r in rows}
    protocols = [p for p in records.PROTOCOLS if any(k[2] == p for k in tf)]
    out = ["| dtype | warps per SM | " + " | ".join(f"TFLOP/s ({p})" for p in protocols) + " |",
           "|---|---|" + "---|" * len(protocols)]
    for dt, warps in dict.fromkeys(k[:2] for k in tf):
        out.append(f"| {dt} | {warps} | " + " | ".join(f"{tf[(dt, warps, p)]:.1f}" for p in protocols) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write data/benchmarks/NAME.json unless --no-write."""
    return gpu_main("peak", sys.argv[1:] if argv is None else list(argv), parser(), run, format_rows)
