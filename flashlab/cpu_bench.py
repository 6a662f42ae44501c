"""CPU benchmark: NumPy naive attention vs NumPy tiled vs Numba tiled (readable and fast), time and peak memory.

:func:`run` times the four forward passes (chapter 5 runs it live) and :func:`format_table` prints medians,
their spread and ratios against the naive version measured in the same run and thread setting;
``python -m flashlab bench cpu`` runs them at n = 512 ... 4096, d = 64, float32, and with ``--record NAME``
writes ``data/cpu_bench/NAME.json`` with the machine and versions it ran on (:mod:`flashlab.bench.cpu`);
:func:`load` reads a recorded run.

Every size is run in each thread setting: one thread (BLAS and Numba both on one), and all cores (BLAS and Numba
both on ``numba.config.NUMBA_NUM_THREADS``, all cores by default). In a setting, naive attention uses BLAS's
threads; Numba's kernels use Numba's (the fast one runs BLAS on one thread inside each of them); the NumPy tiled
version one BLAS thread in both settings (its many small products only lose from more).

Memory is measured three ways, because no single tool sees everything:

* ``tracemalloc`` peak — sees every NumPy buffer (the naive version's n x n score matrix), but not memory that
  Numba's compiled code allocates;
* growth of the resident set (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``) — sees
  everything the process touches, including Numba's tiles; it can read low when freed memory is reused;
* for Numba, the analytic account of :func:`flashlab.numba_cpu.tiled_forward_workspace_bytes` and
  :func:`flashlab.numba_cpu.fast_forward_workspace_bytes` (outputs plus one set of tiles per thread).
"""

from __future__ import annotations

import contextlib
import platform
import time

import numpy as np

from . import records, reference, tiled
from .measure import peak_memory

RECORDED = "cpu_bench/xeon-2core"  # the recorded run chapter 5 shows: data/cpu_bench/xeon-2core.json
DEFAULT_SIZES = (512, 1024, 2048, 4096)
IMPLEMENTATIONS = ("numpy_naive", "numpy_tiled", "numba_tiled", "numba_fast")
NUMBA_IMPLEMENTATIONS = ("numba_tiled", "numba_fast")


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
        "numba_fast": numba_cpu.fast_forward,  # its own blocks: 512 keys, query blocks by fast_block_q
    }


def all_threads() -> int:
    """The "all cores" thread count: Numba's maximum (``NUMBA_NUM_THREADS``, the number of cores by default)."""
    from numba import config

    return int(config.NUMBA_NUM_THREADS)


@contextlib.contextmanager
def thread_setting(threads: int):
    """BLAS and Numba both on ``threads`` threads inside the block; Numba's previous count restored after it."""
    from numba import get_num_threads, set_num_threads
    from threadpoolctl import threadpool_limits

    before = get_num_threads()
    set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            yield
    finally:
        set_num_threads(before)


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
        check: bool = True, verbose: bool = True, threads=(1, None), implementations=IMPLEMENTATIONS) -> list[dict]:
    """Benchmark the implementations at each n and thread setting; return one row per (threads, n, implementation).

    ``threads`` lists the settings, each a thread count for BLAS and Numba alike (None: :func:`all_threads`).
    Each implementation is timed in blocks of calls, each block right after an untimed warm-up call (the very
    first includes Numba's compilation): after a call, OpenBLAS's worker threads keep spinning for a while and
    Numba's wait in OpenMP's loop, and either would steal a core from whatever runs next on a 2-core machine.
    The ``rounds`` blocks of each implementation alternate with the others', so that a slow phase of a shared
    machine does not fall on one implementation only. ``repeat`` is the number of timed calls per round.
    ``block`` is the tile size of the NumPy and readable Numba tiled versions; the fast one picks its own.
    """
    from . import numba_cpu

    settings = list(dict.fromkeys(all_threads() if t is None else int(t) for t in threads))
    fns = {name: fn for name, fn in _functions(block).items() if name in implementations}
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
        O_ref = reference.attention(Q, K, V)[0] if check else None
        for t in settings:
            with thread_setting(t):
                outputs = {}
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(rounds):
                    for name, fn in fns.items():
                        outputs[name] = fn(Q, K, V)  # warm-up (and, the first time, compilation)
                        for _ in range(repeat):
                            t0 = time.perf_counter()
                            fn(Q, K, V)
                            times[name].append(time.perf_counter() - t0)
                for name, fn in fns.items():
                    traced, _ = peak_memory(fn, Q, K, V)
                    row = {
                        "n": n, "d": d, "dtype": "float32", "block": block, "threads": t, "implementation": name,
                        "median_s": float(np.median(times[name])), "times_s": [round(x, 6) for x in times[name]],
                        "tracemalloc_peak_bytes": int(traced), "rss_growth_bytes": rss_growth(fn, Q, K, V),
                        "rel_error_vs_float64": _rel_error(outputs[name][0], O_ref) if check else None,
                    }
                    if name == "numba_tiled":
                        row["analytic_peak_bytes"] = numba_cpu.tiled_forward_workspace_bytes(
                            n, d, d, block_q=block, block_k=block, itemsize=4, threads=t)
                    if name == "numba_fast":
                        row["analytic_peak_bytes"] = numba_cpu.fast_forward_workspace_bytes(n, d, d, itemsize=4,
                                                                                           threads=t)
                    if name in NUMBA_IMPLEMENTATIONS:
                        row["numba_threads"] = t
                    rows.append(row)
            if verbose:
                print(format_table([r for r in rows if r["n"] == n and r["threads"] == t],
                                   header=n == sizes[0] and t == settings[0]), flush=True)
    return rows


def numba_peak(row: dict) -> int:
    """A Numba row's peak memory as the larger of the measured RSS growth and the analytic account."""
    return max(row.get("analytic_peak_bytes") or 0, row.get("rss_growth_bytes") or 0)


def peak_bytes(row: dict) -> int:
    """Peak memory of a row: tracemalloc for NumPy; for Numba (invisible to tracemalloc) see :func:`numba_peak`."""
    return numba_peak(row) if row["implementation"] in NUMBA_IMPLEMENTATIONS else row["tracemalloc_peak_bytes"]


def spread(row: dict) -> tuple[float, float]:
    """The fastest and the slowest of a row's timed calls, in seconds."""
    return min(row["times_s"]), max(row["times_s"])


def format_table(rows: list[dict], header: bool = True) -> str:
    """A text table per thread setting and n: median time and the range of the timed calls, speed-up over naive,
    peak memory and its share of naive's."""
    lines = []
    if header:
        lines.append(f"{'threads':>7} {'n':>6} {'implementation':<14} {'median ms':>10} {'min-max ms':>13} "
                     f"{'vs naive':>9} {'peak MB':>9} {'mem/naive':>9} {'rel.err':>9}")
    naive = {(r["threads"], r["n"]): r for r in rows if r["implementation"] == "numpy_naive"}
    for r in rows:
        base = naive.get((r["threads"], r["n"]))
        speed = base["median_s"] / r["median_s"] if base else float("nan")
        mem = peak_bytes(r) / peak_bytes(base) if base else float("nan")
        err = r.get("rel_error_vs_float64")
        low, high = spread(r)
        lines.append(f"{r['threads']:>7} {r['n']:>6} {r['implementation']:<14} {r['median_s'] * 1e3:>10.1f} "
                     f"{f'{low * 1e3:.1f}-{high * 1e3:.1f}':>13} {speed:>8.2f}x {peak_bytes(r) / 1e6:>9.2f} "
                     f"{mem:>9.4f} {err if err is None else f'{err:.1e}':>9}")
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


FAST_TARGET = 2.0  # the fast kernel's goal: at least this many times the speed of naive attention


def summary(rows: list[dict]) -> dict:
    """The chapter's targets at the largest n, per thread setting: the readable Numba kernel faster than naive and
    the fast one at least :data:`FAST_TARGET` times naive's speed, each with at most 1/10 of naive's peak memory."""
    n = max(r["n"] for r in rows)
    settings = []
    for threads in dict.fromkeys(r["threads"] for r in rows if r["n"] == n):
        by = {r["implementation"]: r for r in rows if r["n"] == n and r["threads"] == threads}
        naive = by["numpy_naive"]
        entry = {"threads": threads}
        for name, key, goal in (("numba_tiled", "numba", 1.0), ("numba_fast", "fast", FAST_TARGET)):
            if name not in by:
                continue
            speed = naive["median_s"] / by[name]["median_s"]
            memory = numba_peak(by[name]) / naive["tracemalloc_peak_bytes"]
            entry[f"speedup_{key}_vs_naive"] = speed
            entry[f"memory_ratio_{key}_vs_naive"] = memory
            entry[f"target_met_{key}"] = bool(speed >= goal and memory <= 0.1)
        settings.append(entry)
    return {"n": n, "settings": settings,
            "target_met": all(v for e in settings for k, v in e.items() if k.startswith("target_met_"))}


def format_summary(result: dict) -> str:
    """:func:`summary` in sentences, one per thread setting."""
    lines = []
    for e in result["settings"]:
        parts = []
        for key, label, goal in (("numba", "Numba tiled", "faster"), ("fast", "Numba fast", f">= {FAST_TARGET:g}x")):
            if f"speedup_{key}_vs_naive" in e:
                parts.append(f"{label} {e[f'speedup_{key}_vs_naive']:.2f}x the speed of NumPy naive with "
                             f"{e[f'memory_ratio_{key}_vs_naive']:.4f} of its peak memory (target: {goal}, <= 0.1) -> "
                             f"{'met' if e[f'target_met_{key}'] else 'NOT met'}")
        lines.append(f"n = {result['n']}, {e['threads']} thread(s): " + "; ".join(parts))
    return "\n".join(lines)


def load(name: str = RECORDED) -> dict:
    """A recorded run by its name under data/ (``"cpu_bench/NAME"``); by default the one chapter 5 shows."""
    return records.read_record(name)
