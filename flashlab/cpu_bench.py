"""CPU benchmark: NumPy naive attention vs NumPy tiled vs Numba tiled, time and peak memory.

:func:`run` times the three forward passes (chapter 5 runs it live) and :func:`format_table` prints medians and
ratios against the naive version measured in the same run; ``python -m flashlab bench cpu`` runs them at n = 512
... 4096, d = 64, float32, and with ``--record NAME`` writes ``data/cpu_bench/NAME.json`` with the machine and
versions it ran on (:mod:`flashlab.bench.cpu`); :func:`load` reads a recorded run. Naive attention uses all of
BLAS's threads; the NumPy tiled version one (its many small products only lose from more); Numba its own
threads (``NUMBA_NUM_THREADS``, all cores by default).

Memory is measured three ways, because no single tool sees everything:

* ``tracemalloc`` peak — sees every NumPy buffer (the naive version's n x n score matrix), but not memory that
  Numba's compiled code allocates;
* growth of the resident set (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``) — sees
  everything the process touches, including Numba's tiles; it can read low when freed memory is reused;
* for Numba, the analytic account of :func:`flashlab.numba_cpu.tiled_forward_workspace_bytes` (outputs plus
  one set of tiles per thread).
"""

from __future__ import annotations

import platform
import time

import numpy as np

from . import records, reference, tiled
from .measure import peak_memory

RECORDED = "cpu_bench/xeon-2core"  # the recorded run chapter 5 shows: data/cpu_bench/xeon-2core.json
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

    from . import numba_cpu

    def numpy_tiled(Q, K, V):
        # Many small tile products: one BLAS thread is faster than several (chapter 2). Naive attention keeps
        # all of BLAS's threads for its two large products: the strongest baseline.
        with threadpool_limits(limits=1, user_api="blas"):
            return tiled.forward(Q, K, V, block_q=block, block_k=block, loop_order="q_outer")

    return {
        "numpy_naive": naive_attention,
        "numpy_tiled": numpy_tiled,
        "numba_tiled": lambda Q, K, V: numba_cpu.tiled_forward(Q, K, V, block_q=block, block_k=block),
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

    from . import numba_cpu

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
                row["analytic_peak_bytes"] = numba_cpu.tiled_forward_workspace_bytes(
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


def load(name: str = RECORDED) -> dict:
    """A recorded run by its name under data/ (``"cpu_bench/NAME"``); by default the one chapter 5 shows."""
    return records.read_record(name)
