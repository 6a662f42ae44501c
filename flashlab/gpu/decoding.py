"""Split-KV decoding (FlashDecoding): a few query tokens against a long KV cache, on the GPU.

At inference time each step adds one (or a few) query tokens, so n is tiny while the cache holds m keys. The
forward kernels give each thread block a slab of query rows; with n = 1 that is one block per (batch, head),
which at batch 1 leaves most of the GPU idle while a few blocks stream the whole cache. FlashDecoding splits the
keys instead: ``S`` blocks per head each reduce a contiguous key range to a partial ``(o_s, lse_s)``, and a second
kernel merges them with chapter 1's rule::

    lse = log sum_s exp(lse_s),      o = sum_s exp(lse_s - lse) o_s

``merge_partials`` is that rule in NumPy (the CPU truth of the merge kernel; ``flashlab.online.merge`` is the same
rule on (m, l, u) states). ``decode_numpy`` runs the whole scheme on the CPU with ``flashlab.reference`` for each
split, so the split arithmetic is tested without a GPU.

Kernels: ``kernels/decode_r1_split.cu`` (``kernel="rows"``: the first version, warps share out the query rows of
a 32-key tile in shared memory; and the merge kernel), ``kernels/decode_r2_warp_keys.cu`` (``kernel="keys"``: warps
share out the keys and stream them from global memory with many 16-byte loads in flight, the query rows in
registers) and ``kernels/decode_r3_mma.cu`` (``kernel="mma"``: a group's query rows are the 16 rows of a tensor-core
mma, a warp per block streaming its keys through a cp.async ring; ``kernel="fused"``: the same kernel with the merge
inside it, done by the blocks that finish last as a tree of fan-in ``MERGE_FAN``, so that a step is one launch).
"best" takes "mma" from sm_80 on (on the H200 it
ran within two per cent of "keys" with one query row per K/V head and faster with GQA groups, under both protocols:
data/ch8/decode.json, decode_gqa.json), "keys" on sm_75. Inputs fp16, or bf16 bit patterns in uint16 with
``bf16=True`` (see ``flashlab.gpu``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import reference
from .._checks import check_scale

# flashlab.gpu imports this module after defining these (at its end); bound once, not on every call
from . import (
    DeviceLimits,
    Plan,
    Workspace,
    _check_half_launch,
    _check_inputs,
    _cupy,
    _device_id,
    choose,
    cuda_driver,
    kernel_function,
    launch_problem,
    sm_count,
)
from . import (
    _outputs as _checked_outputs,
)

KERNEL_FILE = "decode_r1_split.cu"  # the "rows" split kernel and the merge kernel both versions use
KEYS_FILE = "decode_r2_warp_keys.cu"
MMA_FILE = "decode_r3_mma.cu"
KERNEL_FILES = (KERNEL_FILE, KEYS_FILE, MMA_FILE)
# "best" takes the first this GPU runs: "mma", "keys", "rows" are fastest first on the H200; "fused" is not yet
# ranked (no record times it), so it runs when asked for by name
KERNELS = ("mma", "fused", "keys", "rows")
BLOCK_KEYS = 32  # keys per tile of the "rows" kernel (BC in the .cu); split lengths are multiples of it for both
BLOCK_ROWS = 32  # query rows (heads of a group x query tokens) per block of the "rows" kernel (ROWS in the .cu)
KEYS_ROWS = (1, 2, 4, 8)  # row counts the "keys" kernel is compiled for (R in the .cu): the smallest that fits
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs (launch share, merge traffic) outweigh its keys
# Blocks of each split kernel an SM holds at once, as built for sm_90 (the "keys" kernel's __launch_bounds__
# minimum per R): the default split count fills the GPU with one wave of them. On a GPU, decode asks the driver
# for the compiled kernel's real number instead (``resident_blocks``); these are what the CPU-side planning and
# chapter 8 assume.
BLOCKS_PER_SM = {"rows": 4}
KEYS_BLOCKS_PER_SM = {1: 5, 2: 4, 4: 4, 8: 2}  # the "keys" kernel, by query rows per block (R)
FILES = {"mma": MMA_FILE, "fused": MMA_FILE, "keys": KEYS_FILE, "rows": KERNEL_FILE}
THREADS = 128  # threads per block of the "keys" and "rows" split kernels
MERGE_THREADS = 1024  # of the merge kernel (MT in decode_r1_split.cu)
MIN_CC = 75  # plain CUDA (bf16 stored by hand below sm_80); static shared memory only (< 48 KB)
MMA_ROWS = 16  # query rows per block of the "mma" kernel: the rows of one mma.sync m16n8k16
MMA_THREADS = 32  # one warp per block
MMA_MIN_CC = 80  # mma.sync m16n8k16 with bf16 inputs, cp.async
MMA_BLOCKS_PER_SM = 4  # its 48 KB ring of static shared memory per block at d = 128, as on sm_90
MERGE_FAN = 16  # nodes a block of the "fused" kernel merges at once (FAN in decode_r3_mma.cu)
MMA_KERNELS = ("mma", "fused")  # the two entry points of decode_r3_mma.cu: the same blocks, rows and occupancy
FILE_MIN_CC = {KERNEL_FILE: MIN_CC, KEYS_FILE: MIN_CC, MMA_FILE: MMA_MIN_CC}  # the oldest GPU each file builds for
# threads per block of each split kernel
SPLIT_THREADS = {"mma": MMA_THREADS, "fused": MMA_THREADS, "keys": THREADS, "rows": THREADS}


@functools.lru_cache(maxsize=64)
def _decode_plan(d: int, kernel: str, lim: DeviceLimits) -> Plan:
    if kernel != "best" and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))} or 'best'; got {kernel!r}")

    def problem(name: str, *_) -> str | None:
        return launch_problem("", min_cc=FILE_MIN_CC[FILES[name]], shared_bytes=0, threads=SPLIT_THREADS[name],
                              lim=lim)

    name, file, passed = choose("decode", FILES, problem, kernel, lim)
    return Plan("decode", name, file, 0, SPLIT_THREADS[name], lim, passed, file)


def plan_decode(q, k_cache, v_cache, *, kernel: str = "best", bf16: bool = False) -> Plan:
    """The split kernel ``decode`` launches on this GPU, and why (see ``flashlab.gpu.plan``): "mma" from sm_80 up,
    "keys" on sm_75; older GPUs get a ValueError naming the compute capability."""
    dt = _check_inputs(q, k_cache, v_cache, bf16)
    if dt == "f32":
        raise TypeError("decode takes float16 or (with bf16=True) bfloat16 bits in uint16; got float32")
    return _decode_plan(q.shape[-1], kernel, _gpu().device_limits())


# ----------------------------------------------------------------------------------------------- CPU: the math
def merge_partials(o_parts, lse_parts) -> tuple[np.ndarray, np.ndarray]:
    """Merge split partials: ``o_parts`` (..., S, dv) normalised per split, ``lse_parts`` (..., S).

    Returns ``(o, lse)`` with shapes (..., dv) and (...). A split that saw no key has lse = -inf and weight 0;
    a row where every split is empty gets o = 0 and lse = -inf, as ``flashlab.reference.attention`` gives.
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    if o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(f"o_parts (..., S, dv) and lse_parts (..., S) disagree: {o_parts.shape} vs {lse_parts.shape}")
    mx = lse_parts.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(mx), mx, 0.0)  # all splits empty: exp(-inf - 0) = 0 weights, not nan
    w = np.exp(lse_parts - safe)
    total = w.sum(axis=-1, keepdims=True)
    o = (w[..., None] * o_parts).sum(axis=-2) / np.where(total > 0, total, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, safe[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1)),
                       -np.inf)
    return o, lse


def merge_tree_sizes(num_splits: int, fan: int = MERGE_FAN) -> tuple[int, int]:
    """The "fused" kernel's merge tree over ``num_splits`` partials: ``(nodes, counters)`` per row and per group,
    i.e. the nodes above level 0 that are not the root (each row's share of the tree buffers) and the counters of
    all runs of ``fan`` nodes, the root's run included (as ``merge_tree`` in decode_r3_mma.cu walks them)."""
    nodes = counters = 0
    level = num_splits
    while True:
        up = math.ceil(level / fan)
        counters += up
        if up == 1:
            return nodes, counters
        nodes += up
        level = up


def merge_tree_numpy(o_parts, lse_parts, fan: int = MERGE_FAN) -> tuple[np.ndarray, np.ndarray]:
    """The "fused" kernel's merge in float64: ``merge_partials`` applied to runs of ``fan`` consecutive partials,
    level by level, until one is left. Equal to one ``merge_partials`` up to rounding (the rule is associative),
    which is why the kernel may merge in a tree."""
    o, lse = np.asarray(o_parts, np.float64), np.asarray(lse_parts, np.float64)
    while True:
        runs = [merge_partials(o[..., i:i + fan, :], lse[..., i:i + fan]) for i in range(0, lse.shape[-1], fan)]
        o, lse = np.stack([r[0] for r in runs], axis=-2), np.stack([r[1] for r in runs], axis=-1)
        if lse.shape[-1] == 1:
            return o[..., 0, :], lse[..., 0]


def split_length(m: int, num_splits: int) -> int:
    """Keys per split: ceil(m / num_splits) rounded up to whole key tiles (so no tile straddles two splits)."""
    per = math.ceil(m / num_splits)
    return math.ceil(per / BLOCK_KEYS) * BLOCK_KEYS


def split_ranges(m: int, num_splits: int) -> list[tuple[int, int]]:
    """The key range [lo, hi) of each split, as the kernel computes it (some may be empty)."""
    step = split_length(m, num_splits)
    return [(min(s * step, m), min((s + 1) * step, m)) for s in range(num_splits)]


def decode_numpy(q, k, v, *, num_splits: int = 1, lengths=None, causal: bool = False, scale: float | None = None):
    """The split-KV scheme in float64 on the CPU: ``reference.attention`` per split, then ``merge_partials``.

    Shapes as for :func:`decode` (4-D). Each split's partial o is normalised and its lse is -inf when it sees no
    key. Used by the tests to check the split and merge arithmetic (and ragged lengths) without a GPU.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, n, _ = q.shape
    m = k.shape[-2]
    lengths = [m] * B if lengths is None else [int(x) for x in lengths]
    sc = check_scale(scale, q.shape[-1])
    o_parts = np.zeros((B, H, n, num_splits, v.shape[-1]))
    lse_parts = np.full((B, H, n, num_splits), -np.inf)
    for b in range(B):
        for s, (lo, hi) in enumerate(split_ranges(m, num_splits)):
            hi = min(hi, lengths[b])
            if hi <= lo:
                continue
            S = reference.scores(q[b], np.repeat(k[b, :, lo:hi], H // k.shape[1], axis=0), scale=sc)
            if causal:  # token i sees keys j <= i + len - n (the new tokens are the cache's last n entries)
                j = np.arange(lo, hi)[None, :]
                S = np.where(j <= np.arange(n)[:, None] + lengths[b] - n, S, -np.inf)
            mx = S.max(axis=-1, keepdims=True)
            safe = np.where(np.isfinite(mx), mx, 0.0)
            P = np.exp(S - safe)
            tot = P.sum(axis=-1, keepdims=True)
            vv = np.repeat(v[b, :, lo:hi], H // v.shape[1], axis=0)
            o_parts[b, :, :, s] = (P @ vv) / np.where(tot > 0, tot, 1.0)
            total = tot[..., 0]
            lse_parts[b, :, :, s] = np.where(total > 0, safe[..., 0] + np.log(np.maximum(total, 1e-300)), -np.inf)
    return merge_partials(o_parts, lse_parts)


def default_num_splits(batch: int, kv_heads: int, row_chunks: int, m: int, sm_count: int,
                       blocks_per_sm: int = 4) -> int:
    """As many splits as make one full wave: every SM holding ``blocks_per_sm`` blocks at once, none left over for a
    second wave; but no split under MIN_KEYS_PER_SPLIT keys, and at least one.

    FlashDecoding's idea, not its exact rule. One wave rather than more: a block streams its keys at the speed the
    SM's share of DRAM allows, and every split adds a block's start, its reduction and partial, and a partial to
    merge (the decode benchmark's split sweeps, in data/ch8/decode.json and data/ch8/decode_gqa.json, show it).
    """
    blocks = batch * kv_heads * row_chunks
    want = blocks_per_sm * sm_count // blocks
    return int(max(1, min(want, math.ceil(m / MIN_KEYS_PER_SPLIT), 1024)))


def block_rows(kernel: str, rows: int) -> int:
    """Query rows per block: 32 for "rows", 16 for "mma"; for "keys" the smallest of KEYS_ROWS that holds ``rows``
    (else 8)."""
    if kernel == "rows":
        return BLOCK_ROWS
    if kernel in MMA_KERNELS:
        return MMA_ROWS
    return next((r for r in KEYS_ROWS if r >= rows), KEYS_ROWS[-1])


def resolve_num_splits(batch: int, heads: int, kv_heads: int, n: int, m: int, num_splits: int | None,
                       sm_count: int, kernel: str = KERNELS[0], blocks_per_sm: int | None = None) -> int:
    """The split count decode uses: ``num_splits`` if given, else ``default_num_splits`` for this launch, with
    ``blocks_per_sm`` resident blocks per SM (None: the kernel's as built for sm_90, ``KEYS_BLOCKS_PER_SM``)."""
    if num_splits is not None:
        return int(num_splits)
    rows = heads // kv_heads * n
    per_block = block_rows(kernel, rows)
    chunks = math.ceil(rows / per_block)
    if blocks_per_sm is None:
        blocks_per_sm = built_blocks_per_sm(kernel, per_block)
    return default_num_splits(batch, kv_heads, chunks, m, sm_count, blocks_per_sm)


# id of a kernel object of flashlab.gpu.kernel_function (kept there, one per file, defines, name and device, for the
# life of the process) -> its blocks per SM, asked of the driver once: a decoding step pays a dictionary lookup
_RESIDENT: dict[int, int] = {}


def resident_blocks(kern, built_for: int, threads: int = THREADS) -> int:
    """Blocks of a compiled split kernel (``threads`` threads, static shared memory only) that one SM of this GPU holds
    at once, as the driver's occupancy calculator says (its registers and shared memory as built here).
    ``built_for``: the number the kernel is built for, returned for a kernel with no driver handle (the CPU host
    emulation of tools/hostemu launches Python functions)."""
    got = _RESIDENT.get(id(kern))
    if got is None:
        ptr = getattr(getattr(kern, "kernel", None), "ptr", None)
        got = _RESIDENT[id(kern)] = built_for if ptr is None else max(
            1, int(_cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, threads, 0)))
    return got


def default_splits_here(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], d: int, kernel: str = KERNELS[0],
                        dt: str = "f16") -> int:
    """The split count ``decode`` takes on this GPU when none is given, for 4-D q and K/V cache shapes: one wave of
    the compiled split kernel's blocks, as the driver counts them (``resident_blocks``)."""
    B, H, n, _ = q_shape
    Hk, m = kv_shape[1], kv_shape[2]
    rows = block_rows(kernel, H // Hk * n)
    resident = resident_blocks(_kernels(dt, d, kernel, rows)[0], built_blocks_per_sm(kernel, rows),
                               SPLIT_THREADS[kernel])
    return resolve_num_splits(B, H, Hk, n, m, None, sm_count(), kernel, resident)


def built_blocks_per_sm(kernel: str, rows: int) -> int:
    """Blocks per SM a split kernel of ``rows`` query rows per block is built for (as on sm_90)."""
    if kernel in MMA_KERNELS:
        return MMA_BLOCKS_PER_SM
    return KEYS_BLOCKS_PER_SM[rows] if kernel == "keys" else BLOCKS_PER_SM[kernel]


# ------------------------------------------------------------------------------------------------ GPU: launch
def _kernels(dt: str, d: int, kernel: str, rows: int):
    """The split kernel and the merge kernel a step launches (no merge kernel for "fused", which merges itself)."""
    if kernel == "fused":
        return kernel_function(MMA_FILE, f"decode_fused_{dt}_d{d}"), None
    merge = kernel_function(KERNEL_FILE, f"decode_merge_{dt}_d{d}")
    if kernel == "rows":
        return kernel_function(KERNEL_FILE, f"decode_split_{dt}_d{d}"), merge
    if kernel == "mma":
        return kernel_function(MMA_FILE, f"decode_mma_{dt}_d{d}"), merge
    return kernel_function(KEYS_FILE, f"decode_keys_{dt}_d{d}_r{rows}"), merge


# The kernels take a null lengths pointer to mean "every cache holds m keys" (`lens ? lens[b] : m` in both files).
# CuPy passes a NumPy int64 by value as 8 bytes, which is exactly a null pointer's bytes: no array to fill.
NULL_POINTER = np.int64(0)


class _DriverLaunch:
    """A kernel CuPy compiled, launched through the driver (cuda-bindings' ``cuLaunchKernel``, or ``cuLaunchKernelEx``
    for a dependent launch) from an argument block kept from call to call.

    CuPy's ``RawKernel.__call__`` wraps each argument in an object and packs a new block on every launch. A decoding
    step's split kernel takes 13 arguments, and under the latency protocol (one call, then synchronize) that packing
    runs while the GPU waits for the step's first kernel (data/benchmarks/host_decode.json times a step before and
    after; docs/kernels.md, "What a call costs the host"). Here each argument has an 8-byte slot of a ctypes array
    and holds its value in the slot's low bytes (the driver copies as many bytes as the kernel's parameter has: 8 for
    a pointer, 4 for an int or a float, and x86 and Arm hosts are little-endian); a call rewrites the slots that
    change and launches. Every thread has its own block: a launch copies the arguments before it returns, so a
    thread may reuse its block at once, but two threads must not fill one.

    ``dependent=True``: the merge kernel launched as a programmatic dependent of the split kernel (sm_90 and later),
    with the attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the merge grid may be scheduled as
    soon as every split block has executed ``griddepcontrol.launch_dependents`` (``decode_mma_*`` does so first; the
    other split kernels do not, and a block that exits counts as having done so), and each merge block waits in
    ``griddepcontrol.wait`` until the split grid has ended and its partials are in memory. An ordinary launch starts
    the merge's blocks after the split grid has ended, with the SMs idle meanwhile. CuPy's ``RawKernel`` cannot set
    launch attributes.
    """

    def __init__(self, kern, grid: tuple[int, ...], threads: int, count: int, fixed: dict[int, int] | None = None,
                 dependent: bool = False) -> None:
        import ctypes

        what = "the merge kernel's dependent launch (cuLaunchKernelEx) goes" if dependent else "a direct launch goes"
        cu = cuda_driver(what)
        self._cu, self._ctypes = cu, ctypes
        self._func = cu.CUfunction(kern.kernel.ptr)
        self._grid, self._threads = (*grid, 1, 1)[:3], threads
        self._count, self._fixed = count, dict(fixed or {})
        self.dependent = dependent
        self._handles: dict[int, Any] = {}  # CuPy stream pointer -> its CUstream, or its launch configuration
        self._local = threading.local()
        self._ok = cu.CUresult.CUDA_SUCCESS

    def block(self):
        """This thread's argument block: (its slots, the address of its array of pointers to them), the fixed slots
        filled. A thread's first block also makes the current device's context current in that thread: CuPy does so
        before each of its launches, and a thread whose arrays, outputs and workspace all came from another thread
        may have made no CUDA call yet, so that the driver would find no context to launch in."""
        got = getattr(self._local, "block", None)
        if got is None:
            _bind_context()
            ct = self._ctypes
            slots = (ct.c_uint64 * self._count)()
            for i, value in self._fixed.items():
                slots[i] = value
            at = ct.addressof(slots)
            params = (ct.c_void_p * self._count)(*(at + 8 * i for i in range(self._count)))
            got = self._local.block = (slots, ct.addressof(params), params)  # params kept alive with the block
        return got[0], got[1]

    def _handle(self, stream: int):
        cu = self._cu
        if len(self._handles) >= STREAMS_KEPT:  # a process that makes a stream per request: remade when needed
            self._handles.clear()
        # CuPy's null stream (pointer 0) is the legacy default stream; named as such (CU_STREAM_LEGACY, 0x1), so that
        # a driver binding set to a per-thread default stream does not take 0 to mean that one instead
        handle = cu.CUstream(0x1 if stream == 0 else stream)
        if not self.dependent:
            return self._handles.setdefault(stream, handle)
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self._grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self._threads, 1, 1
        cfg.sharedMemBytes = 0
        cfg.hStream = handle
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return self._handles.setdefault(stream, cfg)

    def launch(self, address: int, stream: int) -> None:
        """Launch on CuPy's stream ``stream`` (a pointer) with the block at ``address`` (from ``block``)."""
        handle = self._handles.get(stream) or self._handle(stream)
        cu = self._cu
        if self.dependent:
            err, = cu.cuLaunchKernelEx(handle, self._func, address, 0)
        else:
            err, = cu.cuLaunchKernel(self._func, *self._grid, self._threads, 1, 1, 0, handle, address, 0)
        if err != self._ok:
            raise RuntimeError(f"launching a decoding kernel through the driver failed: {err!r}")


def _bind_context() -> None:
    """Make the current device's primary context current in this thread (the CUDA runtime does it on a thread's
    first runtime call; ``cudaFree(0)`` is that call and frees nothing)."""
    _cupy().cuda.runtime.free(0)


def slot_value(x) -> int:
    """A kernel argument as its slot of a ``_DriverLaunch`` block holds it: an array's device address, a float32's
    bits, an integer's value (two's complement in 8 bytes, of which the kernel reads its parameter's width)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"a kernel argument is an int, a float32 or an array; got {x!r}")
    if isinstance(x, np.float32):
        return int(x.view(np.uint32))
    if isinstance(x, (int, np.integer)):
        return int(x) & 0xFFFF_FFFF_FFFF_FFFF
    if hasattr(x, "data") and hasattr(x.data, "ptr"):
        return int(x.data.ptr)
    raise TypeError(f"a kernel argument is an int, a float32 or an array; got {type(x).__name__} {x!r}")


def _driver_launch(kern, grid, threads: int, count: int, fixed: dict[int, int] | None = None):
    """A ``_DriverLaunch`` of ``kern``, or None where CuPy launches it instead: a kernel that CuPy did not compile (the
    host emulation's) or no cuda-bindings installed (a plain CuPy install: correct, a few microseconds slower)."""
    if getattr(getattr(kern, "kernel", None), "ptr", None) is None:
        return None
    try:
        return _DriverLaunch(kern, grid, threads, count, fixed)
    except ImportError:
        return None


STREAMS_KEPT = 64  # streams a launch keeps the driver's handle of (a handle costs microseconds to make)
DEPENDENT_MERGE_MIN_CC = 90  # griddepcontrol: programmatic dependent launch, Hopper on
MERGE_ARGS = 5  # o_parts, lse_parts, o, lse, num_splits
SPLIT_ARGS = 13  # q, k, v, lengths, o_parts, lse_parts, n, m, H, Hk, split length, scale, causal


def _no_dependent_merge(merge, cc: int) -> str | None:
    """Why this step's merge kernel cannot be launched as a dependent launch here, or None if it can be tried."""
    if merge is None:
        return "kernel='fused' merges inside its own launch; there is no merge kernel to launch"
    if cc < DEPENDENT_MERGE_MIN_CC:
        return f"programmatic dependent launch needs sm_{DEPENDENT_MERGE_MIN_CC} or later; this GPU is sm_{cc}"
    if not hasattr(merge, "kernel"):  # not a kernel CuPy compiled (the host emulation's): no driver function
        return "the merge kernel is not a CuPy RawKernel, so it has no driver function to launch"
    return None


def _merge_launch(merge, grid, asked: bool | None, cc: int):
    """How this step launches its merge kernel: a ``_DriverLaunch`` (dependent or not), or None for CuPy's launch.
    ``asked`` None takes the dependent launch where it can run (sm_90 on, cuda-bindings installed), False never,
    True or an error saying why not."""
    if asked is not False:
        why = _no_dependent_merge(merge, cc)
        if why is None:
            try:
                return _DriverLaunch(merge, grid, MERGE_THREADS, MERGE_ARGS, dependent=True)
            except ImportError as e:
                why = str(e)
        if asked:
            raise ValueError(f"dependent_merge=True: {why}")
    return None if merge is None else _driver_launch(merge, grid, MERGE_THREADS, MERGE_ARGS)


def _lengths_array(lengths, B: int, m: int):
    """The lengths as the kernels take them: a device int32 array, or NULL_POINTER for "all m"."""
    from . import _cupy

    if lengths is None:
        return NULL_POINTER
    cp = _cupy()
    host = lengths.get() if isinstance(lengths, cp.ndarray) else np.asarray(lengths)
    if host.shape != (B,) or not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"lengths must be {B} integers (one cache length per batch element); got {host!r}")
    if (host < 0).any() or (host > m).any():
        raise ValueError(f"lengths must lie in [0, m] = [0, {m}]; got {host.tolist()}")
    return cp.asarray(host.astype(np.int32))


@dataclasses.dataclass(frozen=True)
class _Step:
    """A decoding step's two launches for one signature (shapes, dtypes, kernel and split count asked for, device),
    worked out once by ``_plan_step``; a later call with that signature checks its arrays' layout and launches."""

    dt: str  # "f16" or "bf16"
    split: Any  # the split kernel, compiled and loaded
    merge: Any  # the merge kernel; None for "fused"
    split_launch: Any  # the split kernel through the driver (``_DriverLaunch``), or None: CuPy launches it
    merge_launch: Any  # the merge kernel through the driver, dependent or not (``_merge_launch``), or None
    grid: tuple[int, int, int]
    threads: int
    dims: tuple  # n, m, H, Hk and the split length as np.int32: the split kernel's arguments after the arrays
    num_splits: Any  # np.int32, the merge kernel's last argument
    parts: tuple[tuple[int, ...], tuple[int, ...]]  # shapes of the partials o_parts and lse_parts
    merge_grid: tuple[int]
    d: int
    batch: int
    m: int
    scale: Any  # the default scale 1 / sqrt(d), as np.float32
    scale_slot: int  # its bits, as the split kernel's argument block holds them
    tree: tuple[tuple[int, ...], tuple[int, ...], tuple[int]]  # "fused": shapes of tree_o, tree_l and the counters
    tree_dims: tuple  # "fused": nodes and counters per row and group (``merge_tree_sizes``), as np.int32

    def launch_split(self, cp, q, k_cache, v_cache, lens, o_parts, lse_parts, scale, causal: bool) -> None:
        """The split kernel on CuPy's current stream; ``scale`` None is the default (``check_scale``'d otherwise),
        ``lens`` a device array or ``NULL_POINTER``."""
        launch = self.split_launch
        if launch is None:
            scale = self.scale if scale is None else np.float32(check_scale(scale, self.d))
            self.split(self.grid, (self.threads,), (q, k_cache, v_cache, lens, o_parts, lse_parts, *self.dims, scale,
                                                    _CAUSAL[bool(causal)]))
            return
        slots, address = launch.block()  # slots 6-10 (dims) were filled when the block was made
        slots[11] = self.scale_slot if scale is None else slot_value(np.float32(check_scale(scale, self.d)))
        slots[0], slots[1], slots[2] = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        slots[3] = 0 if lens is NULL_POINTER else lens.data.ptr
        slots[4], slots[5], slots[12] = o_parts.data.ptr, lse_parts.data.ptr, 1 if causal else 0
        launch.launch(address, cp.cuda.get_current_stream().ptr)

    def launch_merge(self, cp, o_parts, lse_parts, o, lse) -> None:
        """The merge kernel on CuPy's current stream, after the split kernel."""
        launch = self.merge_launch
        if launch is None:
            self.merge(self.merge_grid, (MERGE_THREADS,), (o_parts, lse_parts, o, lse, self.num_splits))
            return
        slots, address = launch.block()
        slots[0], slots[1], slots[2], slots[3] = o_parts.data.ptr, lse_parts.data.ptr, o.data.ptr, lse.data.ptr
        slots[4] = int(self.num_splits)
        launch.launch(address, cp.cuda.get_current_stream().ptr)


_CAUSAL = (np.int32(0), np.int32(1))


def _gpu():
    """The ``flashlab.gpu`` package, for what must be read at call time: a decoding step's launches are kept in its
    dictionary of compiled and configured kernels (``_FUNCTIONS``) and go with them when that is replaced, and a
    step is planned for what ``device_limits()`` says then (tests replace both to plan for another GPU)."""
    return sys.modules[__package__]


_STEPS_KEPT = 256  # signatures a process keeps planned (a loop whose cache grows each step would add one a step)


def _steps() -> dict:
    """The planned steps of every device (the device is part of each key), oldest first, kept in the package's
    dictionary of configured kernels."""
    return _gpu()._FUNCTIONS.setdefault("decode steps", {})


def _plan_step(q, k_cache, v_cache, bf16: bool, kernel: str, num_splits: int | None,
               dependent_merge: bool | None = None) -> _Step:
    """Every check of ``decode``'s inputs, its kernel plan, the compiled kernels, grid and split count."""
    dt = _check_inputs(q, k_cache, v_cache, bf16)
    _check_half_launch("decode", dt, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    d = q.shape[-1]
    q4 = q if q.ndim == 4 else q.reshape(1, 1, *q.shape)
    k4 = k_cache if k_cache.ndim == 4 else k_cache.reshape(1, 1, *k_cache.shape)
    B, H, n, _ = q4.shape
    Hk, m = k4.shape[1], k4.shape[2]
    G = H // Hk
    lim = _gpu().device_limits()
    kernel = _decode_plan(d, kernel, lim).kernel
    rows = block_rows(kernel, G * n)
    chunks = math.ceil(G * n / rows)
    if kernel == "rows" and Hk * chunks > 65535:
        raise ValueError(f"heads_kv x ceil(group x n / {rows}) must be at most 65535; got {Hk * chunks}")
    if kernel != "rows" and B * Hk > 65535:
        raise ValueError(f"batch x heads_kv must be at most 65535; got {B * Hk}")
    split, merge = _kernels(dt, d, kernel, rows)
    if num_splits is None:
        num_splits = default_splits_here(q4.shape, k4.shape, d, kernel, dt)
    if not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits must be between 1 and 65535; got {num_splits}")
    num_splits = int(num_splits)
    grid = (num_splits, Hk * chunks, B) if kernel == "rows" else (chunks, num_splits, B * Hk)
    dims = tuple(np.int32(x) for x in (n, m, H, Hk, split_length(m, num_splits)))
    nodes, counters = merge_tree_sizes(num_splits)
    tree = ((B * H * n, max(nodes, 1), d), (B * H * n, max(nodes, 1)), (B * Hk * chunks * counters,))
    merge_grid = (B * H * n,)
    merge_launch = _merge_launch(merge, merge_grid, dependent_merge, lim.cc)
    split_launch = None if merge is None else _driver_launch(  # "fused" (20 arguments) keeps CuPy's launch
        split, grid, SPLIT_THREADS[kernel], SPLIT_ARGS, {6 + i: slot_value(x) for i, x in enumerate(dims)})
    scale = np.float32(check_scale(None, d))
    return _Step(dt, split, merge, split_launch, merge_launch, grid, SPLIT_THREADS[kernel], dims,
                 np.int32(num_splits), ((B, H, n, num_splits, d), (B, H, n, num_splits)), merge_grid, d, B, m,
                 scale, slot_value(scale), tree, (np.int32(nodes), np.int32(counters)))


def _outputs(cp, q, out, fused: bool):
    """(o, lse) of a decoding step: new arrays, or ``out`` checked to be what the step would have made (as
    ``attention``'s, and for "fused" aligned)."""
    o, lse = _checked_outputs(q, out)
    if fused and out is not None and o.data.ptr % 16:  # "fused": its root block stores o 8 or 4 bytes at a time
        raise ValueError("out[0] must start on a 16-byte boundary for kernel='fused' (it stores several elements "
                         "at a time); a fresh CuPy array does")
    return o, lse


def decode(q, k_cache, v_cache, *, num_splits: int | None = None, lengths: Sequence[int] | None = None,
           causal: bool = False, scale: float | None = None, bf16: bool = False, return_partials: bool = False,
           kernel: str = "best", out: tuple[Any, Any] | None = None, workspace: Workspace | None = None,
           dependent_merge: bool | None = False):
    """Attention of a few query tokens against a KV cache, split over the keys (FlashDecoding). Returns (o, lse).

    q is (batch, heads, n, d) or (n, d); k_cache and v_cache are (batch, heads_kv, m, d) or (m, d), heads_kv
    dividing heads (GQA/MQA: the query heads of a group share every K/V tile the kernel reads). CuPy arrays,
    C-contiguous, float16, or bfloat16 bits in uint16 with ``bf16=True``; d is 64 or 128. ``lengths`` (one int per
    batch element, 0 <= length <= m) says how much of each cache is filled; default all m. ``causal``: the n query
    tokens are the last n entries of the cache, so token i sees keys j <= i + length - n. ``num_splits`` None
    picks enough splits to fill the GPU with one wave of blocks (``default_num_splits``, with the kernel's
    occupancy on this GPU: ``resident_blocks``); 1 is the unsplit kernel (one block per (batch,
    K/V head, chunk of query rows)), followed by the same merge kernel, which then copies. ``kernel`` picks the
    split kernel: "mma", "fused" ("mma" with the merge inside, one launch), "keys", "rows" (the first version; see
    the module's docstring) or "best" (the default: "mma" from sm_80, "keys" on sm_75; ``plan_decode``).

    o has q's shape and dtype; lse (q's shape without d, float32, natural log) is -inf for a row that sees no
    key (its o is 0). ``return_partials=True`` also returns the fp32 partials (o_parts (B, H, n, S, d),
    lse_parts (B, H, n, S)) for teaching and tests.

    ``out`` = (o, lse) writes into given arrays instead of allocating them; ``workspace`` (a
    ``flashlab.gpu.Workspace``) keeps the partials from call to call (partials returned from a call with a
    workspace are its buffers, overwritten by the next call). With both and the default ``lengths``, a decoding
    step allocates nothing and launches two kernels ("fused": one).

    ``dependent_merge``: launch the merge kernel as a programmatic dependent of the split kernel, so that its launch
    and its blocks' start-up overlap the split work (``_DriverLaunch``). False (the default): an ordinary launch;
    True: a dependent launch, or a ValueError saying why it cannot be; None: a dependent launch where the GPU can
    (sm_90 on, with cuda-bindings installed), else an ordinary one.
    """
    cp = _cupy()
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))):
        raise TypeError(f"num_splits must be an int or None; got {num_splits!r}")
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a name (a str); got {kernel!r}")
    if dependent_merge is not None and not isinstance(dependent_merge, (bool, np.bool_)):
        raise TypeError(f"dependent_merge must be True, False or None; got {dependent_merge!r}")
    step = key = None
    if isinstance(q, cp.ndarray) and isinstance(k_cache, cp.ndarray) and isinstance(v_cache, cp.ndarray):
        # Strides are part of the signature: a step is planned only for arrays checked C-contiguous, and arrays of
        # the same shapes and strides are C-contiguous too, so a later call checks only where its arrays start.
        key = (q.shape, q.strides, k_cache.shape, k_cache.strides, v_cache.shape, v_cache.strides, q.dtype,
               k_cache.dtype, v_cache.dtype, bool(bf16), kernel, num_splits, dependent_merge, _device_id(cp))
        step = _steps().get(key)
    if step is None:  # the first call of this signature: every check, the plan, the kernels, the split count
        step = _plan_step(q, k_cache, v_cache, bf16, kernel, num_splits, dependent_merge)
        if key is not None:
            steps = _steps()
            if len(steps) >= _STEPS_KEPT:
                steps.pop(next(iter(steps), None), None)  # another thread may have dropped it first
            steps[key] = step
    elif (q.data.ptr | k_cache.data.ptr | v_cache.data.ptr) % 16:  # what the signature does not fix
        _check_half_launch("decode", step.dt, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    lens = NULL_POINTER if lengths is None else _lengths_array(lengths, step.batch, step.m)
    if workspace is None:
        o_parts = cp.empty(step.parts[0], dtype=cp.float32)
        lse_parts = cp.empty(step.parts[1], dtype=cp.float32)
    else:
        o_parts = workspace.get("decode_o_parts", step.parts[0], cp.float32)
        lse_parts = workspace.get("decode_lse_parts", step.parts[1], cp.float32)
    if step.merge is None:  # "fused": the tree's nodes and its counters, which every call leaves at zero
        o, lse = _outputs(cp, q, out, fused=True)
        if workspace is None:
            tree_o, tree_l = cp.empty(step.tree[0], cp.float32), cp.empty(step.tree[1], cp.float32)
            counts = cp.zeros(step.tree[2], cp.int32)
        else:
            tree_o = workspace.get("decode_tree_o", step.tree[0], cp.float32)
            tree_l = workspace.get("decode_tree_lse", step.tree[1], cp.float32)
            counts = workspace.get("decode_counters", step.tree[2], cp.int32, zero=True)
        scale = step.scale if scale is None else np.float32(check_scale(scale, step.d))
        # (n, d) inputs are passed as they are: a (1, 1, n, d) view would be the same pointer
        step.split(step.grid, (step.threads,), (q, k_cache, v_cache, lens, o_parts, lse_parts, *step.dims, scale,
                                                _CAUSAL[bool(causal)], tree_o, tree_l, counts, o, lse,
                                                *step.tree_dims))
    else:
        # The split kernel writes the partials only, so it is queued before the outputs are checked or made: that
        # Python then runs while the GPU already reads the cache, instead of before (a wrong out= is still refused
        # before anything writes to it; the partials it leaves are scratch).
        step.launch_split(cp, q, k_cache, v_cache, lens, o_parts, lse_parts, scale, causal)
        o, lse = _outputs(cp, q, out, fused=False)
        step.launch_merge(cp, o_parts, lse_parts, o, lse)
    if return_partials:
        return o, lse, o_parts, lse_parts
    return o, lse
