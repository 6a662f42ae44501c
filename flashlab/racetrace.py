"""Watching shared memory in the CUDA simulator: which thread touched which element between which barriers.

Inside :func:`trace_shared_memory`, every ``cuda.shared.array`` a simulated kernel allocates records who read and
wrote which of its elements between which barriers, and :class:`SharedMemoryTrace` reports data races (two
threads of one block touching the same element, one of them writing, with no barrier in between) whatever order
the simulator happened to run the threads in. Lab 05's grader names a missing ``cuda.syncthreads()`` with it, and
chapter 5 draws a kernel's accesses from it. The simulator is chosen as :mod:`flashlab.numba_cuda` explains.
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from .numba_cuda import settle_failed_blocks, simulator_active


@dataclass
class SharedAccess:
    """One access to a shared array: which block and thread, between which barriers (``epoch`` = barriers
    this thread had passed), read or write, and the element's position."""

    array: str
    block: tuple
    thread: tuple
    epoch: int
    write: bool
    index: tuple


@dataclass
class Race:
    """Two threads of one block touched one shared element in the same epoch, at least one of them writing."""

    array: str
    block: tuple
    index: tuple
    epoch: int
    first: tuple  # (thread, "read"/"write")
    second: tuple

    lines: tuple = ("", "")  # where each access was made in the kernel's source ("line 21: k_tile[j, c] = ...")
    # The order of accesses within each of the two threads, which the simulator's scheduling cannot change: had
    # the writer already read shared memory in this epoch when it wrote, had the reader already written?
    writer_read_before: bool = False
    reader_wrote_before: bool = False

    @property
    def missing(self) -> str:
        """Which barrier is missing. Loads then reads in one epoch (the reader had loaded its share before reading):
        the barrier after loading. Reads then loads (the writer had read this tile before loading the next): the
        barrier after using. Only when neither thread tells (e.g. a thread with nothing to load), the order the
        simulator ran them in: read after write -> after loading, write after read -> after using."""
        kinds = (self.first[1], self.second[1])
        if "read" not in kinds:
            return "between two writes"
        if self.writer_read_before:
            return "after using"
        if self.reader_wrote_before:
            return "after loading"
        return "after loading" if kinds == ("write", "read") else "after using"

    @property
    def certain(self) -> bool:
        """Whether :attr:`missing` comes from the threads' own order rather than the simulator's."""
        return self.writer_read_before or self.reader_wrote_before

    def __str__(self) -> str:
        def who(idx):
            return f"thread {idx[0]}" if tuple(idx[1:]) == (0, 0) else f"thread {tuple(idx)}"

        block = self.block[0] if tuple(self.block[1:]) == (0, 0) else tuple(self.block)
        text = (f"{who(self.first[0])} ({self.first[1]}) and {who(self.second[0])} ({self.second[1]}) of block "
                f"{block} touched {self.array}{list(self.index)} with no syncthreads() between them")
        kinds = (self.first[1], self.second[1])
        where = [f"{kind} at {line}" for kind, line in zip(kinds, self.lines, strict=True) if line]
        return text + (f" ({'; '.join(where)})" if where else "")


@dataclass
class SharedMemoryTrace:
    """What a simulated launch did to its shared arrays: allocations, accesses (if kept) and data races."""

    shapes: dict = field(default_factory=dict)  # array name (its variable in the kernel) -> shape
    dtypes: dict = field(default_factory=dict)  # array name -> dtype name
    accesses: list = field(default_factory=list)
    races: list = field(default_factory=list)
    out_of_bounds: list = field(default_factory=list)  # (array, index, shape, "line N: text")
    barriers: int = 0


def _source_line(frame) -> str:
    """``line N: text`` of a frame of the kernel (the notebook's cell or the grader's copy of the source)."""
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"line {frame.f_lineno}: {text}" if text else f"line {frame.f_lineno}"


def _kernel_frame():
    """The innermost frame outside this module: the kernel's line that touched the array."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame


def _array_name(frame) -> str:
    """The variable a shared array is assigned to on its line (``k_tile = cuda.shared.array(...)``), else the line."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    match = re.match(r"\s*([A-Za-z_]\w*)\s*=\s*[\w.]*array\(", line)
    return match.group(1) if match else f"the shared array of line {frame.f_lineno}"


def _here():
    th = threading.current_thread()
    block = tuple(th.blockIdx) if hasattr(th, "blockIdx") else ()
    thread = tuple(th.threadIdx) if hasattr(th, "threadIdx") else ()
    return block, thread, getattr(th, "_flashlab_epoch", 0)


def _done_before(epoch: int, write: bool) -> bool:
    """Whether this thread has already done the other kind of access (a read, for a write) in ``epoch``; records
    this access's kind."""
    th = threading.current_thread()
    other, own = ("_flashlab_read_in", "_flashlab_wrote_in") if write else ("_flashlab_wrote_in", "_flashlab_read_in")
    setattr(th, own, epoch)
    return getattr(th, other, None) == epoch


class _TracedShared:
    """Stands in for a simulator shared array; checks every access against the other threads' accesses."""

    def __init__(self, data: np.ndarray, name: str, trace: SharedMemoryTrace, keep: bool, max_races: int):
        self._data = data
        self._name = name
        self._trace = trace
        self._keep = keep
        self._max_races = max_races
        self._positions = np.arange(data.size).reshape(data.shape)
        self._lock = threading.Lock()
        # per element: (block, thread, epoch) of the last write, and the readers in that element's epoch
        self._writer: dict = {}
        self._readers: dict = {}
        self._lines: dict = {}  # (block, thread, epoch, flat, write) -> the kernel's line, for race reports
        self.shape, self.dtype, self.size, self.ndim = data.shape, data.dtype, data.size, data.ndim

    def __len__(self) -> int:
        return len(self._data)

    def _flat(self, index):
        idx = index if isinstance(index, tuple) else (index,)
        for k, i in enumerate(idx):
            if isinstance(i, (int, np.integer)) and not (0 <= i < self._data.shape[k]):
                frame = _kernel_frame()
                where = _source_line(frame) if frame is not None else ""
                self._trace.out_of_bounds.append((self._name, idx, self._data.shape, where))
                raise IndexError(f"{self._name} of shape {self._data.shape} indexed at {list(idx)}"
                                 + (f" ({where})" if where else ""))
        return np.atleast_1d(self._positions[index]).ravel()

    def _record(self, index, write: bool):
        block, thread, epoch = _here()
        before = _done_before(epoch, write)  # a write: read before it; a read: wrote before it (this epoch)
        flats = self._flat(index)
        frame = _kernel_frame()
        line = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
        with self._lock:
            for f in flats.tolist():
                self._lines[(block, thread, epoch, f, write)] = line
                key = (block, f)
                w = self._writer.get(key)
                if w is not None and w[1] == epoch and w[0] != thread:
                    self._race(block, f, epoch, (w[0], "write"), (thread, "write" if write else "read"),
                               w[2], not write and before)
                readers = self._readers.get(key)
                if write:
                    if readers and readers[0] == epoch:
                        for r, wrote_before in readers[1].items():
                            if r != thread:
                                self._race(block, f, epoch, (r, "read"), (thread, "write"), before, wrote_before)
                                break
                    self._writer[key] = (thread, epoch, before)
                    self._readers[key] = (epoch, {})
                else:
                    if readers is None or readers[0] != epoch:
                        readers = (epoch, {})
                        self._readers[key] = readers
                    readers[1].setdefault(thread, before)
            if self._keep:
                pos = np.unravel_index(flats, self._data.shape)
                for k in range(len(flats)):
                    self._trace.accesses.append(
                        SharedAccess(self._name, block, thread, epoch, write, tuple(int(p[k]) for p in pos)))

    def _race(self, block, flat, epoch, first, second, writer_read_before=False, reader_wrote_before=False):
        if len(self._trace.races) < self._max_races:
            index = tuple(int(i) for i in np.unravel_index(flat, self._data.shape))
            lines = []
            for thread, kind in (first, second):
                where = self._lines.get((block, thread, epoch, flat, kind == "write"))
                text = linecache.getline(*where).strip() if where else ""
                lines.append(f"line {where[1]}: {text}" if where and text else f"line {where[1]}" if where else "")
            self._trace.races.append(Race(self._name, block, index, epoch, first, second, tuple(lines),
                                          writer_read_before, reader_wrote_before))

    def __getitem__(self, index):
        self._record(index, write=False)
        return self._data[index]

    def __setitem__(self, index, value):
        self._record(index, write=True)
        self._data[index] = value


@contextlib.contextmanager
def trace_shared_memory(*, keep_accesses: bool = False, max_races: int = 20):
    """Within this block, simulated kernels record their shared-memory use into the yielded trace.

    Simulator only. A race is reported when two threads of one block access one element between the same two
    barriers and one of them writes: exactly the accesses a GPU may run in either order. Because the check
    compares barrier counts, not the order the simulator ran the threads in, it finds the same races on every
    run. ``keep_accesses`` also keeps every access (for pictures; small launches only).
    """
    if not simulator_active():
        raise RuntimeError("trace_shared_memory needs the CUDA simulator (call use_simulator() first)")
    from numba.cuda.simulator import kernelapi  # imports numba.cuda too: the simulator, as checked above

    settle_failed_blocks()  # a kernel that raised must not leave threads running into the next traced launch

    trace = SharedMemoryTrace()
    shared_cls, module_cls = kernelapi.FakeCUDAShared, kernelapi.FakeCUDAModule
    original_array, original_sync = shared_cls.array, module_cls.syncthreads
    allocation_lock = threading.Lock()

    def array(self, shape, dtype, *args, **kwargs):
        if shape == 0:  # dynamic shared memory: one untraced buffer, as the simulator has it
            return original_array(self, shape, dtype, *args, **kwargs)
        # The simulator keeps one array per source line of the kernel (its caller's frame); calling it from here
        # would make every array this wrapper creates the same one, so allocate here, keyed the same way.
        frame = sys._getframe(1)
        key = (frame.f_code.co_filename, frame.f_lineno)
        with allocation_lock:  # every thread of the block asks; exactly one may create the array
            traced = self.__dict__.setdefault("_flashlab_traced", {})
            if key not in traced:
                data = kernelapi.FakeCUDALocal().array(shape, dtype)  # np.empty, with numba's dtype converted
                name = _array_name(frame)
                if name in trace.shapes:  # the same variable name on two lines: tell them apart
                    name = f"{name} (line {key[1]})"
                trace.shapes[name] = tuple(data.shape)
                trace.dtypes[name] = str(data.dtype)
                traced[key] = _TracedShared(data, name, trace, keep_accesses, max_races)
            return traced[key]

    def syncthreads(self):
        th = threading.current_thread()
        th._flashlab_epoch = getattr(th, "_flashlab_epoch", 0) + 1
        trace.barriers += 1
        return original_sync(self)

    shared_cls.array, module_cls.syncthreads = array, syncthreads
    try:
        yield trace
    finally:
        shared_cls.array, module_cls.syncthreads = original_array, original_sync

