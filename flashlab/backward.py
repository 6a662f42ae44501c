"""The tiled backward pass with recomputation: gradients of attention from Q, K, V, O, dO and the saved L only.

The forward saves one number per query row, the logsumexp ``L = m + log(l)``. Any probability tile can then be
rebuilt exactly from Q and K: ``P_ij = exp(scale * Q_i K_j^T - L_i)``, already normalised. So the backward
never needs the ``n x m`` matrix P that standard attention keeps, and walks over the same tiles as the forward:

* ``D = rowsum(dO * O)`` once, O(n) (it equals ``rowsum(P * dP)``, the softmax backward's correction);
* for each K/V block j (outer), for each Q block i (inner): recompute ``P_ij``; ``dV_j += P_ij^T dO_i``;
  ``dP_ij = dO_i V_j^T``; ``dS_ij = P_ij * (dP_ij - D_i)``; ``dQ_i += scale * dS_ij K_j``;
  ``dK_j += scale * dS_ij^T Q_i``.

That is the backward order of both FlashAttention papers (the first paper's Algorithm 4, FlashAttention-2's
Algorithm 2) in FlashAttention-2's form, P from L and D computed once: dK_j and dV_j stay in "SRAM" while the Q
blocks stream past; dQ is
accumulated in its full-size output. Five ``B_r x B_c`` matmuls per tile against the forward's two: 2.5x the
forward's FLOPs (the recomputation of S is one of the five).
"""

from __future__ import annotations

import numpy as np

from ._checks import as_float_array, causal_offset, check_block, check_qkv, check_scale


def _check_saved(Q, V, O, L, dO, dtype):
    rows = Q.shape[:-1]
    O = as_float_array(O, "O")
    dO = as_float_array(dO, "dO")
    L = as_float_array(L, "L")
    out_shape = rows + (V.shape[-1],)
    if O.shape != out_shape:
        raise ValueError(f"O must have shape (..., n, dv) = {out_shape}, as the forward returned it; got {O.shape}")
    if dO.shape != out_shape:
        raise ValueError(f"dO must have the shape of O, {out_shape}; got {dO.shape}")
    if L.shape != rows:
        raise ValueError(f"L must have shape (..., n) = {rows} (one logsumexp per query row); got {L.shape}")
    if np.isnan(L).any() or np.isposinf(L).any():
        raise ValueError("L must be the forward's logsumexp: finite, or -inf for a row that sees no key")
    return O.astype(dtype, copy=False), L.astype(dtype, copy=False), dO.astype(dtype, copy=False)


def _prepare(Q, K, V, block_q, block_k, scale):
    K0, V0 = np.asarray(K), np.asarray(V)
    Q, K, V = check_qkv(Q, K, V, allowed=(np.float32, np.float64), allow_gqa=True)
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    dtype = np.result_type(Q, K, V)
    Q, K, V = (x.astype(dtype, copy=False) for x in (Q, K, V))
    return Q, K, V, K0.shape, V0.shape, block_q, block_k, dtype, dtype.type(check_scale(scale, Q.shape[-1]))


def _fold_heads(dK, dV, k_shape, v_shape):
    """Grouped-query attention: K/V heads were repeated for the query heads; their gradients add up."""
    if dK.shape == k_shape:
        return dK, dV
    group = dK.shape[-3] // k_shape[-3]
    dK = dK.reshape(k_shape[:-2] + (group,) + k_shape[-2:]).sum(axis=-3)
    dV = dV.reshape(v_shape[:-2] + (group,) + v_shape[-2:]).sum(axis=-3)
    return dK, dV


def _mask(S, causal, q0, k0, offset):
    if not causal:
        return S
    qi = np.arange(q0, q0 + S.shape[-2])[:, None]
    kj = np.arange(k0, k0 + S.shape[-1])[None, :]
    return np.where(kj <= qi + offset, S, np.asarray(-np.inf, dtype=S.dtype))


def _tiles(n, m, block_q, block_k, causal):
    """(q0, q1, k0, k1) for every tile the backward visits, K/V blocks outer; fully masked tiles are skipped."""
    offset = causal_offset(n, m)
    for k0 in range(0, m, block_k):
        for q0 in range(0, n, block_q):
            q1 = min(q0 + block_q, n)
            if causal and k0 > (q1 - 1) + offset:
                continue
            yield q0, q1, k0, min(k0 + block_k, m)


def backward(
    Q,
    K,
    V,
    O,
    L,
    dO,
    *,
    block_q: int = 64,
    block_k: int = 64,
    causal: bool = False,
    scale: float | None = None,
    stats: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dQ, dK, dV)`` of attention, tile by tile, recomputing P from Q, K and the saved L.

    Q (..., n, d), K (..., m, d), V (..., m, dv) as for :func:`flashlab.tiled.forward`; O (..., n, dv) and
    L (..., n) are what that forward returned; dO is the gradient of the loss with respect to O. float32 or
    float64 (the result keeps the dtype). Nothing of size n x m is ever allocated: the largest temporaries are
    ``block_q x block_k`` tiles. A row with ``L = -inf`` (it saw no key) gets zero gradients.

    ``stats``, if a dict, receives ``"flops"`` (matmul FLOPs actually done, 2 per multiply-add) and ``"tiles"``.
    """
    Q, K, V, k_shape, v_shape, block_q, block_k, dtype, scale = _prepare(Q, K, V, block_q, block_k, scale)
    O, L, dO = _check_saved(Q, V, O, L, dO, dtype)
    n, m, d, dv = Q.shape[-2], K.shape[-2], Q.shape[-1], V.shape[-1]
    offset = causal_offset(n, m)
    heads = int(np.prod(Q.shape[:-2], dtype=np.int64))

    D = np.sum(dO * O, axis=-1)
    # exp(S - (+inf)) = 0: a row that saw no key has P = 0 everywhere instead of exp(-inf - -inf) = nan.
    L_safe = np.where(np.isneginf(L), np.inf, L)
    dQ = np.zeros(Q.shape, dtype=dtype)
    dK = np.zeros(K.shape, dtype=dtype)
    dV = np.zeros(V.shape, dtype=dtype)
    flops = tiles = 0
    for q0, q1, k0, k1 in _tiles(n, m, block_q, block_k, causal):
        Qi, Kj, Vj, dOi = Q[..., q0:q1, :], K[..., k0:k1, :], V[..., k0:k1, :], dO[..., q0:q1, :]
        S = _mask(scale * (Qi @ np.swapaxes(Kj, -1, -2)), causal, q0, k0, offset)
        P = np.exp(S - L_safe[..., q0:q1, None])
        dV[..., k0:k1, :] += np.swapaxes(P, -1, -2) @ dOi
        dP = dOi @ np.swapaxes(Vj, -1, -2)
        dS = P * (dP - D[..., q0:q1, None])
        dQ[..., q0:q1, :] += scale * (dS @ Kj)
        dK[..., k0:k1, :] += scale * (np.swapaxes(dS, -1, -2) @ Qi)
        tiles += 1
        flops += heads * 2 * (q1 - q0) * (k1 - k0) * (3 * d + 2 * dv)
    if stats is not None:
        stats.update(flops=flops, tiles=tiles)
    dK, dV = _fold_heads(dK, dV, k_shape, v_shape)
    return dQ, dK, dV


def backward_from_p(
    Q,
    K,
    V,
    O,
    P,
    dO,
    *,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
    stats: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same tiled backward, reading P tiles from a stored ``n x m`` matrix instead of recomputing them.

    This is what recomputation is measured against (chapter 4): same tiles, same order, four matmuls per tile
    instead of five and no exp, but the forward had to keep all of P. ``P`` is (..., n, m), masked entries 0.
    """
    Q, K, V, k_shape, v_shape, block_q, block_k, dtype, scale = _prepare(Q, K, V, block_q, block_k, scale)
    n, m, d, dv = Q.shape[-2], K.shape[-2], Q.shape[-1], V.shape[-1]
    O, _, dO = _check_saved(Q, V, O, np.zeros(Q.shape[:-1], dtype=dtype), dO, dtype)
    P = as_float_array(P, "P")
    if P.shape != Q.shape[:-1] + (m,):
        raise ValueError(f"P must have shape (..., n, m) = {Q.shape[:-1] + (m,)}; got {P.shape}")
    heads = int(np.prod(Q.shape[:-2], dtype=np.int64))
    D = np.sum(dO * O, axis=-1)
    dQ = np.zeros(Q.shape, dtype=dtype)
    dK = np.zeros(K.shape, dtype=dtype)
    dV = np.zeros(V.shape, dtype=dtype)
    flops = tiles = 0
    for q0, q1, k0, k1 in _tiles(n, m, block_q, block_k, False):
        Qi, Kj, Vj, dOi = Q[..., q0:q1, :], K[..., k0:k1, :], V[..., k0:k1, :], dO[..., q0:q1, :]
        Pij = P[..., q0:q1, k0:k1]
        dV[..., k0:k1, :] += np.swapaxes(Pij, -1, -2) @ dOi
        dS = Pij * (dOi @ np.swapaxes(Vj, -1, -2) - D[..., q0:q1, None])
        dQ[..., q0:q1, :] += scale * (dS @ Kj)
        dK[..., k0:k1, :] += scale * (np.swapaxes(dS, -1, -2) @ Qi)
        tiles += 1
        flops += heads * 2 * (q1 - q0) * (k1 - k0) * (2 * d + 2 * dv)
    if stats is not None:
        stats.update(flops=flops, tiles=tiles)
    dK, dV = _fold_heads(dK, dV, k_shape, v_shape)
    return dQ, dK, dV
