"""Lab 11's grader (flashlab/grading/lab11.py): its truths, what its simulations say about each known mistake, and
what it does with malformed answers. That the solution scores full marks through the batch grader, the released lab
scores 0 and every mistake is named on every seed is checked for every lab by tests/test_labs.py,
tests/test_mistakes.py and `python -m flashlab.mistakes --labs lab11 --seeds 40`."""

from __future__ import annotations

import numpy as np
import pytest

from flashlab import pipeline
from flashlab.gpu import HOPPER_RUNGS, KERNEL_DIR
from flashlab.grading import lab11, run_question
from flashlab.grading.core import mistake_title
from flashlab.grading.known import solution_object


# ------------------------------------------------------------------------------------------------- the truths
def test_the_solution_agrees_with_the_package_everywhere():
    ring, pingpong = solution_object("lab11", "ring_schedule"), solution_object("lab11", "pingpong_ops")
    for stages in range(1, 6):
        for tiles in range(0, 20):
            want = [(w.stage, w.full_parity, w.empty_parity) for w in pipeline.ring_schedule(tiles, stages)]
            assert ring(tiles, stages) == want, (tiles, stages)
    for ntiles in range(0, 7):
        for mine in range(ntiles + 1):
            for c in (0, 1):
                assert pingpong(c, ntiles, mine) == pipeline.pingpong_ops(c, ntiles, mine), (c, ntiles, mine)
                assert lab11._pingpong(c, ntiles, mine) == pipeline.pingpong_ops(c, ntiles, mine)  # the mutants' base


def test_the_closed_form_is_the_largest_number_of_stages_that_fits(rng):
    fit = solution_object("lab11", "stages_that_fit")
    for _ in range(300):
        d, rows, keys = (int(rng.choice(v)) for v in ([32, 64, 128, 256], [64, 128, 192], [32, 64, 128, 176]))
        limit = int(rng.integers(0, 300 * 1024))
        want = lab11._stages_that_fit(d, rows, keys, limit)
        assert fit(d, rows, keys, limit) == want
        assert lab11._ring_bytes(d, rows, keys, want + 1) > limit
        assert want == 0 or lab11._ring_bytes(d, rows, keys, want) <= limit


def test_the_budget_is_rung_h4_s_layout_and_the_host_sizing():
    """Two stages of H4's tiles take what the host reserves for the rung, less its eighth, unused barrier (the host
    rounds up to a whole number of bytes per unit of d); the kernel's own comment states the same layout."""
    source = (KERNEL_DIR / "hopper" / "h4_overlap.cu").read_text()
    assert "(128 + 2 * STAGES * BC) * D * 2 + 1024 + 64" in source
    assert "fullk = qbar + 8, fullv = fullk + 8 * STAGES" in source and "empty = fullv + 8 * STAGES" in source
    assert "static_assert(STAGES == 2" in source
    for d in (64, 128):
        reserved = HOPPER_RUNGS["overlap"].shared_bytes(d)
        used = lab11._ring_bytes(d, 128, 128, 2)
        assert 0 <= reserved - (used + 8) < d, (d, reserved, used)
        assert lab11._stages_that_fit(d, 128, 128, reserved) == 2


def test_rung_h4_s_tiles_leave_room_for_a_third_stage_on_an_h100_at_d_128():
    """What the lab's last cell prints and its check-yourself answer 4 uses: rung H5 takes that third stage, within
    what the host reserves for it and what an H100's block may have."""
    assert lab11._stages_that_fit(128, 128, 128, lab11.H100_SMEM) == 3
    assert "#define STAGES 3" in (KERNEL_DIR / "hopper" / "h5_three_stages.cu").read_text()
    for d in (64, 128):
        reserved = HOPPER_RUNGS["three_stages"].shared_bytes(d)
        assert lab11._ring_bytes(d, 128, 128, 3) <= reserved <= lab11.H100_SMEM
        assert lab11._stages_that_fit(d, 128, 128, reserved) == 3
    assert lab11._stages_that_fit(64, 128, 128, lab11.H100_SMEM) == 6
    three = lab11._ring_bytes(128, 128, 128, 3)
    assert three == 230_480 and three + 128 * 128 * 2 > lab11.H100_SMEM


# ---------------------------------------------------------------------- what the simulations say of each mistake
def _simulated_ring(schedule, tiles, stages):
    waits = [pipeline.Wait(t, *entry) for t, entry in enumerate(schedule(tiles, stages))]
    return [pipeline.simulate(tiles, stages, 2, schedule=lambda *_: waits, seed=s).problem
            for s in range(lab11.INTERLEAVINGS)]


@pytest.mark.parametrize("mutant", lab11.SCHEDULE_MUTANTS, ids=lambda m: mistake_title(m.message)[:40])
def test_each_wrong_schedule_breaks_the_simulated_ring_as_its_message_says(mutant):
    problems = []
    for tiles, stages in lab11.SIMULATED_RINGS:
        ring = _simulated_ring(mutant.fn, tiles, stages)
        if mutant.fn(tiles, stages) != lab11._schedule(tiles, stages):  # (t mod 2 is right with 2 stages)
            problems += ring
        else:
            assert not any(ring), ring[:3]
    if "would pass at once" in mutant.message:  # waiting for parity 1 on a fresh barrier is harmless
        assert not any(problems), problems[:3]
        return
    assert problems and all(problems), "some interleavings ran a wrong schedule to the end"
    said = {"deadlock": "deadlock", "overwrites": "still compute", "read the stage before": "which holds"}
    for phrase, symptom in said.items():
        if phrase in mutant.message:
            assert any(symptom in p for p in problems), (phrase, problems[:3])


@pytest.mark.parametrize("mutant", lab11.PINGPONG_MUTANTS, ids=lambda m: mistake_title(m.message)[:40])
def test_each_wrong_turn_order_meets_the_symptom_its_message_names(mutant):
    problems = set()
    for ntiles, mine0, mine1 in lab11.SIMULATED_BLOCKS:
        programs = [mutant.fn(0, ntiles, mine0), mutant.fn(1, ntiles, mine1)]
        problems |= {pipeline.simulate_turns(programs, seed=s).problem for s in range(lab11.TURN_INTERLEAVINGS)}
    problems.discard("")
    said = {"deadlock": "deadlock", "left pending": "left pending", "waits forever": "deadlock",
            "__syncthreads": "barrier 0", "both issue together": "outside its turn"}
    named = [symptom for phrase, symptom in said.items() if phrase in mutant.message]
    if named:
        assert all(any(s in p for p in problems) for s in named), (named, problems)
    else:  # a renaming or the wrong products: the barriers still match, only the comparison tells
        assert not problems, problems


def test_the_feedback_names_the_mistake_and_says_what_the_simulation_saw():
    r = run_question("lab11", "q1", [lab11._schedule_empty_first_0], seed=2)
    assert r.score == 0 and "wait for parity 0 of empty" in r.feedback and "deadlock" in r.feedback, r.feedback
    r = run_question("lab11", "q1", [lab11._schedule_empty_first_1], seed=2)
    assert r.score == 1 and "[ok  ] the simulated ring runs your schedule" in r.feedback, r.feedback
    r = run_question("lab11", "q2", [lab11._pp_last_arrive_too], seed=2)
    assert r.score == 0 and "left pending when the block ends" in r.feedback, r.feedback
    r = run_question("lab11", "q2", [lab11._pp_hands_over_first], seed=2)
    assert "issued S_0 outside its turn" in r.feedback, r.feedback


# ------------------------------------------------------------------------------------------ malformed answers
def _right_schedule(tiles, stages):
    return [(t % stages, (t // stages) % 2, None if t < stages else (t // stages - 1) % 2) for t in range(tiles)]


@pytest.mark.parametrize("answer,phrase", [
    (lambda tiles, stages: None, "returned None (NoneType), not a list of"),
    (lambda tiles, stages: "0, 0, None", "not a list of"),
    (lambda tiles, stages: [(0, 0)] * tiles, "whose entry 0 is (0, 0)"),
    (lambda tiles, stages: [(0.5, 0, None)] * tiles, "stage is 0.5 (float), not a whole number"),
    (lambda tiles, stages: [(s, f, -1 if e is None else e) for s, f, e in _right_schedule(tiles, stages)],
     "nan for None"),  # -1 is not None
    (lambda tiles, stages: np.array([(s, f, 0 if e is None else e) for s, f, e in _right_schedule(tiles, stages)]),
     "nan for None"),  # an array cannot hold None
    (lambda tiles, stages: [(0, 0, None)] * 10**5, "got shape (100000, 3)"),
    (lambda tiles, stages: 1 / 0, "ZeroDivisionError"),
])
def test_a_malformed_schedule_scores_zero_with_a_clear_message(answer, phrase):
    r = run_question("lab11", "q1", [answer], seed=4)
    assert r.score == 0 and phrase in r.feedback, r.feedback
    assert "the check could not run your code" not in r.feedback


def test_a_schedule_of_numpy_integers_and_whole_floats_is_right():
    def numpy_schedule(tiles, stages):
        return [(np.int64(s), float(f), e if e is None else np.int32(e)) for s, f, e in _right_schedule(tiles, stages)]

    r = run_question("lab11", "q1", [numpy_schedule], seed=5)
    assert r.score == r.max_score, r.feedback


@pytest.mark.parametrize("answer,phrase", [
    (lambda c, n, m: [("sync", 1), "x"], "whose op 1 is 'x'"),
    (lambda c, n, m: [("wait", 1)], "whose op 0 is ('wait', 1)"),
    (lambda c, n, m: [("sync", 1.5)], "1.5 (float), not a whole number"),
    (lambda c, n, m: {"sync": 1}, "not a list of ops"),
    (lambda c, n, m: [(["sync"], 1)], "whose op 0 is (['sync'], 1)"),
])
def test_malformed_ops_score_zero_with_a_clear_message(answer, phrase):
    r = run_question("lab11", "q2", [answer], seed=4)
    assert r.score == 0 and phrase in r.feedback, r.feedback


def test_ops_on_a_barrier_the_hardware_lacks_are_refused_by_the_simulation_not_the_grader():
    right = solution_object("lab11", "pingpong_ops")

    def far_barriers(consumer, ntiles, my_tiles):
        return [(name, number + 20 if name in ("sync", "arrive") else number)
                for name, number in right(consumer, ntiles, my_tiles)]

    r = run_question("lab11", "q2", [far_barriers], seed=6)
    assert r.score == 0 and "named barriers are 0 .. 15" in r.feedback, r.feedback


@pytest.mark.parametrize("answer", [lambda *a: "three", lambda *a: None, lambda *a: [3, 4]])
def test_a_stage_count_that_is_not_a_number_scores_zero(answer):
    r = run_question("lab11", "q3", [answer], seed=4)
    assert r.score == 0 and "the check could not run your code" not in r.feedback, r.feedback
