import math

import numpy as np
import pytest

from flashlab import iocount


def _both(algorithm, n, d, sram, bq, bk):
    """(count, predict), or None when both agree that the blocks do not fit."""
    try:
        predicted = iocount.predict(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
    except iocount.SramOverflow:
        with pytest.raises(iocount.SramOverflow):
            iocount.count(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
        return None
    return iocount.count(algorithm, n, d, sram=sram, block_q=bq, block_k=bk), predicted


@pytest.mark.parametrize("algorithm", iocount.ALGORITHMS)
def test_counted_equals_predicted_on_a_grid(algorithm):
    tried = 0
    for n in (1, 5, 47, 97):
        for d in (1, 8):
            # M below n makes standard attention stream S twice; 4d is the smallest M the paper's blocks allow.
            for sram in (4 * d, 50, 333, 4096):
                for bq, bk in ((None, None), (1, 2), (3, 7), (16, 5), (32, 32)):
                    if n > 50 and bq == 1:
                        continue  # one-row blocks at n = 97 cost seconds and add nothing that n = 47 lacks
                    pair = _both(algorithm, n, d, sram, bq, bk)
                    if pair is not None:
                        counted, predicted = pair
                        assert counted == predicted, (algorithm, n, d, sram, bq, bk)
                        tried += 1
    assert tried > 60


@pytest.mark.parametrize("algorithm", iocount.ALGORITHMS)
def test_counted_equals_predicted_random_draws(rng, algorithm):
    agreed = 0
    for _ in range(12):
        n = int(rng.integers(1, 130))
        d = int(rng.integers(1, 20))
        sram = int(rng.integers(4 * d, 4 * d + 3000))
        bq = None if rng.random() < 0.3 else int(rng.integers(1, 70))
        bk = None if rng.random() < 0.3 else int(rng.integers(1, 70))
        pair = _both(algorithm, n, d, sram, bq, bk)
        if pair is not None:
            counted, predicted = pair
            assert counted == predicted, (algorithm, n, d, sram, bq, bk)
            agreed += 1
    assert agreed >= 3


def test_standard_streams_rows_that_do_not_fit():
    n, d = 40, 2
    fits = iocount.count("standard", n, d, sram=n, block_q=4, block_k=4)
    streams = iocount.count("standard", n, d, sram=n - 1, block_q=4, block_k=4)
    assert streams.reads - fits.reads == n * n  # S read a second time
    assert streams.writes == fits.writes


def test_flops_are_the_same_for_every_algorithm():
    n, d, sram = 70, 8, 600
    flops = {a: iocount.count(a, n, d, sram=sram).flops for a in iocount.ALGORITHMS}
    assert set(flops.values()) == {4 * n * n * d}


@pytest.mark.parametrize("algorithm", ["kv_outer", "q_outer"])
def test_default_blocks_follow_the_paper_and_fit(rng, algorithm):
    for _ in range(50):
        d = int(rng.integers(1, 257))
        sram = int(rng.integers(4 * d, 200_000))
        b_r, b_c = iocount.default_blocks(algorithm, d, sram)
        assert b_c == sram // (4 * d) and b_r == min(b_c, d)
        if sram % (4 * d) == 0:
            assert b_c == math.ceil(sram / (4 * d))  # the paper's ceiling, where it is exact
        assert iocount.predict(algorithm, 4096, d, sram=sram).sram_peak <= sram


def test_sram_refuses_to_hold_more_than_m():
    hbm = iocount.HBM("X", np.arange(20.0).reshape(5, 4))
    chip = iocount.SRAM(10)
    a = chip.load(hbm, np.s_[0:2])
    with pytest.raises(iocount.SramOverflow, match="at most M = 10"):
        chip.load(hbm, np.s_[2:3])
    chip.free(a)
    b = chip.load(hbm, np.s_[2:4])
    np.testing.assert_array_equal(b, hbm.data[2:4])
    assert hbm.reads == 16 and chip.peak == 8 and chip.used == 8
    hbm.write(np.s_[0], np.ones(4))
    assert hbm.writes == 4 and hbm.data[0].sum() == 4


@pytest.mark.parametrize("algorithm", iocount.ALGORITHMS)
def test_blocks_too_big_raise(algorithm):
    with pytest.raises(iocount.SramOverflow):
        iocount.count(algorithm, 64, 16, sram=256, block_q=32, block_k=32)
    with pytest.raises(iocount.SramOverflow):
        iocount.predict(algorithm, 64, 16, sram=256, block_q=32, block_k=32)


def test_asymptotics_match_the_paper():
    d, sram = 64, 116_224
    n = 1 << 16  # a row of S fits in SRAM: S and P are each written once and read once
    assert 4 * n * n <= iocount.predict("standard", n, d, sram=sram).accesses <= 4.5 * n * n
    n = 1 << 20  # a row does not fit: S is read twice
    assert 5 * n * n <= iocount.predict("standard", n, d, sram=sram).accesses <= 5.5 * n * n
    tiled = iocount.predict("kv_outer", n, d, sram=sram).accesses
    # Algorithm 1 with B_c = M/4d: T_c ~ 4nd/M passes, each reading Q and O and writing O (3nd) plus l and m
    # read and written (4n): 12 n^2 d^2 / M, times (1 + 4/(3d)) for the statistics.
    assert tiled == pytest.approx(12 * n * n * d * d / sram * (1 + 4 / (3 * d)), rel=0.002)


def test_bad_arguments():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        iocount.predict("flash", 8, 4, sram=64)
    with pytest.raises(ValueError, match="n must be >= 1"):
        iocount.count("standard", 0, 4, sram=64)
    with pytest.raises(TypeError, match="d must be a positive integer"):
        iocount.predict("q_outer", 8, 4.0, sram=64)
    with pytest.raises(iocount.SramOverflow, match="M >= 4d"):
        iocount.predict("kv_outer", 8, 4, sram=15)
    with pytest.raises(ValueError, match="one head"):
        iocount.run("q_outer", np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), sram=64)


@pytest.mark.parametrize("algorithm", iocount.ALGORITHMS)
def test_run_computes_attention(rng, algorithm):
    from flashlab import reference

    Q, K, V = (rng.standard_normal((37, 5)) for _ in range(3))
    O, counts = iocount.run(algorithm, Q, K, V, sram=200, block_q=6, block_k=4)
    np.testing.assert_allclose(O, reference.attention(Q, K, V)[0], rtol=1e-12, atol=1e-12)
    assert counts.sram_peak <= 200


def test_backward_closed_forms(rng):
    from flashlab import backward, tiled

    n, d, sram = 96, 16, 2048
    # the FLOPs of the kv_outer backward are the ones the package's tiled backward really does: 2.5 forwards
    Q, K, V, dO = (rng.standard_normal((n, d)) for _ in range(4))
    O, L = tiled.forward(Q, K, V)
    stats = {}
    backward.backward(Q, K, V, O, L, dO, stats=stats)
    flash = iocount.predict_backward("kv_outer", n, d, sram=sram)
    assert stats["flops"] == flash.flops == 2.5 * iocount.predict("kv_outer", n, d, sram=sram).flops
    assert iocount.predict_backward("standard", n, d, sram=sram).flops == 8 * n * n * d
    # traffic: standard reads and writes P-sized matrices 7 times; the tiled backward is Theta(n^2 d^2 / M)
    big, d, sram = 1 << 16, 64, 116_224
    assert iocount.predict_backward("standard", big, d, sram=sram).accesses >= 7 * big * big
    b_r, b_c = iocount.default_blocks_backward("kv_outer", d, sram)
    assert 4 * (b_r + b_c) * d <= sram
    tiled_bwd = iocount.predict_backward("kv_outer", big, d, sram=sram).accesses
    assert tiled_bwd == pytest.approx(big / b_c * (5 * big * d + 2 * big), rel=0.02)  # ~T_c passes of 5nd + 2n
    with pytest.raises(ValueError, match="backward is modelled for"):
        iocount.predict_backward("q_outer", n, d, sram=sram)


@pytest.mark.parametrize("algorithm", iocount.BACKWARD_ALGORITHMS)
def test_backward_counted_equals_predicted(rng, algorithm):
    tried = 0
    draws = [(n, d, sram, b) for n in (1, 6, 41) for d in (2, 8) for sram in (8 * d, 70, 600)
             for b in ((None, None), (3, 5), (16, 16))]
    draws += [(int(rng.integers(1, 60)), int(rng.integers(1, 12)), int(rng.integers(100, 3000)),
               (int(rng.integers(1, 30)), int(rng.integers(1, 30)))) for _ in range(6)]
    for n, d, sram, (bq, bk) in draws:
        try:
            predicted = iocount.predict_backward(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
        except iocount.SramOverflow:
            with pytest.raises(iocount.SramOverflow):
                iocount.count_backward(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
            continue
        counted = iocount.count_backward(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
        assert counted == predicted, (n, d, sram, bq, bk)
        tried += 1
    assert tried > 20


@pytest.fixture
def package_answers_allowed():
    """The package's counter stands in for a student's formulas: graded as the course's own code."""
    from flashlab.grading import answers

    with answers.trusted():
        yield


def _lab03_answers():
    from flashlab.grading import lab03

    def formula(algorithm):
        return lambda n, d, sram, bq, bk: lab03._rw(iocount.predict(algorithm, n, d, sram=sram, block_q=bq, block_k=bk))

    return {
        "standard_counts": formula("standard"),
        "kv_outer_counts": formula("kv_outer"),
        "q_outer_counts": formula("q_outer"),
        "paper_blocks": lambda d, sram: iocount.default_blocks("kv_outer", d, sram),
        "best_q_outer_blocks": lambda n, d, sram: (sram // (2 * d) - 1, 1),
    }


@pytest.mark.usefixtures("package_answers_allowed")
def test_lab03_diagnoses_each_known_mistake():
    from flashlab.grading import get_lab, lab03, run_question

    good = _lab03_answers()
    for question, slot, mutants in (("q1", 0, lab03.STANDARD_MUTANTS), ("q1", 1, lab03.KV_OUTER_MUTANTS),
                                    ("q1", 2, lab03.Q_OUTER_MUTANTS), ("q2", 0, lab03.BLOCK_MUTANTS)):
        names = get_lab("lab03").questions[question].objects
        for mutant in mutants:
            objects = [good[name] for name in names]
            objects[slot] = mutant.fn
            result = run_question("lab03", question, objects)
            assert result.score == result.max_score - (2 if question == "q1" else 1), (question, mutant.message)
            assert mutant.message in result.feedback, (question, mutant.message, result.feedback)


@pytest.mark.usefixtures("package_answers_allowed")
def test_lab03_parts_are_graded_separately():
    from flashlab.grading import run_question

    good = _lab03_answers()

    def unwritten(*args):
        raise NotImplementedError

    result = run_question("lab03", "q1", [good["standard_counts"], unwritten, unwritten])
    assert result.score == 2 and result.feedback.count("not implemented yet") == 2


@pytest.mark.usefixtures("package_answers_allowed")
def test_lab03_block_choice_is_graded_by_traffic():
    from flashlab.grading import lab03, run_question

    paper = _lab03_answers()["paper_blocks"]
    assert run_question("lab03", "q2", [paper, lambda n, d, sram: (sram // (2 * d) - 1, 1)]).score == 3
    paper_for_q = run_question("lab03", "q2", [paper, lambda n, d, sram: iocount.default_blocks("q_outer", d, sram)])
    assert paper_for_q.score == 1 and "is possible" in paper_for_q.feedback
    too_big = run_question("lab03", "q2", [paper, lambda n, d, sram: (sram // d, 1)])
    assert too_big.score == 1 and "do not fit" in too_big.feedback
    acc, b_r, b_c = lab03.best_q_outer(4096, 64, 116_224)
    assert 2 * (b_r + b_c) * 64 <= 116_224 and acc == iocount.predict("q_outer", 4096, 64, sram=116_224,
                                                                        block_q=b_r, block_k=b_c).accesses
