"""``python -m flashlab bench decode``: split-KV decoding, one query token (or a few) against a KV cache of m keys.

Each split kernel of ``flashlab.gpu.decoding`` (``--kernels``; impl "<kernel>" with the default split count,
"<kernel>_split_<S>" for the sweep, "<kernel>_unsplit" for num_splits=1), PyTorch SDPA on the same shapes, and
a device-to-device copy of the cache, whose bandwidth gives the time to read the cache once: all in one run, on
the same random fp16 inputs, each output checked against the unsplit "rows" kernel before it is timed. Rows: pass
"decode", with kv_bytes and GB/s, written to data/ch8/decode.json.
"""

from __future__ import annotations

import argparse
import sys

from .. import records
from ..gpu import decoding
from . import error_line, gpu_main, record_parser, training_kernel_hashes
from .backward import OUT_DIR, max_diff


def _copy_ms(nbytes: int, repeat: int, warmup: int) -> float:
    import cupy as cp

    src = cp.ones(nbytes // 2, dtype=cp.float16)
    dst = cp.empty_like(src)
    return records.median_ms(lambda: cp.copyto(dst, src), repeat, warmup)


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """One table per cache length of ``args.m``: every split kernel and split count, SDPA, and the copy floor."""
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

            err = max_diff(fn()[0], ref)
            ms = records.median_ms(fn, args.repeat, args.warmup)
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
        err = max_diff(cp.from_dlpack(sdpa().contiguous()), ref)
        ms = records.median_ms(sdpa, args.repeat, args.warmup, kind="torch")
    except Exception as e:  # noqa: BLE001
        rows.append({**base, "impl": "sdpa", "error": f"{type(e).__name__}: {str(e)[:200]}"})
        return
    rows.append({**base, "impl": "sdpa", "median_ms": round(ms, 5), "gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1),
                 "x_read_once": round(ms / read_once_ms, 3), "repeat": args.repeat, "max_abs_diff": err,
                 "diff_against": "rows_unsplit"})
    print(f"  {'sdpa':<10} {'':<12} {ms * 1e3:9.1f} us  {rows[-1]['gbps']:7.0f} GB/s", flush=True)


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row: time, GB/s and multiple of the time to read the cache once."""
    return "\n".join(error_line(r) if "error" in r else
                     f"{r['impl']:<16} m={r['m']:<7} splits={r.get('num_splits', '-')!s:<5} "
                     f"{r['median_ms'] * 1e3:9.1f} us {r['gbps']:8.0f} GB/s {r['x_read_once']:6.2f}x read-once"
                     for r in rows)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("decode", __doc__.splitlines()[0], name="decode", out=OUT_DIR)
    p.add_argument("--d", nargs="+", type=int, default=[128], help="head dimension (the first is used)")
    p.add_argument("--m", nargs="+", type=int, default=[4096, 16384, 65536], help="cache lengths")
    p.add_argument("--queries", type=int, default=1, help="query tokens per step")
    p.add_argument("--splits", nargs="*", type=int, default=[4, 16, 64, 256], help="extra split counts")
    p.add_argument("--kernels", nargs="+", default=list(decoding.KERNELS), choices=decoding.KERNELS,
                   help="split kernels to time")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: heads)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print it; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("decode", argv, parser(), run, format_rows, extra_provenance=training_kernel_hashes)
