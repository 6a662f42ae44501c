"""Lab 01 — online softmax: ``online_update``, ``online_merge`` and ``attend_in_blocks`` for one row of scores."""

from __future__ import annotations

import numpy as np

from .. import online
from .core import Case, Lab, Mutant, Trial
from .known import Demo, KnownMistakes

LAB = Lab("lab01", "Online softmax")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. The reference and
# tiled forward compute one row's softmax average too (Q = [[1]], K = the scores as a column). q2 cannot list
# online.update: the grader's own adapter builds the two states with it while the student's merge runs.
ANSWERS = {
    "q1": ("flashlab.online.update",),
    "q2": ("flashlab.online.merge", "flashlab.gpu.decoding.merge_partials"),
    "q3": ("flashlab.online.attend", "flashlab.online.update", "flashlab.reference.attention", "flashlab.tiled.forward",
           "flashlab.numba_cpu.tiled_forward", "flashlab.numba_cpu.fast_forward", "flashlab.cpu_bench.naive_attention"),
}

LN3 = float(np.log(3.0))


# ------------------------------------------------------------------------------------------- truth and helpers
def _state(x) -> tuple:
    m, l, u = x
    return (np.float64(m), np.float64(l), np.asarray(u, dtype=np.float64))


def _ref_state(scores, values) -> tuple:
    """The exact state of one row after seeing all of ``scores`` (through flashlab.online)."""
    dv = None if np.ndim(values) == 1 else np.shape(values)[-1]
    s = online.update(online.init((), dv), np.asarray(scores, float), np.asarray(values, float))
    u = s.u if dv is not None else np.float64(s.u)
    if not np.any(np.isfinite(scores)):
        u = np.zeros_like(np.asarray(u, dtype=float))
    return (s.m, s.l, u)


def _edges(k: int, splits) -> list[tuple[int, int]]:
    e = [0, *splits, k]
    return list(zip(e[:-1], e[1:], strict=False))


def _fold(fn, case: Case) -> tuple:
    """Start from (−inf, 0, 0) and feed the blocks in order to ``fn(m, l, u, scores, values)``."""
    scores, values, splits = case.args
    m, l, u = -np.inf, 0.0, 0.0
    for lo, hi in _edges(len(scores), splits):
        m, l, u = fn(m, l, u, scores[lo:hi], values[lo:hi])
    return (m, l, u)


def _result_key(out: tuple) -> tuple:
    m, l, u = out
    with np.errstate(all="ignore"):
        return (np.asarray(u, float) / np.asarray(l, float),)


def _random_values(t: Trial, k: int):
    if t.rng.random() < 0.5:
        return t.rng.standard_normal(k)
    return t.rng.standard_normal((k, int(t.rng.integers(1, 5))))


def _random_splits(t: Trial, k: int, nblocks: int | None = None) -> list[int]:
    if k < 2:
        return []
    nblocks = nblocks or int(t.rng.integers(2, min(k, 5) + 1))
    return sorted(int(x) for x in t.rng.choice(np.arange(1, k), size=min(nblocks - 1, k - 1), replace=False))


# --------------------------------------------------------------------------------------------------- mutants
def _update_no_rescale(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:  # the guard kept: a learner who forgets the rescale usually has the rest right
        return m, l, u
    p = np.exp(s - m2)
    return m2, l + p.sum(), u + p @ v


def _update_no_max(m, l, u, s, v):
    p = np.exp(s)
    return max(m, np.max(s)), l + p.sum(), u + p @ v


def _update_unguarded(m, l, u, s, v):
    m2 = max(m, np.max(s))
    a = np.exp(m - m2)
    p = np.exp(s - m2)
    return m2, a * l + p.sum(), a * u + p @ v


def _update_average(m, l, u, s, v):
    m2 = max(m, np.max(s))
    a = np.exp(m - m2) if np.isfinite(m2) else 0.0
    p = np.exp(s - m2) if np.isfinite(m2) else np.zeros_like(s)
    l2 = a * l + p.sum()
    block = (p @ v) / p.sum() if p.sum() > 0 else 0.0 * (p @ v)
    result = block if l == 0 else (np.asarray(u) / l + block) / 2
    return m2, l2, l2 * result


def _update_normalised_wrong(m, l, u, s, v):
    # u kept normalised, but the old u is not multiplied back by l before adding: the lab 02 classic.
    m2 = max(m, np.max(s))
    a = np.exp(m - m2) if np.isfinite(m2) else 0.0
    p = np.exp(s - m2) if np.isfinite(m2) else np.zeros_like(s)
    l2 = a * l + p.sum()
    return m2, l2, (a * u + p @ v) / l2


def _update_normalised(m, l, u, s, v):
    m2 = max(m, np.max(s))
    a = np.exp(m - m2) if np.isfinite(m2) else 0.0
    p = np.exp(s - m2) if np.isfinite(m2) else np.zeros_like(s)
    l2 = a * l + p.sum()
    return m2, l2, (a * l * u + p @ v) / l2


def _update_rescale_l_only(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m - m2)
    p = np.exp(s - m2)
    return m2, a * l + p.sum(), u + p @ v


def _update_rescale_u_only(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m - m2)
    p = np.exp(s - m2)
    return m2, l + p.sum(), a * u + p @ v


def _update_flipped_rescale(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m2 - m)  # upside down: exp(m_new - m_old) >= 1, and inf while the state is empty
    p = np.exp(s - m2)
    return m2, a * l + p.sum(), a * u + p @ v


def _update_keeps_old_max(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m - m2)
    p = np.exp(s - m2)
    return m, a * l + p.sum(), a * u + p @ v  # the old m handed back


def _update_block_max(m, l, u, s, v):
    m2 = np.max(s)  # this block's max, not the running one
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m - m2)
    p = np.exp(s - m2)
    return m2, a * l + p.sum(), a * u + p @ v


def _update_block_against_old_max(m, l, u, s, v):
    m2 = max(m, np.max(s))
    if m2 == -np.inf:
        return m, l, u
    a = np.exp(m - m2)
    p = np.exp(s - m)  # the new block measured against the old max
    return m2, a * l + p.sum(), a * u + p @ v


UPDATE_MUTANTS = [
    Mutant(
        "l and u are not rescaled by exp(m - m_new) when a block raises the max: what was summed against the old "
        "max must be multiplied by exp(m_old - m_new) before adding the new block.",
        fn=_update_no_rescale,
    ),
    Mutant(
        "no max subtraction: exp(s) of raw scores overflows to inf (and inf/inf = nan) for scores near 1000; "
        "exponentiate s - m_new, where m_new is the running max.",
        fn=_update_no_max,
    ),
    Mutant(
        "a fully masked block (all scores -inf) gives nan: with m = m_new = -inf, exp(m - m_new) = exp(-inf + inf) "
        "= nan. When the max is still -inf, exponentiate against 0 instead (or skip the block).",
        fn=_update_unguarded,
    ),
    Mutant(
        "averaging block results: the new result is the plain mean of the old result and this block's result, "
        "but each block carries a different mass (its l); weight by mass, i.e. keep u and l as sums.",
        fn=_update_average,
        key=_result_key,
    ),
    Mutant(
        "your u is normalised (divided by l). In this lab u is the unnormalised sum of exp(s - m) * v; the "
        "answer u / l is taken once, at the end.",
        fn=_update_normalised,
    ),
    Mutant(
        "l is rescaled but u is not: both sums were measured against the old max, so both are multiplied by "
        "alpha = exp(m_old - m_new) before the new block is added (u' = alpha * u + p @ values).",
        fn=_update_rescale_l_only,
    ),
    Mutant(
        "u is rescaled but l is not: both sums were measured against the old max, so both are multiplied by "
        "alpha = exp(m_old - m_new) before the new block is added (l' = alpha * l + p.sum()).",
        fn=_update_rescale_u_only,
    ),
    Mutant(
        "the rescale factor is upside down: alpha = exp(m_old - m_new) is at most 1 (and 0 while the state is "
        "empty); exp(m_new - m_old) grows, and is inf on the first block (inf * 0 = nan).",
        fn=_update_flipped_rescale,
    ),
    Mutant(
        "m is not updated: you return the old max, so the next block rescales against the wrong max; return "
        "m_new = max(m, max(scores)) with the new l and u.",
        fn=_update_keeps_old_max,
    ),
    Mutant(
        "the running max is replaced by this block's max: m_new = max(m, max(scores)), the largest score seen so "
        "far, not only this block's (with a smaller block max, exp(m - m_new) > 1 can overflow).",
        fn=_update_block_max,
    ),
    Mutant(
        "the new block is exponentiated against the old max: p = exp(scores - m_new), not exp(scores - m); with the "
        "old max the first block gives exp(s + inf) = inf.",
        fn=_update_block_against_old_max,
    ),
    Mutant(
        "normalising inside the loop: you divide by the new l but did not multiply the old (already divided) u "
        "back by the old l. Keep u unnormalised here and divide once, at the end.",
        fn=_update_normalised_wrong,
    ),
]


def _merge_no_rescale(a, b):
    return max(a[0], b[0]), a[1] + b[1], a[2] + b[2]


def _merge_unguarded(a, b):
    m = max(a[0], b[0])
    wa, wb = np.exp(a[0] - m), np.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def _merge_average(a, b):
    m = max(a[0], b[0])
    ra, rb = np.asarray(a[2]) / a[1], np.asarray(b[2]) / b[1]
    return m, 1.0, (ra + rb) / 2


def _merge_swapped_weights(a, b):
    m = max(a[0], b[0])
    if m == -np.inf:
        return m, 0.0, a[2] + b[2]
    wa, wb = np.exp(b[0] - m), np.exp(a[0] - m)  # each side gets the other's factor
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def _merge_inverted_rescale(a, b):
    m = max(a[0], b[0])
    if m == -np.inf:
        return m, 0.0, a[2] + b[2]
    wa, wb = np.exp(m - a[0]), np.exp(m - b[0])  # upside down: >= 1, and inf for an empty side (inf * 0 = nan)
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def _merge_min(a, b):
    m = min(a[0], b[0])
    wa, wb = np.exp(a[0] - m), np.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def _merge_empty_if_either(a, b):
    if a[0] == -np.inf or b[0] == -np.inf:
        return -np.inf, 0.0, 0.0 * (np.asarray(a[2]) + np.asarray(b[2]))
    m = max(a[0], b[0])
    wa, wb = np.exp(a[0] - m), np.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def _merge_rescale_l_only(a, b):
    m = max(a[0], b[0])
    if m == -np.inf:
        return m, 0.0, a[2] + b[2]
    wa, wb = np.exp(a[0] - m), np.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], a[2] + b[2]


MERGE_MUTANTS = [
    Mutant(
        "averaging the two results: each state carries a different mass l, so the merged result is the l-weighted "
        "mean, (l_a e^(m_a-m) r_a + l_b e^(m_b-m) r_b) / l. Merge the sums (l, u), not the results.",
        fn=_merge_average,
        key=_result_key,
    ),
    Mutant(
        "the two states are added without rescaling: each was measured against its own max; multiply l and u of "
        "each by exp(m_own - m_new) before adding.",
        fn=_merge_no_rescale,
    ),
    Mutant(
        "merging two empty (fully masked) states gives nan: exp(-inf - (-inf)) = nan. When the new max is -inf the "
        "result is the empty state (-inf, 0, 0).",
        fn=_merge_unguarded,
    ),
    Mutant(
        "the two weights are swapped: state a is rescaled by exp(m_a - m) and state b by exp(m_b - m), each by its "
        "own max.",
        fn=_merge_swapped_weights,
    ),
    Mutant(
        "the rescale factor is inverted: each state is multiplied by exp(m_own - m), at most 1 (and 0 for an empty "
        "side); exp(m - m_own) grows instead, and is inf for an empty side (inf * 0 = nan).",
        fn=_merge_inverted_rescale,
    ),
    Mutant(
        "the merged max is the smaller one: m = max(m_a, m_b), so that no factor exp(m_own - m) exceeds 1 (with "
        "the min, an empty side gives exp(+inf)).",
        fn=_merge_min,
    ),
    Mutant(
        "one empty side empties the merge: when only one state is empty (-inf, 0, 0) the result is the other "
        "state; only two empty states give the empty state.",
        fn=_merge_empty_if_either,
    ),
    Mutant(
        "the merge rescales l but not u: u_a and u_b are sums against their own maxes too; multiply each by "
        "exp(m_own - m) before adding.",
        fn=_merge_rescale_l_only,
    ),
]


def _attend_average(scores, values, block):
    results = []
    for lo in range(0, len(scores), block):
        s, v = scores[lo : lo + block], values[lo : lo + block]
        w = np.exp(s - s.max())
        results.append((w @ v) / w.sum())
    return np.mean(results, axis=0)


def _attend_drop_ragged(scores, values, block):
    k = (len(scores) // block) * block
    return online.attend(scores[:k], values[:k], list(range(block, k, block)))


def _attend_returns_u(scores, values, block):
    s = online.init((), None if np.ndim(values) == 1 else np.shape(values)[-1])
    for lo in range(0, len(scores), block):
        s = online.update(s, scores[lo : lo + block], values[lo : lo + block])
    return s.u


def _attend_max_starts_at_zero(scores, values, block):
    m, l, u = 0.0, 0.0, 0.0
    for lo in range(0, len(scores), block):
        sb, vb = scores[lo : lo + block], values[lo : lo + block]
        m2 = max(m, sb.max())
        a, p = np.exp(m - m2), np.exp(sb - m2)
        m, l, u = m2, a * l + p.sum(), a * u + p @ vb
    return u / l


def _attend_slices_one_short(scores, values, block):
    s = online.init((), None if np.ndim(values) == 1 else np.shape(values)[-1])
    for lo in range(0, len(scores), block):
        s = online.update(s, scores[lo : lo + block - 1], values[lo : lo + block - 1])
    return s.result()


def _attend_state_reset_per_block(scores, values, block):
    for lo in range(0, len(scores), block):
        s = online.init((), None if np.ndim(values) == 1 else np.shape(values)[-1])
        s = online.update(s, scores[lo : lo + block], values[lo : lo + block])
    return s.result()


ATTEND_MUTANTS = [
    Mutant(
        "averaging block results: the mean of each block's softmax average ignores that blocks carry different "
        "masses (0.5 instead of 0.75 on the scalar example). Fold the blocks through online_update instead.",
        fn=_attend_average,
    ),
    Mutant(
        "the last ragged block is dropped: when len(scores) is not a multiple of the block size, the final, "
        "shorter block still has to be processed (range(0, k, block) with slices that stop at k).",
        fn=_attend_drop_ragged,
    ),
    Mutant(
        "the result is not divided by l: the state's u is a sum of exp(s - m) * v; the softmax average is u / l.",
        fn=_attend_returns_u,
    ),
    Mutant(
        "the running max starts at 0 instead of -inf: when every score is far below 0 (about -745 or less), "
        "exp(s - 0) underflows to 0 and u / l = 0 / 0. Start from the empty state (-inf, 0, 0).",
        fn=_attend_max_starts_at_zero,
    ),
    Mutant(
        "each block slice is one key short: scores[start : start + block] already stops before start + block; "
        "with - 1 a key per block is skipped (and block = 1 gives empty blocks).",
        fn=_attend_slices_one_short,
    ),
    Mutant(
        "the state is reset inside the block loop: only the last block is left. Start from (-inf, 0, 0) once, "
        "before the loop.",
        fn=_attend_state_reset_per_block,
    ),
]


# ------------------------------------------------------------------------------------------------- questions
# Every part always holds the inputs its points are for (the scalar examples, a later block with a smaller max, a
# ragged last block, block = 1, scores far below 0, masked blocks on either side): the same wrong code earns the
# same points whatever the seed; the random inputs around them only make hard-coding pointless.
FOLD_ARGS = ("scores", "values", "splits")
#: The lab's second scalar example: every missing rescale (of l, of u, of both) changes its answer 5/3.
SEPARATING = (np.array([0.0, 0.0, LN3, 0.0]), np.array([0.0, 2.0, 2.0, 2.0]))


def _fold_case(scores, values, splits, label: str) -> Case:
    return Case((np.asarray(scores, float), np.asarray(values, float), list(splits)), label, names=FOLD_ARGS)


@LAB.question("q1", points=5, objects=("online_update",))
def q1(t: Trial, online_update) -> None:
    """online_update folds blocks of scores into (m, l, u) exactly."""
    names = ("m", "l", "u")

    def ref(case):
        return _ref_state(case.args[0], case.args[1])

    one = [_fold_case([0.5, -1.0, 2.0], [1.0, 2.0, 3.0], [], "one block, k=3")]
    for _ in range(3):
        k = int(t.rng.integers(1, 9))
        one.append(_fold_case(t.rng.standard_normal(k) * 3, _random_values(t, k), [], f"one block, k={k}"))
    t.compare("one block", 1, student=online_update, cases=one, reference=ref, run=_fold, mutants=UPDATE_MUTANTS,
              names=names)

    many = [
        _fold_case([0, 0, LN3, LN3], [0.0, 0, 1, 1], [2], "the scalar example (answer 0.75)"),
        _fold_case(*SEPARATING, [2], "the second scalar example (answer 5/3)"),
        _fold_case([2.0, 0.5, -1.0, 0.3], [1.0, -1.0, 2.0, 0.5], [2], "the max falls in the second block"),
    ]
    for i in range(6):
        k = int(t.rng.integers(2, 13))
        s = t.rng.standard_normal(k) * 3
        if i % 2 == 0:
            s = np.sort(s)  # the max grows with every block: the rescale is needed each time
        many.append(_fold_case(s, _random_values(t, k), _random_splits(t, k), f"k={k}"))
    t.compare("several blocks, any split", 2, student=online_update, cases=many, reference=ref, run=_fold,
              mutants=UPDATE_MUTANTS, names=names)

    huge = [_fold_case([998.0, 1000.0], [0.0, 1.0], [1], "scores 998 then 1000")]
    for _ in range(3):
        k = int(t.rng.integers(2, 10))
        s = np.sort(t.rng.uniform(-1000, 1000, k))
        s[-1] = 1000.0
        huge.append(_fold_case(s, _random_values(t, k), _random_splits(t, k), f"scores up to 1000, k={k}"))
    t.compare("huge scores (up to 1000)", 1, student=online_update, cases=huge, reference=ref, run=_fold,
              mutants=UPDATE_MUTANTS, names=names)

    v4 = [1.0, 4.0, 4.0, -1.0]
    masked = [_fold_case([0.5, -np.inf, -np.inf, 2.0], v4, [1, 3], "masked block, then a larger max"),
              _fold_case([2.0, -np.inf, -np.inf, 0.5], v4, [1, 3], "masked block, then a smaller max")]
    for i in range(4):
        k = int(t.rng.integers(3, 10))
        s = t.rng.standard_normal(k)
        j = int(t.rng.integers(1, k - 1))
        if i % 2 == 0:
            s[:j] = -np.inf  # the first block is masked: the state is still empty when it arrives
            splits = [j]
        else:
            j2 = int(t.rng.integers(j + 1, k))
            s[j:j2] = -np.inf
            splits = [j, j2]
        masked.append(_fold_case(s, _random_values(t, k), splits, f"a fully masked block, k={k}"))
    t.compare("a fully masked block (-inf scores)", 1, student=online_update, cases=masked, reference=ref, run=_fold,
              mutants=UPDATE_MUTANTS, names=names)


def _merge_run(fn, case: Case) -> tuple:
    scores, values, j = case.args
    a = _ref_state(scores[:j], values[:j]) if j > 0 else (-np.inf, 0.0, 0.0)
    b = _ref_state(scores[j:], values[j:]) if j < len(scores) else (-np.inf, 0.0, 0.0)
    return tuple(fn(a, b))


MERGE_ARGS = ("scores", "values", "split (state_a: scores[:split], state_b: scores[split:])")


@LAB.question("q2", points=3, objects=("online_merge",))
def q2(t: Trial, online_merge) -> None:
    """online_merge combines the states of two disjoint sets of keys."""

    def ref(case):
        return _ref_state(case.args[0], case.args[1])

    cases = [Case((np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2), "the scalar example split in two",
                  names=MERGE_ARGS),
             Case((np.array([1.5, -0.5, 0.0]), np.array([1.0, 3.0, -2.0]), 1), "the larger max on the left",
                  names=MERGE_ARGS)]
    for i in range(6):
        k = int(t.rng.integers(2, 12))
        s = t.rng.standard_normal(k) * (1000 if i == 5 else 3)
        cases.append(Case((s, _random_values(t, k), int(t.rng.integers(1, k))), f"k={k}", names=MERGE_ARGS))
    t.compare("two halves", 2, student=online_merge, cases=cases, reference=ref, run=_merge_run,
              mutants=MERGE_MUTANTS, names=("m", "l", "u"))

    empty = []
    for i in range(3):
        k = int(t.rng.integers(2, 8))
        s = t.rng.standard_normal(k)
        j = int(t.rng.integers(1, k))
        if i == 0:
            s[:] = -np.inf  # both sides saw only masked keys
        elif i == 1:
            s[:j] = -np.inf
        else:
            s[j:] = -np.inf
        where = ("both sides", "the left side", "the right side")[i]
        empty.append(Case((s, _random_values(t, k), j), "masked keys on " + where, names=MERGE_ARGS))
    empty.append(Case((np.array([0.5, 1.0]), np.array([1.0, 2.0]), 0), "state_a empty (-inf, 0, 0)",
                      names=MERGE_ARGS))
    t.compare("an empty or fully masked side", 1, student=online_merge, cases=empty, reference=ref, run=_merge_run,
              mutants=MERGE_MUTANTS, names=("m", "l", "u"))


@LAB.question("q3", points=2, objects=("attend_in_blocks",), uses=("online_update",))
def q3(t: Trial, attend_in_blocks) -> None:
    """attend_in_blocks(scores, values, block) gives the softmax-weighted average of values."""
    cases = [
        Case((np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2), "the scalar example (answer 0.75)"),
        Case((*SEPARATING, 2), "the second scalar example (answer 5/3)"),
        Case((np.array([0, 0, LN3, LN3, 2.0]), np.array([0.0, 0, 1, 1, 4]), 2), "a ragged last block"),
        Case((np.array([-1000.0, -1001.0, -999.5]), np.array([1.0, 2.0, 3.0]), 2), "every score near -1000"),
    ]
    k = int(t.rng.integers(2, 9))
    cases.append(Case((t.rng.standard_normal(k) * 3, _random_values(t, k), 1), f"k={k}, block=1"))
    for _ in range(5):
        k = int(t.rng.integers(2, 20))
        block = int(t.rng.integers(1, k + 1))
        if k % block == 0 and block > 1:
            block -= 1  # mostly ragged: the last block is shorter
        cases.append(Case((t.rng.standard_normal(k) * 3, _random_values(t, k), block), f"k={k}, block={block}"))

    def ref(case):
        s, v, _ = case.args
        return online.attend(s, v)

    t.compare("blocks of any size", 2, student=attend_in_blocks, cases=cases, reference=ref, mutants=ATTEND_MUTANTS,
              names=("result",), arg_names=("scores", "values", "block"))


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _result_of(state) -> tuple:
    m, l, u = (np.asarray(x, dtype=float) for x in state)
    with np.errstate(all="ignore"):
        result = np.where(l == 0, 0.0, u / np.where(l == 0, 1.0, l))  # an empty row's result is 0 by convention
    return (result, m, l, u)


def _update_demo() -> Demo:
    return Demo(
        examples=[
            ("the scalar example: scores [0, 0, ln 3, ln 3], values [0, 0, 1, 1], two blocks of two",
             (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), [2])),
            ("the second scalar example: scores [0, 0, ln 3, 0], values [0, 2, 2, 2], two blocks of two",
             (*SEPARATING, [2])),
            ("the max falls in the second block: scores [2, 0.5, -1, 0.3], values [1, -1, 2, 0.5], two blocks of two",
             (np.array([2.0, 0.5, -1.0, 0.3]), np.array([1.0, -1.0, 2.0, 0.5]), [2])),
            ("logits near 1000: scores [998, 1000], values [0, 1], one score per block",
             (np.array([998.0, 1000.0]), np.array([0.0, 1.0]), [1])),
            ("a fully masked first block: scores [-inf, -inf, 0, ln 3], values [5, 5, 0, 1], two blocks of two",
             (np.array([-np.inf, -np.inf, 0, LN3]), np.array([5.0, 5, 0, 1]), [2])),
        ],
        run=lambda fn, args: _result_of(_fold(fn, Case(args))),
        right=lambda args: _result_of(_ref_state(args[0], args[1])),
        names=("result u/l", "m", "l", "u"),
    )


def _merge_demo() -> Demo:
    return Demo(
        examples=[
            ("the scalar example split in two: scores [0, 0 | ln 3, ln 3], values [0, 0 | 1, 1]",
             (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2)),
            ("the second scalar example split in two: scores [0, 0 | ln 3, 0], values [0, 2 | 2, 2]",
             (*SEPARATING, 2)),
            ("logits +-1000: scores [1000 | -1000], values [1 | 0]", (np.array([1000.0, -1000.0]), np.array([1.0, 0]),
                                                                     1)),
            ("both halves fully masked: scores [-inf | -inf]", (np.array([-np.inf, -np.inf]), np.array([1.0, 2.0]),
                                                                1)),
            ("one half fully masked: scores [-inf | 0.5], values [1 | 2]", (np.array([-np.inf, 0.5]),
                                                                          np.array([1.0, 2.0]), 1)),
        ],
        run=lambda fn, args: _result_of(_merge_run(fn, Case(args))),
        right=lambda args: _result_of(_ref_state(args[0], args[1])),
        names=("result u/l", "m", "l", "u"),
    )


def _attend_demo() -> Demo:
    return Demo(
        examples=[
            ("the scalar example, block = 2", (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2)),
            ("a ragged last block: scores [0, 0, ln 3, ln 3, 2], values [0, 0, 1, 1, 4], block = 2",
             (np.array([0, 0, LN3, LN3, 2.0]), np.array([0.0, 0, 1, 1, 4]), 2)),
            ("every score near -1000: scores [-1000, -1001, -999.5], values [1, 2, 3], block = 2",
             (np.array([-1000.0, -1001.0, -999.5]), np.array([1.0, 2.0, 3.0]), 2)),
        ],
        right=lambda args: online.attend(args[0], args[1]),
        names=("result",),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"UPDATE_MUTANTS": _update_demo, "MERGE_MUTANTS": _merge_demo, "ATTEND_MUTANTS": _attend_demo},
)
