"""Lab 07's grader: the solution scores full marks, the released stubs zero, and each known mistake is named — the
same mistake, with the same score, whatever the seed — while right answers written differently pass."""

from __future__ import annotations

import ast
import pathlib

import nbformat
import numpy as np
import pytest

from flashlab import fragments, mistakes
from flashlab.grading import get_lab, lab07, run_question
from flashlab.grading.core import mistake_title
from flashlab.grading.known import solution_object

ROOT = pathlib.Path(__file__).resolve().parent.parent
RELEASED = ROOT / "labs" / "lab07_tensor_cores.ipynb"
SEEDS = (0, 1, 2, 3, 4)


def _solution(question: str) -> list:
    return [solution_object("lab07", name) for name in get_lab("lab07").questions[question].objects]


def _released_namespace() -> dict:
    """The functions of the student's copy, defined as the notebook defines them (stubs)."""
    namespace: dict = {"np": np, "shfl_xor": fragments.shfl_xor}
    for cell in nbformat.read(RELEASED, as_version=4).cells:
        if cell.cell_type == "code":
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.FunctionDef):
                    exec(compile(ast.Module([node], []), RELEASED.name, "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize("question", ["q1", "q2", "q3", "q4"])
def test_the_solution_scores_full_marks(question):
    for seed in SEEDS:
        r = run_question("lab07", question, _solution(question), seed=seed)
        assert r.score == r.max_score > 0, r.feedback


@pytest.mark.parametrize("question", ["q1", "q2", "q3", "q4"])
def test_the_released_stubs_score_zero(question):
    namespace = _released_namespace()
    objects = [namespace[name] for name in get_lab("lab07").questions[question].objects]
    r = run_question("lab07", question, objects, seed=1)
    assert r.score == 0 and "not implemented yet" in r.feedback, r.feedback


def test_the_lab_is_worth_twelve_points_on_a_cpu():
    assert get_lab("lab07").max_score == 12
    assert not mistakes.needs_gpu("lab07") and not mistakes.needs_simulator("lab07")


def _cases():
    for m in mistakes.catalogue(["lab07"]):
        yield pytest.param(m, id=f"{m.question}-{m.title[:50]}")


@pytest.mark.parametrize("mistake", list(_cases()))
def test_each_mistake_is_named_alone_with_one_score_over_seeds(mistake):
    scores = set()
    for seed in SEEDS:
        r = mistakes.grade(mistake, seed)
        scores.add(r.score)
        assert r.score < r.max_score, r.feedback
        assert mistake.message in r.feedback, f"seed {seed}:\n{r.feedback}"
        assert r.diagnoses == [mistake_title(mistake.message)], f"seed {seed} names {r.diagnoses}"
    assert len(scores) == 1, f"{mistake!r} scores {sorted(scores)} depending on the seed"


def test_there_are_many_known_mistakes_in_every_question():
    per_question = {q: sum(m.question == q for m in mistakes.catalogue(["lab07"])) for q in ("q1", "q2", "q3", "q4")}
    assert per_question["q1"] >= 8 and per_question["q2"] >= 10 and per_question["q3"] >= 5, per_question
    assert per_question["q4"] >= 4, per_question


def test_a_wrong_map_fails_the_product_too():
    a, b, c = _solution("q1")
    r = run_question("lab07", "q1", [a, lab07._b_no_pairs, c], seed=3)
    assert r.score == 2
    assert "D = A B + C is wrong at" in r.feedback and "B's k pairs start at t, not 2t" in r.feedback


def test_the_maps_are_m16n8k8_s_the_k_0_to_7_half_of_m16n8k16_s():
    """The relation the lab asks the learner to derive, and the Turing kernel relies on (r3t_mma_m16n8k8.cu): the
    m16n8k16 A fragment is m16n8k8's for k = 0..7, then the same for k = 8..15; B likewise; C is the same."""
    for lane in range(32):
        a8, b8, c8 = (fn(lane) for fn in lab07._K8_MAPS)
        assert fragments.a_positions(lane) == a8 + [(r, k + 8) for r, k in a8]
        assert fragments.b_positions(lane) == b8 + [(k + 8, c) for k, c in b8]
        assert fragments.c_positions(lane) == c8


def test_a_k16_product_is_two_emulated_k8_products(rng):
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    a8, b8, c8 = lab07._K8_MAPS
    D = fragments.gather(C, c8)
    for k0 in (0, 8):
        D = fragments.mma(fragments.gather(A[:, k0:k0 + 8], a8), fragments.gather(B[k0:k0 + 8], b8), D,
                          maps=lab07._K8_MAPS)
    assert np.allclose(fragments.scatter(D, c8, (16, 8)), A @ B + C, rtol=1e-13, atol=1e-13)


def test_the_package_s_m16n8k16_maps_handed_in_score_nothing():
    """Chapter 7 draws m16n8k16's maps from flashlab.fragments; reusing them for k8 is calling the course's answer."""
    r = run_question("lab07", "q1", [lambda lane: fragments.a_positions(lane)[:4],
                                     lambda lane: fragments.b_positions(lane)[:2], fragments.c_positions], seed=2)
    assert r.score == 0 and "calls flashlab.fragments.a_positions" in r.feedback, r.feedback


def test_a_map_of_the_wrong_length_is_explained():
    a, b, c = _solution("q1")
    r = run_question("lab07", "q1", [a, b, lambda lane: c(lane)[:2]], seed=3)
    assert r.score == 2 and "lane 0 gave 2 positions; it holds 4" in r.feedback, r.feedback


@pytest.mark.parametrize("swizzle", [lambda row, chunk: (chunk + row) % 16,
                                     lambda row, chunk: chunk ^ (row % 16),
                                     lambda row, chunk: chunk ^ (7 - row % 8)],
                         ids=["rotation", "xor row % 16", "xor reversed"])
def test_any_conflict_free_permutation_passes(swizzle):
    r = run_question("lab07", "q3", [swizzle], seed=2)
    assert r.score == r.max_score, r.feedback


def test_a_swizzle_for_one_element_at_a_time_is_graded_too():
    def one_at_a_time(row, chunk):
        if not isinstance(row, int):
            raise TypeError("ints only")
        return chunk ^ (row % 8)

    assert run_question("lab07", "q3", [one_at_a_time], seed=2).score == 2
    r = run_question("lab07", "q3", [lambda row, chunk: int(chunk) ^ int(row % 4)], seed=2)
    assert r.score == 1 and "XOR with row % 4" in r.feedback, r.feedback


def test_an_unknown_mistake_shows_the_failing_input_and_names_nothing():
    right = solution_object("lab07", "softmax_tile")

    def doubled(s, m, l, o):  # noqa: E741
        p, m_new, l_new, o_new = right(s, m, l, o)
        return p, m_new, 2 * l_new, o_new

    r = run_question("lab07", "q2", [doubled], seed=4)
    assert r.score == 0 and r.diagnoses == [] and "Smallest failing input" in r.feedback
    assert "l_new: largest difference" in r.feedback and "p: correct" in r.feedback
    # the input is shown under the names of the learner's own parameters, however the grader wraps the function
    assert "s = " in r.feedback and "o = " in r.feedback and "arg1" not in r.feedback, r.feedback


def test_chapter_9_reports_a_lab07_mistake_with_its_demo():
    text = mistakes.report(mistakes.find("lab07", "XOR with row // 8"))
    assert "(recognised)" in text and "worst passes per 8-row block" in text
    rows = mistakes.demo(mistakes.find("lab07", "one max for both rows"))
    assert rows is not None and any(row.differs for row in rows)


def test_ldmatrix_addresses_outside_the_tile_are_explained():
    r = run_question("lab07", "q4", [lambda lane: (lane, 0)], seed=5)
    assert r.score == 0 and "lane 16 points at row 16, chunk 0: outside the 16 × 16 tile" in r.feedback, r.feedback
    r = run_question("lab07", "q4", [lab07._ld_own_row], seed=5)
    assert "receives A at row 2, column 0, where the mma expects row 8, column 0" in r.feedback, r.feedback


def test_an_exception_in_a_map_is_feedback_and_the_other_parts_keep_their_points():
    a, b, c = _solution("q1")

    def c_breaks_on_lane_7(lane):
        if lane == 7:
            raise IndexError("list index out of range")
        return c(lane)

    r = run_question("lab07", "q1", [a, b, c_breaks_on_lane_7], seed=6)
    assert r.score == 2 and "lane 7: IndexError: list index out of range" in r.feedback, r.feedback


def _reduced_with(max_offsets, sum_offsets):
    """A learner's softmax_tile whose quad reductions use the given shfl_xor offsets (right: 1 and 2 for both)."""
    def softmax_tile(s, m, l, o):  # noqa: E741
        s, m, l, o = (np.asarray(x, dtype=np.float64) for x in (s, m, l, o))  # noqa: E741
        row_max = np.stack([s[:, :, 0:2].max(axis=(1, 2)), s[:, :, 2:4].max(axis=(1, 2))], axis=1)
        for k in max_offsets:
            row_max = np.maximum(row_max, fragments.shfl_xor(row_max, k))
        m_new = np.maximum(m, row_max)
        safe = np.where(np.isneginf(m_new), 0.0, m_new)
        alpha = np.exp(m - safe)
        p = np.exp(s - safe[:, None, [0, 0, 1, 1]])
        row_sum = np.stack([p[:, :, 0:2].sum(axis=(1, 2)), p[:, :, 2:4].sum(axis=(1, 2))], axis=1)
        for k in sum_offsets:
            row_sum = row_sum + fragments.shfl_xor(row_sum, k)
        return p, m_new, alpha * l + row_sum, o * alpha[:, None, [0, 0, 1, 1]]

    return softmax_tile


@pytest.mark.parametrize("max_offsets, sum_offsets, named", [
    ((1, 4), (1, 2), "the row max is reduced over the wrong lanes"),
    ((1,), (1, 2), "the row max is reduced over the wrong lanes"),
    ((1, 2), (1, 4), "the row sum is reduced over the wrong lanes"),
    ((1, 8), (1, 8), "the row max and sum are reduced over the wrong lanes"),
    ((2, 1), (2, 1), None),
])
def test_a_reduction_over_any_wrong_lanes_is_named(max_offsets, sum_offsets, named):
    for seed in SEEDS[:3]:
        r = run_question("lab07", "q2", [_reduced_with(max_offsets, sum_offsets)], seed=seed)
        if named is None:
            assert r.score == 4 and r.diagnoses == []
        else:
            assert r.score == 0 and [d for d in r.diagnoses if d.startswith(named)] == r.diagnoses != [], r.feedback
