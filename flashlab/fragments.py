"""A warp's tensor-core work, emulated in NumPy: fragments, ``mma.sync``, shuffles, shared-memory banks.

Chapter 7 draws the maps and builds the rest step by step in its cells; lab 07 grades against them (its first
question asks for the maps of Turing's ``mma.sync.m16n8k8``, which its grader holds: :func:`mma` runs them too).
Everything is per *lane*: a warp's registers are an array whose first axis is the lane (0..31), so one NumPy
operation acts on all 32 lanes at once, as one warp instruction does.

* :func:`a_positions`, :func:`b_positions`, :func:`c_positions` — which elements of the A (16×16), B (16×8) and
  C/D (16×8) operands of ``mma.sync.aligned.m16n8k16.row.col`` each lane holds, in register order (the PTX
  manual's figures). With ``g = lane // 4`` (the lane's *group*) and ``t = lane % 4`` (its place in the group).
* :func:`gather`, :func:`scatter` — a matrix to per-lane fragments and back, through any such map;
  :func:`ldmatrix_x4` — ``ldmatrix.x4``: four 8×8 matrices from shared memory into those registers;
  :func:`mma` — one warp-wide ``D = A B + C`` on per-lane fragments; :func:`warp_tile` — chapter 7's inner loop
  of rung 3 for one warp and one key tile (S by ``mma``, softmax on fragments, O = P V by ``mma``).
* :func:`shfl_xor` — ``__shfl_xor_sync``: every lane reads the value of lane ``lane ^ offset``;
  :func:`softmax_tile` — one tile of the online softmax on S fragments (row max and sum, rescaled state).
* :func:`passes` — how many passes (wavefronts) a shared-memory request needs with 32 banks of 4 bytes;
  :func:`swizzle`, :func:`chunk_address`, :func:`phase_passes` — the XOR swizzle of rung 4 and the passes of
  every ``ldmatrix`` phase of a tile stored with any swizzle.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

LANES = 32
#: Shared memory: 32 banks of 4-byte words.
BANKS, WORD_BYTES = 32, 4
#: ``ldmatrix`` reads 8 rows of 16 bytes (8 halves) per phase: one such 16-byte piece is a *chunk*.
CHUNK_BYTES = 16

Positions = list[tuple[int, int]]
PositionMap = Callable[[int], Sequence[tuple[int, int]]]


# ----------------------------------------------------------------------------------------- fragment layouts
def a_positions(lane: int) -> Positions:
    """(row, k) of the 8 halves of A (16 × 16) that ``lane`` holds: a0..a3, two halves per register."""
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]


def b_positions(lane: int) -> Positions:
    """(k, column) of the 4 halves of B (16 × 8) that ``lane`` holds: b0, b1, two halves per register."""
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def c_positions(lane: int) -> Positions:
    """(row, column) of the 4 floats of C and D (16 × 8) that ``lane`` holds: c0..c3."""
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


SHAPES = {"A": (16, 16), "B": (16, 8), "C": (16, 8)}


def gather(M: np.ndarray, where: PositionMap) -> np.ndarray:
    """Per-lane fragments of ``M``: row ``lane`` holds ``M`` at ``where(lane)``, in register order."""
    M = np.asarray(M)
    return np.array([[M[r, c] for r, c in where(lane)] for lane in range(LANES)])


def scatter(frags: np.ndarray, where: PositionMap, shape: tuple[int, int]) -> np.ndarray:
    """The matrix of ``shape`` whose per-lane fragments are ``frags`` (the inverse of :func:`gather`).

    Elements that no lane holds stay nan, so a map that misses some shows them.
    """
    M = np.full(shape, np.nan)
    for lane in range(LANES):
        for (r, c), x in zip(where(lane), frags[lane], strict=True):
            M[r, c] = x
    return M


def owners(where: PositionMap, shape: tuple[int, int]) -> np.ndarray:
    """For each element of a ``shape`` operand, the lane that holds it under ``where`` (-1: no lane, -2: several)."""
    out = np.full(shape, -1)
    for lane in range(LANES):
        for r, c in where(lane):
            out[r, c] = lane if out[r, c] == -1 else -2
    return out


def show_layout(where: PositionMap, shape: tuple[int, int]) -> str:
    """The operand as a grid of ``lane:register`` labels, one row per line (the PTX manual's figures, in text).

    `` ?  `` marks an element no lane holds, `` !! `` one that several lanes claim; positions outside the operand
    (a wrong map) are listed under the grid rather than raising, so that a wrong map can be looked at."""
    labels = np.full(shape, " ?  ", dtype=object)
    outside = []
    for lane in range(LANES):
        for reg, (r, c) in enumerate(where(lane)):
            if not (0 <= r < shape[0] and 0 <= c < shape[1]):
                outside.append(f"lane {lane} value {reg} at ({r}, {c})")
                continue
            labels[r, c] = f"{lane:2d}:{reg}" if labels[r, c] == " ?  " else " !! "
    head = "     " + "".join(f"{c:^6d}" for c in range(shape[1]))
    lines = [head] + [f"{r:3d}  " + "".join(f"{x:^6}" for x in labels[r]) for r in range(shape[0])]
    if outside:
        shown = ", ".join(outside[:8]) + (f" and {len(outside) - 8} more" if len(outside) > 8 else "")
        lines.append(f"outside the {shape[0]} x {shape[1]} operand: {shown}")
    return "\n".join(lines)


def mma(a_frags: np.ndarray, b_frags: np.ndarray, c_frags: np.ndarray,
        maps: tuple[PositionMap, PositionMap, PositionMap] | None = None) -> np.ndarray:
    """One warp-wide ``mma.sync.m16n8k16``: per-lane fragments of A (32, 8), B (32, 4), C (32, 4) in, D (32, 4) out.

    The hardware reads every register through its fixed layout (:func:`a_positions` ...), whatever the program
    meant to put there. ``maps`` = (A's, B's, C's) emulates another m16n8 shape through that shape's layout: k is
    read from A's fragments (4 halves per lane: k = 8, Turing's ``m16n8k8``, whose maps lab 07's grader holds).
    """
    a_map, b_map, c_map = maps or (a_positions, b_positions, c_positions)
    a_frags = np.asarray(a_frags, dtype=np.float64)
    k = a_frags.shape[1] * LANES // 16
    A = scatter(a_frags, a_map, (16, k))
    B = scatter(np.asarray(b_frags, dtype=np.float64), b_map, (k, 8))
    C = scatter(np.asarray(c_frags, dtype=np.float64), c_map, SHAPES["C"])
    return gather(A @ B + C, c_map)


def ldmatrix_x4(tile: np.ndarray, rows_chunks: np.ndarray) -> np.ndarray:
    """``ldmatrix.sync.aligned.m8n8.x4.b16`` from a tile of 16-bit values (rows × 8·chunks), for every lane at once.

    Each lane supplies the address of one 16-byte row piece: ``rows_chunks[lane] = (row, chunk)`` names halves
    ``tile[row, 8 chunk : 8 chunk + 8]``. Lanes 8j .. 8j + 7 supply the 8 rows of matrix j (j = 0..3), and matrix
    j arrives in register j of every lane: lane ``4g + t`` gets halves 2t and 2t + 1 of the row supplied by lane
    8j + g. Returns (32, 8): each lane's 4 registers, two halves each, in the order of :func:`a_positions`.
    """
    tile = np.asarray(tile)
    rc = np.asarray(rows_chunks)
    if rc.shape != (LANES, 2):
        raise ValueError(f"ldmatrix takes one (row, chunk) per lane: shape (32, 2), got {rc.shape}")
    rows = [tile[int(r), 8 * int(c):8 * int(c) + 8] for r, c in rc]
    if any(len(x) != 8 for x in rows) or (rc < 0).any():
        raise IndexError("an ldmatrix row address lies outside the tile")
    out = np.zeros((LANES, 8), dtype=tile.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        for j in range(4):
            out[lane, 2 * j:2 * j + 2] = rows[8 * j + g][2 * t:2 * t + 2]
    return out


# ----------------------------------------------------------------------------------------- warp shuffles
def shfl_xor(values: np.ndarray, offset: int) -> np.ndarray:
    """``__shfl_xor_sync(0xffffffff, v, offset)`` for every lane at once: lane ``i`` gets lane ``i ^ offset``'s value.

    ``values`` has the lane as its first axis (32 rows); the result has the same shape.
    """
    values = np.asarray(values)
    if values.shape[:1] != (LANES,):
        raise ValueError(f"shfl_xor takes one value (or row of values) per lane: shape (32, ...), got {values.shape}")
    if not 0 <= int(offset) < LANES:
        raise ValueError(f"a lane offset is 0..31, got {offset}")
    return values[np.arange(LANES) ^ int(offset)]


def _rows_of_fragments(s: np.ndarray) -> np.ndarray:
    """S fragments (32, tiles, 4) as the 16 × (8·tiles) matrix they hold (C layout per 8-column tile)."""
    s = np.asarray(s, dtype=np.float64)
    return np.concatenate([scatter(s[:, nt], c_positions, SHAPES["C"]) for nt in range(s.shape[1])], axis=1)


def _fragments_of_rows(M: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_rows_of_fragments`: a 16 × (8·tiles) matrix as (32, tiles, 4) fragments."""
    return np.stack([gather(M[:, 8 * nt:8 * nt + 8], c_positions) for nt in range(M.shape[1] // 8)], axis=1)


def row_state(x: np.ndarray) -> np.ndarray:
    """Per-lane copies (32, 2) of a per-row quantity of 16 rows: lane ``4g + t`` holds rows g and g + 8."""
    x = np.asarray(x, dtype=np.float64)
    g = np.arange(LANES) // 4
    return np.stack([x[g], x[g + 8]], axis=1)


def _per_row(x: np.ndarray) -> np.ndarray:
    """The 16 per-row values of a (32, 2) per-lane state, read from the first lane of each quad."""
    x = np.asarray(x, dtype=np.float64)
    return np.concatenate([x[0::4, 0], x[0::4, 1]])


def softmax_tile(s: np.ndarray, m: np.ndarray, l: np.ndarray,  # noqa: E741 - the paper's name
                 o: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One key tile of the online softmax on a warp's fragments, computed row by row in NumPy (the truth).

    ``s`` (32, tiles, 4): the lane's scores in C layout, one 8-key tile per middle index (values 0, 1 in row g,
    values 2, 3 in row g + 8; -inf for a masked key). ``m``, ``l`` (32, 2): the running max and sum of rows g and
    g + 8 before this tile (the same in the 4 lanes of a quad). ``o`` (32, dv/8, 4): the unnormalised output
    accumulators, C layout. Returns ``p = exp(s - m_new)`` (32, tiles, 4), ``m_new``, ``l_new = alpha·l +
    rowsum(p)`` and ``o·alpha``, with ``alpha = exp(m - m_new)``; a row that has seen only masked keys keeps
    ``m = -inf``, ``l = 0``, ``o = 0`` and gets ``p = 0``.
    """
    S = _rows_of_fragments(s)  # 16 x keys
    m_rows, l_rows = _per_row(m), _per_row(l)
    m_new = np.maximum(m_rows, S.max(axis=1))
    safe = np.where(np.isneginf(m_new), 0.0, m_new)             # a row with no key yet: exp(-inf - 0) = 0
    alpha = np.exp(m_rows - safe)
    P = np.exp(S - safe[:, None])
    l_new = alpha * l_rows + P.sum(axis=1)
    o = np.asarray(o, dtype=np.float64)
    o_new = o * row_state(alpha)[:, None, [0, 0, 1, 1]]
    return _fragments_of_rows(P), row_state(m_new), row_state(l_new), o_new


def warp_tile(Q16: np.ndarray, Kt: np.ndarray, Vt: np.ndarray, scale: float) -> np.ndarray:
    """Rung 3's inner loop for one warp and one key tile, on fragments: S = Q K^T by :func:`mma`, the softmax with
    quad reductions by :func:`shfl_xor`, P rounded to fp16, O = P V by :func:`mma`, divided by the row sums.

    ``Q16`` (16, d), ``Kt`` and ``Vt`` (keys, d) with d and keys multiples of 16. Returns O (16, d).
    """
    dd, bc = Q16.shape[1], Kt.shape[0]
    S = np.zeros((LANES, bc // 8, 4))
    for nt in range(bc // 8):
        for kk in range(dd // 16):
            a = gather(Q16[:, 16 * kk:16 * kk + 16], a_positions)
            b = gather(Kt[8 * nt:8 * nt + 8, 16 * kk:16 * kk + 16].T, b_positions)
            S[:, nt] = mma(a, b, S[:, nt])
    s = S * scale
    row_max = np.stack([s[:, :, 0:2].max(axis=(1, 2)), s[:, :, 2:4].max(axis=(1, 2))], axis=1)
    for offset in (1, 2):  # the four lanes of a quad hold the same two rows
        row_max = np.maximum(row_max, shfl_xor(row_max, offset))
    p = np.exp(s - row_max[:, None, [0, 0, 1, 1]])
    row_sum = np.stack([p[:, :, 0:2].sum(axis=(1, 2)), p[:, :, 2:4].sum(axis=(1, 2))], axis=1)
    for offset in (1, 2):
        row_sum = row_sum + shfl_xor(row_sum, offset)
    p16 = p.astype(np.float16).astype(np.float64)  # P is rounded to fp16 for the tensor cores
    O = np.zeros((LANES, dd // 8, 4))
    for kk in range(bc // 16):
        a = np.concatenate([p16[:, 2 * kk], p16[:, 2 * kk + 1]], axis=1)  # two C tiles of S are one A operand of P
        for nt in range(dd // 8):
            b = gather(Vt[16 * kk:16 * kk + 16, 8 * nt:8 * nt + 8], b_positions)
            O[:, nt] = mma(a, b, O[:, nt])
    O = O / row_sum[:, None, [0, 0, 1, 1]]
    return np.concatenate([scatter(O[:, nt], c_positions, SHAPES["C"]) for nt in range(dd // 8)], axis=1)


# ------------------------------------------------------------------------------------ shared-memory banks
def passes(byte_addresses: Sequence[int], width: int = 4) -> int:
    """Passes (wavefronts) one shared-memory request needs: the most distinct 4-byte words any one bank delivers.

    ``byte_addresses`` are the start addresses of the lanes' accesses, each ``width`` bytes wide (4 for a 32-bit
    load, 16 for a row of ``ldmatrix``). Lanes that read the same word share it (a broadcast).
    """
    words_by_bank: dict[int, set[int]] = {}
    for a in byte_addresses:
        for k in range(0, width, WORD_BYTES):
            word = (int(a) + k) // WORD_BYTES
            words_by_bank.setdefault(word % BANKS, set()).add(word)
    return max(len(w) for w in words_by_bank.values())


def swizzle(row: int | np.ndarray, chunk: int | np.ndarray) -> int | np.ndarray:
    """Rung 4's XOR swizzle: 16-byte chunk ``chunk`` of tile row ``row`` is stored at chunk ``chunk ^ (row % 8)``.

    Works elementwise on integer arrays too.
    """
    return chunk ^ (row % 8)


def chunk_address(row: int, chunk: int, swizzle: Callable[[int, int], int] | None = None, d: int = 128) -> int:
    """Byte address (from the tile's start) of 16-byte chunk ``chunk`` of row ``row`` of a tile of fp16 rows of
    ``d`` halves, stored with ``swizzle(row, chunk)`` (None: row-major, no swizzle)."""
    stored = chunk if swizzle is None else swizzle(row, chunk)
    return row * d * 2 + int(stored) * CHUNK_BYTES


def phase_passes(swizzle: Callable[[int, int], int] | None, rows: int = 64, d: int = 128) -> np.ndarray:
    """Passes of every ``ldmatrix`` phase of a ``rows`` × ``d`` fp16 tile stored with ``swizzle``.

    A phase reads one logical chunk from 8 consecutive rows (rows 8i .. 8i + 7): entry ``[i, c]`` is the passes of
    the phase of row block ``i`` and chunk ``c``.
    """
    chunks = d * 2 // CHUNK_BYTES
    out = np.zeros((rows // 8, chunks), dtype=int)
    for i in range(rows // 8):
        for c in range(chunks):
            out[i, c] = passes([chunk_address(r, c, swizzle, d) for r in range(8 * i, 8 * i + 8)], width=CHUNK_BYTES)
    return out
