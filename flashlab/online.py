"""Online softmax: attention over a stream of score blocks without ever holding a whole row.

The state of one row (or of many rows at once, as arrays) is three numbers:

* ``m`` — the largest score seen so far (the running max),
* ``l`` — ``sum(exp(s - m))`` over the scores seen so far,
* ``u`` — ``sum(exp(s - m) * v)``, the unnormalised output (a scalar or a vector of length dv).

The answer is ``u / l`` and the row's logsumexp is ``m + log(l)``. When a new block raises the max from ``m`` to
``m'``, everything accumulated so far was measured against the old max and must be rescaled by
``exp(m - m')`` (Milakov & Gimelshein, 2018). The update is exact for any split and any order of blocks, for
blocks that are entirely masked (-inf), and for scores of +-1000, because no exponent is ever positive.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class State:
    """Online-softmax state (m, l, u) for one row or an array of rows."""

    m: np.ndarray
    l: np.ndarray  # noqa: E741 - the paper's name
    u: np.ndarray

    def result(self) -> np.ndarray:
        """``u / l``; a row that saw only masked scores (l == 0) gives 0, not nan."""
        l = self.l[..., None] if self.u.ndim > self.l.ndim else self.l  # noqa: E741
        return self.u / np.where(l > 0, l, 1)

    def logsumexp(self) -> np.ndarray:
        """``m + log(l)``: -inf for a row that saw only masked scores."""
        with np.errstate(divide="ignore"):
            return np.where(self.l > 0, self.m + np.log(np.where(self.l > 0, self.l, 1)), -np.inf)

    def __iter__(self):
        return iter((self.m, self.l, self.u))


def init(rows: tuple[int, ...] = (), dv: int | None = None, dtype=np.float64) -> State:
    """Empty state: m = -inf, l = 0, u = 0. ``dv=None`` gives a scalar u per row, else a vector of length dv."""
    u_shape = tuple(rows) if dv is None else tuple(rows) + (dv,)
    return State(
        m=np.full(rows, -np.inf, dtype=dtype),
        l=np.zeros(rows, dtype=dtype),
        u=np.zeros(u_shape, dtype=dtype),
    )


def _safe(m: np.ndarray) -> np.ndarray:
    # A max of -inf means "nothing seen yet"; exponentiating against 0 instead makes every weight exp(-inf) = 0
    # rather than exp(-inf - -inf) = nan.
    return np.where(np.isfinite(m), m, 0)


def _expand(x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return x[..., None] if like.ndim > x.ndim else x


def update(state: State, scores, values) -> State:
    """Fold one block of scores into the state.

    ``scores`` has shape ``rows + (k,)``; ``values`` is ``(k,)`` (scalar values) or ``(..., k, dv)``.
    Masked scores are ``-inf``; a block that is all ``-inf`` leaves the state unchanged.
    """
    scores = np.asarray(scores)
    values = np.asarray(values)
    m_new = np.maximum(state.m, scores.max(axis=-1))
    m_safe = _safe(m_new)
    alpha = np.exp(state.m - m_safe)  # rescales what was accumulated against the old max
    p = np.exp(scores - m_safe[..., None])
    l_new = alpha * state.l + p.sum(axis=-1)
    pv = p @ values
    u_new = _expand(alpha, pv) * state.u + pv
    return State(m_new, l_new, u_new)


def merge(a: State, b: State) -> State:
    """Combine two states computed over disjoint sets of keys (in any order): the state of their union."""
    m_new = np.maximum(a.m, b.m)
    m_safe = _safe(m_new)
    wa = np.exp(a.m - m_safe)
    wb = np.exp(b.m - m_safe)
    return State(m_new, wa * a.l + wb * b.l, _expand(wa, a.u) * a.u + _expand(wb, b.u) * b.u)


def attend(scores, values, splits=None) -> float | np.ndarray:
    """Softmax-weighted average of ``values`` computed block by block; ``splits`` are the block boundaries."""
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    k = scores.shape[-1]
    edges = [0, *(splits or []), k]
    dv = None if values.ndim == 1 else values.shape[-1]
    state = init(scores.shape[:-1], dv)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        state = update(state, scores[..., lo:hi], values[lo:hi])
    return state.result()
