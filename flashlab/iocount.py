"""Counting memory traffic: run attention through a model of a GPU's memory and count every element moved.

The counting model (chapter 3 derives the closed forms of :func:`predict` from it):

* **HBM** (:class:`HBM`) is the large, slow memory. An *HBM access* is one element moved between HBM and the
  chip: a *read* when it is loaded, a *write* when it is stored. Moving a ``b x d`` block costs ``b * d``
  accesses; touching an element twice costs twice.
* **SRAM** (:class:`SRAM`) is the small on-chip memory of ``M`` elements (shared memory on a GPU). It holds the
  tiles of the ``n x d`` matrices that an algorithm keeps on chip to reuse (``Q_i``, ``K_j``, ``V_j``, ``O_i``)
  and, in standard attention's softmax pass, slabs of whole rows of ``S``. Holding more than ``M`` elements at
  once raises :class:`SramOverflow`.
* **Registers** hold what is computed and consumed on the spot: the ``B_r x B_c`` score / probability tile and
  per-row statistics (running max ``m``, sum ``l``, logsumexp ``L``). They are not charged to ``M`` (in
  FlashAttention-2/3 on Hopper these tiles do live in registers, and the paper's block rule ``4 B_c d ~ M``
  budgets exactly the four ``d``-wide tiles). Their loads from and stores to HBM are still counted.
* **FLOPs** are matmul FLOPs: ``2 a b c`` for an ``(a x b) @ (b x c)`` product. ``exps`` counts exponentials.

The counter works at block granularity (a block read adds its size at once) but really moves the data: every
number an algorithm uses is copied out of an HBM array into a tile, and the output O it produces is checked
against :func:`flashlab.reference.attention`.

Algorithms (self-attention, one head: Q, K, V are ``n x d``; ``T_r = ceil(n / B_r)``, ``T_c = ceil(n / B_c)``):

* ``"standard"`` — the paper's Algorithm 0. Three passes over HBM: S = scale Q K^T is written; S is read, softmax
  applied, P written; P is read and O = P V written. The GEMM passes keep a block of ``B_r`` rows of Q (or of
  the O accumulator) in SRAM and stream ``B_c``-row blocks of K (or V) past it, so K and V are read ``T_r``
  times. The softmax holds whole rows when a row fits (``n <= M``) and reads S once; otherwise it streams
  each row twice (max and sum first, then the normalised values).
* ``"kv_outer"`` — the paper's Algorithm 1: outer loop over K/V blocks, inner loop over Q blocks; O, l and m
  live in HBM (initialised there) and are read and written back on every visit.
* ``"q_outer"`` — FlashAttention-2's order: one Q block and its O accumulator stay on chip while every K/V
  block streams past; O and L are written once.

Block-sparse attention (chapter 3, last section): the tiled orders take ``mask=``, a pattern of
:mod:`flashlab.blocksparse` (or an ``n x n`` boolean mask). Its block mask over the ``B_r x B_c`` tiles decides
what moves: an EMPTY tile is never loaded or computed, and a block of K/V (kv_outer) or of Q (q_outer) that no
computed tile needs is never loaded; PARTIAL and FULL tiles cost the same traffic and FLOPs (the element mask of
a partial tile is computed from the indices, on chip, as the causal mask is). :func:`predict` sums the per-tile
costs over the block mask; :func:`count` runs the algorithm with the tiles skipped.

The backward passes (the paper's Algorithms 3 and 4) are modelled the same way: :func:`count_backward` runs them
through the counter, :func:`predict_backward` gives their closed forms (chapter 3, section 8).

Default blocks follow the paper: ``B_c = floor(M / 4d)``, ``B_r = min(B_c, d)``. The paper writes a ceiling,
which can overshoot M by up to ``4d - 1`` elements; we round down so that the default always fits (both agree
whenever ``4d`` divides ``M``, as for every Hopper size in chapter 3). Standard attention has no such rule;
its default is ``B_r = B_c = floor(M / 2d)``, the largest square blocks whose two tiles fit, which keeps its
K/V re-reads small (the fairest comparison).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from . import blocksparse, online, reference
from ._checks import check_block

ALGORITHMS = ("standard", "kv_outer", "q_outer")


class SramOverflow(ValueError):
    """An algorithm tried to hold more than M elements in SRAM at once."""


class Counts(NamedTuple):
    """Traffic and work of one algorithm on one ``n x d`` head."""

    reads: int  # elements loaded from HBM
    writes: int  # elements stored to HBM
    flops: int  # matmul FLOPs (2 per multiply-add)
    exps: int  # exponentials evaluated
    sram_peak: int  # most elements held in SRAM at once

    @property
    def accesses(self) -> int:
        """HBM reads + writes."""
        return self.reads + self.writes


class HBM:
    """An array in slow memory that counts every element read from it and written to it."""

    def __init__(self, name: str, array: np.ndarray):
        self.name = name
        self.data = np.array(array, dtype=np.float64)
        self.reads = 0
        self.writes = 0

    def read(self, index) -> np.ndarray:
        """Copy ``data[index]`` onto the chip (into registers) and count its elements as reads."""
        tile = self.data[index].copy()
        self.reads += tile.size
        return tile

    def write(self, index, tile) -> None:
        """Store ``tile`` at ``data[index]`` and count its elements as writes."""
        target = self.data[index]  # a view: writing through it stores into HBM
        target[...] = tile
        self.writes += target.size


class SRAM:
    """On-chip memory of ``capacity`` elements: tiles are loaded into it, allocated in it and freed from it."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0
        self._held: dict[int, int] = {}

    def _hold(self, tile: np.ndarray, what: str) -> np.ndarray:
        if self.used + tile.size > self.capacity:
            raise SramOverflow(
                f"SRAM holds at most M = {self.capacity} elements: {self.used} are in use and {what} needs "
                f"{tile.size} more; choose smaller blocks"
            )
        self.used += tile.size
        self.peak = max(self.peak, self.used)
        self._held[id(tile)] = tile.size
        return tile

    def load(self, hbm: HBM, index) -> np.ndarray:
        """Read ``hbm.data[index]`` from HBM into a tile held in SRAM."""
        tile = hbm.data[index].copy()
        self._hold(tile, f"a tile of {hbm.name} {tile.shape}")
        hbm.reads += tile.size
        return tile

    def alloc(self, shape, fill: float = 0.0) -> np.ndarray:
        """A tile made on chip (no HBM traffic), e.g. an accumulator."""
        return self._hold(np.full(shape, fill), f"a new tile {tuple(shape)}")

    def free(self, *tiles: np.ndarray) -> None:
        for tile in tiles:
            self.used -= self._held.pop(id(tile))


def _check_sizes(n, d, sram) -> tuple[int, int, int]:
    for name, value in (("n", n), ("d", d), ("sram", sram)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be a positive integer; got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    return int(n), int(d), int(sram)


def default_blocks(algorithm: str, d: int, sram: int) -> tuple[int, int]:
    """``(B_r, B_c)`` when none are given: the paper's rule for the tiled orders, square halves for standard."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    if algorithm == "standard":
        if sram < 2 * d:
            raise SramOverflow(f"standard attention needs M >= 2d = {2 * d} to hold one row of Q and one of K")
        b = sram // (2 * d)
        return b, b
    if sram < 4 * d:
        raise SramOverflow(f"the paper's blocks need M >= 4d = {4 * d} (B_c = floor(M/4d) >= 1); got M = {sram}")
    b_c = sram // (4 * d)
    return min(b_c, d), b_c


def _resolve_blocks(defaults, algorithm, d, sram, block_q, block_k) -> tuple[int, int]:
    """Blocks the caller gave, the rest from DEFAULTS(algorithm, d, sram)."""
    if block_q is None or block_k is None:
        b_r, b_c = defaults(algorithm, d, sram)
        block_q = b_r if block_q is None else block_q
        block_k = b_c if block_k is None else block_k
    return check_block(block_q, "block_q"), check_block(block_k, "block_k")


def _blocks(algorithm, n, d, sram, block_q, block_k) -> tuple[int, int]:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    return _resolve_blocks(default_blocks, algorithm, d, sram, block_q, block_k)


def _sram_need(algorithm, n, d, sram, b_r, b_c) -> int:
    """Most elements the algorithm holds in SRAM at once (blocks larger than n shrink to n)."""
    r, c = min(b_r, n), min(b_c, n)
    if algorithm == "standard":
        gemm = (r + c) * d
        softmax_rows = n * min(n, sram // n) if n <= sram else 0
        return max(gemm, softmax_rows)
    return 2 * (r + c) * d


def _tiles(algorithm, n, b_r, b_c, mask) -> blocksparse.BlockMask | None:
    """The block mask of ``mask`` over the algorithm's tiles, or None for dense attention."""
    if mask is None:
        return None
    if algorithm not in ("kv_outer", "q_outer"):
        raise ValueError(f"mask= skips tiles of the tiled orders (kv_outer, q_outer); {algorithm!r} computes all of S")
    return blocksparse.as_pattern(mask).block_mask(n, n, b_r, b_c)


def _predict_sparse(algorithm, n, d, sram, tiles: blocksparse.BlockMask) -> Counts:
    """Per-tile costs summed over the computed (non-EMPTY) tiles of the block mask."""
    r, c, done = tiles.heights(), tiles.widths(), tiles.computed
    elements = int(r @ done @ c)  # score elements computed: sum of r_i c_j over computed tiles
    tile_rows = int(done.sum(axis=1) @ r)  # sum of r_i over computed tiles: rows of Q_i (and O_i, l_i, m_i) visited
    tile_cols = int(done.sum(axis=0) @ c)  # sum of c_j over computed tiles: rows of K_j and V_j streamed
    need = int(2 * d * (r[:, None] + c[None, :])[done].max()) if done.any() else 0
    if need > sram:
        raise SramOverflow(f"{algorithm} with blocks B_r={tiles.block_q}, B_c={tiles.block_k}, d={d} holds {need} "
                           f"elements > M = {sram}")
    flops, exps = 4 * d * elements, elements + tile_rows
    if algorithm == "kv_outer":
        kv_loaded = int(c[done.any(axis=0)].sum())  # key blocks some computed tile needs
        reads = 2 * d * kv_loaded + (2 * d + 2) * tile_rows
        return Counts(reads, n * d + 2 * n + (d + 2) * tile_rows, flops, exps, need)
    q_loaded = int(r[done.any(axis=1)].sum())  # query blocks that see some key
    return Counts(d * q_loaded + 2 * d * tile_cols, n * d + n, flops, exps, need)


def predict(algorithm: str, n: int, d: int, *, sram: int, block_q: int | None = None,
            block_k: int | None = None, mask=None) -> Counts:
    """Closed-form counts of ``algorithm`` on one ``n x d`` head with an SRAM of ``sram`` elements.

    Same arguments as :func:`count`; raises :class:`SramOverflow` when the blocks do not fit.
    With ``T_r = ceil(n/B_r)``, ``T_c = ceil(n/B_c)``:

    * standard:  reads ``nd + 2 T_r nd + (1 or 2) n^2 + n^2``, writes ``2 n^2 + nd``
      (S is read twice when a row does not fit, ``n > M``)
    * kv_outer:  reads ``2nd + T_c (2nd + 2n)``, writes ``(nd + 2n) (1 + T_c)``
    * q_outer:   reads ``nd + 2 T_r nd``, writes ``nd + n``

    FLOPs are ``4 n^2 d`` for all three; exps are ``n^2 + n T_c`` for the tiled orders (one rescale factor per
    row per visited tile) and for standard ``n^2`` (``2 n^2 + n T_c`` when S is streamed twice).

    With ``mask`` (tiled orders only; see the module docstring), sums over the computed tiles (i, j) of heights
    ``r_i`` and widths ``c_j``: FLOPs ``4 d sum(r_i c_j)``, exps ``sum(r_i c_j + r_i)``;
    kv_outer reads ``2d sum(c_j over needed K/V blocks) + (2d + 2) sum(r_i)``, writes ``nd + 2n + (d + 2) sum(r_i)``;
    q_outer reads ``d sum(r_i over needed Q blocks) + 2d sum(c_j)``, writes ``nd + n``. Dense attention is the
    case where every tile is computed.
    """
    n, d, sram = _check_sizes(n, d, sram)
    b_r, b_c = _blocks(algorithm, n, d, sram, block_q, block_k)
    tiles = _tiles(algorithm, n, b_r, b_c, mask)
    if tiles is not None:
        return _predict_sparse(algorithm, n, d, sram, tiles)
    need = _sram_need(algorithm, n, d, sram, b_r, b_c)
    if need > sram:
        raise SramOverflow(f"{algorithm} with blocks B_r={b_r}, B_c={b_c}, d={d} holds {need} elements > M = {sram}")
    t_r, t_c = math.ceil(n / b_r), math.ceil(n / b_c)
    nd, nn = n * d, n * n
    flops = 4 * nn * d
    if algorithm == "standard":
        if n <= sram:
            return Counts(nd + 2 * t_r * nd + nn + nn, 2 * nn + nd, flops, nn, need)
        return Counts(nd + 2 * t_r * nd + 2 * nn + nn, 2 * nn + nd, flops, 2 * nn + n * t_c, need)
    exps = nn + n * t_c
    if algorithm == "kv_outer":
        return Counts(2 * nd + t_c * (2 * nd + 2 * n), (nd + 2 * n) * (1 + t_c), flops, exps, need)
    return Counts(nd + 2 * t_r * nd, nd + n, flops, exps, need)


# --- the algorithms, moving real data through HBM and SRAM -------------------------------------------------


class _Tally:
    def __init__(self):
        self.flops = 0
        self.exps = 0

    def matmul(self, a, b):
        self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b


def _ranges(n, b):
    return [(lo, min(lo + b, n)) for lo in range(0, n, b)]


def _standard(hbm, sram, tally, n, d, b_r, b_c, scale):
    Q, K, V, S, O = hbm["Q"], hbm["K"], hbm["V"], hbm["S"], hbm["O"]
    rows, cols = _ranges(n, b_r), _ranges(n, b_c)
    # Pass 1: S = scale Q K^T, written to HBM tile by tile.
    for r0, r1 in rows:
        Qi = sram.load(Q, np.s_[r0:r1])
        for c0, c1 in cols:
            Kj = sram.load(K, np.s_[c0:c1])
            S.write(np.s_[r0:r1, c0:c1], scale * tally.matmul(Qi, Kj.T))
            sram.free(Kj)
        sram.free(Qi)
    # Pass 2: P = softmax(S), in place of S (P is a new matrix in HBM, S's storage reused).
    if n <= sram.capacity:
        slab = max(1, min(n, sram.capacity // n))
        for r0, r1 in _ranges(n, slab):
            Si = sram.load(S, np.s_[r0:r1])
            Pi = np.exp(Si - Si.max(axis=1, keepdims=True))
            tally.exps += Pi.size
            S.write(np.s_[r0:r1], Pi / Pi.sum(axis=1, keepdims=True))
            sram.free(Si)
    else:
        # A row does not fit: stream it twice, first for its max and sum (online), then to normalise.
        for r0, r1 in rows:
            state = online.init((r1 - r0,), None)
            for c0, c1 in cols:
                Sij = S.read(np.s_[r0:r1, c0:c1])
                state = online.update(state, Sij, np.zeros(c1 - c0))
                tally.exps += Sij.size + (r1 - r0)
            for c0, c1 in cols:
                Sij = S.read(np.s_[r0:r1, c0:c1])
                S.write(np.s_[r0:r1, c0:c1], np.exp(Sij - state.m[:, None]) / state.l[:, None])
                tally.exps += Sij.size
    # Pass 3: O = P V.
    for r0, r1 in rows:
        Oi = sram.alloc((r1 - r0, d))
        for c0, c1 in cols:
            Vj = sram.load(V, np.s_[c0:c1])
            Oi += tally.matmul(S.read(np.s_[r0:r1, c0:c1]), Vj)
            sram.free(Vj)
        O.write(np.s_[r0:r1], Oi)
        sram.free(Oi)


def _tile_update(tally, state, Qi, Kj, Vj, scale, keep=None):
    Sij = scale * tally.matmul(Qi, Kj.T)
    if keep is not None:  # a PARTIAL tile: its element mask, computed on chip from the indices
        Sij = np.where(keep, Sij, -np.inf)
    tally.exps += Sij.size + Sij.shape[0]  # the tile's exps and one rescale factor per row
    tally.flops += 2 * Sij.size * Vj.shape[1]  # P_ij V_j, done inside online.update
    return online.update(state, Sij, Vj)


def _computed(tiles, i, j) -> bool:
    return tiles is None or tiles.kinds[i, j] != blocksparse.EMPTY


def _keep(tiles, i, j):
    """The element mask of a PARTIAL tile; None for a FULL one (no mask applied)."""
    if tiles is None or tiles.kinds[i, j] == blocksparse.FULL:
        return None
    return tiles.tile_mask(i, j)


def _kv_outer(hbm, sram, tally, n, d, b_r, b_c, scale, tiles=None):
    Q, K, V, O, l, m = (hbm[k] for k in ("Q", "K", "V", "O", "l", "m"))
    O.write(np.s_[:], np.zeros((n, d)))
    l.write(np.s_[:], np.zeros(n))
    m.write(np.s_[:], np.full(n, -np.inf))
    rows = list(enumerate(_ranges(n, b_r)))
    for j, (c0, c1) in enumerate(_ranges(n, b_c)):
        visits = [(i, r) for i, r in rows if _computed(tiles, i, j)]
        if not visits:
            continue  # no query sees these keys: K_j and V_j are never loaded
        Kj, Vj = sram.load(K, np.s_[c0:c1]), sram.load(V, np.s_[c0:c1])
        for i, (r0, r1) in visits:
            Qi, Oi = sram.load(Q, np.s_[r0:r1]), sram.load(O, np.s_[r0:r1])
            li, mi = l.read(np.s_[r0:r1]), m.read(np.s_[r0:r1])
            state = _tile_update(tally, online.State(mi, li, Oi * li[:, None]), Qi, Kj, Vj, scale, _keep(tiles, i, j))
            O.write(np.s_[r0:r1], state.result())
            l.write(np.s_[r0:r1], state.l)
            m.write(np.s_[r0:r1], state.m)
            sram.free(Qi, Oi)
        sram.free(Kj, Vj)


def _q_outer(hbm, sram, tally, n, d, b_r, b_c, scale, tiles=None):
    Q, K, V, O, L = (hbm[k] for k in ("Q", "K", "V", "O", "L"))
    cols = list(enumerate(_ranges(n, b_c)))
    for i, (r0, r1) in enumerate(_ranges(n, b_r)):
        visits = [(j, c) for j, c in cols if _computed(tiles, i, j)]
        if not visits:  # these queries see no key: O_i = 0 and L_i = -inf, Q_i is never loaded
            O.write(np.s_[r0:r1], np.zeros((r1 - r0, d)))
            L.write(np.s_[r0:r1], np.full(r1 - r0, -np.inf))
            continue
        Qi, Oi = sram.load(Q, np.s_[r0:r1]), sram.alloc((r1 - r0, d))
        state = online.State(np.full(r1 - r0, -np.inf), np.zeros(r1 - r0), Oi)
        for j, (c0, c1) in visits:
            Kj, Vj = sram.load(K, np.s_[c0:c1]), sram.load(V, np.s_[c0:c1])
            state = _tile_update(tally, state, Qi, Kj, Vj, scale, _keep(tiles, i, j))
            sram.free(Kj, Vj)
        O.write(np.s_[r0:r1], state.result())
        L.write(np.s_[r0:r1], state.logsumexp())
        sram.free(Qi, Oi)


_RUNNERS = {"standard": _standard, "kv_outer": _kv_outer, "q_outer": _q_outer}


def run(algorithm: str, Q, K, V, *, sram: int, block_q: int | None = None,
        block_k: int | None = None, mask=None) -> tuple[np.ndarray, Counts]:
    """Run ``algorithm`` on one head (Q, K, V all ``n x d``) through HBM and an SRAM of ``sram`` elements.

    ``mask`` (tiled orders only) is a :mod:`flashlab.blocksparse` pattern or an ``n x n`` boolean mask: EMPTY
    tiles are skipped. Returns ``(O, counts)``. Raises :class:`SramOverflow` if the blocks make it hold more
    than ``sram``.
    """
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    if Q.ndim != 2 or Q.shape != K.shape or Q.shape != V.shape:
        raise ValueError(f"run() counts one head: Q, K and V must all be (n, d); got {Q.shape}, {K.shape}, {V.shape}")
    n, d = Q.shape
    n, d, sram = _check_sizes(n, d, sram)
    b_r, b_c = _blocks(algorithm, n, d, sram, block_q, block_k)
    tiles = _tiles(algorithm, n, b_r, b_c, mask)
    hbm = {"Q": HBM("Q", Q), "K": HBM("K", K), "V": HBM("V", V), "O": HBM("O", np.zeros((n, d)))}
    if algorithm == "standard":
        hbm["S"] = HBM("S", np.zeros((n, n)))
    elif algorithm == "kv_outer":
        hbm["l"], hbm["m"] = HBM("l", np.zeros(n)), HBM("m", np.zeros(n))
    else:
        hbm["L"] = HBM("L", np.zeros(n))
    chip, tally = SRAM(sram), _Tally()
    args = (hbm, chip, tally, n, d, b_r, b_c, 1.0 / math.sqrt(d))
    if tiles is None:
        _RUNNERS[algorithm](*args)
    else:
        _RUNNERS[algorithm](*args, tiles)
    if chip.used != 0:
        raise RuntimeError(f"{algorithm} left {chip.used} elements in SRAM")  # a bug in this module, not the caller's
    reads = sum(a.reads for a in hbm.values())
    writes = sum(a.writes for a in hbm.values())
    return hbm["O"].data, Counts(reads, writes, tally.flops, tally.exps, chip.peak)


def count(algorithm: str, n: int, d: int, *, sram: int, block_q: int | None = None,
          block_k: int | None = None, seed: int = 0, mask=None) -> Counts:
    """Count the HBM reads and writes, FLOPs and exps of ``algorithm`` on random ``n x d`` Q, K, V.

    ``algorithm`` is "standard", "kv_outer" or "q_outer"; ``sram`` is M in elements; blocks default to the
    paper's (see the module docstring); ``mask`` as for :func:`run`. The output O is checked against the float64
    reference (with the same mask), so a count always belongs to a run that computed attention correctly.
    """
    n, d, sram = _check_sizes(n, d, sram)
    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((n, d)) for _ in range(3))
    O, counts = run(algorithm, Q, K, V, sram=sram, block_q=block_q, block_k=block_k, mask=mask)
    O_ref, _ = reference.attention(Q, K, V, mask=mask)
    err = np.abs(O - O_ref).max()
    if not err <= 1e-12:
        raise RuntimeError(f"{algorithm} computed a wrong O through the counter (max error {err:.3g})")
    return counts


# --- the backward pass -------------------------------------------------------------------------------------

BACKWARD_ALGORITHMS = ("standard", "kv_outer")


def default_blocks_backward(algorithm: str, d: int, sram: int) -> tuple[int, int]:
    """``(B_r, B_c)`` for the backward when none are given.

    Standard attention keeps its forward blocks. The paper's Algorithm 4 reuses the forward's rule, but it holds
    eight tiles at once (K_j, V_j, dK_j, dV_j and Q_i, O_i, dO_i, dQ_i): ``4 (B_r + B_c) d``, twice the forward's.
    So that they fit, we take ``B_r = min(floor(M / 8d), d)`` and ``B_c = floor(M / 4d) - B_r``.
    """
    if algorithm not in BACKWARD_ALGORITHMS:
        raise ValueError(f"the backward is modelled for {BACKWARD_ALGORITHMS}; got {algorithm!r}")
    if algorithm == "standard":
        return default_blocks("standard", d, sram)
    if sram < 8 * d:
        raise SramOverflow(f"the tiled backward needs M >= 8d = {8 * d} to hold its eight tiles; got M = {sram}")
    b_r = min(sram // (8 * d), d)
    return b_r, sram // (4 * d) - b_r


def _backward_blocks(algorithm, d, sram, block_q, block_k) -> tuple[int, int]:
    if algorithm not in BACKWARD_ALGORITHMS:
        raise ValueError(f"the backward is modelled for {BACKWARD_ALGORITHMS}; got {algorithm!r}")
    return _resolve_blocks(default_blocks_backward, algorithm, d, sram, block_q, block_k)


def _backward_sram_need(algorithm, n, d, sram, b_r, b_c) -> int:
    r, c = min(b_r, n), min(b_c, n)
    if algorithm == "standard":
        rows = 2 * n * min(n, sram // (2 * n)) if 2 * n <= sram else 0  # slabs of rows of P and dP together
        return max((r + r) * d, rows)  # its GEMM passes use square blocks of B_r rows
    return 4 * (r + c) * d


def predict_backward(algorithm: str, n: int, d: int, *, sram: int, block_q: int | None = None,
                     block_k: int | None = None) -> Counts:
    """Closed-form counts of the backward pass on one ``n x d`` head; :func:`count_backward` runs it.

    The forward's results (P for standard attention; O, l, m for the tiled one) and dO are already in HBM.

    * ``"standard"`` — the paper's Algorithm 3 in five passes, each GEMM blocked like the forward's (blocks of
      ``B = block_q`` rows, ``T = ceil(n / B)``): dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)) with
      rows of P and dP held together when ``2n <= M`` (else both are streamed twice); dQ = scale dS K;
      dK = scale dS^T Q. Reads ``5 n^2 + nd + 4 T nd`` (``+ 2 n^2`` when ``2n > M``), writes ``2 n^2 + 3 nd``,
      FLOPs ``8 n^2 d``.
    * ``"kv_outer"`` — the paper's Algorithm 4: dQ, dK, dV initialised in HBM; for each K/V block (loaded once,
      dK_j and dV_j accumulated on chip and written once) every Q block streams past with O_i, dO_i, dQ_i, l_i
      and m_i; P_ij is recomputed and dQ_i written back. Reads ``2nd + T_c (4nd + 2n)``, writes
      ``3nd + 2nd + T_c nd``, FLOPs ``10 n^2 d`` (2.5 times the forward's ``4 n^2 d``), exps ``n^2``.
    """
    n, d, sram = _check_sizes(n, d, sram)
    b_r, b_c = _backward_blocks(algorithm, d, sram, block_q, block_k)
    need = _backward_sram_need(algorithm, n, d, sram, b_r, b_c)
    if need > sram:
        raise SramOverflow(f"{algorithm} backward with B_r={b_r}, B_c={b_c}, d={d} holds {need} elements > M = {sram}")
    nd, nn = n * d, n * n
    if algorithm == "standard":
        t = math.ceil(n / b_r)
        extra = 0 if 2 * n <= sram else 2 * nn
        return Counts(5 * nn + nd + 4 * t * nd + extra, 2 * nn + 3 * nd, 8 * nn * d, 0, need)
    t_c = math.ceil(n / b_c)
    return Counts(2 * nd + t_c * (4 * nd + 2 * n), 5 * nd + t_c * nd, 10 * nn * d, nn, need)


def _standard_backward(hbm, sram, tally, n, d, b, scale):
    Q, K, V, P, dO, dP, dS, dQ, dK, dV = (hbm[k] for k in ("Q", "K", "V", "P", "dO", "dP", "dS", "dQ", "dK", "dV"))
    blocks = _ranges(n, b)
    for c0, c1 in blocks:  # dV = P^T dO: a dV block stays on chip while dO streams past
        acc = sram.alloc((c1 - c0, d))
        for r0, r1 in blocks:
            dOi = sram.load(dO, np.s_[r0:r1])
            acc += tally.matmul(P.read(np.s_[r0:r1, c0:c1]).T, dOi)
            sram.free(dOi)
        dV.write(np.s_[c0:c1], acc)
        sram.free(acc)
    for r0, r1 in blocks:  # dP = dO V^T
        dOi = sram.load(dO, np.s_[r0:r1])
        for c0, c1 in blocks:
            Vj = sram.load(V, np.s_[c0:c1])
            dP.write(np.s_[r0:r1, c0:c1], tally.matmul(dOi, Vj.T))
            sram.free(Vj)
        sram.free(dOi)
    if 2 * n <= sram.capacity:  # dS = P * (dP - rowsum(P * dP)), rows of P and dP held together
        slab = max(1, min(n, sram.capacity // (2 * n)))
        for r0, r1 in _ranges(n, slab):
            Pi, dPi = sram.load(P, np.s_[r0:r1]), sram.load(dP, np.s_[r0:r1])
            dS.write(np.s_[r0:r1], Pi * (dPi - np.sum(Pi * dPi, axis=1, keepdims=True)))
            sram.free(Pi, dPi)
    else:  # rows too long: one sweep for the row sums, one to write dS
        for r0, r1 in blocks:
            D = np.zeros(r1 - r0)
            for c0, c1 in blocks:
                D += np.sum(P.read(np.s_[r0:r1, c0:c1]) * dP.read(np.s_[r0:r1, c0:c1]), axis=1)
            for c0, c1 in blocks:
                tile = np.s_[r0:r1, c0:c1]
                dS.write(tile, P.read(tile) * (dP.read(tile) - D[:, None]))
    for r0, r1 in blocks:  # dQ = scale dS K
        acc = sram.alloc((r1 - r0, d))
        for c0, c1 in blocks:
            Kj = sram.load(K, np.s_[c0:c1])
            acc += tally.matmul(dS.read(np.s_[r0:r1, c0:c1]), Kj)
            sram.free(Kj)
        dQ.write(np.s_[r0:r1], scale * acc)
        sram.free(acc)
    for c0, c1 in blocks:  # dK = scale dS^T Q
        acc = sram.alloc((c1 - c0, d))
        for r0, r1 in blocks:
            Qi = sram.load(Q, np.s_[r0:r1])
            acc += tally.matmul(dS.read(np.s_[r0:r1, c0:c1]).T, Qi)
            sram.free(Qi)
        dK.write(np.s_[c0:c1], scale * acc)
        sram.free(acc)


def _kv_outer_backward(hbm, sram, tally, n, d, b_r, b_c, scale):
    Q, K, V, O, dO, l, m, dQ, dK, dV = (hbm[k] for k in ("Q", "K", "V", "O", "dO", "l", "m", "dQ", "dK", "dV"))
    for grad in (dQ, dK, dV):  # Algorithm 4, line 4: initialise in HBM
        grad.write(np.s_[:], np.zeros((n, d)))
    for c0, c1 in _ranges(n, b_c):
        Kj, Vj = sram.load(K, np.s_[c0:c1]), sram.load(V, np.s_[c0:c1])
        dKj, dVj = sram.alloc((c1 - c0, d)), sram.alloc((c1 - c0, d))
        for r0, r1 in _ranges(n, b_r):
            Qi, Oi = sram.load(Q, np.s_[r0:r1]), sram.load(O, np.s_[r0:r1])
            dOi, dQi = sram.load(dO, np.s_[r0:r1]), sram.load(dQ, np.s_[r0:r1])
            li, mi = l.read(np.s_[r0:r1]), m.read(np.s_[r0:r1])
            Pij = np.exp(scale * tally.matmul(Qi, Kj.T) - mi[:, None]) / li[:, None]  # recomputed, never stored
            tally.exps += Pij.size
            dVj += tally.matmul(Pij.T, dOi)
            dSij = Pij * (tally.matmul(dOi, Vj.T) - np.sum(dOi * Oi, axis=1, keepdims=True))
            dQi += scale * tally.matmul(dSij, Kj)
            dKj += scale * tally.matmul(dSij.T, Qi)
            dQ.write(np.s_[r0:r1], dQi)
            sram.free(Qi, Oi, dOi, dQi)
        dK.write(np.s_[c0:c1], dKj)
        dV.write(np.s_[c0:c1], dVj)
        sram.free(Kj, Vj, dKj, dVj)


def count_backward(algorithm: str, n: int, d: int, *, sram: int, block_q: int | None = None,
                   block_k: int | None = None, seed: int = 0) -> Counts:
    """Run the backward of ``algorithm`` ("standard" or "kv_outer") through HBM and SRAM and count it.

    Random Q, K, V, dO; the forward's results are put in HBM uncounted (P for standard attention; O, l, m for
    the tiled one). The gradients are checked against :func:`flashlab.reference.attention_backward`.
    """
    n, d, sram = _check_sizes(n, d, sram)
    b_r, b_c = _backward_blocks(algorithm, d, sram, block_q, block_k)
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((n, d)) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    S = scale * (Q @ K.T)
    row_max = S.max(axis=1)
    row_sum = np.exp(S - row_max[:, None]).sum(axis=1)
    P = np.exp(S - row_max[:, None]) / row_sum[:, None]
    hbm = {name: HBM(name, x) for name, x in (("Q", Q), ("K", K), ("V", V), ("dO", dO))}
    for name in ("dQ", "dK", "dV"):
        hbm[name] = HBM(name, np.zeros((n, d)))
    if algorithm == "standard":
        hbm.update(P=HBM("P", P), dP=HBM("dP", np.zeros((n, n))), dS=HBM("dS", np.zeros((n, n))))
    else:
        hbm.update(O=HBM("O", P @ V), l=HBM("l", row_sum), m=HBM("m", row_max))
    chip, tally = SRAM(sram), _Tally()
    if algorithm == "standard":
        _standard_backward(hbm, chip, tally, n, d, b_r, scale)
    else:
        _kv_outer_backward(hbm, chip, tally, n, d, b_r, b_c, scale)
    if chip.used != 0:
        raise RuntimeError(f"{algorithm} backward left {chip.used} elements in SRAM")
    want = reference.attention_backward(Q, K, V, dO)
    err = max(np.abs(hbm[g].data - w).max() for g, w in zip(("dQ", "dK", "dV"), want, strict=True))
    if not err <= 1e-11:
        raise RuntimeError(f"{algorithm} backward computed wrong gradients through the counter (max error {err:.3g})")
    reads = sum(a.reads for a in hbm.values())
    writes = sum(a.writes for a in hbm.values())
    return Counts(reads, writes, tally.flops, tally.exps, chip.peak)
