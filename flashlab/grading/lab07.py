"""Lab 07 — the tensor cores, practised on the CPU through the fragment emulator (:mod:`flashlab.fragments`).

q1: the lane ↔ element maps of the A, B and C operands of ``mma.sync.m16n8k8`` (Turing's instruction; chapter 7
draws m16n8k16's, from which they are derived), as ``a_positions``, ``b_positions``, ``c_positions``, checked lane by
lane and by running the emulated instruction with them.
q2: ``softmax_tile``, one key tile of the online softmax on a warp's S fragments (quad reductions with
``shfl_xor``, rescaled l and O accumulators). q3: ``swizzle(row, chunk)``, a layout of a d = 128 fp16 tile in
shared memory whose every ``ldmatrix`` phase takes one pass. q4: ``ldmatrix_rows(lane)``, the row of a 16×16 A tile
each lane points ``ldmatrix.x4`` at, so that the four registers arrive as ``mma.sync``'s A fragment.

q5: ``KERNEL``, a CUDA kernel in which one warp computes a 16×8 tile of S = Q K^T; the student writes the lines of
one tensor-core step (the ``ldmatrix.x4`` address, the B registers, the ``mma.sync`` asm statement). Graded like lab
06's kernel: compiled (CuPy on a GPU of sm_80 or newer, else nvcc for sm_80 — sm_75 for a kernel of m16n8k8 alone —
else g++; 1 point), then run on random inputs against float64 (3 points) on such a GPU, or on the CPU: the asm
statements are rewritten into the host emulation's calls by :func:`flashlab.hostcuda.host_source`, compiled with g++
in the sandbox and run one OS thread per CUDA thread (:mod:`flashlab.hostcuda`). A failure is diagnosed by running
:data:`KERNEL_MUTANTS` (compiled into one module) on the same inputs; an accumulator passed as an output-only
operand is named from the asm statement itself. Points this machine cannot grade are not counted.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import numpy as np

from .. import fragments, hostcuda
from ..fragments import shfl_xor
from . import lab06
from .core import Case, Lab, Mutant, NotImplementedYet, Trial, allclose, as_outputs, fmt, mistake_title, parameter_names
from .known import Demo, KnownMistakes
from .lab06 import CudaMutant

LAB = Lab("lab07", "The tensor cores, practised")

#: Every question runs on a CPU: q1-q4 through the NumPy emulator, q5's kernel through g++ (chapter 9 and the seed
#: sweep read this; without g++ and a GPU, q5 is worth no points here).
NEEDS_GPU = False

# The course's own answers (flashlab.grading.answers): calling one scores 0. _softmax_variant with every switch
# off is a right softmax_tile.
ANSWERS = {
    # m16n8k8's maps are the k = 0..7 half of m16n8k16's (and C is the same): the package's are answers too.
    "q1": ("flashlab.grading.lab07._a8_positions", "flashlab.grading.lab07._b8_positions",
           "flashlab.grading.lab07._c8_positions", "flashlab.fragments.a_positions", "flashlab.fragments.b_positions",
           "flashlab.fragments.c_positions"),
    "q2": ("flashlab.fragments.softmax_tile", "flashlab.grading.lab07._softmax_variant"),
    "q3": ("flashlab.fragments.swizzle",),
    "q4": ("flashlab.grading.lab07._ldmatrix_a_rows",),
}

_OPERANDS = {"A": (16, 8, 4), "B": (8, 8, 2), "C": (16, 8, 4)}  # m16n8k8: rows, columns, values per lane


# -------------------------------------------------------------------------------------------- q1: the maps
# The hardware's maps of mma.sync.m16n8k8 with f16 inputs (PTX ISA, "Matrix Fragments for mma.m16n8k8"): q1's
# answers. They live here, with the grader, rather than in flashlab.fragments, so that the emulator a learner
# imports does not hand them out; the student's copy of the package has no body for them (ANSWERS).
def _a8_positions(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def _b8_positions(lane):
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g)]


def _c8_positions(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


#: The maps the emulated m16n8k8 reads its registers through (flashlab.fragments.mma with maps=).
_K8_MAPS = (_a8_positions, _b8_positions, _c8_positions)


def _a_g_t_swapped(lane):
    g, t = lane % 4, lane // 4
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def _a_transposed(lane):
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t, g + 8), (2 * t + 1, g + 8)]


def _a_halves_swapped(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t + 1)]


def _a_no_pairs(lane):
    g, t = divmod(lane, 4)
    return [(g, t), (g, t + 1), (g + 8, t), (g + 8, t + 1)]


def _a_along_k(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g, 2 * t + 8), (g, 2 * t + 9)]


def _a_k16(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]


A_POSITIONS_MUTANTS = [
    Mutant("g and t swapped in A: a lane's group is g = lane // 4 (the row, 0..7) and its place in the group "
           "t = lane % 4 (which pair of columns); you used g = lane % 4 and t = lane // 4.", fn=_a_g_t_swapped),
    Mutant("A is read transposed (row and column swapped): A is row-major (.row), 16 rows × 8 columns k, so each "
           "register holds two halves of one row, g or g + 8, at columns 2t and 2t + 1.", fn=_a_transposed),
    Mutant("the halves of A in the wrong order: a register holds two consecutive k of one row, so a0 = row g at "
           "columns 2t, 2t + 1 and a1 = row g + 8 at the same columns.", fn=_a_halves_swapped),
    Mutant("A's column pairs start at t, not 2t: each 32-bit register holds two consecutive halves, so the four "
           "lanes of a group cover columns 0-1, 2-3, 4-5, 6-7 (2t and 2t + 1).", fn=_a_no_pairs),
    Mutant("A's second register continues along k: m16n8k8's A is only 8 columns wide, so a1 holds row g + 8 at "
           "columns 2t, 2t + 1, not row g at 2t + 8, 2t + 9 (that is a2 of m16n8k16).", fn=_a_along_k),
    Mutant("the map of m16n8k16's A (8 values per lane): m16n8k8's A is 16 × 8, two registers (a0, a1) of two "
           "halves, 4 values per lane — the k = 0..7 half of m16n8k16's fragment.", fn=_a_k16),
]


def _b_g_t_swapped(lane):
    g, t = lane % 4, lane // 4
    return [(2 * t, g), (2 * t + 1, g)]


def _b_transposed(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1)]


def _b_no_pairs(lane):
    g, t = divmod(lane, 4)
    return [(t, g), (t + 1, g)]


def _b_k16(lane):
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


B_POSITIONS_MUTANTS = [
    Mutant("g and t swapped in B: B's column is the group g = lane // 4 and its k pair starts at 2t with "
           "t = lane % 4; you used g = lane % 4 and t = lane // 4.", fn=_b_g_t_swapped),
    Mutant("B is read transposed (row and column swapped): B is column-major (.col): a lane holds column g, at "
           "k = 2t and 2t + 1 — positions are (k, column).", fn=_b_transposed),
    Mutant("B's k pairs start at t, not 2t: the register b0 holds two consecutive halves of column g, so the four "
           "lanes of a group cover k = 0-1, 2-3, 4-5, 6-7 (2t and 2t + 1).", fn=_b_no_pairs),
    Mutant("the map of m16n8k16's B (4 values per lane): m16n8k8's B is 8 × 8, one register b0 of two halves per "
           "lane — the k = 0..7 half of m16n8k16's fragment.", fn=_b_k16),
]


def _c_g_t_swapped(lane):
    g, t = lane % 4, lane // 4
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def _c_transposed(lane):
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t, g + 8), (2 * t + 1, g + 8)]


def _c_halves_swapped(lane):
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t + 1)]


C_POSITIONS_MUTANTS = [
    Mutant("g and t swapped in C: a lane's rows are g and g + 8 with g = lane // 4, its columns 2t and 2t + 1 "
           "with t = lane % 4; you used g = lane % 4 and t = lane // 4.", fn=_c_g_t_swapped),
    Mutant("C is read transposed (row and column swapped): C is 16 rows × 8 columns and a lane holds rows g and "
           "g + 8, columns 2t and 2t + 1: positions are (row, column).", fn=_c_transposed),
    Mutant("the values of C in the wrong order: c0, c1 are row g (columns 2t, 2t + 1) and c2, c3 row g + 8 — "
           "the two columns of one row come first.", fn=_c_halves_swapped),
]


def _positions_run(fn, case: Case):
    return (np.asarray(fn(*case.args), dtype=float),)


def _positions_array(t: Trial, fn, count: int) -> np.ndarray | str:
    """The student's map for every lane as an int array (32, count, 2), or why it is not one."""
    out = []
    for lane in range(32):
        try:
            pos = np.asarray(t.call(fn, lane), dtype=float)
        except NotImplementedYet:
            raise
        except Exception as e:  # the student's bug, or not a list of pairs: feedback, like compare's
            return f"lane {lane}: {type(e).__name__}: {e}"[:300]
        if pos.shape != (count, 2) or not np.all(pos == np.round(pos)):
            return f"lane {lane} gave {pos.shape[0] if pos.ndim else 0} positions; it holds {count} (row, column) pairs"
        out.append(pos.astype(int))
    return np.array(out)


def _product_hint(pos: dict[str, np.ndarray | str], t: Trial) -> str:
    """Why ``D = A B + C`` through the emulated ``mma.sync`` with these maps is wrong ('' if it is right)."""
    for name, p in pos.items():
        if isinstance(p, str):
            return f"{name}: {p}"
        rows, cols, _ = _OPERANDS[name]
        bad = (p[..., 0] < 0) | (p[..., 0] >= rows) | (p[..., 1] < 0) | (p[..., 1] >= cols)
        if bad.any():
            lane, reg = (int(x) for x in np.argwhere(bad)[0])
            return (f"lane {lane}'s value {reg} of {name} is at {tuple(int(x) for x in p[lane, reg])}, outside the "
                    f"{rows}×{cols} {name}")
    A = t.rng.standard_normal((16, 8)).astype(np.float16).astype(np.float64)
    B = t.rng.standard_normal((8, 8)).astype(np.float16).astype(np.float64)
    C = t.rng.standard_normal((16, 8))
    frags = {n: np.array([[M[r, c] for r, c in pos[n][lane]] for lane in range(32)]) for n, M in
             (("A", A), ("B", B), ("C", C))}
    # The hardware's layout, whatever the maps say.
    D_frags = fragments.mma(frags["A"], frags["B"], frags["C"], maps=_K8_MAPS)
    D = np.full((16, 8), np.nan)
    for lane in range(32):
        for (r, c), x in zip(pos["C"][lane], D_frags[lane], strict=True):
            D[r, c] = x
    want = A @ B + C
    wrong = ~np.isclose(D, want, rtol=1e-12, atol=1e-12)
    if not wrong.any():
        return ""
    r, c = (int(x) for x in np.argwhere(wrong)[0])
    return (f"loaded with your maps, run through the emulated mma.sync.m16n8k8 and read back with your C map, "
            f"D = A B + C is wrong at {int(wrong.sum())} of 128 elements (first at row {r}, column {c}: expected "
            f"{want[r, c]:.4g}, got {D[r, c]:.4g}). The tensor core reads each register where the hardware's "
            "layout puts it: a lane must load exactly the elements that layout assigns to it.")


@LAB.question("q1", points=4, objects=("a_positions", "b_positions", "c_positions"))
def q1(t: Trial, a_positions, b_positions, c_positions) -> None:
    """a_positions, b_positions, c_positions give, per lane, the elements of m16n8k8's A, B, C it holds, in register
    order."""
    lanes = list(range(32))  # every lane, in order: the smallest failing input shown is the first failing lane
    maps = {"A": (a_positions, _a8_positions, A_POSITIONS_MUTANTS),
            "B": (b_positions, _b8_positions, B_POSITIONS_MUTANTS),
            "C": (c_positions, _c8_positions, C_POSITIONS_MUTANTS)}
    for name, (student, truth, mutants) in maps.items():
        rows, cols, count = _OPERANDS[name]
        cases = [Case((lane,), f"lane {lane}") for lane in lanes]
        t.compare(f"{name} ({rows}×{cols}): the {count} (row, column) positions of every lane", 1, student=student,
                  cases=cases, reference=lambda c, truth=truth: _positions_run(truth, c), run=_positions_run,
                  mutants=mutants, names=("positions",))
    pos = {name: _positions_array(t, maps[name][0], _OPERANDS[name][2]) for name in maps}
    hint = _product_hint(pos, t)
    t.expect("the emulated mma.sync.m16n8k8 with your three maps computes D = A B + C", 1, not hint, hint)


# ------------------------------------------------------------------------------ q2: the softmax on fragments
_ROW = [0, 0, 1, 1]  # value j of a lane's C fragment belongs to row g (j = 0, 1) or g + 8 (j = 2, 3)


def _softmax_variant(s, m, l, o, *, offsets=(1, 2), sum_offsets=None, rescale_o=True, rescale_l=True,  # noqa: E741
                     exponent="new max", rows="right", guard=True, alpha_sign=1):
    """softmax_tile with one switch per classic mistake (the defaults give the right answer)."""
    s, m, l, o = (np.asarray(x, dtype=np.float64) for x in (s, m, l, o))
    if rows == "swapped":
        own = np.stack([s[:, :, 2:4].max(axis=(1, 2)), s[:, :, 0:2].max(axis=(1, 2))], axis=1)
    elif rows == "merged":
        own = np.repeat(s.max(axis=(1, 2))[:, None], 2, axis=1)
    else:
        own = np.stack([s[:, :, 0:2].max(axis=(1, 2)), s[:, :, 2:4].max(axis=(1, 2))], axis=1)
    tile_max = own
    for k in offsets:
        tile_max = np.maximum(tile_max, shfl_xor(tile_max, k))
    m_new = np.maximum(m, tile_max)
    safe = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
    alpha = np.exp(alpha_sign * (m - safe))
    if exponent == "raw":
        base = np.zeros_like(m)
    elif exponent == "old max":
        base = np.where(np.isneginf(m), 0.0, m)
    elif exponent == "tile max":
        base = np.where(np.isneginf(tile_max), 0.0, tile_max)
    else:
        base = safe
    if rows == "swapped":
        base_values = base[:, [1, 1, 0, 0]]
    else:
        base_values = base[:, _ROW]
    p = np.exp(s - base_values[:, None, :])
    own_sum = np.stack([p[:, :, 0:2].sum(axis=(1, 2)), p[:, :, 2:4].sum(axis=(1, 2))], axis=1)
    tile_sum = own_sum
    for k in (offsets if sum_offsets is None else sum_offsets):
        tile_sum = tile_sum + shfl_xor(tile_sum, k)
    l_new = (alpha * l if rescale_l else l) + tile_sum
    o_new = o * alpha[:, None, _ROW] if rescale_o else o
    return p, m_new, l_new, o_new


def _softmax_switch(**flags):
    def softmax_tile(s, m, l, o):  # noqa: E741
        return _softmax_variant(s, m, l, o, **flags)

    return softmax_tile


# Every set of shfl_xor offsets a learner may reduce with; a quad needs exactly {1, 2} (in either order).
_OFFSET_SETS = [tuple(o for i, o in enumerate((1, 2, 4, 8, 16)) if bits >> i & 1) for bits in range(32)]
_WRONG_SETS = [o for o in _OFFSET_SETS if set(o) != {1, 2}]
_WHOLE_WARP, _HALF_QUAD = (16, 8, 4, 2, 1), (1,)


def _lanes_explain(max_sets, sum_sets):
    """``explains`` for reductions over the wrong lanes: the student's outputs are those of some pair (offsets of
    the max, offsets of the sum) from ``max_sets`` x ``sum_sets`` (``None`` in ``sum_sets``: the same as the max's)
    on this input."""
    def explains(case, got, expected):
        for mo in max_sets:
            for so in sum_sets:
                variant = _softmax_variant(*case.args, offsets=mo, sum_offsets=mo if so is None else so)
                if allclose(got, variant):
                    return True
        return False

    return explains


SOFTMAX_MUTANTS = [
    Mutant("the row max and sum are reduced over the wrong lanes (such as offsets 4 and 8): those lanes hold "
           "other rows. The 4 lanes of a quad (same g = lane // 4) hold one row's values: reduce with offsets 1 and "
           "2.", fn=_softmax_switch(offsets=(4, 8)),
           explains=_lanes_explain([o for o in _WRONG_SETS if set(o) not in ({1}, set(_WHOLE_WARP), set())],
                                   [None])),
    Mutant("the row max is reduced over the wrong lanes (the sum is right): the 4 lanes of a quad (same g = lane "
           "// 4) hold one row's values; reduce the max with shfl_xor offsets 1 and 2, as the sum.",
           fn=_softmax_switch(offsets=(1, 4), sum_offsets=(1, 2)), explains=_lanes_explain(_WRONG_SETS, [(1, 2)])),
    Mutant("the row sum is reduced over the wrong lanes (the max is right): the 4 lanes of a quad (same g = lane "
           "// 4) hold one row's values; add the sums with shfl_xor offsets 1 and 2, as for the max.",
           fn=_softmax_switch(sum_offsets=(1, 4)),
           explains=_lanes_explain([(1, 2)], [o for o in _WRONG_SETS if o])),
    Mutant("the row max and sum are reduced over the whole warp (offsets 16, 8, 4, 2, 1): that mixes the 16 rows "
           "together. Only the 4 lanes of a quad share a row: offsets 1 and 2.",
           fn=_softmax_switch(offsets=_WHOLE_WARP)),
    Mutant("only half a quad is reduced (one shuffle, offset 1): lanes t = 0, 1 and t = 2, 3 then disagree about "
           "the row. A quad has 4 lanes: shfl_xor with 1, then with 2.", fn=_softmax_switch(offsets=_HALF_QUAD)),
    Mutant("the row sum is not reduced across the quad: each lane's l counts only its own columns. Add the sums "
           "of the quad with shfl_xor (offsets 1 and 2), as for the max.", fn=_softmax_switch(sum_offsets=())),
    Mutant("O is not rescaled when the row max grows: the accumulators were summed against the old max; multiply "
           "each by alpha = exp(m_old - m_new) of its row (values 0, 1: row g; 2, 3: row g + 8).",
           fn=_softmax_switch(rescale_o=False)),
    Mutant("l is not rescaled when the row max grows: l_new = alpha * l + rowsum(p), with alpha = exp(m_old - "
           "m_new).", fn=_softmax_switch(rescale_l=False)),
    Mutant("alpha is inverted: exp(m_new - m_old) grows without bound; the old sums shrink by "
           "alpha = exp(m_old - m_new) <= 1.", fn=_softmax_switch(alpha_sign=-1)),
    Mutant("exp without subtracting the max: p = exp(s) overflows for large scores and disagrees with m; "
           "p = exp(s - m_new), with the new running max of the row.", fn=_softmax_switch(exponent="raw")),
    Mutant("p subtracts the old max: p = exp(s - m_old) is measured against a max the tile may have raised (and "
           "overflows then); subtract the new running max m_new.", fn=_softmax_switch(exponent="old max")),
    Mutant("p subtracts the tile's max instead of the running max: when an earlier tile had the larger max, p must "
           "still be exp(s - m_new) with m_new = max(m_old, tile max), the scale l and O are kept at.",
           fn=_softmax_switch(exponent="tile max")),
    Mutant("rows g and g + 8 swapped: a lane's values 0, 1 are row g (m[:, 0], l[:, 0]) and values 2, 3 row "
           "g + 8 (m[:, 1], l[:, 1]).", fn=_softmax_switch(rows="swapped")),
    Mutant("one max for both rows of a lane: values 0, 1 (row g) and 2, 3 (row g + 8) are two different rows; "
           "take a max per row.", fn=_softmax_switch(rows="merged")),
    Mutant("a row with no unmasked key yet gives nan: with m_new = -inf, exp(s - m_new) = exp(-inf + inf). "
           "Subtract 0 instead while the max is still -inf (p = 0, l = 0 and O = 0 stay).",
           fn=_softmax_switch(guard=False)),
]


def _tile_case(t: Trial, kind: str) -> Case:
    """A warp's S fragments for one key tile and the state before it, each row chosen to expose a mistake."""
    tiles = int(t.rng.choice([1, 2, 4]))
    dv_tiles = int(t.rng.choice([1, 2, 4]))
    S = t.rng.standard_normal((16, 8 * tiles)) * 2.0
    if kind == "huge":
        S += 1000.0
    # Each row: "first" (no key seen yet), "rises" (this tile raises the max), "stays" (an earlier tile had more).
    roles = np.array(["first", "rises", "stays"] * 6)[:16]
    roles = roles[t.rng.permutation(16)]
    if kind == "masked":
        S[t.rng.random(S.shape) < 0.3] = -np.inf
        roles[0], roles[1] = "first", "stays"
        S[0] = -np.inf  # no key yet and none in this tile: the row stays empty
        S[1] = -np.inf  # keys seen before, all masked here
    row_max = np.where(np.isneginf(S).all(axis=1), 0.0, np.max(np.where(np.isneginf(S), -1e300, S), axis=1))
    m = np.where(roles == "first", -np.inf,
                 np.where(roles == "rises", row_max - t.rng.uniform(0.5, 3.0, 16), row_max + t.rng.uniform(0.5, 3, 16)))
    l = np.where(roles == "first", 0.0, t.rng.uniform(0.5, 4.0, 16))  # noqa: E741
    O = t.rng.standard_normal((16, 8 * dv_tiles)) * (roles != "first")[:, None]
    s = np.stack([fragments.gather(S[:, 8 * k:8 * k + 8], fragments.c_positions) for k in range(tiles)], axis=1)
    o = np.stack([fragments.gather(O[:, 8 * k:8 * k + 8], fragments.c_positions) for k in range(dv_tiles)], axis=1)
    label = f"{tiles} tile(s) of 8 keys, dv = {8 * dv_tiles}" + {"masked": ", masked keys (-inf) and empty rows",
                                                                  "huge": ", scores near 1000"}.get(kind, "")
    return Case((s, fragments.row_state(m), fragments.row_state(l), o), label)


_SOFTMAX_NAMES = ("p", "m_new", "l_new", "o")


def _lane_differences(returned: list[tuple[tuple, object]]) -> str:
    """For the smallest input on which the function returned wrong values: the first lane where each output
    differs, with that lane's inputs (the arrays are too large to print whole)."""
    wrong = []
    for args, out in returned:
        try:
            got = as_outputs(out)
        except TypeError:
            continue
        want = fragments.softmax_tile(*args)
        if len(got) == len(want) and not allclose(got, want):
            wrong.append((sum(np.size(a) for a in args), args, got, want))
    if not wrong:
        return ""
    _, args, got, want = min(wrong, key=lambda w: w[0])
    lines, lanes = [], []
    for name, g, w in zip(_SOFTMAX_NAMES, got, want, strict=True):
        if g.shape != w.shape:
            lines.append(f"  {name}: shape {g.shape}, expected {w.shape}")
            continue
        bad = ~np.isclose(g, w, rtol=1e-9, atol=1e-12, equal_nan=True)
        if bad.any():
            lane = int(np.argwhere(bad)[0][0])
            lanes.append(lane)
            lines.append(f"  {name}, lane {lane}: expected {fmt(w[lane])}, got {fmt(g[lane])}")
    if lanes:
        lane = lanes[0]
        g = lane // 4
        s, m, l, _ = args  # noqa: E741
        lines.append(f"  lane {lane} holds rows {g} and {g + 8}; its inputs: s = {fmt(s[lane])}, m = {fmt(m[lane])}, "
                     f"l = {fmt(l[lane])} (lanes {4 * g}..{4 * g + 3} share these rows)")
    return "In the smallest input where your function returned wrong values:\n" + "\n".join(lines)


@LAB.question("q2", points=4, objects=("softmax_tile",))
def q2(t: Trial, softmax_tile) -> None:
    """softmax_tile(s, m, l, o) returns p, m_new, l_new and the rescaled O accumulators of a warp's fragments."""

    def ref(case):
        return fragments.softmax_tile(*case.args)

    for label, points, kind, count in (("random tiles", 2, "plain", 6),
                                       ("masked keys (-inf), rows with no key yet", 1, "masked", 4),
                                       ("scores near 1000", 1, "huge", 3)):
        cases = [_tile_case(t, kind) for _ in range(count)]
        returned: list[tuple[tuple, object]] = []

        def recorded(*args, returned=returned):
            out = softmax_tile(*args)
            returned.append((args, out))
            return out

        if not t.compare(label, points, student=recorded, cases=cases, reference=ref, mutants=SOFTMAX_MUTANTS,
                         names=_SOFTMAX_NAMES, arg_names=parameter_names(softmax_tile) or ("s", "m", "l", "o")):
            _add_feedback(t, lambda returned=returned: _lane_differences(returned))


def _add_feedback(t: Trial, extra) -> None:
    """Append ``extra()`` (evaluated when the feedback is written) to the message of the part just added."""
    label, got, points, message = t.parts[-1]

    def both() -> str:
        first = message() if callable(message) else message
        return "\n".join(x for x in (first, extra()) if x)

    t.parts[-1] = (label, got, points, both)


# ----------------------------------------------------------------------------------------- q3: the swizzle
CHUNKS = 16  # a d = 128 fp16 row is 256 bytes: 16 chunks of 16 bytes


def _swizzle_none(row, chunk):
    return chunk


def _swizzle_row_block(row, chunk):
    return chunk ^ (row // 8)


def _swizzle_mod4(row, chunk):
    return chunk ^ (row % 4)


def _swizzle_whole_row(row, chunk):
    return chunk ^ row


def _swizzle_mod8_after(row, chunk):
    return (chunk ^ row) % 8


SWIZZLE_MUTANTS = [
    Mutant("no swizzle: the 8 rows of an ldmatrix phase all start in bank 0 (a row is 256 bytes), so one phase "
           "takes 8 passes. Store chunk c of row r at c ^ (r % 8).", fn=_swizzle_none),
    Mutant("XOR with row // 8: the 8 rows of a phase share row // 8, so they still land in the same banks (8 "
           "passes); the rows of a phase differ in row % 8 — XOR with that.", fn=_swizzle_row_block),
    Mutant("XOR with row % 4: rows r and r + 4 of a phase still collide (2 passes); 8 rows need 8 different bank "
           "groups: XOR with row % 8.", fn=_swizzle_mod4),
    Mutant("XOR with the whole row index: from row 16 on, chunk ^ row leaves the row's 16 chunks (a chunk of "
           "another row is overwritten); XOR with row % 8 keeps every chunk in its row.", fn=_swizzle_whole_row),
    Mutant("the result is folded with % 8: 16 chunks are sent to 8 places, so two chunks of a row overwrite each "
           "other; c ^ (r % 8) is already in 0..15.", fn=_swizzle_mod8_after),
]


def _swizzle_table(fn, rows: int, call=None) -> np.ndarray:
    """``fn(row, chunk)`` for every row and chunk (rows, 16): called once on arrays, else element by element."""
    call = call or (lambda f, *a: f(*a))
    R, C = np.meshgrid(np.arange(rows), np.arange(CHUNKS), indexing="ij")
    try:
        table = np.asarray(call(fn, R, C))
        if table.shape == R.shape and table.dtype.kind in "biuf":
            return table
    except (TypeError, ValueError, IndexError):
        pass  # written for one (row, chunk) at a time: ask element by element
    return np.array([[call(fn, r, c) for c in range(CHUNKS)] for r in range(rows)])


def _table_passes(table: np.ndarray) -> np.ndarray:
    rows = table.shape[0]
    return np.array([[fragments.passes([r * 256 + int(table[r, c]) * 16 for r in range(8 * i, 8 * i + 8)], width=16)
                      for c in range(CHUNKS)] for i in range(rows // 8)])


@LAB.question("q3", points=2, objects=("swizzle",))
def q3(t: Trial, swizzle) -> None:
    """swizzle(row, chunk) keeps each chunk in its row and makes every ldmatrix phase one pass."""
    rows = 8 * int(t.rng.integers(3, 9))  # 24..64 rows: row 16 on shows a swizzle that leaves its row
    try:
        table = _swizzle_table(swizzle, rows, t.call)
        if not np.all(table == np.round(table)):
            raise ValueError("returned a chunk number that is not a whole number")
        table = table.astype(np.int64)
    except NotImplementedYet:
        raise
    except Exception as e:  # the student's bug, reported as feedback
        message = f"your swizzle raised {type(e).__name__}: {e}"[:300]
        t.expect("a permutation of the 16 chunks of every row", 1, False, message)
        t.expect("every ldmatrix phase (8 rows × 16 bytes) takes 1 pass", 1, False, message)
        return
    named = ""
    for mutant in SWIZZLE_MUTANTS:
        if np.array_equal(table, _swizzle_table(mutant.fn, rows)):
            named = f"Likely mistake: {mutant.message}"
            t.diagnoses.append(mistake_title(mutant.message))
            break
    bad_rows = [r for r in range(rows) if sorted(table[r].tolist()) != list(range(CHUNKS))]
    hint = ""
    if bad_rows:
        r = bad_rows[0]
        hint = (f"{len(bad_rows)} of {rows} rows are not a permutation of chunks 0..15; row {r} stores its chunks "
                f"at {table[r].tolist()}.")
        hint = f"{named}\n{hint}" if named else hint
    t.expect("a permutation of the 16 chunks of every row", 1, not bad_rows, hint)
    counts = _table_passes(table)
    worst = np.unravel_index(int(np.argmax(counts)), counts.shape)
    hint = ""
    if counts.max() > 1:
        i, c = (int(x) for x in worst)
        hint = (f"{int((counts > 1).sum())} of {counts.size} phases take more than 1 pass; the phase of rows "
                f"{8 * i}..{8 * i + 7} reading chunk {c} stores it at chunks {table[8 * i:8 * i + 8, c].tolist()} "
                f"-> {int(counts.max())} passes (chunks that are equal mod 8 fall in the same banks).")
        hint = f"{named}\n{hint}" if named and not bad_rows else hint
    t.expect("every ldmatrix phase (8 rows × 16 bytes) takes 1 pass", 1, counts.max() == 1, hint)


# ------------------------------------------------------------------------------- q4: ldmatrix's addresses
def _ldmatrix_a_rows(lane):
    """The right answer: lanes 0-7, 8-15, 16-23, 24-31 point at matrices a0 .. a3 (rows 0-7 / 8-15, k 0-7 / 8-15)."""
    return (lane % 16, lane // 16)


def _ld_matrices_swapped(lane):
    return (lane % 8 + 8 * (lane // 16), (lane // 8) % 2)


def _ld_along_k(lane):
    return (lane % 8, lane // 8)


def _ld_own_row(lane):
    return (lane // 4, 0)


def _ld_same_matrix(lane):
    return (lane % 8, 0)


def _ld_row_major(lane):
    return (lane // 2, lane % 2)


LDMATRIX_MUTANTS = [
    Mutant("matrices 1 and 2 swapped: register a1 is rows 8-15 at k 0-7 and a2 rows 0-7 at k 8-15, so lanes 8-15 "
           "point at rows 8-15, chunk 0, and lanes 16-23 at rows 0-7, chunk 1.", fn=_ld_matrices_swapped),
    Mutant("the four matrices laid side by side along k: a 16×16 tile is 2 chunks wide and 16 rows tall — "
           "matrices 1 and 3 are rows 8-15; use row = lane % 16, chunk = lane // 16.", fn=_ld_along_k),
    Mutant("each lane points at the row its own values come from (lane // 4): in ldmatrix a lane supplies the "
           "address of one row for the whole warp — lane 8j + i the i-th row of matrix j.", fn=_ld_own_row),
    Mutant("all four matrices load the same 8 rows (as for ldmatrix.x1): with .x4, lanes 8j .. 8j + 7 give the "
           "rows of matrix j, a different 8×8 block for each register.", fn=_ld_same_matrix),
    Mutant("the tile's rows in reading order, two lanes per row: ldmatrix does not fill registers in row-major "
           "order; lanes 8j .. 8j + 7 give the 8 rows of matrix j.", fn=_ld_row_major),
]


def _ldmatrix_hint(t: Trial, student) -> str:
    """Why A's fragments loaded by ldmatrix.x4 from the student's addresses are not the mma's ('' if they are)."""
    try:
        rc = np.array([np.asarray(t.call(student, lane), dtype=float) for lane in range(32)])
    except NotImplementedYet:
        raise
    except Exception as e:  # the student's bug, or not one pair per lane: feedback, like compare's
        return f"your ldmatrix_rows raised {type(e).__name__}: {e}"[:300]
    if rc.shape != (32, 2) or not np.all(rc == np.round(rc)):
        return "every lane must give one (row, chunk) pair of whole numbers"
    rc = rc.astype(int)
    A = t.rng.standard_normal((16, 16)).astype(np.float16).astype(np.float64)
    B = t.rng.standard_normal((16, 8)).astype(np.float16).astype(np.float64)
    try:
        a = fragments.ldmatrix_x4(A, rc)
    except IndexError:
        lane = int(np.argwhere((rc[:, 0] < 0) | (rc[:, 0] > 15) | (rc[:, 1] < 0) | (rc[:, 1] > 1))[0][0])
        return f"lane {lane} points at row {rc[lane, 0]}, chunk {rc[lane, 1]}: outside the 16 × 16 tile (2 chunks wide)"
    D = fragments.scatter(fragments.mma(a, fragments.gather(B, fragments.b_positions), np.zeros((32, 4))),
                          fragments.c_positions, (16, 8))
    wrong = ~np.isclose(D, A @ B, rtol=1e-12, atol=1e-12)
    if not wrong.any():
        return ""
    want = fragments.gather(np.arange(256).reshape(16, 16), fragments.a_positions)
    got = fragments.ldmatrix_x4(np.arange(256).reshape(16, 16), rc)
    lane, value = (int(x) for x in np.argwhere(want != got)[0])
    r, c = divmod(int(got[lane, value]), 16)
    rw, cw = divmod(int(want[lane, value]), 16)
    return (f"the fragments ldmatrix.x4 loads with your addresses make mma.sync compute a wrong D = A B at "
            f"{int(wrong.sum())} of 128 elements: lane {lane}'s value {value} (register a{value // 2}) receives A at "
            f"row {r}, column {c}, where the mma expects row {rw}, column {cw}.")


@LAB.question("q4", points=2, objects=("ldmatrix_rows",))
def q4(t: Trial, ldmatrix_rows) -> None:
    """ldmatrix_rows(lane) gives the (row, chunk) of the 16×16 A tile that each lane points ldmatrix.x4 at."""
    lanes = list(range(32))  # every lane, in order: the smallest failing input shown is the first failing lane
    t.compare("the (row, chunk) every lane supplies", 1, student=ldmatrix_rows,
              cases=[Case((lane,), f"lane {lane}") for lane in lanes],
              reference=lambda c: _positions_run(_ldmatrix_a_rows, c), run=_positions_run, mutants=LDMATRIX_MUTANTS,
              names=("(row, chunk)",))
    hint = _ldmatrix_hint(t, ldmatrix_rows)
    t.expect("ldmatrix.x4 with your addresses loads the A fragments of mma.sync", 1, not hint, hint)


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _positions_demo(truth) -> Demo:
    return Demo(examples=[(f"lane {lane}", (lane,)) for lane in (0, 5, 13)],
                run=lambda fn, args: _positions_run(fn, Case(args)),
                right=lambda args: _positions_run(truth, Case(args)), names=("positions",))


def _softmax_demo() -> Demo:
    t = Trial(3)
    return Demo(examples=[("one tile of 8 keys, random scores", _tile_case(t, "plain").args),
                          ("masked keys and a row with no key yet", _tile_case(t, "masked").args),
                          ("scores near 1000", _tile_case(t, "huge").args)],
                right=lambda args: fragments.softmax_tile(*args), names=_SOFTMAX_NAMES)


def _swizzle_demo() -> Demo:
    def run(fn, args):
        table = _swizzle_table(fn, args[0])
        perm = [sorted(row.tolist()) == list(range(CHUNKS)) for row in table]
        return (np.array(perm, dtype=float), _table_passes(table).max(axis=1))

    return Demo(examples=[("a 32-row tile", (32,))], run=run, right=lambda args: run(fragments.swizzle, args),
                names=("each row a permutation (1 = yes)", "worst passes per 8-row block"))




# ------------------------------------------------------------------ q5: the tensor-core lines of a CUDA kernel
# The kernel q5 grades: one warp computes a 16 x 8 tile of S = Q K^T with mma.sync.m16n8k16, its A fragment loaded
# by ldmatrix.x4. "/*MMA*/" marks the lines the student writes; render_kernel() fills them in. The solution
# notebook's KERNEL is render_kernel(KERNEL_SOLUTION) with the release markers around those lines (a test checks it).
KERNEL_TEMPLATE = r"""// Lab 07, task 5 -- the tensor-core lines of rung 3, with rung 4's ldmatrix: one warp computes a
// 16 x 8 tile of S = Q K^T with mma.sync.m16n8k16 (fp16 inputs, fp32 accumulators).
//
// Block (x, y) owns query rows 16x .. 16x + 15 and keys 8y .. 8y + 7. Layout: q (n, D) and k (m, D) fp16, passed
// as their 16-bit patterns; s (n, m) float32; n a multiple of 16, m of 8. Grid (n / 16, m / 8); block: one warp.
// Needs sm_80 or newer (Turing, sm_75, has m16n8k8 only).

typedef unsigned short u16;
typedef unsigned int u32;

// ldmatrix.x4: lanes 8j .. 8j + 7 each give the shared-memory address of one 16-byte row (8 halves) of 8x8 matrix
// j; matrix j arrives in register r[j] of every lane, lane 4g + t receiving halves 2t, 2t + 1 of its row g.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* row) {
    const u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <int D>
__device__ void qk_tile(const u16* __restrict__ q, const u16* __restrict__ k, float* __restrict__ s, int m) {
    constexpr int LD = D + 8;  // a padded row (16 bytes more): the 8 rows of an ldmatrix phase hit different banks
    __shared__ __align__(16) u16 qs[16 * LD];  // the block's 16 query rows
    __shared__ __align__(16) u16 ks[8 * LD];   // its 8 key rows
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const u16* qt = q + (size_t)blockIdx.x * 16 * D;
    const u16* kt = k + (size_t)blockIdx.y * 8 * D;
    for (int e = lane; e < 16 * LD; e += 32) qs[e] = e % LD < D ? qt[e / LD * D + e % LD] : (u16)0;
    for (int e = lane; e < 8 * LD; e += 32) ks[e] = e % LD < D ? kt[e / LD * D + e % LD] : (u16)0;
    __syncthreads();

    float c[4] = {0.f, 0.f, 0.f, 0.f};  // this lane's accumulators: S at rows g, g + 8 and keys 2t, 2t + 1
    for (int k0 = 0; k0 < D; k0 += 16) {  // one mma.sync per 16 columns of Q and K
        u32 a[4];    // A = Q[16 rows, k0 .. k0 + 15], row-major: registers a0 .. a3 as mma.sync.m16n8k16 takes them
        u32 b0, b1;  // B = K[8 keys, k0 .. k0 + 15]^T, column-major: column g of B is key g
/*MMA*/
    }

    // c0, c1: row g, keys 2t and 2t + 1; c2, c3: row g + 8, the same keys.
    float* st = s + (size_t)blockIdx.x * 16 * m + blockIdx.y * 8;
    st[g * m + 2 * t] = c[0];
    st[g * m + 2 * t + 1] = c[1];
    st[(g + 8) * m + 2 * t] = c[2];
    st[(g + 8) * m + 2 * t + 1] = c[3];
}

extern "C" __global__ void __launch_bounds__(32)
qk_lab_d32(const u16* q, const u16* k, float* s, int m) { qk_tile<32>(q, k, s, m); }
extern "C" __global__ void __launch_bounds__(32)
qk_lab_d64(const u16* q, const u16* k, float* s, int m) { qk_tile<64>(q, k, s, m); }
"""

# In the sandbox's copy of the package the solution's lines (and the mutants made from them) are poisoned
# (answers.student_package): a KERNEL assembled from them fails to compile with an error that names them.
SANDBOX_POISON = ("KERNEL_SOLUTION",)
KERNEL_SOLUTION = """\
// Lane 8j + i points at row i of matrix j: a0 = rows 0-7 and a1 = rows 8-15 at columns k0 .. k0 + 7, then a2 and
// a3 the same rows at columns k0 + 8 .. k0 + 15.
ldmatrix_x4(a, &qs[(lane % 16) * LD + k0 + 8 * (lane / 16)]);
// b0: key g at columns k0 + 2t, k0 + 2t + 1, side by side in its row: one 32-bit load; b1: 8 columns on.
b0 = *(const u32*)&ks[g * LD + k0 + 2 * t];
b1 = *(const u32*)&ks[g * LD + k0 + 8 + 2 * t];
// D = A B + C, with C the accumulators themselves ("+f": read, then written).
asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
             "{%0, %1, %2, %3};"
             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));"""

KERNEL_HEAD_DIMS = (32, 64)
KERNEL_ENTRY_POINTS = tuple(f"qk_lab_d{d}" for d in KERNEL_HEAD_DIMS)
KERNEL_TOLERANCE = 1e-5  # fp32 accumulation of exact fp16 products: relative, in the 2-norm (CONTRIBUTING.md)
KERNEL_MATCH = 1e-4  # a student's S "matches" a mutant's within this (relative)
KERNEL_ARCH = 80  # m16n8k16 needs Ampere; a kernel written with m16n8k8 alone is compiled for Turing (sm_75)
Q5_COMPILE_POINTS, Q5_RUN_POINTS = 1, 3
_MMA_INDENT = " " * 8  # the lines' indentation in KERNEL_TEMPLATE


def render_kernel(lines: str, prefix: str = "qk_lab") -> str:
    """KERNEL_TEMPLATE with ``lines`` in place of /*MMA*/; ``prefix`` renames its kernels and device functions
    (the mutants share one module)."""
    body = "\n".join(_MMA_INDENT + line if line.strip() else line for line in lines.split("\n"))
    source = KERNEL_TEMPLATE.replace("/*MMA*/", body)
    if prefix != "qk_lab":
        for name in ("qk_lab_d", "qk_tile", "ldmatrix_x4"):
            source = source.replace(name, f"{prefix}_{name}")
    return source


_SOLUTION_LINES = KERNEL_SOLUTION.split("\n")
_A_LINE = _SOLUTION_LINES[2]
_B0_LINE, _B1_LINE = _SOLUTION_LINES[4], _SOLUTION_LINES[5]
_MMA_LINES = "\n".join(_SOLUTION_LINES[7:])


def _lines(a: str = _A_LINE, b0: str = _B0_LINE, b1: str = _B1_LINE, mma: str = _MMA_LINES) -> str:
    """The solution's lines (without comments) with the given ones in place of its own."""
    return "\n".join([a, b0, b1, mma])


_A_REGS = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])'
_A12 = ("registers a1 and a2 of A exchanged: mma.sync.m16n8k16 takes a0 = rows 0-7 and a1 = rows 8-15 at k 0-7, then "
        "a2, a3 the same rows at k 8-15. Either ldmatrix's lanes 8-15 point at rows 0-7 of the second 8 columns and "
        "lanes 16-23 at rows 8-15 of the first (use row lane % 16, column k0 + 8 * (lane / 16)), or the mma takes "
        "a[0], a[2], a[1], a[3]: pass a[0] .. a[3] in order.")
_ACCUMULATOR = ("the accumulators are not passed in as C: D = A B + C must read c[0..3] and write them back (\"+f\" "
                "operands, C = {%0, %1, %2, %3}); with C = 0 each mma.sync overwrites the sum of the previous 16 "
                "columns, and S holds only the last k step.")

KERNEL_MUTANTS = (
    CudaMutant("a_matrices_swapped", _A12,
                     _lines(a="ldmatrix_x4(a, &qs[(lane % 8 + 8 * (lane / 16)) * LD + k0 + 8 * (lane / 8 % 2)]);")),
    CudaMutant("a_registers_order", _A12,
                     _lines(mma=_MMA_LINES.replace(_A_REGS, '"r"(a[0]), "r"(a[2]), "r"(a[1]), "r"(a[3])'))),
    CudaMutant("a_along_k", "ldmatrix's four matrices laid side by side along k: lanes 8j .. 8j + 7 point at "
                     "rows 0-7 only, at columns k0 + 8j, so A's rows 8-15 are never loaded and a2, a3 come from 16 "
                     "columns further. The 16 x 16 tile of A is 2 chunks wide and 16 rows tall: row lane % 16, column "
                     "k0 + 8 * (lane / 16).",
                     _lines(a="ldmatrix_x4(a, &qs[(lane % 8) * LD + k0 + 8 * (lane / 8)]);")),
    CudaMutant("a_two_lanes_per_row", "ldmatrix addresses in reading order, two lanes per row (row lane / 2, "
                     "column k0 + 8 * (lane % 2)): ldmatrix does not fill registers row by row; lanes 8j .. 8j + 7 "
                     "give the 8 rows of matrix j, so row lane % 16, column k0 + 8 * (lane / 16).",
                     _lines(a="ldmatrix_x4(a, &qs[(lane / 2) * LD + k0 + 8 * (lane % 2)]);")),
    CudaMutant("a_own_row", "each lane points ldmatrix at the row its own values come from (lane / 4): in "
                     "ldmatrix a lane supplies the address of one row for the whole warp, lane 8j + i the i-th row of "
                     "matrix j: row lane % 16, column k0 + 8 * (lane / 16).",
                     _lines(a="ldmatrix_x4(a, &qs[(lane / 4) * LD + k0]);")),
    CudaMutant("a_no_k0", "A is loaded without k0: every step of the loop over k reads Q's first 16 columns, so "
                     "S = Q[:, :16] K^T summed over the steps. Point ldmatrix at column k0 + 8 * (lane / 16).",
                     _lines(a="ldmatrix_x4(a, &qs[(lane % 16) * LD + 8 * (lane / 16)]);")),
    CudaMutant("b_swapped", "b0 and b1 exchanged: b0 holds key g at k = 2t, 2t + 1 of this step's 16 columns "
                     "and b1 the same 8 columns on (k0 + 8 + 2t); the mma takes {b0, b1} in that order.",
                     _lines(mma=_MMA_LINES.replace('"r"(b0), "r"(b1)', '"r"(b1), "r"(b0)'))),
    CudaMutant("b_g_t_swapped", "B loaded with g and t swapped: column g = lane / 4 of B is key g, and the "
                     "lane's k pair starts at 2t with t = lane % 4; you load key t at columns 2g, 2g + 1.",
                     _lines(b0="b0 = *(const u32*)&ks[t * LD + k0 + 2 * g];",
                            b1="b1 = *(const u32*)&ks[t * LD + k0 + 8 + 2 * g];")),
    CudaMutant("b_no_k0", "B is loaded without k0: every step of the loop over k multiplies by K's first 16 "
                     "columns. Key g's halves of this step are at ks[g * LD + k0 + 2t] (b0) and 8 columns on (b1).",
                     _lines(b0="b0 = *(const u32*)&ks[g * LD + 2 * t];",
                            b1="b1 = *(const u32*)&ks[g * LD + 8 + 2 * t];")),
    CudaMutant("zero_accumulator", _ACCUMULATOR,
                     _lines(mma=_MMA_LINES.replace("{%0, %1, %2, %3};", "{%10, %11, %12, %13};")
                            .replace('"+f"', '"=f"').replace('"r"(b1));', '"r"(b1),\n  "f"(0.f), "f"(0.f), "f"(0.f), '
                                                                          '"f"(0.f));'))),
    CudaMutant("output_only_accumulator", _ACCUMULATOR,
                     _lines(mma=_MMA_LINES.replace('"+f"', '"=f"'))),
)


# Mutants whose mistake is in an asm statement's operands: the rewriting for the CPU names it before anything runs.
_REFUSED_ON_CPU = frozenset({"output_only_accumulator"})


def _runnable_mutants() -> list:
    return [mu for mu in KERNEL_MUTANTS if mu.tag not in _REFUSED_ON_CPU]


def kernel_mutant_source() -> str:
    """One CUDA module holding every kernel mutant the CPU emulation runs (not ``output_only_accumulator``, whose
    mistake is in the asm operands, which the rewriting names before anything runs); mutant ``tag``'s kernels are
    ``qk_<tag>_qk_lab_d32`` and ``..._d64``."""
    return "\n".join(render_kernel(mu.update, f"qk_{mu.tag}") for mu in _runnable_mutants())


def _mutant_kernel(tag: str, d: int) -> str:
    return f"qk_{tag}_qk_lab_d{d}"


# ------------------------------------------------------------------------------------------ q5: the inputs
class KernelCase:
    """One launch: Q (n, d) and K (m, d) as fp16 values, n a multiple of 16 and m of 8."""

    def __init__(self, q: np.ndarray, k: np.ndarray, label: str) -> None:
        self.q, self.k, self.label = q.astype(np.float16), k.astype(np.float16), label

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q.shape[0], self.k.shape[0], self.q.shape[1]

    def reference(self) -> np.ndarray:
        return self.q.astype(np.float64) @ self.k.astype(np.float64).T


def kernel_cases(t: Trial) -> list[KernelCase]:
    """q5's inputs, fresh every run: both head dimensions, one block and several, n != m."""
    cases = [KernelCase(t.rng.standard_normal((16, d)), t.rng.standard_normal((8, d)), "one block")
             for d in KERNEL_HEAD_DIMS]
    for d in KERNEL_HEAD_DIMS:
        n, m = 16 * int(t.rng.integers(2, 5)), 8 * int(t.rng.integers(2, 7))
        cases.append(KernelCase(t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d)), "several blocks"))
    return cases


def _host_launch(kernel: str, case: KernelCase) -> hostcuda.Launch:
    n, m, _ = case.shape
    s = np.full((n, m), np.nan, dtype=np.float32)
    args = (case.q.view(np.uint16).copy(), case.k.view(np.uint16).copy(), s, np.int32(m))
    return hostcuda.Launch(kernel, (n // 16, m // 8), 32, args, outputs=(2,))


def _gpu_launch(source: str, kernel: str, case: KernelCase) -> np.ndarray:
    import cupy

    n, m, _ = case.shape
    fn = lab06._module(source).get_function(kernel)
    q, k = (cupy.asarray(x.view(np.uint16)) for x in (case.q, case.k))
    s = cupy.full((n, m), cupy.nan, dtype=cupy.float32)
    fn((n // 16, m // 8), (32,), (q, k, s, np.int32(m)))
    return cupy.asnumpy(s)


# ---------------------------------------------------------------------------------------- q5: the machines
@functools.lru_cache(maxsize=None)
def _gpu_runs_mma() -> bool:
    """A GPU with m16n8k16 (compute capability 8.0 or newer) is here: q5 runs the kernel on it."""
    if not lab06._has_gpu():
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= KERNEL_ARCH


def _kernel_can_compile() -> bool:
    return _gpu_runs_mma() or lab06._nvcc() is not None or lab06._host_cc()


def _kernel_can_run() -> bool:
    return _gpu_runs_mma() or lab06._host_cc()


def can_run_kernel() -> bool:
    """Whether :func:`qk_scores` can run a kernel here: on a GPU of sm_80 or newer, or on the CPU with g++."""
    return _kernel_can_run()


def _arch(source: str) -> int:
    """sm_75 for a kernel whose mma.sync instructions are all m16n8k8 (Turing's), else sm_80."""
    shapes = set(re.findall(r'"\s*mma\.sync\.aligned\.(m\d+n\d+k\d+)', source))
    return 75 if shapes == {"m16n8k8"} else KERNEL_ARCH


class KernelFailed(Exception):
    """The kernel does not compile or run; the message says why (the compiler's log, or what stopped it)."""


def _host_source(source: str) -> str:
    """The student's kernel made host C++ (flashlab.hostcuda.host_source); raises KernelFailed for PTX the CPU
    emulation cannot run, with the reason."""
    try:
        return hostcuda.host_source(source)
    except hostcuda.UnknownPTX as e:
        raise KernelFailed(f"an asm statement cannot run: {e}") from None


def qk_scores(source: str, Q, K) -> np.ndarray:
    """Launch the notebook's KERNEL on Q (n, d) and K (m, d) (n a multiple of 16, m of 8, d 32 or 64; rounded to
    fp16) and return S = Q K^T (float32): on a GPU of sm_80 or newer with CuPy, else on the CPU with g++. Raises
    :class:`KernelFailed` when the kernel does not compile or its launch fails."""
    Q, K = np.asarray(Q), np.asarray(K)
    if Q.ndim != 2 or K.ndim != 2 or Q.shape[1] != K.shape[1] or Q.shape[1] not in KERNEL_HEAD_DIMS:
        raise ValueError(f"need Q (n, d) and K (m, d) with d in {KERNEL_HEAD_DIMS}; got {Q.shape}, {K.shape}")
    if Q.shape[0] % 16 or K.shape[0] % 8 or not Q.shape[0] or not K.shape[0]:
        raise ValueError(f"need n a multiple of 16 and m a multiple of 8; got n = {Q.shape[0]}, m = {K.shape[0]}")
    case = KernelCase(Q, K, "")
    source = lab06.clean_source(source)
    kernel = f"qk_lab_d{Q.shape[1]}"
    if _gpu_runs_mma():
        try:
            return _gpu_launch(source, kernel, case)
        except Exception as e:  # CuPy's CompileException, which CuPy does not export under one name
            if type(e).__name__ != "CompileException":
                raise
            raise KernelFailed(str(e)) from None
    if not lab06._host_cc():
        raise RuntimeError("qk_scores() runs the kernel on a GPU (sm_80 or newer), or on the CPU with g++; "
                           "neither is here")
    try:
        program = lab06._host_program(_host_source(source), KERNEL_ENTRY_POINTS)
    except (hostcuda.CompileError, lab06.MissingKernels) as e:
        raise KernelFailed(getattr(e, "log", str(e))) from None
    (result,) = hostcuda.run(program, [_host_launch(kernel, case)], timeout=lab06.RUN_TIMEOUT)
    if isinstance(result, Exception):
        raise KernelFailed(str(result))
    return result[0]


# --------------------------------------------------------------------------------------- q5: the grading
def _relative(x: np.ndarray, y: np.ndarray) -> float:
    return lab06._rel(np.asarray(x, np.float64), np.asarray(y, np.float64))


def _kernel_close(got: np.ndarray, want: np.ndarray, tol: float = KERNEL_TOLERANCE) -> bool:
    return bool(np.isfinite(got).all()) and _relative(got, want) <= tol


def _describe_case(case: KernelCase, got) -> str:
    n, m, d = case.shape
    where = f"n = {n}, m = {m}, d = {d} [{case.label}]"
    if isinstance(got, BaseException):
        return f"{where}: {str(got)[:300]}"
    want = case.reference()
    bad = ~np.isclose(got, want, rtol=1e-4, atol=1e-4) | ~np.isfinite(got)
    gap = np.where(np.isfinite(got), np.abs(got - want), np.inf)
    # the first wrong score, or the farthest off where rounding alone exceeds the tolerance
    r, j = (int(x) for x in (np.argwhere(bad)[0] if bad.any() else np.unravel_index(np.argmax(gap), gap.shape)))
    g, lane = r % 8, 4 * (r % 8) + (j % 8) // 2
    value = 2 * (r % 16 >= 8) + j % 2
    error = _relative(np.nan_to_num(got), want)
    return (f"{where}: {int(bad.sum())} of {n * m} scores wrong (relative error {error:.2e}, allowed "
            f"{KERNEL_TOLERANCE:g}); the first at query {r}, key {j}: expected {want[r, j]:.4g}, got {got[r, j]:.4g} "
            f"(lane {lane}'s c[{value}] in its block: row g = {g}{' + 8' if r % 16 >= 8 else ''}, "
            f"keys 2t, 2t + 1 with t = {(j % 8) // 2})")


def _q5_compile(t: Trial, source: str) -> tuple[bool, str]:
    """Compile with what this machine has: (ok, feedback)."""
    arch = _arch(source)
    if _gpu_runs_mma():
        try:
            lab06._cupy_compile(source, KERNEL_ENTRY_POINTS)
            return True, "compiles with NVRTC (CuPy) and defines " + ", ".join(KERNEL_ENTRY_POINTS)
        except lab06.MissingKernels as e:
            return False, str(e)
        except Exception as e:  # noqa: BLE001 - CompileException: the compiler's log is the feedback
            return False, lab06._compile_feedback(str(e))
    if lab06._nvcc() is not None:
        ok, log, usage = lab06.nvcc_compile(source, arch)
        if not ok:
            return False, lab06._compile_feedback(log)
        missing = [name for name in KERNEL_ENTRY_POINTS if name not in {u["kernel"] for u in usage}]
        if missing:
            return False, f"compiles, but these kernels are missing: {', '.join(missing)}"
        return True, f"compiles with nvcc for sm_{arch}"
    try:
        lab06._host_program(_host_source(source), KERNEL_ENTRY_POINTS)
    except KernelFailed as e:
        return False, str(e)
    except lab06.MissingKernels as e:
        return False, str(e)
    except hostcuda.CompileError as e:
        return False, lab06._compile_feedback(e.log)
    return True, "compiles for the CPU with g++ (no nvcc here: an error only the CUDA compiler makes shows with nvcc)"


def _q5_outputs(source: str, cases: list[KernelCase]) -> tuple[list, Callable]:
    """The student's S per case (an array, or the exception that stopped it), and ``mutants(cases)``: every mutant's
    S on those cases ({tag: [S or exception per case]}), run in one module."""
    if _gpu_runs_mma():
        got = []
        for case in cases:
            try:
                got.append(_gpu_launch(source, f"qk_lab_d{case.shape[2]}", case))
            except Exception as e:  # noqa: BLE001 - a failed launch is feedback
                got.append(e)

        def mutants(subset):
            module = kernel_mutant_source()
            return {mu.tag: [_gpu_launch(module, _mutant_kernel(mu.tag, c.shape[2]), c) for c in subset]
                    for mu in _runnable_mutants()}

        return got, mutants
    program = lab06._host_program(_host_source(source), KERNEL_ENTRY_POINTS)
    got = [out[0] if not isinstance(out, Exception) else out for out in
           hostcuda.run(program, [_host_launch(f"qk_lab_d{c.shape[2]}", c) for c in cases], timeout=lab06.RUN_TIMEOUT)]

    def mutants(subset):
        names = tuple(_mutant_kernel(mu.tag, d) for mu in _runnable_mutants() for d in KERNEL_HEAD_DIMS)
        prog = lab06._host_program(_host_source(kernel_mutant_source()), names, trusted=True)
        jobs = [(mu.tag, c) for mu in _runnable_mutants() for c in subset]
        outs = hostcuda.run(prog, [_host_launch(_mutant_kernel(tag, c.shape[2]), c) for tag, c in jobs],
                            timeout=lab06.RUN_TIMEOUT)
        found: dict[str, list] = {}
        for (tag, _), out in zip(jobs, outs, strict=True):
            found.setdefault(tag, []).append(out if isinstance(out, Exception) else out[0])
        return found

    return got, mutants


def _same_s(a, b) -> bool:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return False
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    f = np.isfinite(a)
    return not f.any() or _relative(a[f], b[f]) <= KERNEL_MATCH


def _q5_diagnose(t: Trial, cases, got, mutants) -> str:
    failed = [i for i, (c, s) in enumerate(zip(cases, got, strict=True))
              if isinstance(s, BaseException) or not _kernel_close(s, c.reference())]
    smallest = min(failed, key=lambda i: cases[i].q.size + cases[i].k.size)
    text = "Smallest failing input: " + _describe_case(cases[smallest], got[smallest])
    try:
        outs = mutants(cases)
    except Exception:  # noqa: BLE001 - no diagnosis rather than none at all
        return text
    for mu in KERNEL_MUTANTS:
        wrong = outs.get(mu.tag)
        if wrong is None:
            continue
        explains = all(_same_s(got[i], wrong[i]) for i in failed)
        contradicts = any(isinstance(wrong[i], BaseException) or not _kernel_close(wrong[i], cases[i].reference())
                          for i in range(len(cases)) if i not in failed)
        if explains and not contradicts:
            t.diagnoses.append(mistake_title(mu.message))
            return f"Likely mistake (all {len(failed)} failing inputs match it): {mu.message}\n{text}"
    return text


def _needs_q5() -> str:
    parts = []
    if not _kernel_can_compile():
        parts.append(f"{Q5_COMPILE_POINTS} point (compiling) needs a GPU, nvcc or a C++ compiler (g++)")
    if not _kernel_can_run():
        why = "a GPU of sm_80 or newer" + (" (this one is older)" if lab06._has_gpu() else "")
        parts.append(f"{Q5_RUN_POINTS} points (running) need {why} or a C++ compiler (g++)")
    return ("q5: " + "; ".join(parts) + "; not graded here.") if parts else ""


def _accumulator_misuse(source: str) -> str:
    """The rewriting's words when an asm statement reads an output-only operand ('' otherwise)."""
    try:
        hostcuda.host_source(source)
    except hostcuda.UnknownPTX as e:
        return str(e) if "output-only operand" in str(e) else ""
    return ""


@LAB.question("q5", points=Q5_COMPILE_POINTS * _kernel_can_compile() + Q5_RUN_POINTS * _kernel_can_run(),
              objects=("KERNEL",))
def q5(t: Trial, KERNEL) -> None:
    """KERNEL (the ldmatrix address, the B loads and the mma.sync line) compiles, and computes S = Q K^T tile by tile
    against the reference (on a GPU of sm_80 or newer, or on the CPU through g++)."""
    source = lab06._student(KERNEL)
    needs = _needs_q5()
    compiled = False
    if _kernel_can_compile():
        compiled, message = _q5_compile(t, source)
        t.expect("compiles and defines " + ", ".join(KERNEL_ENTRY_POINTS), Q5_COMPILE_POINTS, compiled,
                 message + (f"\n{needs}" if needs else ""))
    if not _kernel_can_run():
        return None if t.parts else (0.0, needs)
    label = f"S = Q K^T on {2 * len(KERNEL_HEAD_DIMS)} random inputs (d = 32 and 64, one block and several)"
    misuse = _accumulator_misuse(source)
    if misuse:
        t.diagnoses.append(mistake_title(_ACCUMULATOR))
        t.expect(label, Q5_RUN_POINTS, False, f"Likely mistake: {_ACCUMULATOR}\n({misuse})")
        return None
    if t.parts and not compiled:
        t.expect(label, Q5_RUN_POINTS, False, "cannot run: the kernel does not compile (above)")
        return None
    cases = kernel_cases(t)
    try:
        got, mutants = _q5_outputs(source, cases)
    except KernelFailed as e:
        t.expect(label, Q5_RUN_POINTS, False, f"cannot run: {e}")
        return None
    except (hostcuda.CompileError, lab06.MissingKernels) as e:
        why = lab06._compile_feedback(e.log) if isinstance(e, hostcuda.CompileError) else str(e)
        t.expect(label, Q5_RUN_POINTS, False, f"cannot run: {why}")
        return None
    ok = all(not isinstance(s, BaseException) and _kernel_close(s, c.reference()) for c, s in zip(cases, got,
                                                                                                    strict=True))
    if ok:
        t.expect(label, Q5_RUN_POINTS, True)
        return None
    t.parts.append((label, 0.0, Q5_RUN_POINTS, lambda: _q5_diagnose(t, cases, got, mutants)))
    return None


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _kernel_demo() -> Demo:
    rng = np.random.default_rng(7)
    Q, K = rng.standard_normal((16, 32)), rng.standard_normal((8, 32))
    return Demo(examples=[("one block: n = 16 queries, m = 8 keys, d = 32 (two k steps)", (Q, K))],
                run=lambda source, args: (qk_scores(source, *args),),
                right=lambda args: (KernelCase(*args, "").reference(),), names=("S",),
                rtol=1e-4, atol=1e-4)  # fp32 accumulation: rounding is not a mistake


def _kernel_sources(mutant) -> tuple[str, str]:
    """(right lines, wrong lines) of a kernel mutant, shown as a diff; nothing for the Python mutants."""
    return (KERNEL_SOLUTION, mutant.update) if isinstance(mutant, CudaMutant) else ("", "")


KNOWN_MISTAKES = KnownMistakes(
    demos={"A_POSITIONS_MUTANTS": lambda: _positions_demo(_a8_positions),
           "B_POSITIONS_MUTANTS": lambda: _positions_demo(_b8_positions),
           "C_POSITIONS_MUTANTS": lambda: _positions_demo(_c8_positions),
           "SOFTMAX_MUTANTS": _softmax_demo, "SWIZZLE_MUTANTS": _swizzle_demo,
           "LDMATRIX_MUTANTS": lambda: _positions_demo(_ldmatrix_a_rows), "KERNEL_MUTANTS": _kernel_demo},
    # A kernel mutant is a set of wrong lines, not a function: a student hands in the notebook's KERNEL string.
    submission=lambda mutant: render_kernel(mutant.update),
    sources=_kernel_sources,
)
