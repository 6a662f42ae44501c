"""``python -m flashlab bench host``: what one call of the launchers costs the host, in microseconds.

For ``flashlab.gpu.attention``, ``attention_backward`` and ``decode``: the wall-clock time of the Python call alone
(checks, kernel lookup, allocation, launches), nothing in it waiting for the GPU, median of --repeat calls after
--warmup; the device is synchronized after each call outside the clock, so every call finds an empty launch queue
(:func:`flashlab.records.host_times`). Each is timed as a plain call (outputs and scratch allocated by the call,
default lengths) and, where the launcher takes them, into preallocated outputs with a reused workspace.
``--window W`` adds ``attention(..., window=(W, 0))``, the block-sparse path, as the op ``attention_window``.

``--baseline DIR`` times, in the same run and on the same inputs, the launchers of another copy of the package
(DIR holds its ``flashlab`` folder, e.g. ``git archive COMMIT flashlab | tar -x -C DIR``), so that a change of the
host path is measured before and after on one machine. Rows: pass "host", written to data/benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import pathlib
import statistics
import sys

from .. import records
from . import gpu_main, record_parser

OUT_DIR = records.DATA_DIR / "benchmarks"
OPS = ("attention", "attention_backward", "decode")


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("host", __doc__.splitlines()[0], name="host", out=OUT_DIR, repeat=500, warmup=20)
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="a folder holding another copy of the flashlab package, timed in the same run")
    p.add_argument("--baseline-label", default="baseline", help="the name its rows carry (e.g. a commit)")
    p.add_argument("--d", type=int, default=128, help="head dimension")
    p.add_argument("--n", type=int, default=1024, help="sequence length of attention and its backward")
    p.add_argument("--heads", type=int, default=16, help="heads of attention and its backward")
    p.add_argument("--m", type=int, default=4096, help="cache length of decode (batch 1, 32 heads, one token)")
    p.add_argument("--decode-kernels", nargs="+", default=[], metavar="K",
                   help="also time decode(..., kernel=K) for each K, as the op decode_K (e.g. fused: one launch)")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="also time attention(..., window=(W, 0)), the block-sparse path (its own op row)")
    return p


def load_package(folder: str | pathlib.Path, name: str = "flashlab_baseline"):
    """Import FOLDER/flashlab as a package called ``name`` beside this one (its modules import each other
    relatively, so they stay within that copy)."""
    root = pathlib.Path(folder) / "flashlab"
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: no package at {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    importlib.import_module(f"{name}.gpu")
    return module


def _calls(gpu, args: argparse.Namespace, preallocated: bool) -> dict:
    """op -> a call of ``gpu``'s launcher on fixed inputs (plain, or into preallocated outputs and a workspace)."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    shape = (1, args.heads, args.n, args.d)
    q, k, v, do = (rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(4))
    o, lse = gpu.attention(q, k, v)
    qd = rng.standard_normal((1, 32, 1, args.d), dtype=cp.float32).astype(cp.float16)
    kc, vc = (rng.standard_normal((1, 32, args.m, args.d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    if preallocated:
        fwd = {"out": (cp.empty_like(q), cp.empty_like(lse))}
        grads = (cp.empty_like(q), cp.empty_like(k), cp.empty_like(v))
        dec_out = (cp.empty_like(qd), cp.empty(qd.shape[:-1], dtype=cp.float32))
        ws_bwd, ws_dec = gpu.Workspace(), gpu.Workspace()
        calls = {"attention": lambda: gpu.attention(q, k, v, **fwd),
                 "attention_backward": lambda: gpu.attention_backward(q, k, v, o, lse, do, out=grads,
                                                                      workspace=ws_bwd),
                 "decode": lambda: gpu.decode(qd, kc, vc, out=dec_out, workspace=ws_dec)}
    else:
        fwd = {}
        calls = {"attention": lambda: gpu.attention(q, k, v),
                 "attention_backward": lambda: gpu.attention_backward(q, k, v, o, lse, do),
                 "decode": lambda: gpu.decode(qd, kc, vc)}
    for kern in args.decode_kernels:  # a --baseline without the kernel gets no such row
        if kern in getattr(gpu.decoding, "KERNELS", ()):
            dec = {"out": dec_out, "workspace": ws_dec} if preallocated else {}
            calls[f"decode_{kern}"] = lambda kern=kern, dec=dec: gpu.decode(qd, kc, vc, kernel=kern, **dec)
    if args.window is not None and "window" in inspect.signature(gpu.attention).parameters:  # a --baseline may lack it
        calls["attention_window"] = lambda: gpu.attention(q, k, v, window=(args.window, 0), **fwd)
    return calls


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time each launcher of this package (and of --baseline) plain and, where it can, preallocated."""
    import cupy as cp

    import flashlab.gpu as fgpu

    versions = [("current", fgpu)]
    if args.baseline:
        versions.insert(0, (args.baseline_label, load_package(args.baseline).gpu))

    def sync() -> None:
        cp.cuda.Device().synchronize()

    for label, gpu in versions:
        styles = ["plain"] + (["preallocated"] if hasattr(gpu, "Workspace") else [])
        for style in styles:
            for op, fn in _calls(gpu, args, style == "preallocated").items():
                times = records.host_times(fn, args.repeat, args.warmup, sync=sync)
                q1, med, q3 = statistics.quantiles(times, n=4)
                extra = {"window": [args.window, 0]} if op == "attention_window" else {}
                decoding = op.startswith("decode")
                rows.append({"pass": "host", "op": op, **extra, "version": label, "call": style, "d": args.d,
                             "n": 1 if decoding else args.n, "m": args.m if decoding else args.n,
                             "heads": 32 if decoding else args.heads, "batch": 1, "dtype": "float16",
                             "host_us": round(statistics.median(times), 2), "host_us_q1": round(q1, 2),
                             "host_us_q3": round(q3, 2), "repeat": args.repeat})
                print(f"  {label:<10} {style:<12} {op:<20} {rows[-1]['host_us']:8.1f} us "
                      f"(quartiles {q1:.1f} .. {q3:.1f})", flush=True)


def format_rows(rows: list[dict]) -> str:
    """Markdown: one line per launcher, the median host microseconds of each version and call style."""
    cols = list(dict.fromkeys((r["version"], r["call"]) for r in rows))
    us = {(r["op"], r["version"], r["call"]): r["host_us"] for r in rows}
    lines = ["| call | " + " | ".join(f"{v}, {c} (µs)" for v, c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for op in dict.fromkeys(r["op"] for r in rows):
        cells = [f"{us[(op, v, c)]:.1f}" if (op, v, c) in us else "-" for v, c in cols]
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; print it; write data/benchmarks/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("host", argv, parser(), run, format_rows)
