"""What a check cell says when code is wrong: a mistake is named only when it explains every failing input, an
earlier answer that fails is named before the code that calls it, arguments carry their names, and the same wrong
code earns the same points whatever the seed."""

from __future__ import annotations

import numpy as np
import pytest

from flashlab import mistakes, online
from flashlab.grading import answers, core, get_lab, grade_namespace, lab, lab01, lab02, run_question
from flashlab.grading.known import solution_object

SEEDS = (3, 17, 2024, 99991)


# ---------------------------------------------------------------------------------------- naming a mistake
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("flag,named", [("rescale_acc", "l is rescaled but the accumulated output is not"),
                                        ("rescale_l", "the accumulated output is rescaled but l is not")])
def test_partial_rescales_are_named_and_never_taken_for_a_dropped_tile(seed, flag, named):
    for question in ("q2", "q3"):
        r = run_question("lab02", question, [lab02._switch(**{flag: False})], seed=seed)
        assert named in r.feedback, r.feedback
        for dropped in ("ragged query tile", "ragged K/V tile"):
            assert dropped not in r.feedback, r.feedback
        assert "1 of the" not in r.feedback  # a guess from a single input is never printed


def _mixed(scores, values, block):
    """Averages block results on even lengths and drops the ragged block on odd ones: two mistakes at once."""
    if len(scores) % 2 == 0:
        return lab01._attend_average(scores, values, block)
    return lab01._attend_drop_ragged(scores, values, block)


def test_a_mistake_that_explains_only_some_failing_inputs_is_not_printed_as_likely():
    for seed in SEEDS:
        with answers.trusted():  # _mixed reuses the course's own wrong implementations, which call its answers
            r = run_question("lab01", "q3", [_mixed], seed=seed)
        assert r.score == 0 and "Likely mistake" not in r.feedback, r.feedback
        assert "No known mistake explains every failing input" in r.feedback, r.feedback
        assert r.diagnoses == []


def _merge_inverted_factor(a, b):
    """A natural wrong merge: the rescale factors are exp(m - m_own) instead of exp(m_own - m)."""
    m = max(a[0], b[0])
    if m == -np.inf:
        return -np.inf, 0.0, 0.0
    ea, eb = np.exp(m - a[0]), np.exp(m - b[0])
    return m, ea * a[1] + eb * b[1], ea * a[2] + eb * b[2]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mistake_contradicted_by_another_part_of_the_question_is_not_named(seed):
    # An empty side gives nan here, and so does averaging the results (0/0): averaging fits that part alone, but
    # the two halves it does not explain rule it out.
    others = [m for m in lab01.MERGE_MUTANTS if "inverted" not in m.message]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lab01, "MERGE_MUTANTS", others)
        r = run_question("lab01", "q2", [_merge_inverted_factor], seed=seed)
    assert r.diagnoses == [], r.feedback
    assert "Likely mistake" not in r.feedback, r.feedback
    assert "fits these inputs but not those of the part \"two halves\"" in r.feedback, r.feedback
    # With its own mutant in the list, the inverted factor is named by both parts.
    r = run_question("lab01", "q2", [_merge_inverted_factor], seed=seed)
    assert r.feedback.count("Likely mistake") == 2 and r.diagnoses == ["the rescale factor is inverted"], r.feedback


def test_what_is_known_names_each_output():
    def o_wrong(Q, K, V, block_q, block_k):
        O, L = lab02._switch()(Q, K, V, block_q, block_k)
        return O + 1.0, L  # no known mistake adds one

    with answers.trusted():  # o_wrong reuses the course's own switchable forward
        r = run_question("lab02", "q2", [o_wrong], seed=5)
    assert "O wrong, L right on 5 of 5 failing inputs" in r.feedback, r.feedback
    assert "Likely mistake" not in r.feedback


def test_a_named_mistake_says_it_explains_every_failing_input():
    r = run_question("lab01", "q1", [lab01._update_rescale_u_only], seed=4)
    line = next(s for s in r.feedback.splitlines() if "Likely mistake" in s)
    assert "(it explains all" in line or "(it explains the failing input)" in line
    assert mistakes.likely_titles(r) and set(mistakes.likely_titles(r)) == {"u is rescaled but l is not"}


# ------------------------------------------------------------------------------------------- dependencies
def _attend_through(update):
    def attend_in_blocks(scores, values, block):
        m, l, u = -np.inf, 0.0, 0.0
        for lo in range(0, len(scores), block):
            m, l, u = update(m, l, u, scores[lo:lo + block], values[lo:lo + block])
        return u / l

    return attend_in_blocks


def test_q3_says_that_the_online_update_it_calls_fails_q1():
    wrong = lab01._update_no_rescale
    r = run_question("lab01", "q3", [_attend_through(wrong)], seed=7, uses={"online_update": wrong})
    assert r.score < r.max_score
    first = r.feedback.splitlines()[0]
    assert first.startswith("q3 uses your online_update, which fails q1") and "fix that first" in first, r.feedback
    assert "Likely mistake" not in r.feedback and r.diagnoses == []


def test_no_dependency_note_when_the_earlier_answer_is_right():
    right = solution_object("lab01", "online_update")
    r = run_question("lab01", "q3", [lab01._attend_drop_ragged], seed=7, uses={"online_update": right})
    assert "uses your" not in r.feedback and "last ragged block is dropped" in r.feedback, r.feedback


def test_grading_a_notebook_reuses_the_earlier_result():
    wrong = lab01._update_rescale_l_only
    ns = {"online_update": wrong, "online_merge": solution_object("lab01", "online_merge"),
          "attend_in_blocks": _attend_through(wrong)}
    results = {r.name: r for r in grade_namespace("lab01", ns, seed=11)}
    q1 = results["q1"]
    assert q1.score < q1.max_score
    assert f"which fails q1 ({q1.score:g}/{q1.max_score:g} points)" in results["q3"].feedback


def test_the_check_cell_finds_the_earlier_answer_in_the_notebook(capsys):
    namespace = {"online_update": lab01._update_no_rescale, "check": lab("lab01")}
    namespace["attend_in_blocks"] = _attend_through(lab01._update_no_rescale)
    exec('check("q3", attend_in_blocks, seed=5)', namespace)
    assert "q3 uses your online_update, which fails q1" in capsys.readouterr().out


def test_questions_declare_what_they_use():
    assert get_lab("lab01").questions["q3"].uses == ("online_update",)
    assert get_lab("lab02").questions["q2"].uses == ("tiles",) == get_lab("lab02").questions["q3"].uses
    assert get_lab("lab01").grader_of("online_update").name == "q1"


# -------------------------------------------------------------------------------------- labelled arguments
def test_failing_inputs_show_parameter_names():
    r = run_question("lab02", "q2", [lab02._switch(scale="none")], seed=1)
    assert "Q = " in r.feedback and "block_q = " in r.feedback and "block_k = " in r.feedback, r.feedback
    r = run_question("lab01", "q1", [lab01._update_no_rescale], seed=1)
    assert "scores = " in r.feedback and "splits = " in r.feedback and "arg1" not in r.feedback, r.feedback
    r = run_question("lab01", "q3", [lab01._attend_returns_u], seed=1)
    assert "block = " in r.feedback, r.feedback  # taken from the student's own signature


def test_differences_that_print_alike_are_located():
    expected = np.full((28, 6), 0.5)
    got = expected.copy()
    got[3, 4] += 1e-6  # rounds to the same printout
    text = core.difference(expected, got)
    assert "largest difference at [3, 4]" in text and "1 of 168 entries differ" in text and "0.500001" in text
    small_e, small_g = np.array([0.25, 0.5]), np.array([0.25, 0.5 + 1e-7])
    assert "printed alike" in core.difference(small_e, small_g)
    assert "nan" in core.difference(np.array([1.0, 2.0]), np.array([1.0, np.nan]))
    assert "shape" in core.difference(np.zeros(3), np.zeros(4))
    assert core.fmt(np.arange(100.0)).startswith("<array shape (100,), values 0 .. 99")


# --------------------------------------------------------------------------------------- the same points
def _deterministic_cases():
    for m in mistakes.catalogue(["lab01", "lab02"]):
        yield pytest.param(m, id=f"{m.lab_id}-{m.question}-{m.title[:40]}-{m.variant[:20]}")


@pytest.mark.slow  # every mistake of two labs graded three times, lab 02's memory parts at n = 4096 included
@pytest.mark.parametrize("mistake", list(_deterministic_cases()))
def test_a_known_mistake_earns_the_same_points_whatever_the_seed(mistake):
    scores = {seed: mistakes.grade(mistake, seed).score for seed in SEEDS[:3]}
    assert len(set(scores.values())) == 1, f"{mistake!r}: {scores}"


# ------------------------------------------------------------------------------------- the labs themselves
def test_lab01_second_example_shows_every_missing_rescale():
    scores, values = lab01.SEPARATING
    right = float(online.attend(scores, values))
    assert right == pytest.approx(5 / 3)
    wrong = [lab01._update_no_rescale, lab01._update_rescale_l_only, lab01._update_rescale_u_only]
    got = [float(np.ravel(lab01._result_of(lab01._fold(fn, core.Case((scores, values, [2]))))[0])[0])
           for fn in wrong]
    assert all(abs(g - right) > 0.1 for g in got) and len({round(g, 6) for g in got}) == 3, got


def test_lab02_names_the_key_count_n_keys():
    import nbformat

    for folder in ("solutions", "labs"):
        nb = nbformat.read(mistakes.ROOT / folder / "lab02_tiled_forward.ipynb", as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "n_keys, dv = V.shape" in code and "m, dv = V.shape" not in code.replace("n_keys, dv", "")


def test_count_reads_shows_the_two_loop_orders():
    n, d, block = 64, 4, 16
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((n, d)) for _ in range(3))
    tiles = n // block
    q_outer = lab02.count_reads(solution_object("lab02", "flash_forward"), Q, K, V, block, block)
    kv_outer = lab02.count_reads(solution_object("lab02", "flash_forward_kv_outer"), Q, K, V, block, block)
    assert q_outer == {"Q": n * d, "K": tiles * n * d, "V": tiles * n * d}
    assert kv_outer == {"Q": tiles * n * d, "K": n * d, "V": n * d}


# -------------------------------------------------------------------------------------- the sweep's rates
def test_rates_count_names_and_wrong_guesses():
    m = mistakes.find("lab01", "not rescaled")
    right = mistakes.grade(m, 1)
    guessed = core.Result("q1", 0.0, 5.0, "Likely mistake (it explains all 2 failing inputs): " +
                          lab01.UPDATE_MUTANTS[1].message, 1)
    outcomes = [mistakes.Outcome(m, 1, right, mistakes.diagnosed(m, right), mistakes.false_likely(m, right)),
                mistakes.Outcome(m, 2, guessed, mistakes.diagnosed(m, guessed), mistakes.false_likely(m, guessed))]
    assert outcomes[0].named and outcomes[0].wrong_guesses == []
    assert not outcomes[1].named and outcomes[1].wrong_guesses == ["no max subtraction"]
    lab_rates = mistakes.rates(outcomes)["lab01"]
    assert lab_rates.named_rate == 0.5 and lab_rates.false_likely == 1 and not lab_rates.meets_targets
    assert "MISSES A TARGET" in lab_rates.line()


def test_lab08_inputs_are_labelled_by_name():  # lab 05's, in the simulator: tests/test_mistakes.py
    from flashlab.grading import lab08

    r = run_question("lab08", "q2", [lab08._split_floor_dropped], seed=1)
    assert "num_splits = " in r.feedback and "arg1" not in r.feedback, r.feedback
    assert r.diagnoses == ["the last keys fall in no split (the split length rounded down)"], r.feedback
