"""CPU benchmark: NumPy naive attention vs NumPy tiled vs Numba tiled, time and peak memory.

``python -m flashlab.cpu_bench`` times the three forward passes at n = 512 ... 4096, d = 64, float32, prints a
table with medians and ratios against the naive version measured in the same run, and with ``--record NAME``
writes ``data/cpu_bench/NAME.json`` with the machine and versions it ran on. Naive attention uses all of
BLAS's threads; the NumPy tiled version one (its many small products only lose from more); Numba its own
threads (``NUMBA_NUM_THREADS``, all cores by default).

Memory is measured three ways, because no single tool sees everything:

* ``tracemalloc`` peak — sees every NumPy buffer (the naive version's n x n score matrix), but not memory that
  Numba's compiled code allocates;
* growth of the resident set (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``) — sees
  everything the process touches, including Numba's tiles; it can read low when freed memory is reused;
* for Numba, the analytic account of :func:`flashlab.numba_kernels.tiled_forward_workspace_bytes` (outputs plus
  one set of tiles per thread).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import time

import numpy as np

from . import reference, tiled
from .measure import peak_memory

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "cpu_bench"
DEFAULT_SIZES = (512, 1024, 2048, 4096)
IMPLEMENTATIONS = ("numpy_naive", "numpy_tiled", "numba_tiled")


def naive_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Standard attention in the inputs' dtype: the whole n x m score matrix S, then P = softmax(S), then P V."""
    scale = Q.dtype.type(1.0 / np.sqrt(Q.shape[-1]))
    S = (Q @ np.swapaxes(K, -1, -2)) * scale
    row_max = S.max(axis=-1, keepdims=True)
    P = np.exp(S - row_max)
    row_sum = P.sum(axis=-1, keepdims=True)
    return (P @ V) / row_sum, (row_max + np.log(row_sum))[..., 0]


def _functions(block: int):
    from threadpoolctl import threadpool_limits

    from . import numba_kernels

    def numpy_tiled(Q, K, V):
        # Many small tile products: one BLAS thread is faster than several (chapter 2). Naive attention keeps
        # all of BLAS's threads for its two large products: the strongest baseline.
        with threadpool_limits(limits=1, user_api="blas"):
            return tiled.forward(Q, K, V, block_q=block, block_k=block, loop_order="q_outer")

    return {
        "numpy_naive": naive_attention,
        "numpy_tiled": numpy_tiled,
        "numba_tiled": lambda Q, K, V: numba_kernels.tiled_forward(Q, K, V, block_q=block, block_k=block),
    }


def rss_growth(fn, *args) -> int | None:
    """Bytes the resident set grew by during ``fn(*args)`` (Linux only; None elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the high-water mark VmHWM to the current RSS
    except OSError:
        return None

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    base = status("VmRSS:")
    fn(*args)
    return status("VmHWM:") - base


def _rel_error(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def run(sizes=DEFAULT_SIZES, *, d: int = 64, block: int = 64, repeat: int = 3, rounds: int = 3, seed: int = 0,
        check: bool = True, verbose: bool = True) -> list[dict]:
    """Benchmark the three implementations at each n; return one row per (n, implementation).

    Each implementation is timed in blocks of calls, each block right after an untimed warm-up call (the very
    first includes Numba's compilation): after a call, OpenBLAS's worker threads keep spinning for a while and
    Numba's wait in OpenMP's loop, and either would steal a core from whatever runs next on a 2-core machine.
    The ``rounds`` blocks of each implementation alternate with the others', so that a slow phase of a shared
    machine does not fall on one implementation only. ``repeat`` is the number of timed calls per round.
    """
    from numba import get_num_threads

    from . import numba_kernels

    fns = _functions(block)
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
        outputs = {}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                outputs[name] = fn(Q, K, V)  # warm-up (and, the first time, compilation)
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    fn(Q, K, V)
                    times[name].append(time.perf_counter() - t0)
        O_ref = reference.attention(Q, K, V)[0] if check else None
        for name, fn in fns.items():
            traced, _ = peak_memory(fn, Q, K, V)
            row = {
                "n": n, "d": d, "dtype": "float32", "block": block, "implementation": name,
                "median_s": float(np.median(times[name])), "times_s": [round(t, 6) for t in times[name]],
                "tracemalloc_peak_bytes": int(traced), "rss_growth_bytes": rss_growth(fn, Q, K, V),
                "rel_error_vs_float64": _rel_error(outputs[name][0], O_ref) if check else None,
            }
            if name == "numba_tiled":
                row["analytic_peak_bytes"] = numba_kernels.tiled_forward_workspace_bytes(
                    n, d, d, block_q=block, block_k=block, itemsize=4, threads=get_num_threads())
                row["numba_threads"] = get_num_threads()
            rows.append(row)
        if verbose:
            print(format_table([r for r in rows if r["n"] == n], header=n == sizes[0]), flush=True)
    return rows


def numba_peak(row: dict) -> int:
    """The Numba row's peak memory as the larger of the measured RSS growth and the analytic account."""
    return max(row.get("analytic_peak_bytes") or 0, row.get("rss_growth_bytes") or 0)


def peak_bytes(row: dict) -> int:
    """Peak memory of a row: tracemalloc for NumPy; for Numba (invisible to tracemalloc) see :func:`numba_peak`."""
    return numba_peak(row) if row["implementation"] == "numba_tiled" else row["tracemalloc_peak_bytes"]


def format_table(rows: list[dict], header: bool = True) -> str:
    """A text table: median time, speed-up over naive, peak memory and its share of naive's, per n."""
    lines = []
    if header:
        lines.append(f"{'n':>6} {'implementation':<13} {'median ms':>10} {'vs naive':>9} {'peak MB':>9} "
                     f"{'mem/naive':>9} {'rel.err':>9}")
    naive = {r["n"]: r for r in rows if r["implementation"] == "numpy_naive"}
    for r in rows:
        base = naive.get(r["n"])
        speed = base["median_s"] / r["median_s"] if base else float("nan")
        mem = peak_bytes(r) / peak_bytes(base) if base else float("nan")
        err = r.get("rel_error_vs_float64")
        lines.append(f"{r['n']:>6} {r['implementation']:<13} {r['median_s'] * 1e3:>10.1f} {speed:>8.2f}x "
                     f"{peak_bytes(r) / 1e6:>9.2f} {mem:>9.4f} {err if err is None else f'{err:.1e}':>9}")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_activity(limit: int = 5) -> list[str]:
    """The busiest other processes right now (``ps``), so a record says what else was running."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    busy = []
    for line in out.splitlines():
        pid, cpu, args = (line.split(None, 2) + ["", "", ""])[:3]
        if pid.isdigit() and int(pid) != os.getpid() and float(cpu or 0) >= 5.0:
            busy.append(f"{cpu}% {args}"[:100])
    return busy[:limit]


def provenance(argv: list[str]) -> dict:
    import numba
    from threadpoolctl import threadpool_info

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "numba_threads": numba.get_num_threads(),
        "niceness": os.nice(0),  # below 0: the run had priority over the machine's other processes
        "numba_threading_layer": _threading_layer(),
        "blas": [{k: info.get(k) for k in ("internal_api", "version", "num_threads")}
                 for info in threadpool_info() if info.get("user_api") == "blas"],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": (f"nice -n {os.nice(0)} " if os.nice(0) else "") + "python -m flashlab.cpu_bench "
        + " ".join(shlex.quote(a) for a in argv),
    }


def _threading_layer() -> str | None:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        return None


def summary(rows: list[dict]) -> dict:
    """The chapter's target at the largest n: Numba tiled faster than naive, with at most 1/10 of its memory."""
    n = max(r["n"] for r in rows)
    by = {r["implementation"]: r for r in rows if r["n"] == n}
    naive, numba_row = by["numpy_naive"], by["numba_tiled"]
    return {
        "n": n,
        "speedup_numba_vs_naive": naive["median_s"] / numba_row["median_s"],
        "memory_ratio_numba_vs_naive": numba_peak(numba_row) / naive["tracemalloc_peak_bytes"],
        "memory_ratio_measured_rss": (numba_row["rss_growth_bytes"] or 0) / (naive["rss_growth_bytes"] or 1),
        "memory_ratio_analytic": numba_row["analytic_peak_bytes"] / naive["tracemalloc_peak_bytes"],
        "target_met": bool(naive["median_s"] > numba_row["median_s"]
                           and numba_peak(numba_row) <= naive["tracemalloc_peak_bytes"] / 10),
    }


def load(name: str | None = None) -> dict:
    """A recorded run from data/cpu_bench (the newest one when ``name`` is None)."""
    paths = sorted(DATA_DIR.glob("*.json"), key=lambda p: json.loads(p.read_text())["provenance"]["date_utc"])
    if name is not None:
        paths = [DATA_DIR / f"{name}.json"]
    if not paths:
        raise FileNotFoundError(f"no recorded run in {DATA_DIR}")
    return json.loads(paths[-1].read_text())


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m flashlab.cpu_bench [--sizes N ...] [--repeat R] [--rounds B] [--record NAME]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m flashlab.cpu_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="sequence lengths n")
    parser.add_argument("--d", type=int, default=64, help="head dimension")
    parser.add_argument("--block", type=int, default=64, help="block_q = block_k of the tiled versions")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per implementation and n, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", metavar="NAME", help="write data/cpu_bench/NAME.json")
    args = parser.parse_args(argv)
    if args.record is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.record):
        parser.error("--record takes a plain name (letters, digits, '_', '-', '.'): it names data/cpu_bench/NAME.json")
    before = {"loadavg": list(os.getloadavg()), "busy_processes": machine_activity()}
    rows = run(args.sizes, d=args.d, block=args.block, repeat=args.repeat, rounds=args.rounds, seed=args.seed)
    after = {"loadavg": list(os.getloadavg()), "busy_processes": machine_activity()}
    result = summary(rows)
    print(f"\nat n={result['n']}: numba tiled is {result['speedup_numba_vs_naive']:.2f}x the speed of numpy naive, "
          f"with {result['memory_ratio_numba_vs_naive']:.4f} of its peak memory -> target met: {result['target_met']}")
    if args.record:
        record = {"provenance": provenance(argv), "machine_activity": {"before": before, "after": after},
                  "memory_methods": {"numpy": "tracemalloc peak", "numba": "max(analytic account, RSS growth)"},
                  "summary": result, "rows": rows}
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        path = DATA_DIR / f"{args.record}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
