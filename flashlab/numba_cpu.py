"""The tiled forward pass compiled with Numba for the CPU: ``@njit(parallel=True)``.

:func:`tiled_forward` computes what :func:`flashlab.tiled.forward` computes (O and the row logsumexp L). The
Python loops of the tiled algorithm are compiled to machine code; ``prange`` spreads the independent
(batch·head, query block) pairs over the CPU cores. Each task's tiles stay in the core's cache, its "SRAM", and
:func:`exp_nonpositive` is an exponential the compiler can vectorise. The same algorithm as a ``numba.cuda``
kernel is :mod:`flashlab.numba_cuda`.
"""

from __future__ import annotations

import math

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
