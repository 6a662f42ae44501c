"""``python -m flashlab bench tune``: time a tunable rung (6 or later) with other tile sizes, to choose its defaults.

Same method as ``bench forward`` (fp16 random inputs, CUDA events, median of --repeat runs after warm-up,
16 heads, batch x n = --tokens), one line per (tiles, d, n, causal), plus the max difference against the
default rung's output. Writes data/benchmarks/tune_RUNG.json with provenance unless --no-write.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import records
from . import PROG
from .forward import OUT_DIR, flop


def _launcher(attention, q, k, v, causal, rung, o, lse):
    def run():
        attention(q, k, v, causal=causal, kernel=rung, out=(o, lse))

    return run


def parser() -> argparse.ArgumentParser:
    """The command line of this run."""
    p = argparse.ArgumentParser(prog=f"{PROG} tune", description=__doc__.splitlines()[0])
    p.add_argument("--rung", choices=("exp2_tiles", "warp32", "lean", "addressing", "one_barrier", "k_lanes"),
                   default="k_lanes")
    p.add_argument("--configs", nargs="+", default=["4x64", "8x64", "4x32", "8x32"],
                   help="NWARPSxBC tile sizes (BC = keys per tile; warp32: BC at d = 64, always 32 at d = 128)")
    p.add_argument("--d", nargs="+", type=int, default=[64, 128])
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default=str(OUT_DIR), help="output directory (default: data/benchmarks)")
    p.add_argument("--no-write", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Time every tile configuration of --rung; write data/benchmarks/tune_RUNG.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    import cupy as cp

    from ..gpu import RUNGS, attention, rung6_variant, rung7_variant

    prov = records.gpu_provenance(records.command_line(f"{PROG} tune", argv))
    rows = []
    rng = cp.random.default_rng(1)
    for d in args.d:
        for n in args.n:
            batch = max(1, args.tokens // n)
            for causal in (False, True):
                q, k, v = (rng.standard_normal((batch, args.heads, n, d), dtype=cp.float32).astype(cp.float16)
                           for _ in range(3))
                ref = attention(q, k, v, causal=causal, kernel=RUNGS[args.rung])[0].astype(cp.float32)
                seen = set()
                for cfg in args.configs:
                    w, c = (int(x) for x in cfg.split("x"))
                    if args.rung == "exp2_tiles":
                        if d == 128 and c > 64:  # s[BC/8][4] and O no longer fit in registers: spills
                            continue
                        rung = rung6_variant(w, c)
                    elif args.rung == "warp32":
                        rung = rung7_variant(w, c if d == 64 else 64, 32)
                        if (d, w, rung.name) in seen:  # d = 128 always uses 32-key tiles here
                            continue
                        seen.add((d, w, rung.name))
                    else:
                        rung = rung7_variant(w, c, c, base=args.rung)
                    o = cp.full_like(q, np.nan)
                    lse = cp.empty(q.shape[:-1], cp.float32)
                    attention(q, k, v, causal=causal, kernel=rung, out=(o, lse))
                    err = float(cp.abs(o.astype(cp.float32) - ref).max())
                    ms = records.median_ms(_launcher(attention, q, k, v, causal, rung, o, lse), args.repeat, 3)
                    tf = flop(n, d, batch, args.heads, causal) / (ms * 1e-3) / 1e12
                    rows.append({"impl": rung.name, "nwarps": w, "bc": c, "d": d, "n": n, "batch": batch,
                                 "heads": args.heads, "causal": causal, "median_ms": round(ms, 5),
                                 "tflops": round(tf, 3), "max_abs_diff_vs_default": err})
                    print(f"{rung.name:<20} d={d:<4} n={n:<6} causal={causal!s:<5} {ms:8.3f} ms {tf:8.2f} TFLOP/s "
                          f"diff={err:.1e}", flush=True)
                del q, k, v, ref
                cp.get_default_memory_pool().free_all_blocks()
    if not args.no_write:
        records.write_record(args.out, f"tune_{args.rung}", prov, rows)
    return 0
