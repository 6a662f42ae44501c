"""Honest measurements on the CPU: peak memory with tracemalloc, wall time as a median of repeats."""

from __future__ import annotations

import statistics
import time
import tracemalloc
from typing import Callable


def peak_memory(fn: Callable, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` once; return (peak bytes allocated during the call, its result).

    tracemalloc sees NumPy's buffers, so the peak includes every temporary array the call made, such as an
    n x m score matrix, but not memory that existed before the call (the inputs).
    """
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        base, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base, result


def wall_times(fn: Callable, *args, repeat: int = 5, warmup: int = 1, **kwargs) -> list[float]:
    """Wall-clock seconds of each of ``repeat`` calls after ``warmup`` untimed ones (for a median and a spread)."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable, *args, repeat: int = 5, warmup: int = 1, **kwargs) -> float:
    """Median wall-clock seconds of ``repeat`` calls after ``warmup`` untimed ones."""
    return statistics.median(wall_times(fn, *args, repeat=repeat, warmup=warmup, **kwargs))
