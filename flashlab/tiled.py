"""The tiled forward pass in NumPy, built from the online-softmax state of :mod:`flashlab.online`.

Two loop orders compute the same thing:

* ``"kv_outer"`` — the paper's Algorithm 1: the outer loop walks over blocks of K and V, the inner loop over
  blocks of Q. O, l and m live in "HBM" (full-size arrays) and are read and written back on every pass.
* ``"q_outer"`` — FlashAttention-2's order: one block of queries stays put while all K/V blocks stream past;
  its state never leaves "SRAM" until it is finished.

Neither ever holds more than one ``block_q x block_k`` tile of scores.
"""

from __future__ import annotations

import numpy as np

from . import online
from ._checks import causal_offset, check_block, check_qkv, check_scale

LOOP_ORDERS = ("kv_outer", "q_outer")


def _score_tile(Qi, Kj, scale, causal, q0, k0, offset):
    S = scale * (Qi @ np.swapaxes(Kj, -1, -2))
    if causal:
        qi = np.arange(q0, q0 + Qi.shape[-2])[:, None]
        kj = np.arange(k0, k0 + Kj.shape[-2])[None, :]
        S = np.where(kj <= qi + offset, S, np.asarray(-np.inf, dtype=S.dtype))
    return S


def _tile_masked(q1, k0, causal, offset):
    """True when every key of the tile lies after every query's last visible key, so it can be skipped."""
    return causal and k0 > (q1 - 1) + offset


def forward(
    Q,
    K,
    V,
    *,
    block_q: int = 64,
    block_k: int = 64,
    causal: bool = False,
    scale: float | None = None,
    loop_order: str = "kv_outer",
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled exact attention. Same arguments and results as :func:`flashlab.reference.attention`.

    Q is (..., n, d), K (..., m, d), V (..., m, dv), float32 or float64 (the result keeps the dtype).
    Returns ``(O, L)`` with L the logsumexp of each row of scaled scores.
    """
    Q, K, V = check_qkv(Q, K, V, allowed=(np.float32, np.float64))
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    if loop_order not in LOOP_ORDERS:
        raise ValueError(f"loop_order must be one of {LOOP_ORDERS}; got {loop_order!r}")
    dtype = np.result_type(Q, K, V)
    Q, K, V = (x.astype(dtype, copy=False) for x in (Q, K, V))
    n, m, dv = Q.shape[-2], K.shape[-2], V.shape[-1]
    scale = dtype.type(check_scale(scale, Q.shape[-1]))
    offset = causal_offset(n, m)
    batch = Q.shape[:-2]
    q_blocks = [(q0, min(q0 + block_q, n)) for q0 in range(0, n, block_q)]
    k_blocks = [(k0, min(k0 + block_k, m)) for k0 in range(0, m, block_k)]

    O = np.zeros(batch + (n, dv), dtype=dtype)
    L = np.empty(batch + (n,), dtype=dtype)

    if loop_order == "q_outer":
        for q0, q1 in q_blocks:
            state = online.init(batch + (q1 - q0,), dv, dtype)
            for k0, k1 in k_blocks:
                if _tile_masked(q1, k0, causal, offset):
                    break
                S = _score_tile(Q[..., q0:q1, :], K[..., k0:k1, :], scale, causal, q0, k0, offset)
                state = online.update(state, S, V[..., k0:k1, :])
            O[..., q0:q1, :] = state.result()
            L[..., q0:q1] = state.logsumexp()
        return O, L

    # kv_outer: the paper keeps O normalised in HBM, together with l and m, and rescales on every visit.
    l_hbm = np.zeros(batch + (n,), dtype=dtype)
    m_hbm = np.full(batch + (n,), -np.inf, dtype=dtype)
    for k0, k1 in k_blocks:
        for q0, q1 in q_blocks:
            if _tile_masked(q1, k0, causal, offset):
                continue
            li, mi = l_hbm[..., q0:q1], m_hbm[..., q0:q1]
            state = online.State(mi, li, O[..., q0:q1, :] * li[..., None])
            S = _score_tile(Q[..., q0:q1, :], K[..., k0:k1, :], scale, causal, q0, k0, offset)
            state = online.update(state, S, V[..., k0:k1, :])
            O[..., q0:q1, :] = state.result()
            l_hbm[..., q0:q1] = state.l
            m_hbm[..., q0:q1] = state.m
    L[...] = online.State(m_hbm, l_hbm, O).logsumexp()
    return O, L
