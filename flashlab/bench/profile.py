"""``python -m flashlab bench profile``: one forward pass (or backward, or decoding step) of one implementation,
bracketed for Nsight Compute.

Run it under ``ncu --profile-from-start off ...``: the inputs are made and the kernels compiled and run once
(warm-up) before ``cudaProfilerStart``, so only the measured call's kernels are profiled. Used to record the
DRAM bytes of naive attention against the last rung at the paper's shape (N = 1024, d = 64, 16 heads, batch 64)
and the per-rung counters (bank conflicts, occupancy, stalls) of chapter 7 (``make profile`` runs them all).

``summarize NCU.csv [PROVENANCE.json]`` prints the summary JSON the chapters read (data/ncu/NAME.json) from
Nsight Compute's CSV (kept in data/raw/ncu/); ``provenance [--command TEXT]`` prints the GPU provenance and the
Nsight Compute version to pass to it.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import pathlib
import re
import subprocess
import sys

from .. import records
from . import PROG


def summarize(csv_text: str) -> list[dict]:
    """Sum Nsight Compute's ``--csv`` metrics over the kernels of each profiled process (one per impl).

    Returns one dict per process, in order: the impl and the whole "profiled ..." line this script printed (the
    shape and, for a block-sparse kernel, the window tell apart runs of one impl), the kernels it launched, and
    every metric summed over them (e.g. dram__bytes_read.sum in bytes).
    """
    out: list[dict] = []
    by_pid: dict[str, dict] = {}
    header = None
    profiled_lines = []
    for row in csv.reader(io.StringIO(csv_text)):
        if not row:
            continue
        if row[0] == "ID":
            header = row
            continue
        line = ",".join(row)
        if line.startswith("profiled "):
            profiled_lines.append(line)
            continue
        if header is None or len(row) != len(header):
            continue
        d = dict(zip(header, row, strict=True))
        pid = d["Process ID"]
        if pid not in by_pid:
            by_pid[pid] = {"kernels": [], "metrics": collections.defaultdict(float)}
            out.append(by_pid[pid])
        entry = by_pid[pid]
        if d["ID"] not in {k["id"] for k in entry["kernels"]}:
            entry["kernels"].append({"id": d["ID"], "name": d["Kernel Name"][:120], "grid": d["Grid Size"]})
        value = d["Metric Value"].replace(",", "")
        try:
            entry["metrics"][d["Metric Name"]] += float(value)
        except ValueError:
            pass
    # The "profiled IMPL" line is printed by each process after its kernels ran; pair them in order.
    for entry, profiled in zip(out, profiled_lines, strict=False):
        entry["impl"] = profiled.split()[1]
        entry["profiled"] = profiled
        entry["metrics"] = dict(entry["metrics"])
    return out


STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"  # .format(reason): a stall-reason metric


def stall_cycles(metrics: dict[str, float]) -> float:
    """All stall cycles per issued instruction in a summary's ``metrics`` (the ``STALL`` reasons it holds), the
    issue itself ("selected") left out."""
    return sum(v for k, v in metrics.items() if "issue_stalled" in k and "_selected_" not in k)


_KERNEL_LINE = re.compile(r"^  (\w+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_METRIC_LINE = re.compile(r"^    (\S.*?\S)\s{2,}(\S+)?\s+([\d,.]+)$")


def report_metrics(text: str) -> list[tuple[str, dict[str, float]]]:
    """The kernels of an Nsight Compute text report (``ncu --section ...`` without ``--csv``), in launch order:
    ``(kernel name, {metric name: value})`` with values as numbers (units dropped, thousands separators removed)."""
    out: list[tuple[str, dict[str, float]]] = []
    for line in text.splitlines():
        k = _KERNEL_LINE.match(line)
        if k:
            out.append((k.group(1), {}))
            continue
        m = _METRIC_LINE.match(line)
        if m and out:
            out[-1][1].setdefault(m.group(1), float(m.group(3).replace(",", "")))
    return out


def ncu_version() -> str:
    """The last line of ``ncu --version``, or why there is none."""
    try:
        out = subprocess.run(["ncu", "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return out.splitlines()[-1] if out else "unavailable"


def parser() -> argparse.ArgumentParser:
    """The command line of the profiled run (``summarize`` and ``provenance`` take their own)."""
    p = argparse.ArgumentParser(prog=f"{PROG} profile", description=__doc__.splitlines()[0],
                                epilog="or: summarize NCU.csv [PROVENANCE.json]; provenance [--command TEXT]")
    p.add_argument("--impl", required=True, help="cupy_naive, sdpa_flash or a rung of flashlab.gpu.RUNGS")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pass", dest="which", choices=("forward", "backward", "decode"), default="forward",
                   help="backward: the gradients of one call (the course's backward kernel IMPL, e.g. pipe, or "
                        "sdpa_flash), the forward outputs made before the profiled range; decode: one decoding step "
                        "of the split kernel IMPL (mma, keys or rows) with its default split count, --n query "
                        "tokens against a cache of --m keys")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="forward: a causal sliding window of W keys (attention(..., window=(W, 0), kernel=IMPL), "
                        "IMPL a block-sparse kernel such as hopper_window, or best)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    p.add_argument("--m", type=int, default=None, help="keys (default: --n)")
    return p


def _backward_run(args: argparse.Namespace, q, k, v, rng):
    """One backward call of ``args.impl`` ("sdpa_flash" or a backward kernel of flashlab.gpu), ready to profile."""
    import cupy as cp

    do = rng.standard_normal(q.shape, dtype=cp.float32).astype(cp.float16)
    if args.impl == "sdpa_flash":
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
        tdo = torch.from_dlpack(do)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)

        def run():
            return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)

        return run
    from ..gpu import attention, attention_backward

    o, lse = attention(q, k, v, causal=args.causal)

    def run():
        return attention_backward(q, k, v, o, lse, do, causal=args.causal, kernel=args.impl)

    return run


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab bench profile --impl IMPL ...``, ``... summarize NCU.csv [PROV.json]`` or
    ``... provenance [--command TEXT]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "summarize":  # summarize NCU.csv [PROVENANCE.json]
        data = {"source": argv[1], "processes": summarize(pathlib.Path(argv[1]).read_text())}
        if len(argv) > 2:
            data["provenance"] = json.loads(pathlib.Path(argv[2]).read_text())
        print(json.dumps(data, indent=1))
        return 0
    if argv and argv[0] == "provenance":
        p = argparse.ArgumentParser(prog=f"{PROG} profile provenance")
        p.add_argument("--command", default=records.command_line(f"{PROG} profile", argv),
                       help="the command that made the CSVs (default: this one)")
        prov = records.gpu_provenance(p.parse_args(argv[1:]).command)
        prov["ncu_version"] = ncu_version()
        print(json.dumps(prov, indent=1))
        return 0
    args = parser().parse_args(argv)
    if args.window is not None and (args.which != "forward" or args.impl in ("cupy_naive", "sdpa_flash")):
        raise SystemExit("--window profiles the forward of a block-sparse kernel of flashlab.gpu (e.g. hopper_window)")
    import cupy as cp

    from ..gpu import attention, naive_attention

    rng = cp.random.default_rng(3)
    shape = (args.batch, args.heads, args.n, args.d)
    kv_shape = (args.batch, args.kv_heads or args.heads, args.m or args.n, args.d)
    q = rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    k, v = (rng.standard_normal(kv_shape, dtype=cp.float32).astype(cp.float16) for _ in range(2))
    if args.which == "decode":
        from ..gpu import decode

        def run():
            return decode(q, k, v, causal=args.causal, kernel=args.impl)
    elif args.which == "backward":
        run = _backward_run(args, q, k, v, rng)
    elif args.impl == "cupy_naive":
        def run():
            return naive_attention(q, k, v, causal=args.causal)
    elif args.impl == "sdpa_flash":
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
    elif args.window is not None:
        def run():
            return attention(q, k, v, window=(args.window, 0), kernel=args.impl)
    else:
        def run():
            return attention(q, k, v, causal=args.causal, kernel=args.impl)

    run()  # compile and warm up outside the profiled range
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    run()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    which = "" if args.which == "forward" else f" {args.which}"
    kv = f" kv_shape={kv_shape}" if kv_shape != shape else ""
    window = "" if args.window is None else f" window={args.window}"
    print(f"profiled {args.impl} shape={shape}{kv} causal={args.causal}{window}{which}")
    return 0

