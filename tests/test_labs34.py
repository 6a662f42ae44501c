"""Labs 03 and 04: scores that do not depend on the random draw, diagnoses that name only the mistake made, credit
per gradient and for memory on its own, the derivation tasks checked against finite differences and the counter."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from flashlab import iocount, mistakes, reference, tiled
from flashlab.grading import answers, lab03, lab04, run_question
from flashlab.grading.known import solution_object

SEEDS = (11, 12, 13)
LIKELY = re.compile(r"Likely mistake \([^)]*\): (.*)$")


def _mistakes(lab_id: str):
    return [pytest.param(m, id=f"{m.question}-{m.title[:40]}-{m.variant[:20]}") for m in mistakes.catalogue([lab_id])]


def _likely(feedback: str) -> list[str]:
    return [match.group(1) for line in feedback.splitlines() if (match := LIKELY.search(line))]


def _same_across_seeds_and_named_alone(mistake):
    results = [mistakes.grade(mistake, seed) for seed in SEEDS]
    scores = {r.seed: r.score for r in results}
    assert len(set(scores.values())) == 1, f"{mistake!r} earns different points per seed: {scores}"
    for r in results:
        assert r.score < r.max_score and mistakes.diagnosed(mistake, r), f"seed {r.seed}:\n{r.feedback}"
        if mistake.mutant is not None:  # no other known mistake may be printed as the likely one
            wrong = [text for text in _likely(r.feedback) if text != mistake.message]
            assert not wrong, f"{mistake!r}, seed {r.seed}, also blamed on: {wrong}\n{r.feedback}"


@pytest.mark.parametrize("mistake", _mistakes("lab03"))
def test_lab03_mistakes_score_the_same_for_every_seed_and_only_they_are_named(mistake):
    _same_across_seeds_and_named_alone(mistake)


@pytest.mark.parametrize("mistake", _mistakes("lab04"))
def test_lab04_mistakes_score_the_same_for_every_seed_and_only_they_are_named(mistake):
    _same_across_seeds_and_named_alone(mistake)


def test_at_least_eight_new_mistakes_per_lab_and_the_ones_learners_made_are_named():
    titles = {lab: [m.message for m in mistakes.catalogue([lab])] for lab in ("lab03", "lab04")}
    assert len(titles["lab03"]) >= 16 + 8 and len(titles["lab04"]) >= 13 + 8
    assert any("n // block_k" in t for t in titles["lab03"]) and any("n // block_q" in t for t in titles["lab03"])
    assert any(t.startswith("10 n m d") for t in titles["lab04"]) and any("dv is ignored" in t for t in titles["lab04"])
    assert any("dS @ Q_i" in t for t in titles["lab04"])


# ---------------------------------------------------------------------------------------------------- lab 04
def test_a_wrong_dq_keeps_the_points_of_dk_dv_and_memory():
    r = run_question("lab04", "q1", [lab04._switch(assign_dq=True)], seed=5)
    assert r.score == r.max_score - 1, r.feedback
    assert "[FAIL] dQ" in r.feedback and "[ok  ] dK" in r.feedback and "[ok  ] dV" in r.feedback


def test_a_failing_backward_input_names_its_arguments():
    r = run_question("lab04", "q1", [lab04._switch(assign_dq=True)], seed=5)
    shown = r.feedback.split("Smallest failing input", 1)[1].splitlines()[1]
    assert re.match(r"\s*Q = .*, K = .*, V = .*, O = .*, L = .*, dO = .*, block_q = \d+, block_k = \d+$", shown), shown
    assert "arg1" not in r.feedback, r.feedback


def test_memory_is_half_the_lab_and_scored_whatever_the_gradients():
    lab = lab04.LAB
    assert lab04.MEMORY_POINTS >= lab.max_score / 2
    r = run_question("lab04", "q1", [lab04._switch(use_d=False, scale_scores=False)], seed=6)
    assert r.score == lab04.MEMORY_POINTS and "[ok  ] memory" in r.feedback, r.feedback  # every gradient wrong
    with answers.trusted():  # the course's own wrong answer calls the reference backward
        stores_p = run_question("lab04", "q1", [lab04._stores_p], seed=6)
    assert stores_p.score == 3 and "[FAIL] memory" in stores_p.feedback, stores_p.feedback


def test_memory_is_not_measured_for_outputs_of_the_wrong_shape():
    def transposed_outputs(Q, K, V, O, L, dO, block_q, block_k):
        dQ, dK, dV = reference.attention_backward(Q, K, V, dO)
        return dQ.T, dK.T, dV.T

    with answers.trusted():
        r = run_question("lab04", "q1", [transposed_outputs], seed=7)
    assert r.score == 0 and "memory not measured" in r.feedback and "shapes" in r.feedback, r.feedback


def test_the_memory_part_runs_at_the_size_the_batch_grader_measures():
    assert lab04.MEMORY_N == 4096 and lab04.MEMORY_D == 16 and set(lab04.MEMORY_BLOCKS) == {128, 256}
    assert lab04.MEMORY_LIMIT == 4096 * 4096 * 8 // 8


def _softmax_rows(S):
    P = np.exp(S - S.max(axis=1, keepdims=True))
    return P / P.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("shape,offset", [((3, 5), 0.0), ((1, 4), 0.0), ((4, 1), 0.0), ((2, 6), 1000.0)])
def test_the_softmax_step_is_what_finite_differences_say(shape, offset):
    rng = np.random.default_rng(sum(shape))
    S, dP = offset + rng.standard_normal(shape), rng.standard_normal(shape)
    eps, fd = 1e-6, np.zeros(shape)
    for idx in np.ndindex(shape):
        Sp, Sm = S.copy(), S.copy()
        Sp[idx] += eps
        Sm[idx] -= eps
        fd[idx] = (np.sum(dP * _softmax_rows(Sp)) - np.sum(dP * _softmax_rows(Sm))) / (2 * eps)
    assert np.abs(lab04._softmax_backward(S, dP) - fd).max() < 1e-7
    mine = solution_object("lab04", "softmax_backward")(S, dP)
    assert np.abs(mine - fd).max() < 1e-7


def test_the_row_term_from_dp_equals_the_one_from_do_and_o():
    """rowsum(P * dP) = rowsum(dO * O): the two ways of writing D are not two mistakes, and the grader says so."""
    rng = np.random.default_rng(4)
    Q, K, V, dO = rng.standard_normal((6, 3)), rng.standard_normal((9, 3)), rng.standard_normal((9, 2)), \
        rng.standard_normal((6, 2))
    P = reference.softmax_matrix(Q, K)
    O, _ = reference.attention(Q, K, V)
    assert np.allclose(np.sum(P * (dO @ V.T), axis=1), np.sum(dO * O, axis=1), rtol=1e-12, atol=1e-14)

    def through_the_jacobian(S, dP):  # the full Jacobian of each row, applied: no shortcut through D at all
        dS = np.empty_like(S)
        for i, row in enumerate(_softmax_rows(S)):
            dS[i] = (np.diag(row) - np.outer(row, row)) @ dP[i]
        return dS

    r = run_question("lab04", "q3", [through_the_jacobian], seed=3)
    assert r.score == r.max_score, r.feedback


def test_the_solution_scores_full_marks_on_every_lab04_question():
    for question, obj in (("q1", "flash_backward"), ("q2", "backward_flops"), ("q3", "softmax_backward")):
        r = run_question("lab04", question, [solution_object("lab04", obj)], seed=21)
        assert r.score == r.max_score, r.feedback


# ---------------------------------------------------------------------------------------------------- lab 03
@pytest.mark.parametrize("n", [1, 2, 7, 30, 64, 97])
def test_the_q_outer_backward_closed_form_is_what_the_counter_counts(n):
    for d in (1, 4):
        for bq, bk in ((1, 1), (3, 5), (8, 2), (16, 16), (40, 7)):
            sram = 4 * (min(bq, n) + min(bk, n)) * d
            counted = lab03.count_q_outer_backward(n, d, sram=sram, block_q=bq, block_k=bk, seed=n)
            assert (counted.reads, counted.writes) == lab03._q_outer_backward(n, d, sram, bq, bk)
            assert counted.sram_peak == sram
            mine = solution_object("lab03", "q_outer_backward_counts")(n, d, sram, bq, bk)
            assert tuple(mine) == (counted.reads, counted.writes)
    with pytest.raises(iocount.SramOverflow):
        lab03.count_q_outer_backward(n + 4, 2, sram=4 * 2 * 2 * 2 - 1, block_q=2, block_k=2)


def test_the_backward_task_is_not_a_count_the_chapter_prints():
    """Algorithm 4's closed form (chapter 3, section 8) handed in for the other order is a named mistake."""
    kv = lambda n, d, sram, bq, bk: lab03._rw(iocount.predict_backward("kv_outer", n, d, sram=sram,  # noqa: E731
                                                                      block_q=bq, block_k=bk))
    r = run_question("lab03", "q4", [kv], seed=2)
    assert r.score == 0 and "that is Algorithm 4's count" in r.feedback, r.feedback


def _notebook_namespace(standard_counts=None):
    """The solution's q1-q3 functions in one namespace, as a notebook holds them, optionally one replaced."""
    ns = {"math": math}
    for name in ("standard_counts", "kv_outer_counts", "paper_blocks"):
        ns[name] = solution_object("lab03", name)
    if standard_counts is not None:
        ns["standard_counts"] = standard_counts
    ratio = solution_object("lab03", "traffic_ratio")
    ns["traffic_ratio"] = type(ratio)(ratio.__code__, ns)  # looks its helpers up in this namespace
    return [ns[name] for name in ("traffic_ratio", "standard_counts", "kv_outer_counts", "paper_blocks")]


def _floor_standard(n, d, sram, bq, bk):
    return lab03._standard(n, d, sram, bq, bk, ceil="floor")


def test_q3_says_when_the_earlier_answer_it_calls_is_wrong():
    r = run_question("lab03", "q3", _notebook_namespace(_floor_standard), seed=4)
    assert r.score == 0
    assert "q3 uses your standard_counts, which fails q1" in r.feedback and "fix that first" in r.feedback
    assert "Likely mistake" not in r.feedback, r.feedback
    assert run_question("lab03", "q3", _notebook_namespace(), seed=4).score == 1


def test_q3_with_right_earlier_answers_diagnoses_the_ratio_itself():
    objects = _notebook_namespace()
    objects[0] = lab03.RATIO_MUTANTS[0].fn
    with answers.trusted():  # the course's wrong ratio uses the package's default blocks
        r = run_question("lab03", "q3", objects, seed=4)
    assert r.score == 0 and lab03.RATIO_MUTANTS[0].message in r.feedback and "fix that first" not in r.feedback


def test_a_ratio_that_does_not_use_a_wrong_earlier_answer_is_not_blamed_on_it():
    objects = _notebook_namespace(_floor_standard)
    objects[0] = solution_object("lab03", "traffic_ratio")  # the solution's own helpers, all right
    assert run_question("lab03", "q3", objects, seed=4).score == 1


def test_each_part_always_holds_the_kinds_its_points_are_for():
    from flashlab.grading.core import Trial

    for seed in range(20):
        t = Trial(seed)
        for algorithm in iocount.ALGORITHMS:
            cases = lab03._cases(t, algorithm)
            args = [c.args for c in cases]
            assert any(n % bq and n % bk and n > 2 * max(bq, bk) for n, d, m, bq, bk in args)  # ragged, T >= 2
            assert any(n == 1 for n, *_ in args) and any(n < min(bq, bk) for n, d, m, bq, bk in args)
            assert all(bq != bk for *_, bq, bk in args)
            assert (algorithm != "standard") or any(n > m for n, d, m, bq, bk in args)
        kinds = [c.label.split(":")[0] for c in lab04.backward_cases(t)]
        assert kinds.count("n=1, m=1 (smaller than a block)") == 1 and sum("scores up to 1000" in k for k in kinds) == 2
        square = [c.args for c in lab04.backward_cases(t)[:3]]
        assert all(Q.shape[0] == K.shape[0] and bq == bk and Q.shape[0] // bq >= 2
                   for Q, K, V, O, L, dO, bq, bk in square)


def test_the_lab04_demo_inputs_come_from_the_forward():
    demo = lab04._backward_demo()
    for _, (Q, K, V, O, L, *_rest) in demo.examples:
        O_ref, L_ref = reference.attention(Q, K, V)
        assert np.allclose(O, O_ref, atol=1e-14) and np.allclose(L, L_ref, atol=1e-14)
        assert np.allclose(tiled.forward(Q, K, V)[0], O_ref, atol=1e-14)


def test_a_softmax_without_the_max_keeps_the_points_of_ordinary_scores():
    for seed in (1, 2):
        r = run_question("lab04", "q3", [lab04._softmax_switch("no max")], seed=seed)
        wrong = run_question("lab04", "q3", [lab04._softmax_switch("no D")], seed=seed)
        assert r.score == 1.5 and wrong.score == 0 and r.max_score == 2, (r.feedback, wrong.feedback)
        assert "no max subtraction" in r.feedback, r.feedback


def test_a_scale_missing_only_in_dk_is_named_as_such():
    for seed in (1, 2):
        r = run_question("lab04", "q1", [lab04._switch(unscaled="dK")], seed=seed)
        assert "[ok  ] dQ" in r.feedback and "the scale is missing in dK (dQ has it)" in r.feedback, r.feedback
        assert "missing in dQ and dK" not in r.feedback, r.feedback


# -------------------------------------------------------------------------------- lab 03: block-sparse tiles
def _window_shapes():
    """Edge shapes of the window patterns: n = 1, n and m below a block, ragged, m != n, 1 x 1 tiles, a window
    wider than a tile, window 0 and no limit on either side, with and without a stride."""
    rng = np.random.default_rng(3)
    shapes = [(1, 1, 1, 1, None, 0, 1), (1, 5, 4, 2, 0, 0, 1), (3, 2, 8, 8, None, None, 1), (7, 7, 1, 1, 2, 3, 2),
              (30, 45, 4, 7, 0, 0, 1), (45, 30, 7, 4, 29, 0, 3), (64, 64, 8, 8, None, 0, 4), (17, 40, 2, 1, 9, 5, 5)]
    for _ in range(300):
        n, m = (int(x) for x in rng.integers(1, 60, 2))
        bq, bk = (int(x) for x in rng.integers(1, 13, 2))
        left = None if rng.random() < 0.25 else int(rng.integers(0, m))
        right = None if rng.random() < 0.25 else int(rng.integers(0, n))
        shapes.append((n, m, bq, bk, left, right, int(rng.integers(1, 7))))
    return shapes


def test_the_tile_kinds_of_the_solution_and_of_the_grader_are_blocksparse_s():
    from flashlab import blocksparse

    tile_kinds = solution_object("lab03", "tile_kinds")
    for n, m, bq, bk, left, right, stride in _window_shapes():
        want = blocksparse.Window(left, right, stride).block_mask(n, m, bq, bk).kinds
        seen = blocksparse.Window(left, right, stride).mask(n, m)
        assert np.array_equal(lab03._reduce(seen, bq, bk), want)  # from the element mask, tile by tile
        assert np.array_equal(lab03._kinds(n, m, bq, bk, left, right, stride), want)  # every switch off
        assert np.array_equal(tile_kinds(n, m, bq, bk, left, right, stride), want)


def test_the_flops_q6_expects_are_what_the_counter_counts():
    from flashlab import blocksparse

    for n, bq, bk, pattern in ((37, 8, 5, (6, 0, 1)), (64, 16, 8, (None, 0, 1)), (50, 7, 12, (20, 3, 3))):
        d, sram = 4, 2 * (8 + 16) * 4 + 100
        kinds = blocksparse.Window(*pattern).block_mask(n, n, bq, bk).kinds
        *counts, flops = lab03.tile_work_of(kinds, n, n, d, bq, bk)
        for algorithm in ("q_outer", "kv_outer"):
            counted = iocount.count(algorithm, n, d, sram=sram, block_q=bq, block_k=bk,
                                    mask=blocksparse.Window(*pattern))
            assert flops == counted.flops
        assert counts == [int(np.count_nonzero(kinds == k)) for k in lab03.KIND_ORDER] and sum(counts) == kinds.size
        work = solution_object("lab03", "tile_work")(n, n, d, bq, bk, *pattern)
        assert work == (*counts, flops)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_block_sparse_solution_scores_full_marks(seed):
    for question, name in (("q5", "tile_kinds"), ("q6", "tile_work")):
        r = run_question("lab03", question, [solution_object("lab03", name)], seed=seed)
        assert r.score == r.max_score, r.feedback


def test_each_block_sparse_part_holds_the_inputs_its_mistakes_need():
    from flashlab.grading.core import Trial

    for seed in range(20):
        t = Trial(seed)
        windows = [c.args for c in lab03._pattern_cases(t, lab03.WINDOW_KINDS)]
        dilated = [c.args for c in lab03._pattern_cases(t, lab03.DILATED_KINDS)]
        assert all(bq != bk for _, _, bq, bk, *_ in windows + dilated)  # tiles not square
        assert all(stride == 1 for *_, stride in windows) and all(stride > 1 for *_, stride in dilated)
        assert any(n != m for n, m, *_ in windows) and any(n > m for n, m, *_ in windows)
        assert all(n % bq or m % bk for n, m, bq, bk, *_ in windows)  # a ragged last tile in every window case
        assert any(left == right == 0 for _, _, _, _, left, right, _ in windows)  # window 0
        assert any(left is not None and left > max(bq, bk) for _, _, bq, bk, left, _, _ in windows)
        assert any(bq + bk - 1 < stride for _, _, bq, bk, _, _, stride in dilated)


def test_calling_the_course_s_patterns_scores_zero_however_they_are_reached():
    from flashlab import blocksparse

    def through_a_constructor(n, m, block_q, block_k, left, right, stride):
        return blocksparse.dilated(stride, left=left, right=right).block_mask(n, m, block_q, block_k).kinds

    def through_the_class(n, m, block_q, block_k, left, right, stride):
        return blocksparse.Window(left, right, stride).block_mask(n, m, block_q, block_k).kinds

    def through_the_element_mask(n, m, block_q, block_k, left, right, stride):
        return lab03._reduce(blocksparse.Window(left, right, stride).mask(n, m), block_q, block_k)

    for cheat, name in ((through_a_constructor, "dilated"), (through_the_class, "_check_size"),
                        (through_the_element_mask, "_check_size")):
        r = run_question("lab03", "q5", [cheat], seed=1)
        assert r.score == 0 and f"calls flashlab.blocksparse.{name} " in r.feedback, r.feedback
    tile_kinds = solution_object("lab03", "tile_kinds")
    assert run_question("lab03", "q5", [tile_kinds], seed=1).score == 3  # the constants are not an answer
    assert np.array_equal(blocksparse.causal().block_mask(5, 5, 2, 2).kinds, tile_kinds(5, 5, 2, 2, None, 0, 1))


def test_q6_says_when_the_tile_kinds_it_calls_are_wrong():
    ns = {"np": np, "EMPTY": 0, "PARTIAL": 1, "FULL": 2, "tile_kinds": lab03.TILE_KIND_MUTANTS[-1].fn}
    right = solution_object("lab03", "tile_work")
    tile_work = type(right)(right.__code__, ns)  # looks tile_kinds up in this namespace, as a notebook does
    with answers.trusted():  # the course's own wrong tile_kinds
        r = run_question("lab03", "q6", [tile_work], seed=4, uses={"tile_kinds": ns["tile_kinds"]})
    assert r.score == 0 and "q6 uses your tile_kinds, which fails q5" in r.feedback, r.feedback
    assert "Likely mistake" not in r.feedback, r.feedback


def test_the_block_sparse_mistakes_the_lab_promises_are_named():
    messages = [m.message for m in mistakes.catalogue(["lab03"]) if m.question in ("q5", "q6")]
    assert len(messages) >= 8
    for phrase in ("reaches one tile too far", "boundary tile is treated as FULL", "counts key blocks instead of "
                   "tokens", "left and right are swapped", "causal alignment is ignored", "counted per visible pair"):
        assert any(phrase in text for text in messages), phrase
