"""Block-sparse attention: a pattern of visible (query, key) pairs, and the tiles a tiled kernel may skip.

A *pattern* says which keys each query sees. For block sizes ``(block_q, block_k)`` it becomes a *block mask*
over the tiles of S, each tile one of three kinds:

* ``EMPTY`` — no query of the tile sees any key of it: never loaded, never computed;
* ``FULL`` — every query sees every key: computed without any per-element mask;
* ``PARTIAL`` — some pairs are visible: computed, then masked element by element.

Positions follow the course's causal convention (:func:`flashlab.reference.causal_mask`): with n queries and m
keys, query i stands at position ``i + m - n`` (the last query aligned with the last key), and
``delta = j - (i + m - n)`` is how far key j lies to the right of query i's own position. Every pattern is
written in terms of ``delta``:

* :func:`causal` — ``delta <= 0``;
* :func:`sliding_window` ``(left, right)`` — ``-left <= delta <= right``;
* :func:`dilated` ``(stride)`` — every ``stride``-th token: ``delta % stride == 0`` (causal unless told otherwise);
* :func:`local_global` ``(left, right, tokens)`` — a sliding window, plus a few global tokens that see every key
  and that every query sees;
* :func:`from_mask` — any ``n x m`` boolean mask; :func:`from_blocks` — any mask given tile by tile.

``a & b`` is the pattern of pairs both see. The window patterns classify their tiles from the formula alone
(the range of ``delta`` over a tile), without building the ``n x m`` mask, as a GPU kernel would;
``tests/test_blocksparse.py`` checks every classification against the mask, element by element.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._checks import causal_offset, check_block

EMPTY, PARTIAL, FULL = 0, 1, 2
KIND_NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}


def _check_size(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def _check_reach(value, name: str) -> int | None:
    """A window side: a number of tokens >= 0, or None for no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 0 (tokens) or None (no limit); got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 tokens (None for no limit); got {value}")
    return int(value)


def _edges(size: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of each block of ``size`` (the last block may be shorter)."""
    starts = np.arange(0, size, block)
    return starts, np.minimum(starts + block, size)


class Pattern:
    """Which keys each query sees. Subclasses define :meth:`_tile` (and may classify tiles faster)."""

    def check(self, n: int, m: int) -> None:
        """Raise ValueError if the pattern does not fit ``n`` queries and ``m`` keys."""

    def _tile(self, n: int, m: int, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        raise NotImplementedError

    def tile(self, n: int, m: int, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """The ``(q1 - q0) x (k1 - k0)`` boolean mask of queries ``q0:q1`` against keys ``k0:k1``."""
        n, m = _check_size(n, "n"), _check_size(m, "m")
        self.check(n, m)
        for what, lo, hi, size, count in (("queries", q0, q1, n, "n"), ("keys", k0, k1, m, "m")):
            ok = all(not isinstance(x, bool) and isinstance(x, numbers.Integral) for x in (lo, hi))
            if not ok or not 0 <= lo < hi <= size:
                raise ValueError(f"the {what} {lo!r}:{hi!r} are not a non-empty range within 0:{size} "
                                 f"({count} = {size})")
        return self._tile(n, m, q0, q1, k0, k1)

    def mask(self, n: int, m: int) -> np.ndarray:
        """The ``n x m`` element mask: True where query i sees key j."""
        n, m = _check_size(n, "n"), _check_size(m, "m")
        self.check(n, m)
        return self._tile(n, m, 0, n, 0, m)

    def _kinds(self, n: int, m: int, block_q: int, block_k: int) -> np.ndarray:
        # Any pattern: reduce its element mask over each tile (ufunc.reduceat sums each block of rows/columns).
        mask = self._tile(n, m, 0, n, 0, m)
        rows, cols = np.arange(0, n, block_q), np.arange(0, m, block_k)
        seen = np.add.reduceat(np.add.reduceat(mask.astype(np.int64), rows, axis=0), cols, axis=1)
        r0, r1 = _edges(n, block_q)
        c0, c1 = _edges(m, block_k)
        size = np.outer(r1 - r0, c1 - c0)
        return np.where(seen == 0, EMPTY, np.where(seen == size, FULL, PARTIAL)).astype(np.int8)

    def block_mask(self, n: int, m: int, block_q: int, block_k: int) -> BlockMask:
        """Classify the ``ceil(n / block_q) x ceil(m / block_k)`` tiles of S as EMPTY, PARTIAL or FULL."""
        n, m = _check_size(n, "n"), _check_size(m, "m")
        block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
        self.check(n, m)
        return BlockMask(self, n, m, block_q, block_k, self._kinds(n, m, block_q, block_k))

    def __and__(self, other: Pattern) -> Pattern:
        if not isinstance(other, Pattern):
            return NotImplemented
        return _Both(self, other)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The kind of every tile of S for one pattern, shape and block size (from :meth:`Pattern.block_mask`)."""

    pattern: Pattern
    n: int
    m: int
    block_q: int
    block_k: int
    kinds: np.ndarray  # (tiles of queries, tiles of keys), EMPTY / PARTIAL / FULL

    @property
    def shape(self) -> tuple[int, int]:
        """``(T_r, T_c)``: tiles along the queries and along the keys."""
        return self.kinds.shape

    def heights(self) -> np.ndarray:
        """Rows of each query tile (the last one may be short)."""
        r0, r1 = _edges(self.n, self.block_q)
        return r1 - r0

    def widths(self) -> np.ndarray:
        """Columns of each key tile (the last one may be short)."""
        c0, c1 = _edges(self.m, self.block_k)
        return c1 - c0

    def bounds(self, i: int, j: int) -> tuple[int, int, int, int]:
        """``(q0, q1, k0, k1)``: the queries and keys of tile (i, j)."""
        t_r, t_c = self.shape
        for name, x, size in (("i", i, t_r), ("j", j, t_c)):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < size:
                raise ValueError(f"tile ({i!r}, {j!r}) is outside the {t_r} x {t_c} tiles: {name} runs from 0 to "
                                 f"{size - 1}")
        q0, k0 = i * self.block_q, j * self.block_k
        return q0, min(q0 + self.block_q, self.n), k0, min(k0 + self.block_k, self.m)

    def tile_mask(self, i: int, j: int) -> np.ndarray:
        """The element mask of tile (i, j): what a PARTIAL tile is masked with."""
        return self.pattern.tile(self.n, self.m, *self.bounds(i, j))

    def counts(self) -> dict[str, int]:
        """Number of tiles of each kind: ``{"empty": ..., "partial": ..., "full": ...}``."""
        return {name: int(np.count_nonzero(self.kinds == kind)) for kind, name in KIND_NAMES.items()}

    @property
    def computed(self) -> np.ndarray:
        """Boolean (T_r, T_c): the tiles a kernel loads and computes (PARTIAL or FULL)."""
        return self.kinds != EMPTY

    @property
    def density(self) -> float:
        """Fraction of the tiles that are computed."""
        return float(np.count_nonzero(self.computed)) / self.kinds.size

    def tile_list(self) -> tuple[np.ndarray, np.ndarray]:
        """The computed tiles as a kernel reads them: ``(row_ptr, cols)``, one list per query tile (compressed
        sparse rows, as FlashAttention's block-sparse kernel and FlexAttention's ``kv_indices`` keep them).

        Query tile i computes key tiles ``cols[row_ptr[i]:row_ptr[i + 1]]``, in increasing order; the empty tiles
        appear nowhere, so a kernel walking its list never even looks at them. int32 arrays of length
        ``T_r + 1`` and (number of computed tiles).
        """
        computed = self.computed
        row_ptr = np.zeros(self.shape[0] + 1, dtype=np.int32)
        np.cumsum(np.count_nonzero(computed, axis=1), out=row_ptr[1:])
        return row_ptr, np.nonzero(computed)[1].astype(np.int32)

    def partial_masks(self) -> np.ndarray:
        """The element masks of the PARTIAL tiles, in :meth:`tile_list` order: ``(P, block_q, block_k)`` booleans,
        False beyond the last query or key (a short last tile is padded). The pattern is evaluated one strip of
        ``block_q`` queries at a time, never as the whole ``n x m`` mask."""
        out = np.zeros((int(np.count_nonzero(self.kinds == PARTIAL)), self.block_q, self.block_k), dtype=bool)
        slot = 0
        for i in np.nonzero((self.kinds == PARTIAL).any(axis=1))[0]:
            q0, q1 = i * self.block_q, min((i + 1) * self.block_q, self.n)
            cols = np.nonzero(self.kinds[i] == PARTIAL)[0]
            c0, c1 = cols[0] * self.block_k, min((cols[-1] + 1) * self.block_k, self.m)  # the strip's partial span
            strip = self.pattern.tile(self.n, self.m, q0, q1, c0, c1)
            for j in cols:
                k0, k1 = j * self.block_k, min((j + 1) * self.block_k, self.m)
                out[slot, : q1 - q0, : k1 - k0] = strip[:, k0 - c0:k1 - c0]
                slot += 1
        return out


@dataclass(frozen=True, eq=False)
class Window(Pattern):
    """Query i sees key j when ``-left <= delta <= right`` and ``delta % stride == 0``, ``delta = j - (i + m - n)``.

    ``left`` / ``right`` are numbers of tokens (None: no limit). Build it with :func:`causal`,
    :func:`sliding_window` or :func:`dilated`.
    """

    left: int | None
    right: int | None
    stride: int = 1

    def __post_init__(self):
        _check_reach(self.left, "left")
        _check_reach(self.right, "right")
        _check_size(self.stride, "stride")

    def check(self, n: int, m: int) -> None:
        # delta ranges over [-(m - 1), n - 1]: a side reaching further is wider than the sequence.
        if self.left is not None and self.left > m - 1:
            raise ValueError(f"the window's left side ({self.left} tokens) is larger than the sequence: m = {m} keys "
                             f"lie at most {m - 1} to the left of a query; give left <= {m - 1} (or None: no limit)")
        if self.right is not None and self.right > n - 1:
            raise ValueError(f"the window's right side ({self.right} tokens) is larger than the sequence: with "
                             f"n = {n} queries a key lies at most {n - 1} to the right of a query's position; give "
                             f"right <= {n - 1} (or None: no limit)")

    def _tile(self, n, m, q0, q1, k0, k1):
        delta = np.arange(k0, k1)[None, :] - (np.arange(q0, q1)[:, None] + causal_offset(n, m))
        seen = np.ones(delta.shape, dtype=bool)
        if self.left is not None:
            seen &= delta >= -self.left
        if self.right is not None:
            seen &= delta <= self.right
        if self.stride > 1:
            seen &= delta % self.stride == 0
        return seen

    def _kinds(self, n, m, block_q, block_k):
        # A tile's deltas are every integer from k0 - (q1 - 1) - offset to (k1 - 1) - q0 - offset: the tile is
        # classified from the two ends of that range, as a kernel would, without building its mask.
        offset = causal_offset(n, m)
        q0, q1 = (x[:, None] for x in _edges(n, block_q))
        k0, k1 = (x[None, :] for x in _edges(m, block_k))
        lo, hi = k0 - (q1 - 1) - offset, (k1 - 1) - q0 - offset
        a = -(n + m) if self.left is None else -self.left  # beyond any delta: no limit
        b = n + m if self.right is None else self.right
        first, last = np.maximum(lo, a), np.minimum(hi, b)
        # the largest multiple of the stride <= last; none in [first, last] means nothing is visible
        empty = (last // self.stride) * self.stride < first
        full = (lo >= a) & (hi <= b) & ((self.stride == 1) | ((lo == hi) & (lo % self.stride == 0)))
        return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


@dataclass(frozen=True, eq=False)
class LocalGlobal(Pattern):
    """A sliding window ``(left, right)`` plus global tokens: each position in ``tokens`` is a key every query
    sees and (when a query stands there) a query that sees every key. Build it with :func:`local_global`."""

    left: int
    right: int
    tokens: tuple[int, ...]

    def check(self, n: int, m: int) -> None:
        Window(self.left, self.right).check(n, m)
        if self.tokens[-1] > m - 1:
            raise ValueError(f"global token {self.tokens[-1]} is past the last key (m = {m}: positions 0 to {m - 1})")

    def _global(self, positions: np.ndarray) -> np.ndarray:
        return np.isin(positions, self.tokens)

    def _tile(self, n, m, q0, q1, k0, k1):
        offset = causal_offset(n, m)
        local = Window(self.left, self.right)._tile(n, m, q0, q1, k0, k1)
        return local | self._global(np.arange(k0, k1))[None, :] | self._global(np.arange(q0, q1) + offset)[:, None]

    def _kinds(self, n, m, block_q, block_k):
        offset = causal_offset(n, m)
        kinds = Window(self.left, self.right)._kinds(n, m, block_q, block_k)
        rows = self._global(np.arange(n) + offset)
        cols = self._global(np.arange(m))
        row_any = np.logical_or.reduceat(rows, np.arange(0, n, block_q))
        col_any = np.logical_or.reduceat(cols, np.arange(0, m, block_k))
        kinds = np.where((kinds == EMPTY) & (row_any[:, None] | col_any[None, :]), PARTIAL, kinds)
        # A tile is full when the window covers every pair of its non-global queries and non-global keys: the
        # extreme deltas of those pairs decide it, since the window is an interval.
        big = n + m
        q_lo = np.minimum.reduceat(np.where(rows, big, np.arange(n)), np.arange(0, n, block_q))
        q_hi = np.maximum.reduceat(np.where(rows, -big, np.arange(n)), np.arange(0, n, block_q))
        k_lo = np.minimum.reduceat(np.where(cols, big, np.arange(m)), np.arange(0, m, block_k))
        k_hi = np.maximum.reduceat(np.where(cols, -big, np.arange(m)), np.arange(0, m, block_k))
        none_left = (q_lo[:, None] == big) | (k_lo[None, :] == big)  # every query or every key of the tile is global
        lo = k_lo[None, :] - q_hi[:, None] - offset
        hi = k_hi[None, :] - q_lo[:, None] - offset
        full = none_left | ((lo >= -self.left) & (hi <= self.right))
        return np.where(full, FULL, kinds).astype(np.int8)


@dataclass(frozen=True, eq=False)
class ElementMask(Pattern):
    """A user's ``n x m`` boolean mask (built with :func:`from_mask`)."""

    array: np.ndarray

    def check(self, n: int, m: int) -> None:
        if self.array.shape != (n, m):
            raise ValueError(f"the mask has shape {self.array.shape}, but attention of n = {n} queries and m = {m} "
                             f"keys needs an (n, m) = ({n}, {m}) mask")

    def _tile(self, n, m, q0, q1, k0, k1):
        return self.array[q0:q1, k0:k1]


@dataclass(frozen=True, eq=False)
class TileMask(Pattern):
    """A user's mask given tile by tile: tile (i, j) of ``block_q x block_k`` elements is wholly visible when
    ``blocks[i, j]`` (built with :func:`from_blocks`)."""

    blocks: np.ndarray
    block_q: int
    block_k: int

    def check(self, n: int, m: int) -> None:
        want = (math.ceil(n / self.block_q), math.ceil(m / self.block_k))
        if self.blocks.shape != want:
            raise ValueError(f"the block mask has shape {self.blocks.shape}, but n = {n} queries and m = {m} keys in "
                             f"tiles of {self.block_q} x {self.block_k} make {want[0]} x {want[1]} tiles")

    def _tile(self, n, m, q0, q1, k0, k1):
        i, j = np.arange(q0, q1) // self.block_q, np.arange(k0, k1) // self.block_k
        return self.blocks[i[:, None], j[None, :]]


@dataclass(frozen=True, eq=False)
class _Both(Pattern):
    """Pairs that both patterns see (``a & b``)."""

    a: Pattern
    b: Pattern

    def check(self, n: int, m: int) -> None:
        self.a.check(n, m)
        self.b.check(n, m)

    def _tile(self, n, m, q0, q1, k0, k1):
        return self.a._tile(n, m, q0, q1, k0, k1) & self.b._tile(n, m, q0, q1, k0, k1)

    def _kinds(self, n, m, block_q, block_k):
        ka, kb = self.a._kinds(n, m, block_q, block_k), self.b._kinds(n, m, block_q, block_k)
        kinds = np.where((ka == EMPTY) | (kb == EMPTY), EMPTY,
                         np.where((ka == FULL) & (kb == FULL), FULL, PARTIAL)).astype(np.int8)
        # Two partial tiles may have no visible pair in common: look at those (and only those) element by element.
        for i, j in zip(*np.nonzero((ka == PARTIAL) & (kb == PARTIAL)), strict=True):
            q0, k0 = i * block_q, j * block_k
            if not self._tile(n, m, q0, min(q0 + block_q, n), k0, min(k0 + block_k, m)).any():
                kinds[i, j] = EMPTY
        return kinds


def causal() -> Window:
    """Query i sees key j when ``j <= i + m - n`` (as :func:`flashlab.reference.causal_mask`)."""
    return Window(None, 0)


def sliding_window(left: int | None, right: int | None = 0) -> Window:
    """Query i sees the keys from ``left`` tokens before its position to ``right`` after it.

    ``sliding_window(w)`` is causal local attention over the last ``w + 1`` tokens; ``sliding_window(w, w)``
    sees ``w`` tokens on either side. A side of None has no limit; a side wider than the sequence is refused.
    """
    return Window(_check_reach(left, "left"), _check_reach(right, "right"))


def dilated(stride: int, *, left: int | None = None, right: int | None = 0) -> Window:
    """Every ``stride``-th token: query i sees key j when ``delta % stride == 0`` and ``-left <= delta <= right``.

    By default causal over the whole past (keys at the query's position, ``stride`` before it, ``2 stride``
    before, ...). The stride counts tokens, not tiles.
    """
    return Window(_check_reach(left, "left"), _check_reach(right, "right"), _check_size(stride, "stride"))


def local_global(left: int, right: int, tokens: Sequence[int]) -> LocalGlobal:
    """A sliding window ``(left, right)`` plus global tokens at the key positions ``tokens`` (e.g. ``[0]``)."""
    left, right = _check_reach(left, "left"), _check_reach(right, "right")
    if left is None or right is None:
        raise ValueError("local_global needs a bounded window: give left and right as numbers of tokens")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise TypeError(f"tokens must be a sequence of integer positions; got {tokens!r}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"global token positions must be integers; got {t!r}")
        if t < 0:
            raise ValueError(f"global token positions must be >= 0; got {t}")
    positions = sorted({int(t) for t in tokens})
    if not positions or len(positions) != len(tokens):
        raise ValueError(f"tokens must be one or more distinct positions; got {list(tokens)!r}")
    return LocalGlobal(left, right, tuple(positions))


def from_mask(mask) -> ElementMask:
    """Any element mask: an ``n x m`` boolean array, True where query i sees key j."""
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array (True where query i sees key j); got dtype {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"mask must be 2-D, (n queries, m keys); got shape {array.shape}")
    return ElementMask(array.copy())


def from_blocks(blocks, block_q: int, block_k: int) -> TileMask:
    """Any mask given per tile: a ``T_r x T_c`` boolean array, True where the whole tile is visible."""
    array = np.asarray(blocks)
    if array.dtype != np.bool_:
        raise TypeError(f"blocks must be a boolean array (True where a tile is visible); got dtype {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"blocks must be 2-D, (tiles of queries, tiles of keys); got shape {array.shape}")
    return TileMask(array.copy(), check_block(block_q, "block_q"), check_block(block_k, "block_k"))


def as_pattern(mask) -> Pattern:
    """A pattern as given, or an ``n x m`` boolean array made into one (:func:`from_mask`)."""
    if isinstance(mask, Pattern):
        return mask
    if isinstance(mask, BlockMask):
        raise TypeError("pass the pattern (e.g. blocksparse.sliding_window(...)), not its BlockMask: the tiles are "
                        "classified again for the blocks of the call")
    return from_mask(mask)
