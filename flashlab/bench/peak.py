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
# kernels/hopper/peak_wgmma.cu (sm_90 only): a warpgroup (4 warps) per block issues wgmma m64n256k16, four a batch.
FLOP_PER_WGMMA = 2 * 64 * 256 * 16
WGMMA_PER_ITER = 4
WGMMA_SMEM = (64 + 256) * 64 * 2 + 1024  # A (64 x 64) and B (256 x 64) fp16, and room to align them on 1 KB
IMPLS = {"mma_sync": "mma_sync_m16n8k16", "wgmma": "wgmma_m64n256k16"}


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("peak", __doc__.splitlines()[0], name="peak", out=OUT_DIR, repeat=30, warmup=5)
    p.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16, 32], help="warps per SM (blocks of 4 warps)")
    p.add_argument("--iters", type=int, default=4096, help="loop iterations per warp (ACC mma each)")
    p.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16"), default=["float16", "bfloat16"])
    p.add_argument("--impls", nargs="+", choices=tuple(IMPLS), default=["mma_sync"],
                   help="mma_sync (every GPU from sm_80) and/or wgmma (Hopper's warpgroup MMA, sm_90 only)")
    add_protocols(p)
    return p


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time the kernel for each dtype and warps per SM under each protocol; one row each."""
    import cupy as cp

    import flashlab.gpu as fgpu

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for impl in args.impls:
        if impl == "wgmma" and (problem := fgpu.hopper_problem()):
            raise SystemExit(f"--impls wgmma: {problem}")
        for dtype in args.dtypes:
            suffix = "bf16" if dtype == "bfloat16" else "f16"
            if impl == "wgmma":
                kern = fgpu.kernel_function("hopper/peak_wgmma.cu", "wgmma_peak_" + suffix, shared_bytes=WGMMA_SMEM)
                smem, flop_per_block = WGMMA_SMEM, args.iters * WGMMA_PER_ITER * FLOP_PER_WGMMA
            else:
                kern = fgpu.kernel_function("peak_mma.cu", "mma_peak_" + suffix)
                smem, flop_per_block = 0, 4 * args.iters * ACC * FLOP_PER_MMA
            for warps in args.warps:
                if warps % 4:
                    raise SystemExit(f"--warps must be multiples of 4 (blocks of 4 warps); got {warps}")
                blocks = sms * warps // 4
                out = cp.empty(blocks * 128, cp.float32)

                def fn(kern=kern, blocks=blocks, out=out, smem=smem):
                    kern((blocks,), (128,), (out, np.int32(args.iters), np.uint32(12345)), shared_mem=smem)

                fn()
                if not bool(cp.isfinite(out).all()):
                    raise SystemExit("the peak kernel produced non-finite sums: its operands are not small numbers")
                for protocol in args.protocols:
                    ms = records.median_ms(fn, args.repeat, args.warmup, protocol=protocol)
                    rows.append({"impl": IMPLS[impl], "dtype": dtype, "warps_per_sm": warps, "sms": sms,
                                 "iters": args.iters, "protocol": protocol, "median_ms": round(ms, 5),
                                 "tflops": round(blocks * flop_per_block / (ms * 1e-3) / 1e12, 2),
                                 "repeat": args.repeat})
                    print(f"  {IMPLS[impl]:<18} {dtype:<9} warps/SM={warps:<3} {protocol:<10} {ms:8.3f} ms "
                          f"{rows[-1]['tflops']:8.1f} TFLOP/s", flush=True)


def ceiling(rows: list[dict], dtype: str = "float16", impl: str = IMPLS["mma_sync"]) -> float:
    """The best TFLOP/s of a record's rows of ``dtype`` and ``impl``: by default the mma.sync ceiling the rungs of
    chapter 7 are set against."""
    return max(r["tflops"] for r in rows if r.get("dtype") == dtype and r.get("impl", IMPLS["mma_sync"]) == impl)


def format_rows(rows: list[dict]) -> str:
    """One line per row, and the ceiling of each dtype."""
    lines = [f"{r['impl']} {r['dtype']:<9} warps/SM={r['warps_per_sm']:<3} {r['protocol']:<10} "
             f"{r['median_ms']:8.3f} ms {r['tflops']:8.1f} TFLOP/s" for r in rows]
    for impl, dt in dict.fromkeys((r.get("impl", IMPLS["mma_sync"]), r["dtype"]) for r in rows):
        lines.append(f"ceiling {impl} {dt}: {ceiling(rows, dt, impl):.1f} TFLOP/s")
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
