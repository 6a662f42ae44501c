"""``python -m flashlab bench memory``: what each way of training keeps between the forward and the backward pass.

Flash keeps o and lse; standard attention keeps o and P. For each n: the bytes kept, and the extra memory of each
backward, from CuPy's memory pool (the standard path runs out of memory first: recorded as an error row). Rows:
pass "memory", written to data/ch8/memory.json.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..gpu import backward
from . import error_line, gpu_main, record_parser, training_kernel_hashes
from .backward import OUT_DIR


def _standard_forward(q, k, v):
    """Eager attention as a training framework runs it: returns o and the P it keeps for the backward."""
    import cupy as cp

    s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * np.float32(1 / np.sqrt(q.shape[-1]))
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    P = (p / p.sum(axis=-1, keepdims=True)).astype(q.dtype)
    del s, p
    return cp.matmul(P, v), P


def run(args: argparse.Namespace, rows: list[dict]) -> None:
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


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row: bytes kept, and the backward's extra bytes."""
    return "\n".join(error_line(r) if "error" in r else
                     f"{r['impl']:<12} n={r['n']:<6} kept {r['kept_bytes'] / 1e6:10.1f} MB, backward extra "
                     f"{r['backward_extra_bytes'] / 1e6:10.1f} MB" for r in rows)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (--repeat and --warmup are accepted but nothing is timed)."""
    p = record_parser("memory", __doc__.splitlines()[0], name="memory", out=OUT_DIR)
    p.add_argument("--d", nargs="+", type=int, default=[128], help="head dimension (the first is used)")
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384], help="sequence lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="default 1")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; print it; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("memory", argv, parser(), run, format_rows, extra_provenance=training_kernel_hashes)
