"""The tiled forward pass compiled with Numba: a parallel CPU kernel, and a ``numba.cuda`` GPU kernel.

Two kernels compute what :func:`flashlab.tiled.forward` computes (O and the row logsumexp L):

* :func:`tiled_forward` — ``@njit(parallel=True)``. The Python loops of the tiled algorithm are compiled to
  machine code; ``prange`` spreads the independent (batch·head, query block) pairs over the CPU cores.
* :func:`cuda_forward` — a ``numba.cuda`` kernel written the way a CUDA C kernel is written: one thread block
  per block of ``block_q`` queries (grid axis y walks over batch·heads), one thread per query row holding its
  online-softmax state (m, l, acc) in registers, K/V tiles staged in ``cuda.shared.array`` by all threads
  together, and ``cuda.syncthreads()`` between loading a tile and using it (and again before overwriting it).

The CUDA simulator
------------------
``numba.cuda`` can run kernels on the CPU, each thread of a block as a Python thread (slow: small sizes
only). The simulator is chosen when ``numba.cuda`` is *first imported*, from the environment variable
``NUMBA_ENABLE_CUDASIM=1``; it cannot be switched on or off later in the same process. So:

* in a notebook or script, call :func:`use_simulator` before anything imports ``numba.cuda`` (this module
  imports it only on first use), or export ``NUMBA_ENABLE_CUDASIM=1`` before starting Python;
* to use both (a real GPU and the simulator) from one program, run one of them in a subprocess:
  ``python -m flashlab.numba_kernels --simulator`` checks the kernel in the simulator,
  ``python -m flashlab.numba_kernels --gpu`` on the GPU (the tests and chapter 5 do this).

With numba 0.68 ``numba.cuda`` is still built into numba (the simulator needs nothing else). On a GPU, install
the NVIDIA-maintained ``numba-cuda`` package (requirements-gpu.txt): it takes over ``import numba.cuda``, and
the same code runs unchanged on both.

The simulator also lets us watch a kernel: :class:`SharedMemoryTrace` records which thread of which block
read and wrote which element of each shared array between which barriers, and reports data races (two
threads touching the same element, one of them writing, with no barrier in between) whatever order the
simulator happened to run the threads in.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ._checks import causal_offset, check_block, check_qkv, check_scale

# Vectorising a sum needs permission to reassociate it. No "nnan"/"ninf": masked scores are -inf on purpose.
_FASTMATH = {"reassoc", "contract", "nsz"}


def _njit(**options):
    """``njit(cache=True)`` where the on-disk cache can be written, plain ``njit`` where it cannot.

    Numba raises at decoration time when it finds no writable cache directory (a read-only install with no
    writable home); compiling on every start is then the only option, and still correct.
    """

    def decorate(fn):
        try:
            return njit(cache=True, **options)(fn)
        except Exception:  # numba raises RuntimeError (no cache locator) or OSError; both mean "no cache"
            return njit(**options)(fn)

    return decorate


# ----------------------------------------------------------------------------------------------------------
# CPU: @njit(parallel=True)
# ----------------------------------------------------------------------------------------------------------


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret the bits of an int32 (int64) as a float32 (float64): a free move in a vector register."""
    if bits == types.int32:
        result = types.float32
    elif bits == types.int64:
        result = types.float64
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(result))

    return result(bits), codegen


def exp_nonpositive(x):
    """exp(x) for x <= 0 (including -inf). In compiled code: a version the compiler can vectorise."""
    return np.exp(x)


@overload(exp_nonpositive, jit_options={"fastmath": {"contract"}})  # no "reassoc": it would undo Cody-Waite
def _exp_nonpositive_impl(x):
    # exp(x) = 2**k * exp(r), k = round(x / ln 2), |r| <= ln(2)/2, exp(r) by its Taylor polynomial. A libm call
    # cannot be vectorised; these few multiply-adds and one bit move can, 16 float32 lanes at a time. The
    # answer is as accurate as libm's (tests compare to np.exp) because ln 2 is split into a part whose
    # product with k is exact and a small correction (Cody & Waite).
    if x == types.float32:
        ft, it, degree, lowest, bias, shift = np.float32, np.int32, 7, -87.0, 127, 23
        ln2_hi, ln2_lo = 0.693145751953125, 1.42860682030941723212e-6
    elif x == types.float64:
        ft, it, degree, lowest, bias, shift = np.float64, np.int64, 13, -708.0, 1023, 52
        ln2_hi, ln2_lo = 6.93147180369123816490e-01, 1.90821492927058770002e-10
    else:
        return None
    coeffs = tuple(ft(1.0 / math.factorial(k)) for k in range(degree, -1, -1))
    log2e, hi, lo, floor_at = ft(1.4426950408889634), ft(ln2_hi), ft(ln2_lo), ft(lowest)
    half, zero, bias, shift = ft(0.5), ft(0.0), it(bias), it(shift)

    def impl(x):
        xc = max(x, floor_at)  # below it exp underflows; -inf must not reach the integer conversion
        k = np.floor(xc * log2e + half)
        r = (xc - k * hi) - k * lo
        p = coeffs[0]
        for c in coeffs[1:]:
            p = p * r + c
        return p * _float_from_bits(it((it(k) + bias) << shift)) if x >= floor_at else zero

    return impl


@_njit(parallel=True, fastmath=_FASTMATH)
def _tiled_kernel(Q, K, V, O, L, block_q, block_k, causal, offset, scale):  # pragma: no cover - compiled
    """Q (B, n, d), K (B, m, d), V (B, m, dv) contiguous; writes O (B, n, dv) and L (B, n).

    Query i sees keys j <= i + offset when causal."""
    batch, n, d = Q.shape
    m = K.shape[1]
    dv = V.shape[2]
    neg_inf = Q.dtype.type(-np.inf)
    zero = Q.dtype.type(0)
    q_blocks = (n + block_q - 1) // block_q
    for task in prange(batch * q_blocks):  # independent (batch entry, query block) pairs, spread over the cores
        b = task // q_blocks
        q0 = (task % q_blocks) * block_q
        q1 = min(q0 + block_q, n)
        rows = q1 - q0
        # Everything one task touches is a few tiles, so it stays in the core's cache (its "SRAM").
        q_tile = np.empty((rows, d), dtype=Q.dtype)
        s_tile = np.empty((rows, block_k), dtype=Q.dtype)  # scores, then probabilities, of one K/V tile
        vt_tile = np.empty((dv, block_k), dtype=Q.dtype)  # the V tile transposed: P V becomes dot products
        tile_max = np.empty(rows, dtype=Q.dtype)
        acc = np.zeros((rows, dv), dtype=Q.dtype)
        m_row = np.full(rows, neg_inf, dtype=Q.dtype)
        l_row = np.zeros(rows, dtype=Q.dtype)
        for i in range(rows):
            for c in range(d):
                q_tile[i, c] = Q[b, q0 + i, c] * scale
        # Causal: no query of this block sees a key past (q1 - 1) + offset, so later tiles are skipped.
        k_end = min(m, q1 + offset) if causal else m
        for k0 in range(0, k_end, block_k):
            cols = min(block_k, k_end - k0)
            for j in range(cols):
                for c in range(dv):
                    vt_tile[c, j] = V[b, k0 + j, c]
            # 1. Scores of the tile and each row's max. Four query rows at a time: every key row loaded from
            #    memory serves four dot products (register blocking), each a vectorised sum along d.
            for i0 in range(0, rows, 4):
                group = min(4, rows - i0)
                if group == 4:
                    m0 = neg_inf  # four running maxima: four independent chains of comparisons, not one
                    m1 = neg_inf
                    m2 = neg_inf
                    m3 = neg_inf
                    for j in range(cols):
                        s0 = zero
                        s1 = zero
                        s2 = zero
                        s3 = zero
                        for c in range(d):
                            k = K[b, k0 + j, c]
                            s0 += q_tile[i0, c] * k
                            s1 += q_tile[i0 + 1, c] * k
                            s2 += q_tile[i0 + 2, c] * k
                            s3 += q_tile[i0 + 3, c] * k
                        s_tile[i0, j] = s0
                        s_tile[i0 + 1, j] = s1
                        s_tile[i0 + 2, j] = s2
                        s_tile[i0 + 3, j] = s3
                        m0 = max(m0, s0)
                        m1 = max(m1, s1)
                        m2 = max(m2, s2)
                        m3 = max(m3, s3)
                    tile_max[i0] = m0
                    tile_max[i0 + 1] = m1
                    tile_max[i0 + 2] = m2
                    tile_max[i0 + 3] = m3
                else:
                    for i in range(i0, i0 + group):
                        m0 = neg_inf
                        for j in range(cols):
                            s0 = zero
                            for c in range(d):
                                s0 += q_tile[i, c] * K[b, k0 + j, c]
                            s_tile[i, j] = s0
                            m0 = max(m0, s0)
                        tile_max[i] = m0
            # 2. Online softmax, row by row: mask, new max, rescale, probabilities.
            for i in range(rows):
                visible = cols
                if causal:
                    visible = min(cols, max(0, q0 + i + offset - k0 + 1))
                m_new = max(m_row[i], tile_max[i])
                if visible < cols:  # a tile on the causal diagonal: mask, and take the max of what is visible
                    m_new = m_row[i]
                    for j in range(visible):
                        m_new = max(m_new, s_tile[i, j])
                    for j in range(visible, cols):
                        s_tile[i, j] = neg_inf
                if m_new == neg_inf:  # this row sees no key yet: its state stays empty, its probabilities 0
                    for j in range(cols):
                        s_tile[i, j] = zero
                    continue
                alpha = exp_nonpositive(m_row[i] - m_new)  # rescales what was accumulated against the old max
                total = zero
                for j in range(cols):
                    p = exp_nonpositive(s_tile[i, j] - m_new)
                    s_tile[i, j] = p
                    total += p
                l_row[i] = alpha * l_row[i] + total
                for c in range(dv):
                    acc[i, c] *= alpha
                m_row[i] = m_new
            # 3. acc += P V, again four rows at a time, as dot products along the transposed V tile.
            for i0 in range(0, rows, 4):
                group = min(4, rows - i0)
                for c in range(dv):
                    if group == 4:
                        a0 = zero
                        a1 = zero
                        a2 = zero
                        a3 = zero
                        for j in range(cols):
                            v = vt_tile[c, j]
                            a0 += s_tile[i0, j] * v
                            a1 += s_tile[i0 + 1, j] * v
                            a2 += s_tile[i0 + 2, j] * v
                            a3 += s_tile[i0 + 3, j] * v
                        acc[i0, c] += a0
                        acc[i0 + 1, c] += a1
                        acc[i0 + 2, c] += a2
                        acc[i0 + 3, c] += a3
                    else:
                        for i in range(i0, i0 + group):
                            a0 = zero
                            for j in range(cols):
                                a0 += s_tile[i, j] * vt_tile[c, j]
                            acc[i, c] += a0
        for i in range(rows):
            if l_row[i] > 0:
                for c in range(dv):
                    O[b, q0 + i, c] = acc[i, c] / l_row[i]
                L[b, q0 + i] = m_row[i] + np.log(l_row[i])
            else:  # a row that sees no key at all (causal with n > m)
                for c in range(dv):
                    O[b, q0 + i, c] = 0
                L[b, q0 + i] = neg_inf


def _prepare(Q, K, V, block_q, block_k, scale):
    """Validate, pick the common dtype, and flatten the leading axes to one batch axis of contiguous arrays."""
    Q, K, V = check_qkv(Q, K, V, allowed=(np.float32, np.float64))
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    dtype = np.result_type(Q, K, V)
    lead = Q.shape[:-2]
    Q3, K3, V3 = (np.ascontiguousarray(x.reshape((-1,) + x.shape[-2:]), dtype=dtype) for x in (Q, K, V))
    scale = dtype.type(check_scale(scale, Q.shape[-1]))
    return Q3, K3, V3, lead, dtype, block_q, block_k, scale


def tiled_forward(
    Q, K, V, *, block_q: int = 64, block_k: int = 64, causal: bool = False, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled exact attention compiled with Numba, parallel over batch x heads x query blocks.

    Same arguments and results as :func:`flashlab.tiled.forward`: Q (..., n, d), K (..., m, d), V (..., m, dv),
    float32 or float64 (the result keeps the dtype); returns ``(O, L)`` with L the logsumexp of each row of
    scaled scores. Causal masking aligns the last query with the last key (query i sees keys j <= i + m - n);
    a row that sees no key gets O = 0 and L = -inf. The first call compiles (a few seconds, cached on disk).
    """
    Q3, K3, V3, lead, dtype, block_q, block_k, scale = _prepare(Q, K, V, block_q, block_k, scale)
    O = np.empty(Q3.shape[:2] + (V3.shape[2],), dtype=dtype)
    L = np.empty(Q3.shape[:2], dtype=dtype)
    offset = causal_offset(Q3.shape[1], K3.shape[1])
    _tiled_kernel(Q3, K3, V3, O, L, block_q, block_k, bool(causal), offset, scale)
    return O.reshape(lead + O.shape[1:]), L.reshape(lead + L.shape[1:])


def tiled_forward_workspace_bytes(n: int, d: int, dv: int, *, block_q: int = 64, block_k: int = 64,
                                  itemsize: int = 4, batch: int = 1, threads: int | None = None) -> int:
    """Bytes :func:`tiled_forward` allocates beyond its inputs: the outputs plus each running task's tiles.

    tracemalloc cannot see Numba's allocations, so this is the analytic account the benchmark reports beside
    the measured growth of the resident set: O and L, plus per concurrently running task a scaled Q tile,
    a tile of scores, a transposed V tile, the accumulator and the (m, l, tile max) rows.
    """
    if threads is None:
        from numba import get_num_threads

        threads = get_num_threads()
    outputs = batch * n * (dv + 1)
    per_task = block_q * d + block_q * block_k + dv * block_k + block_q * dv + 3 * block_q
    return itemsize * (outputs + threads * per_task)


# ----------------------------------------------------------------------------------------------------------
# GPU: numba.cuda (real GPU or the CUDA simulator)
# ----------------------------------------------------------------------------------------------------------

cuda = None  # the numba.cuda module, imported on first use; the simulator swaps this global inside kernels


def use_simulator() -> None:
    """Make ``numba.cuda`` run kernels in the CUDA simulator. Call it before anything imports ``numba.cuda``.

    Raises RuntimeError if ``numba.cuda`` was already imported for a real GPU in this process (the choice is
    made once per process: restart the kernel, or run the simulator in a subprocess).
    """
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba.cuda" in sys.modules:
        if not simulator_active():
            raise RuntimeError(
                "numba.cuda was already imported for a real GPU in this process; the simulator can only be "
                "chosen before that import (restart the kernel and call use_simulator() first)"
            )
        return
    from numba.core import config

    config.ENABLE_CUDASIM = 1  # numba read its environment when it was imported; numba.cuda reads this flag


def simulator_active() -> bool:
    """True when ``numba.cuda`` is (or, once imported, will be) the CUDA simulator."""
    if "numba.cuda" in sys.modules:
        return sys.modules["numba.cuda"].jit.__module__.startswith("numba.cuda.simulator")
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def _cuda_module():
    global cuda
    if cuda is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda
    return cuda


def cuda_ready() -> bool:
    """True when :func:`cuda_forward` can run here: the simulator is on, or a CUDA GPU is visible."""
    return simulator_active() or _cuda_module().is_available()


def gpu_available() -> bool:
    """Whether this machine has a CUDA GPU numba can use, asked in a subprocess (so the answer does not
    depend on, or change, the simulator choice of this process)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    code = "from numba import cuda; print(int(cuda.is_available()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip().endswith("1")


@functools.lru_cache(maxsize=None)
def make_cuda_kernel(block_q: int, block_k: int, d: int, dv: int, dtype: str = "float32"):
    """Build the ``numba.cuda`` forward kernel for one tile shape, head size and dtype.

    Like template parameters in CUDA C, ``block_q``, ``block_k``, ``d``, ``dv`` and the dtype are compile-time
    constants here: shared and local arrays need sizes known when the kernel is compiled.

    The kernel's arguments are ``(Q, K, V, O, L, n, m, scale, causal)`` with Q (B, n, d), K (B, m, d),
    V (B, m, dv), O (B, n, dv), L (B, n); launch it as ``kernel[(ceil(n / block_q), B), block_q](...)`` (see
    :func:`launch`). Thread ``t`` of block ``(x, b)`` owns query row ``x * block_q + t`` of batch entry ``b``.
    """
    _cuda_module()
    from numba import from_dtype

    BLOCK_Q, BLOCK_K, D, DV = block_q, block_k, d, dv
    T = from_dtype(np.dtype(dtype))

    @cuda.jit
    def flash_forward_kernel(Q, K, V, O, L, n, m, scale, causal):  # pragma: no cover - runs on the device
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        q0 = cuda.blockIdx.x * BLOCK_Q
        row = q0 + t
        offset = m - n
        # Every thread of the block loads tiles, so all of them run the tile loop (the barriers inside it
        # must be reached by the whole block); only threads that own a real row compute.
        active = row < n
        k_tile = cuda.shared.array((BLOCK_K, D), T)
        v_tile = cuda.shared.array((BLOCK_K, DV), T)
        q = cuda.local.array(D, T)
        acc = cuda.local.array(DV, T)
        for c in range(D):
            q[c] = Q[b, row, c] * scale if active else T(0)
        for c in range(DV):
            acc[c] = 0
        m_i = T(-math.inf)  # typed like the data, so that the arithmetic stays in T (expf for float32)
        l_i = T(0)
        # The same bound for every thread of the block: the last key any of its queries can see.
        k_end = min(m, min(q0 + BLOCK_Q, n) + offset) if causal else m
        for k0 in range(0, k_end, BLOCK_K):
            # 1. Stage the K and V tiles in shared memory: thread t copies elements t, t + BLOCK_Q, ...
            for e in range(t, BLOCK_K * D, BLOCK_Q):
                j = e // D
                c = e % D
                k_tile[j, c] = K[b, k0 + j, c] if k0 + j < m else T(0)
            for e in range(t, BLOCK_K * DV, BLOCK_Q):
                j = e // DV
                c = e % DV
                v_tile[j, c] = V[b, k0 + j, c] if k0 + j < m else T(0)
            cuda.syncthreads()  # the tile is complete before anyone reads it
            # 2. Fold the tile into this row's state (m_i, l_i, acc), one key at a time.
            if active:
                cols = min(BLOCK_K, m - k0)
                if causal:
                    cols = min(cols, max(0, row + offset - k0 + 1))
                for j in range(cols):
                    s = T(0)
                    for c in range(D):
                        s += q[c] * k_tile[j, c]
                    m_new = max(m_i, s)
                    alpha = math.exp(m_i - m_new)
                    p = math.exp(s - m_new)
                    l_i = l_i * alpha + p
                    for c in range(DV):
                        acc[c] = acc[c] * alpha + p * v_tile[j, c]
                    m_i = m_new
            cuda.syncthreads()  # everyone is done with the tile before it is overwritten
        if active:
            if l_i > 0:
                for c in range(DV):
                    O[b, row, c] = acc[c] / l_i
                L[b, row] = m_i + math.log(l_i)
            else:
                for c in range(DV):
                    O[b, row, c] = 0
                L[b, row] = -math.inf

    return flash_forward_kernel


def launch(kernel, Q, K, V, *, block_q: int, causal: bool = False, scale: float | None = None):
    """Run a forward kernel built like :func:`make_cuda_kernel`'s on NumPy inputs; return ``(O, L)`` as NumPy.

    The outputs are filled with NaN before the launch, so a row the kernel never writes cannot pass a check.
    """
    Q3, K3, V3, lead, dtype, block_q, _, scale = _prepare(Q, K, V, block_q, 1, scale)
    batch, n, _ = Q3.shape
    m = K3.shape[1]
    O = np.full((batch, n, V3.shape[2]), np.nan, dtype=dtype)
    L = np.full((batch, n), np.nan, dtype=dtype)
    grid = ((n + block_q - 1) // block_q, batch)
    if simulator_active():
        kernel[grid, block_q](Q3, K3, V3, O, L, np.int64(n), np.int64(m), scale, bool(causal))
    else:
        args = [cuda.to_device(x) for x in (Q3, K3, V3, O, L)]
        kernel[grid, block_q](*args, np.int64(n), np.int64(m), scale, bool(causal))
        cuda.synchronize()
        O, L = args[3].copy_to_host(), args[4].copy_to_host()
    return O.reshape(lead + O.shape[1:]), L.reshape(lead + L.shape[1:])


def cuda_forward(
    Q, K, V, *, block_q: int = 32, block_k: int = 32, causal: bool = False, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled exact attention as a ``numba.cuda`` kernel, on a GPU or in the CUDA simulator.

    Same arguments and results as :func:`tiled_forward`. In the simulator every thread is a Python thread:
    keep n, m and d small (tens). See the module docstring for choosing the simulator.
    """
    Q3, K3, V3, _, dtype, block_q, block_k, _ = _prepare(Q, K, V, block_q, block_k, scale)
    if block_q > 1024:
        raise ValueError(f"block_q is the number of threads of a block, at most 1024 on NVIDIA GPUs; got {block_q}")
    tile_bytes = block_k * (Q3.shape[2] + V3.shape[2]) * dtype.itemsize
    if tile_bytes > 48 * 1024:
        most = 48 * 1024 // (tile_bytes // block_k)
        raise ValueError(f"the K and V tiles need {tile_bytes} bytes of shared memory, more than the 48 KB a kernel "
                         f"gets without opting in; use a smaller block_k (here at most {most})")
    _cuda_module()
    if not cuda_ready():
        raise RuntimeError(
            "no CUDA GPU is visible to numba; to run the kernel in the CUDA simulator call "
            "flashlab.numba_kernels.use_simulator() before numba.cuda is imported (or set NUMBA_ENABLE_CUDASIM=1)"
        )
    kernel = make_cuda_kernel(block_q, block_k, Q3.shape[2], V3.shape[2], dtype.name)
    return launch(kernel, Q, K, V, block_q=block_q, causal=causal, scale=scale)


# ----------------------------------------------------------------------------------------------------------
# Watching shared memory in the simulator
# ----------------------------------------------------------------------------------------------------------


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

    def __str__(self) -> str:
        def who(idx):
            return f"thread {idx[0]}" if tuple(idx[1:]) == (0, 0) else f"thread {tuple(idx)}"

        block = self.block[0] if tuple(self.block[1:]) == (0, 0) else tuple(self.block)
        return (f"{who(self.first[0])} ({self.first[1]}) and {who(self.second[0])} ({self.second[1]}) of block "
                f"{block} touched {self.array}{list(self.index)} with no syncthreads() between them")


@dataclass
class SharedMemoryTrace:
    """What a simulated launch did to its shared arrays: allocations, accesses (if kept) and data races."""

    shapes: dict = field(default_factory=dict)  # array name ("file:line") -> shape
    dtypes: dict = field(default_factory=dict)  # array name -> dtype name
    accesses: list = field(default_factory=list)
    races: list = field(default_factory=list)
    out_of_bounds: list = field(default_factory=list)  # (array, index, shape)
    barriers: int = 0


def _here():
    th = threading.current_thread()
    block = tuple(th.blockIdx) if hasattr(th, "blockIdx") else ()
    thread = tuple(th.threadIdx) if hasattr(th, "threadIdx") else ()
    return block, thread, getattr(th, "_flashlab_epoch", 0)


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
        self.shape, self.dtype, self.size, self.ndim = data.shape, data.dtype, data.size, data.ndim

    def __len__(self) -> int:
        return len(self._data)

    def _flat(self, index):
        idx = index if isinstance(index, tuple) else (index,)
        for k, i in enumerate(idx):
            if isinstance(i, (int, np.integer)) and not (0 <= i < self._data.shape[k]):
                self._trace.out_of_bounds.append((self._name, idx, self._data.shape))
                raise IndexError(f"shared array {self._name} of shape {self._data.shape} indexed at {list(idx)}")
        return np.atleast_1d(self._positions[index]).ravel()

    def _record(self, index, write: bool):
        block, thread, epoch = _here()
        flats = self._flat(index)
        with self._lock:
            for f in flats.tolist():
                key = (block, f)
                w = self._writer.get(key)
                if w is not None and w[1] == epoch and w[0] != thread:
                    self._race(block, f, epoch, (w[0], "write"), (thread, "write" if write else "read"))
                readers = self._readers.get(key)
                if write:
                    if readers and readers[0] == epoch:
                        for r in readers[1]:
                            if r != thread:
                                self._race(block, f, epoch, (r, "read"), (thread, "write"))
                                break
                    self._writer[key] = (thread, epoch)
                    self._readers[key] = (epoch, set())
                else:
                    if readers is None or readers[0] != epoch:
                        readers = (epoch, set())
                        self._readers[key] = readers
                    readers[1].add(thread)
            if self._keep:
                pos = np.unravel_index(flats, self._data.shape)
                for k in range(len(flats)):
                    self._trace.accesses.append(
                        SharedAccess(self._name, block, thread, epoch, write, tuple(int(p[k]) for p in pos)))

    def _race(self, block, flat, epoch, first, second):
        if len(self._trace.races) < self._max_races:
            index = tuple(int(i) for i in np.unravel_index(flat, self._data.shape))
            self._trace.races.append(Race(self._name, block, index, epoch, first, second))

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
    _cuda_module()
    from numba.cuda.simulator import kernelapi

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
                name = f"{os.path.basename(key[0])}:{key[1]}"
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


# ----------------------------------------------------------------------------------------------------------
# Command line: check the kernel in the simulator or on the GPU (a fresh process chooses either)
# ----------------------------------------------------------------------------------------------------------


def _relative_error(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), finite):
        return float("inf")
    scale = np.linalg.norm(ref[finite]) or 1.0
    return float(np.linalg.norm(x[finite] - ref[finite]) / scale)


def check_cuda_forward(n: int, m: int, d: int, *, batch: int = 1, block_q: int = 32, block_k: int = 32,
                       causal: bool = False, dtype: str = "float32", seed: int = 0) -> dict:
    """Run :func:`cuda_forward` once on random inputs; return its errors against the float64 reference and
    the wall time (the first call of a shape includes compilation on a GPU)."""
    from . import reference

    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((batch, r, d)).astype(dtype) for r in (n, m, m))
    t0 = time.perf_counter()
    O, L = cuda_forward(Q, K, V, block_q=block_q, block_k=block_k, causal=causal)
    seconds = time.perf_counter() - t0
    O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
    return {"n": n, "m": m, "d": d, "batch": batch, "block_q": block_q, "block_k": block_k, "causal": causal,
            "dtype": dtype, "seconds": seconds, "simulator": simulator_active(),
            "o_rel_error": _relative_error(O, O_ref), "l_rel_error": _relative_error(L, L_ref)}


def main(argv=None) -> int:
    """``python -m flashlab.numba_kernels [--simulator | --gpu] [--n N] ...``: check cuda_forward, print JSON."""
    parser = argparse.ArgumentParser(prog="python -m flashlab.numba_kernels", description=main.__doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--simulator", action="store_true", help="run in the CUDA simulator (the default)")
    where.add_argument("--gpu", action="store_true", help="run on a real GPU")
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--m", type=int, default=None, help="keys (default: n)")
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-q", type=int, default=32)
    parser.add_argument("--block-k", type=int, default=32)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.gpu:
        use_simulator()
    result = check_cuda_forward(args.n, args.m or args.n, args.d, batch=args.batch, block_q=args.block_q,
                                block_k=args.block_k, causal=args.causal, dtype=args.dtype, seed=args.seed)
    print(json.dumps(result))
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    return 0 if max(result["o_rel_error"], result["l_rel_error"]) <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
