"""The tiled forward pass compiled with Numba for the CPU: ``@njit(parallel=True)``, in two steps.

:func:`tiled_forward` computes what :func:`flashlab.tiled.forward` computes (O and the row logsumexp L). The
Python loops of the tiled algorithm are compiled to machine code; ``prange`` spreads the independent
(batch·head, query block) pairs over the CPU cores. Each task's tiles stay in the core's cache, its "SRAM", and
:func:`exp_nonpositive` is an exponential the compiler can vectorise. It is the readable version: every product
is a loop.

:func:`fast_forward` is the same algorithm with its two tile products done by BLAS, called from inside the
compiled loop (:func:`blas_gemm`: the CBLAS gemm of the BLAS NumPy uses), the softmax done on whole rows of the
tile (vectorised max and exponential), larger tiles, and BLAS on one thread inside each parallel task.

The same algorithm as a ``numba.cuda`` kernel is :mod:`flashlab.numba_cuda`.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from llvmlite import ir
from numba import get_num_threads, get_parallel_chunksize, njit, prange, set_parallel_chunksize, types
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


# ---------------------------------------------------------------------------------------------------------------
# The fast kernel: the same algorithm, with the tile products done by BLAS from inside the compiled loop.
#
# The readable kernel spends most of its time in its two tile products, written as loops: per core they reach a
# fraction of the speed of BLAS's hand-tuned kernels, which naive attention's two large products run on. Here each
# tile product is one call of the CBLAS function NumPy's own BLAS exports (found through threadpoolctl, called
# through ctypes, which Numba compiles to a direct call), and the softmax in between works on whole rows of the
# tile: a vectorised max, a vectorised exponential, one rescale of the accumulator row per tile.

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # the CBLAS enum values


def _gemm_prototype(real, integer):
    """``cblas_?gemm(order, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)`` as a ctypes type."""
    p = ctypes.c_void_p
    return ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, real, p,
                            integer, p, integer, real, p, integer)


_REALS = {np.dtype(np.float32): ("s", ctypes.c_float), np.dtype(np.float64): ("d", ctypes.c_double)}
# The names a BLAS exports cblas_sgemm under, and the width of its integers: NumPy's wheels ship OpenBLAS built
# with 64-bit integers and prefixed names (scipy-openblas64); other builds export the plain CBLAS names.
_CBLAS_NAMES = (("scipy_cblas_{}gemm64_", ctypes.c_int64), ("cblas_{}gemm64_", ctypes.c_int64),
                ("cblas_{}gemm_64", ctypes.c_int64), ("scipy_cblas_{}gemm", ctypes.c_int),
                ("cblas_{}gemm", ctypes.c_int))


@functools.cache
def blas_gemm(dtype: type | np.dtype) -> tuple[object, str] | None:
    """The CBLAS ``sgemm`` (float32) or ``dgemm`` (float64) of the BLAS NumPy uses, as a ctypes function, and
    the library's name; None when no loaded BLAS exports one under a known name (then the fast kernel does its
    tile products with compiled loops instead, see :func:`fast_forward`)."""
    from threadpoolctl import threadpool_info

    letter, real = _REALS[np.dtype(dtype)]
    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        try:
            lib = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        for pattern, integer in _CBLAS_NAMES:
            fn = getattr(lib, pattern.format(letter), None)
            if fn is None:
                continue
            gemm = _gemm_prototype(real, integer)(ctypes.cast(fn, ctypes.c_void_p).value)
            if _gemm_works(gemm, np.dtype(dtype)):  # found by its name: check on numbers that it is that gemm
                return gemm, f"{info.get('internal_api')} {info.get('version')} ({pattern.format(letter)})"
    return None


def _gemm_works(gemm, dtype: np.dtype) -> bool:
    """Whether ``gemm`` computes both products the fast kernel asks for, on small matrices, as NumPy does."""
    rng = np.random.default_rng(0)
    a, b, v = (rng.standard_normal(shape).astype(dtype) for shape in ((3, 4), (5, 4), (5, 2)))
    s = np.zeros((3, 5), dtype)
    acc = np.ones((3, 2), dtype)
    gemm(_ROW_MAJOR, _NO_TRANS, _TRANS, 3, 5, 4, 2.0, a.ctypes.data, 4, b.ctypes.data, 4, 0.0, s.ctypes.data, 5)
    gemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, 3, 2, 5, 1.0, s.ctypes.data, 5, v.ctypes.data, 2, 1.0, acc.ctypes.data, 2)
    tol = 100 * np.finfo(dtype).eps
    return np.allclose(s, 2 * a @ b.T, rtol=tol, atol=tol) and np.allclose(acc, 1 + s @ v, rtol=tol, atol=tol)


def _make_loop_gemm(dtype):
    """A compiled stand-in for cblas_?gemm with the same C signature, used where no BLAS exports one."""
    from numba import carray, cfunc

    real = _REALS[np.dtype(dtype)][1]
    numba_real = types.float32 if np.dtype(dtype) == np.float32 else types.float64
    i64, i32, ptr = types.int64, types.int32, types.voidptr
    sig = types.void(i32, i32, i32, i64, i64, i64, numba_real, ptr, i64, ptr, i64, numba_real, ptr, i64)

    @cfunc(sig, fastmath=_FASTMATH)
    def loop_gemm(order, transa, transb, rows, cols, inner, alpha, a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc):
        a = carray(a_ptr, (rows, lda), dtype=dtype)
        c = carray(c_ptr, (rows, ldc), dtype=dtype)
        if transb == _TRANS:  # C[i, j] = sum_c A[i, c] B[j, c]: dot products along contiguous rows
            b = carray(b_ptr, (cols, ldb), dtype=dtype)
            for i in range(rows):
                for j in range(cols):
                    s = numba_real(0)
                    for k in range(inner):
                        s += a[i, k] * b[j, k]
                    c[i, j] = alpha * s + (beta * c[i, j] if beta != 0 else numba_real(0))
        else:  # C[i, :] += A[i, k] B[k, :]: scaled rows of B added along contiguous rows of C
            b = carray(b_ptr, (inner, ldb), dtype=dtype)
            for i in range(rows):
                for j in range(cols):
                    c[i, j] = beta * c[i, j] if beta != 0 else numba_real(0)
                for k in range(inner):
                    x = alpha * a[i, k]
                    for j in range(cols):
                        c[i, j] += x * b[k, j]

    return _gemm_prototype(real, ctypes.c_int64)(loop_gemm.address), loop_gemm


@functools.cache
def _loop_gemm(dtype):
    """The stand-in for ``dtype``, compiled once (the cfunc object is kept with it: its code lives as long)."""
    return _make_loop_gemm(dtype)


@intrinsic
def _maxnum(typingctx, a, b):
    """max(a, b) as LLVM's maxnum: a running max of it over an array is vectorised. Python's ``max`` as Numba
    compiles it is not: LLVM keeps its NaN behaviour, so one comparison waits for the previous one."""
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        real = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maxnum", [real], ir.FunctionType(real, [real, real]))
        return builder.call(fn, args)

    return a(a, b), codegen


@_njit(fastmath=_FASTMATH, inline="always")
def _softmax_tile_row(s, i, visible, cols, m_row, l_row, acc):  # pragma: no cover - compiled
    """Online softmax of row i of the score tile ``s`` (its first ``visible`` of ``cols`` entries are seen):
    new max, rescale of the row's running sum and accumulator, probabilities written over the scores."""
    neg_inf = s.dtype.type(-np.inf)
    zero = s.dtype.type(0)
    m_new = m_row[i]
    for j in range(visible):
        m_new = _maxnum(m_new, s[i, j])
    if m_new == neg_inf:  # the row has seen no key yet: its probabilities are 0, its state stays empty
        for j in range(cols):
            s[i, j] = zero
        return
    alpha = exp_nonpositive(m_row[i] - m_new)
    # The row's sum in float64 whatever the dtype: fastmath lets LLVM split a float32 sum into as many lanes as the
    # machine's vectors hold, so its rounding depends on the machine (an AVX2 machine rounded it enough to take
    # the output's error past twice naive float32's); the conversions cost 5-10 % of the kernel's time.
    total = 0.0
    for j in range(visible):
        p = exp_nonpositive(s[i, j] - m_new)
        s[i, j] = p
        total += p
    for j in range(visible, cols):  # masked: above the causal diagonal
        s[i, j] = zero
    l_row[i] = alpha * l_row[i] + total
    m_row[i] = m_new
    for c in range(acc.shape[1]):
        acc[i, c] *= alpha


@_njit(parallel=True, fastmath=_FASTMATH)
def _fast_kernel(gemm, Q, K, V, O, L, block_q, block_k, causal, offset, scale):  # pragma: no cover - compiled
    """As :func:`_tiled_kernel`; the tile products S = scale Q K^T and acc += P V are ``gemm`` calls."""
    batch, n, d = Q.shape
    m = K.shape[1]
    dv = V.shape[2]
    neg_inf = Q.dtype.type(-np.inf)
    one = Q.dtype.type(1)
    zero = Q.dtype.type(0)
    q_blocks = (n + block_q - 1) // block_q
    for task in prange(batch * q_blocks):
        b = task // q_blocks
        q0 = (task % q_blocks) * block_q
        rows = min(block_q, n - q0)
        # One task's workspace: a tile of scores (then probabilities), the accumulator, the row state.
        s = np.empty((rows, block_k), dtype=Q.dtype)
        acc = np.zeros((rows, dv), dtype=Q.dtype)
        m_row = np.full(rows, neg_inf, dtype=Q.dtype)
        l_row = np.zeros(rows, dtype=Q.dtype)
        q_ptr = Q[b, q0:].ctypes.data
        k_end = min(m, q0 + rows + offset) if causal else m
        for k0 in range(0, k_end, block_k):
            cols = min(block_k, k_end - k0)
            # S = scale Q_tile K_tile^T: rows x cols, the scale folded into BLAS's alpha.
            gemm(_ROW_MAJOR, _NO_TRANS, _TRANS, rows, cols, d, scale, q_ptr, d, K[b, k0:].ctypes.data, d,
                 zero, s.ctypes.data, block_k)
            for i in range(rows):
                visible = min(cols, max(0, q0 + i + offset - k0 + 1)) if causal else cols
                _softmax_tile_row(s, i, visible, cols, m_row, l_row, acc)
            # acc += P V_tile: the accumulator was rescaled row by row above, so BLAS adds onto it (beta = 1).
            gemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, rows, dv, cols, one, s.ctypes.data, block_k,
                 V[b, k0:].ctypes.data, dv, one, acc.ctypes.data, dv)
        for i in range(rows):
            if l_row[i] > 0:
                inv = one / l_row[i]
                for c in range(dv):
                    O[b, q0 + i, c] = acc[i, c] * inv
                L[b, q0 + i] = m_row[i] + np.log(l_row[i])
            else:  # a row that sees no key at all (causal with n > m)
                for c in range(dv):
                    O[b, q0 + i, c] = 0
                L[b, q0 + i] = neg_inf


_BLAS_LIMITER = []  # one threadpoolctl controller, made on first use: finding the libraries takes milliseconds


def _one_blas_thread():
    """A context in which the loaded BLAS libraries run on one thread each."""
    from threadpoolctl import ThreadpoolController

    if not _BLAS_LIMITER:
        _BLAS_LIMITER.append(ThreadpoolController())
    return _BLAS_LIMITER[0].limit(limits=1, user_api="blas")


def fast_block_q(batch: int, n: int, threads: int | None = None) -> int:
    """The default query block of :func:`fast_forward`: 256 rows (few, long BLAS calls), halved down to 32 while
    the ``batch`` x ceil(n / block_q) tasks would give a thread fewer than two."""
    threads = get_num_threads() if threads is None else threads
    block_q = 256
    while block_q > 32 and batch * -(-n // block_q) < 2 * threads:
        block_q //= 2
    return block_q


def fast_forward(
    Q, K, V, *, block_q: int | None = None, block_k: int = 512, causal: bool = False, scale: float | None = None,
    blas: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tiled_forward` with its tile products done by BLAS from inside the compiled loop: the fast version.

    Same arguments and results as :func:`tiled_forward`. Each (batch·head, query block) task computes its tile of
    scores with one BLAS call, folds it into the running softmax row by row (vectorised max and exponential), and
    adds P V with a second BLAS call; ``prange`` spreads the tasks over Numba's threads, and BLAS runs on one
    thread inside each (the parallelism is the tasks'), so threads are set by ``numba.set_num_threads``. No
    n x m matrix exists: per running task, one block_q x block_k tile, the accumulator and the row state.
    ``blas=False`` (or a BLAS that exports no CBLAS gemm, :func:`blas_gemm`) uses compiled loops for the tile
    products instead: the same results, slower. ``block_q=None`` picks :func:`fast_block_q`.
    """
    pick = block_q is None
    Q3, K3, V3, lead, dtype, block_q, block_k, scale = _prepare(Q, K, V, 256 if pick else block_q, block_k, scale)
    if pick:
        block_q = fast_block_q(Q3.shape[0], Q3.shape[1])
    O = np.empty(Q3.shape[:2] + (V3.shape[2],), dtype=dtype)
    L = np.empty(Q3.shape[:2], dtype=dtype)
    offset = causal_offset(Q3.shape[1], K3.shape[1])
    found = blas_gemm(dtype) if blas else None
    # Tasks handed out one at a time, not split in equal shares up front: a thread slowed down by other work on
    # the machine then takes fewer of them instead of holding up the others at the end.
    chunksize = get_parallel_chunksize()
    set_parallel_chunksize(1)
    try:
        if found is None:
            _fast_kernel(_loop_gemm(dtype)[0], Q3, K3, V3, O, L, block_q, block_k, bool(causal), offset, scale)
        else:
            with _one_blas_thread():
                _fast_kernel(found[0], Q3, K3, V3, O, L, block_q, block_k, bool(causal), offset, scale)
    finally:
        set_parallel_chunksize(chunksize)
    return O.reshape(lead + O.shape[1:]), L.reshape(lead + L.shape[1:])


def fast_forward_workspace_bytes(n: int, d: int, dv: int, *, block_q: int | None = None, block_k: int = 512,
                                 itemsize: int = 4, batch: int = 1, threads: int | None = None) -> int:
    """Bytes :func:`fast_forward` allocates beyond its inputs: the outputs plus each running task's workspace.

    The analytic account (tracemalloc cannot see Numba's allocations): O and L, plus per concurrently running task
    a block_q x block_k tile of scores, the block_q x dv accumulator and the (m, l) rows. BLAS's own packing
    buffers are not counted: BLAS allocates them once and reuses them, for naive attention's products too.
    """
    threads = get_num_threads() if threads is None else threads
    block_q = fast_block_q(batch, n, threads) if block_q is None else block_q
    per_task = block_q * block_k + block_q * dv + 2 * block_q
    return itemsize * (batch * n * (dv + 1) + min(threads, batch * -(-n // block_q)) * per_task)
