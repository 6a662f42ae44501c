"""``python -m flashlab bench decode``: split-KV decoding, one query token (or a few) against a KV cache of m keys.

Each split kernel of ``flashlab.gpu.decoding`` (``--kernels``; impl "<kernel>" with the default split count,
"<kernel>_split_<S>" for the sweep, "<kernel>_unsplit" for num_splits=1; each call through ``flashlab.gpu.decode``
into preallocated outputs with a reused workspace and the default lengths), PyTorch SDPA on the same shapes
("sdpa": PyTorch's own choice of backend; "sdpa_flash", "sdpa_cudnn": that backend), and a device-to-device copy
of the cache, whose bandwidth gives the time to read the cache once: all in one run, on the same random fp16
inputs, each output checked against the unsplit "rows" kernel before it is timed, each timed under every protocol
of --protocols (one row each). Rows: pass "decode", with kv_bytes and GB/s, written to data/ch8/decode.json. A
split kernel's rows say how its merge kernel was launched (``merge_launch``: "ordinary", the default, or
"dependent", a programmatic dependent launch); ``--dependent-merge`` adds "<kernel>_dependent_merge", the default
split count with the dependent launch (sm_90 on), to compare the two in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from .. import records
from ..gpu import decoding
from . import (
    add_protocols,
    add_rounds,
    copy_gbps,
    error_line,
    gpu_main,
    max_diff,
    median_times,
    ratio_cells,
    record_parser,
    time_later_rounds,
    training_kernel_hashes,
)
from .backward import OUT_DIR

SDPA = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}  # impl -> SDPBackend


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """One table per cache length of ``args.m``: every split kernel and split count, SDPA, and the copy time (K
    copied once: the cache's K + V bytes moved, half read and half written)."""
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
    gbps = copy_gbps(k.nbytes, args.repeat, args.warmup)  # a copy of one of K, V
    read_once_ms = kv_bytes / (gbps * 1e9) * 1e3
    base = {"pass": "decode", "dtype": "float16", "d": d, "n": nq, "m": m, "batch": B, "heads": H,
            "kv_heads": Hk, "kv_bytes": kv_bytes, "copy_gbps": round(gbps, 1),
            "read_once_ms": round(read_once_ms, 5)}
    print(f"# m={m}: KV cache {kv_bytes / 1e6:.1f} MB, copy bandwidth {gbps:.0f} GB/s -> copy time "
          f"{read_once_ms * 1e3:.1f} us")
    ref, _ = fgpu.decode(q, k, v, num_splits=1, kernel="rows")
    out = (cp.empty_like(q), cp.empty(q.shape[:-1], dtype=cp.float32))
    workspace = fgpu.Workspace()
    timed: list[tuple] = []  # (row base, timed call, event kind, samples per protocol, max |diff|), in timing order
    # impl: "<kernel>" with the default split count, "<kernel>_unsplit", "<kernel>_split_<S>"
    runs = [(f"{kern}{suffix}", kern, splits, False) for kern in args.kernels
            for suffix, splits in [("", None), ("_unsplit", 1)] + [(f"_split_{s}", s) for s in args.splits]]
    if args.dependent_merge:  # the default split count with the merge as a programmatic dependent launch
        runs += [(f"{kern}_dependent_merge", kern, None, True) for kern in args.kernels if kern != "fused"]
    for name, kern, splits, dependent in runs:
        def fn(splits=splits, kern=kern, dependent=dependent):
            return fgpu.decode(q, k, v, num_splits=splits, kernel=kern, out=out, workspace=workspace,
                               dependent_merge=dependent)

        # the split count decode chose (the default comes from the kernel's occupancy on this GPU)
        used = splits or decoding.default_splits_here(q.shape, k.shape, d, kern)
        # a dependent launch that cannot be is an error in its row (decode raises), so the row says what ran
        extra = {} if kern == "fused" else {"merge_launch": "dependent" if dependent else "ordinary"}
        _first_round(args, rows, timed, {**base, "impl": name, "kernel": kern, "num_splits": used, **extra}, fn,
                     "cupy", lambda fn=fn: fn()[0], ref)
    for name, sdpa in _sdpa_calls(q, k, v, H != Hk):
        _first_round(args, rows, timed, {**base, "impl": name}, sdpa, "torch",
                     lambda sdpa=sdpa: cp.from_dlpack(sdpa().contiguous()), ref)
    rounds = max(1, args.rounds)
    time_later_rounds(args, rounds, [(fn, kind, times) for _, fn, kind, times, _ in timed])
    for row_base, _, _, times, err in timed:
        for protocol, samples in times.items():
            ms = statistics.median(samples)
            row = {**row_base, "protocol": protocol, "median_ms": round(ms, 5),
                   "gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1), "x_read_once": round(ms / read_once_ms, 3),
                   "repeat": args.repeat, "max_abs_diff": err, "diff_against": "rows_unsplit"}
            rows.append({**row, "rounds": rounds} if rounds > 1 else row)
            print(f"  {row['impl']:<16} splits={row.get('num_splits', '-')!s:<5} {protocol:<10} {ms * 1e3:9.1f} us  "
                  f"{row['gbps']:7.0f} GB/s  {row['x_read_once']:.2f}x copy time  max|diff|={err:.1e}", flush=True)


def _sdpa_calls(q, k, v, gqa: bool) -> list:
    """(impl, call) for each SDPA backend of ``SDPA`` on these CuPy arrays; none without PyTorch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

    def call():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)

    # a backend is picked once, outside the timed calls (records.Pinned)
    return [(name, call if backend is None else
             records.Pinned(lambda backend=backend: sdpa_kernel(getattr(SDPBackend, backend)), call))
            for name, backend in SDPA.items()]


def _first_round(args, rows: list[dict], timed: list, base: dict, fn, kind: str, result, ref) -> None:
    """Check ``result()`` against ``ref`` once, then time ``fn`` under each protocol and keep the samples in
    ``timed`` (or append a row with the error)."""
    try:
        err = max_diff(result(), ref)
        times = {p: records.cuda_times(fn, args.repeat, args.warmup, kind=kind, protocol=p) for p in args.protocols}
    except Exception as e:  # noqa: BLE001 - recorded, the table goes on
        rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(f"  {base['impl']:<16} {rows[-1]['error'][:100]}", flush=True)
        return
    timed.append((base, fn, kind, times, err))


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row: protocol, time, GB/s, multiple of the time to read the cache once, and the
    speed as a multiple of sdpa_flash's and sdpa_cudnn's (same m, same protocol; "-" where the run has none)."""
    times = median_times(rows, key=lambda r: (r["m"],))
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(error_line(r))
            continue
        flash, cudnn = ratio_cells(r, times, key=lambda r: (r["m"],))
        lines.append(f"{r['impl']:<16} m={r['m']:<7} splits={r.get('num_splits', '-')!s:<5} "
                     f"{records.protocol_of(r):<10} {r['median_ms'] * 1e3:9.1f} us {r['gbps']:8.0f} GB/s "
                     f"{r['x_read_once']:6.2f}x copy time  x{flash:>5} sdpa_flash x{cudnn:>5} sdpa_cudnn")
    return "\n".join(lines)


LABELS = {"mma": "`mma` (decode_r3_mma.cu), default splits",
          "keys": "`keys` (decode_r2_warp_keys.cu), default splits",
          "rows": "`rows` (decode_r1_split.cu), default splits",
          "sdpa": "PyTorch SDPA, its own backend choice", "sdpa_flash": "PyTorch SDPA, flash backend",
          "sdpa_cudnn": "PyTorch SDPA, cuDNN backend"}


def _label(impl: str) -> str:
    kernel, _, rest = impl.partition("_")
    if rest == "unsplit":
        return f"`{kernel}`, unsplit"
    if rest.startswith("split_"):
        return f"`{kernel}`, {rest.split('_')[1]} splits"
    return LABELS.get(impl, impl)


# The rows docs/kernels.md shows of data/ch8/decode.json (the whole sweep is in the file)
SUMMARY_IMPLS = ("mma", "mma_unsplit", "keys", "keys_unsplit", "keys_split_41", "rows", "rows_unsplit", "sdpa",
                 "sdpa_flash", "sdpa_cudnn")


def markdown_table(rows: list[dict], impls: tuple[str, ...] | None = None) -> str:
    """Markdown as docs/kernels.md shows a decode record: per implementation (``impls``, default every one) and
    protocol, the time, its multiple of the copy time and its speed as a multiple of sdpa_flash's and sdpa_cudnn's."""
    times = median_times(rows, key=lambda r: (r["m"],))
    out = ["| impl | splits | protocol | µs | x read-once | x sdpa_flash | x sdpa_cudnn |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r or (impls is not None and r["impl"] not in impls):
            continue
        flash, cudnn = ratio_cells(r, times, key=lambda r: (r["m"],))
        out.append(f"| {_label(r['impl'])} | {r.get('num_splits', '-')} | {records.protocol_of(r)} | "
                   f"{r['median_ms'] * 1e3:.1f} | {r['x_read_once']:.2f} | {flash} | {cudnn} |")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("decode", __doc__.splitlines()[0], name="decode", out=OUT_DIR)
    p.add_argument("--d", nargs="+", type=int, default=[128], help="head dimension (the first is used)")
    p.add_argument("--m", nargs="+", type=int, default=[4096, 16384, 65536], help="cache lengths")
    p.add_argument("--queries", type=int, default=1, help="query tokens per step")
    p.add_argument("--splits", nargs="*", type=int, default=[4, 16, 64, 256], help="extra split counts")
    p.add_argument("--kernels", nargs="+", default=list(decoding.KERNELS), choices=decoding.KERNELS,
                   help="split kernels to time")
    p.add_argument("--dependent-merge", action="store_true",
                   help="also time each kernel's default split count with the merge kernel launched as a "
                        "programmatic dependent of the split kernel (impl <kernel>_dependent_merge; sm_90 on)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: heads)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    add_protocols(p)
    add_rounds(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print it; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("decode", argv, parser(), run, format_rows, extra_provenance=training_kernel_hashes)
