"""The tiled forward pass in NumPy, built from the online-softmax state of :mod:`flashlab.online`.

Two loop orders compute the same thing:

* ``"kv_outer"`` — the paper's Algorithm 1: the outer loop walks over blocks of K and V, the inner loop over
  blocks of Q. O, l and m live in "HBM" (full-size arrays) and are read and written back on every pass.
* ``"q_outer"`` — FlashAttention-2's order: one block of queries stays put while all K/V blocks stream past;
  its state never leaves "SRAM" until it is finished.

Neither ever holds more than one ``block_q x block_k`` tile of scores.

With a causal mask or a block-sparse pattern (``mask=``, see :mod:`flashlab.blocksparse`), each tile is one of
three kinds: EMPTY tiles are skipped (never loaded, never computed), FULL tiles are computed with no mask, and
only PARTIAL tiles are masked element by element.
"""

from __future__ import annotations

import numpy as np

from . import blocksparse, online
from ._checks import causal_offset, check_block, check_qkv, check_scale

LOOP_ORDERS = ("kv_outer", "q_outer")


def _score_tile(Qi, Kj, scale, causal, q0, k0, offset):
    S = scale * (Qi @ np.swapaxes(Kj, -1, -2))
    if causal:
        qi = np.arange(q0, q0 + Qi.shape[-2])[:, None]
        kj = np.arange(k0, k0 + Kj.shape[-2])[None, :]
        S = np.where(kj <= qi + offset, S, np.asarray(-np.inf, dtype=S.dtype))
    return S


def _block_mask(n, m, block_q, block_k, causal, mask) -> blocksparse.BlockMask:
    """The kind of every tile: the pattern's, intersected with causal when both are asked for."""
    if mask is None:
        pattern = blocksparse.causal() if causal else blocksparse.Window(None, None)  # the latter: every pair
    else:
        pattern = blocksparse.as_pattern(mask)
        if causal:
            pattern = pattern & blocksparse.causal()
    return pattern.block_mask(n, m, block_q, block_k)


def _masked_tile(tiles, i, j, Qi, Kj, scale, causal, mask, offset):
    """Scores of a computed tile: no mask on a FULL tile, the element mask on a PARTIAL one."""
    q0, _, k0, _ = tiles.bounds(i, j)
    partial = tiles.kinds[i, j] == blocksparse.PARTIAL
    if mask is None:  # causal alone: the tile masks itself from its indices
        return _score_tile(Qi, Kj, scale, causal and partial, q0, k0, offset)
    S = _score_tile(Qi, Kj, scale, False, q0, k0, offset)
    if partial:
        S = np.where(tiles.tile_mask(i, j), S, np.asarray(-np.inf, dtype=S.dtype))
    return S


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
    mask=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled exact attention. Same arguments and results as :func:`flashlab.reference.attention`.

    Q is (..., n, d), K (..., m, d), V (..., m, dv), float32 or float64 (the result keeps the dtype).
    ``mask`` is an (n, m) boolean array or a :mod:`flashlab.blocksparse` pattern (combined with ``causal``
    when both are given): tiles it hides entirely are skipped, tiles it shows entirely are computed unmasked.
    Returns ``(O, L)`` with L the logsumexp of each row of scaled scores (-inf for a row that sees no key).
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
    tiles = _block_mask(n, m, block_q, block_k, causal, mask)
    q_blocks = list(enumerate((q0, min(q0 + block_q, n)) for q0 in range(0, n, block_q)))
    k_blocks = list(enumerate((k0, min(k0 + block_k, m)) for k0 in range(0, m, block_k)))

    O = np.zeros(batch + (n, dv), dtype=dtype)
    L = np.empty(batch + (n,), dtype=dtype)

    if loop_order == "q_outer":
        for i, (q0, q1) in q_blocks:
            state = online.init(batch + (q1 - q0,), dv, dtype)
            for j, (k0, k1) in k_blocks:
                if tiles.kinds[i, j] == blocksparse.EMPTY:
                    continue
                S = _masked_tile(tiles, i, j, Q[..., q0:q1, :], K[..., k0:k1, :], scale, causal, mask, offset)
                state = online.update(state, S, V[..., k0:k1, :])
            O[..., q0:q1, :] = state.result()
            L[..., q0:q1] = state.logsumexp()
        return O, L

    # kv_outer: the paper keeps O normalised in HBM, together with l and m, and rescales on every visit.
    l_hbm = np.zeros(batch + (n,), dtype=dtype)
    m_hbm = np.full(batch + (n,), -np.inf, dtype=dtype)
    for j, (k0, k1) in k_blocks:
        for i, (q0, q1) in q_blocks:
            if tiles.kinds[i, j] == blocksparse.EMPTY:
                continue
            li, mi = l_hbm[..., q0:q1], m_hbm[..., q0:q1]
            state = online.State(mi, li, O[..., q0:q1, :] * li[..., None])
            S = _masked_tile(tiles, i, j, Q[..., q0:q1, :], K[..., k0:k1, :], scale, causal, mask, offset)
            state = online.update(state, S, V[..., k0:k1, :])
            O[..., q0:q1, :] = state.result()
            l_hbm[..., q0:q1] = state.l
            m_hbm[..., q0:q1] = state.m
    L[...] = online.State(m_hbm, l_hbm, O).logsumexp()
    return O, L
