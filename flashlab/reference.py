"""Float64 attention: the truth every other implementation in the course is checked against.

It materialises the full score matrix S on purpose: it is slow and memory hungry, but it is short enough to be
obviously right.
"""

from __future__ import annotations

import numpy as np

from . import blocksparse
from ._checks import as_float_array, causal_offset, check_qkv, check_scale


def causal_mask(n: int, m: int) -> np.ndarray:
    """Boolean (n, m) matrix, True where query i may attend to key j (j <= i + m - n)."""
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    return j <= i + causal_offset(n, m)


def visible(n: int, m: int, *, causal: bool = False, mask=None) -> np.ndarray | None:
    """The (n, m) boolean matrix of pairs a query may see, or None when every pair is visible.

    ``mask`` is an (n, m) boolean array or a pattern of :mod:`flashlab.blocksparse`; with ``causal`` as well,
    a pair must be visible to both.
    """
    seen = None if mask is None else blocksparse.as_pattern(mask).mask(n, m)
    if causal:
        seen = causal_mask(n, m) if seen is None else seen & causal_mask(n, m)
    return seen


def scores(Q, K, *, causal: bool = False, scale: float | None = None, mask=None) -> np.ndarray:
    """Scaled scores S = scale * Q K^T in float64, masked entries set to -inf (see :func:`visible`)."""
    Q = np.asarray(Q, dtype=np.float64)
    K = np.asarray(K, dtype=np.float64)
    S = check_scale(scale, Q.shape[-1]) * (Q @ np.swapaxes(K, -1, -2))
    seen = visible(Q.shape[-2], K.shape[-2], causal=causal, mask=mask)
    if seen is not None:
        S = np.where(seen, S, -np.inf)
    return S


def attention(Q, K, V, causal: bool = False, scale: float | None = None, *,
              mask=None) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention in float64.

    Q is (..., n, d); K is (..., m, d) and V is (..., m, dv). K and V may have fewer heads (axis -3) than Q
    when that number divides Q's (grouped-query attention). ``scale`` defaults to 1/sqrt(d). ``mask`` (an
    (n, m) boolean array, True where query i sees key j, or a :mod:`flashlab.blocksparse` pattern) hides the
    other pairs, in every head; with ``causal`` too, a pair must pass both.

    Returns ``(O, L)``: O (..., n, dv) and L (..., n), the logsumexp of each row of scaled scores. A row that
    can see no key (causal with n > m, or a mask's empty row) gets O = 0 and L = -inf.
    """
    Q, K, V = check_qkv(Q, K, V, allow_gqa=True)
    S = scores(Q, K, causal=causal, scale=scale, mask=mask)
    row_max = S.max(axis=-1, keepdims=True)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    P = np.exp(S - safe_max)
    row_sum = P.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        L = (safe_max + np.log(row_sum))[..., 0]
    O = (P @ V.astype(np.float64)) / np.where(row_sum > 0, row_sum, 1.0)
    return O, L


def softmax_matrix(Q, K, *, causal: bool = False, scale: float | None = None, mask=None) -> np.ndarray:
    """The full attention matrix P = softmax(S) in float64 (masked as in :func:`scores`).

    This is what standard attention stores and FlashAttention never does.
    """
    S = scores(Q, K, causal=causal, scale=scale, mask=mask)
    row_max = S.max(axis=-1, keepdims=True)
    P = np.exp(S - np.where(np.isfinite(row_max), row_max, 0.0))
    total = P.sum(axis=-1, keepdims=True)
    return P / np.where(total > 0, total, 1.0)


def attention_backward(Q, K, V, dO, causal: bool = False, scale: float | None = None):
    """Gradients ``(dQ, dK, dV)`` of attention in float64, with P materialised (the textbook backward).

    For ``O = P V`` with ``P = softmax(S)`` row by row and ``S = scale * Q K^T`` (masked entries -inf):

    * ``dV = P^T dO`` and ``dP = dO V^T``;
    * ``D = rowsum(dO * O)`` (equal to ``rowsum(P * dP)``), so the softmax backward is ``dS = P * (dP - D)``;
    * ``dQ = scale * dS K`` and ``dK = scale * dS^T Q``.

    Shapes as in :func:`attention`; ``dO`` has O's shape. With fewer K/V heads than Q heads (grouped-query
    attention) the gradients of the heads that share a K/V head are summed. A row that sees no key has P = 0
    and contributes no gradient.
    """
    K0, V0 = np.asarray(K), np.asarray(V)  # their shapes, to fold grouped-query heads back at the end
    Q, K, V = check_qkv(Q, K, V, allow_gqa=True)
    Q, K, V = (x.astype(np.float64) for x in (Q, K, V))
    dO = as_float_array(dO, "dO").astype(np.float64)
    expected = Q.shape[:-1] + (V.shape[-1],)
    if dO.shape != expected:
        raise ValueError(f"dO must have the shape of O, {expected}; got {dO.shape}")
    scale = check_scale(scale, Q.shape[-1])
    P = softmax_matrix(Q, K, causal=causal, scale=scale)
    O = P @ V
    dV = np.swapaxes(P, -1, -2) @ dO
    dP = dO @ np.swapaxes(V, -1, -2)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    dS = P * (dP - D)
    dQ = scale * (dS @ K)
    dK = scale * (np.swapaxes(dS, -1, -2) @ Q)
    if K.shape != K0.shape:  # grouped-query attention: fold the repeated heads back onto their K/V head
        group = K.shape[-3] // K0.shape[-3]
        dK = dK.reshape(K0.shape[:-2] + (group,) + K0.shape[-2:]).sum(axis=-3)
        dV = dV.reshape(V0.shape[:-2] + (group,) + V0.shape[-2:]).sum(axis=-3)
    return dQ, dK, dV
