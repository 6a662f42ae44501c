"""flashlab.pipeline: the mbarrier ring of chapter 11's warp-specialised rung, simulated."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from flashlab import pipeline


def test_an_mbarrier_completes_a_phase_on_its_arrivals_and_bytes():
    bar = pipeline.MBarrier(2)
    assert bar.try_wait(1) and not bar.try_wait(0)  # phase 0 in progress: parity 1 "completed" (the one before)
    bar.arrive(expect_tx=128)
    bar.arrive()
    assert not bar.try_wait(0)  # arrivals done, bytes owed
    bar.complete_tx(128)
    assert bar.try_wait(0) and not bar.try_wait(1) and bar.completed == 1
    with pytest.raises(ValueError, match="at least one"):
        pipeline.MBarrier(0)


def test_the_schedule_is_stage_t_mod_s_and_its_parities():
    rows = pipeline.ring_schedule(8, 3)
    assert [w.stage for w in rows] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert [w.full_parity for w in rows] == [0, 0, 0, 1, 1, 1, 0, 0]
    assert [w.empty_parity for w in rows] == [None, None, None, 0, 0, 0, 1, 1]
    assert rows[7] == pipeline.Wait(7, 1, 0, 1)  # chapter 11's check-yourself question 7
    with pytest.raises(ValueError, match="stages >= 1"):
        pipeline.ring_schedule(4, 0)


@pytest.mark.parametrize("tiles,stages,consumers", [(1, 2, 2), (7, 2, 2), (12, 3, 2), (9, 4, 1), (10, 1, 3)])
def test_the_schedule_survives_every_interleaving_tried(tiles, stages, consumers):
    for seed in range(40):
        out = pipeline.simulate(tiles, stages, consumers, seed=seed)
        assert out.ok, (seed, out.problem)


def _with(**change):
    def schedule(tiles, stages):
        return [dataclasses.replace(w, **{k: f(w) for k, f in change.items()})
                for w in pipeline.ring_schedule(tiles, stages)]
    return schedule


@pytest.mark.parametrize("name,schedule,symptom", [
    ("full parity t % 2", _with(full_parity=lambda w: w.tile % 2), "holds"),
    ("no wait for empty", _with(empty_parity=lambda w: None), "still compute"),
    ("empty parity one phase late", _with(empty_parity=lambda w: None if w.empty_parity is None
                                          else 1 - w.empty_parity), "still compute"),
    ("full parity one phase late", _with(full_parity=lambda w: 1 - w.full_parity), ""),
])
def test_each_wrong_parity_is_caught(name, schedule, symptom):
    problems = [pipeline.simulate(8, 2, 2, schedule=schedule, seed=s).problem for s in range(40)]
    bad = [p for p in problems if p]
    assert bad, f"{name}: no interleaving of 40 went wrong"
    assert any(symptom in p for p in bad), (name, bad[:3])


# ------------------------------------------------------------------------------------ ping-pong: named barriers
KERNEL_H4 = pathlib.Path(pipeline.__file__).parent / "gpu" / "kernels" / "hopper" / "h4_overlap.cu"


def test_pingpong_ops_are_the_turns_chapter_11_prints():
    ntiles = 4  # chapter 11's table: turn t issues S_t if t < ntiles, then P_{t-1} V_{t-1} if t > 0
    for c in (0, 1):
        ops = pipeline.pingpong_ops(c, ntiles, ntiles)
        assert ops[:1] == ([("arrive", 1)] if c == 1 else [("sync", 1)])
        turns = [[]]
        for op in ops[1 if c == 1 else 0:]:
            if op[0] == "sync" and turns[-1]:
                turns.append([])
            turns[-1].append(op)
        assert len(turns) == ntiles + 1
        for t, turn in enumerate(turns):
            work = [("S", t)] * (t < ntiles) + [("PV", t - 1)] * (t > 0)
            hand = [] if (c == 1 and t == ntiles) else [("arrive", 2 - c)]
            assert turn == [("sync", 1 + c), *work, *hand], (c, t, turn)


def test_a_consumer_past_its_causal_end_takes_empty_turns():
    ops = pipeline.pingpong_ops(0, 3, 1)
    assert ops == [("sync", 1), ("S", 0), ("arrive", 2), ("sync", 1), ("PV", 0), ("arrive", 2),
                   ("sync", 1), ("arrive", 2), ("sync", 1), ("arrive", 2)]
    assert pipeline.pingpong_ops(1, 0, 0) == [("arrive", 1), ("sync", 2)]  # a block whose rows see no key


def test_pingpong_ops_follow_the_kernel_source():
    """The model's rules, as rung H4 writes them (a recorded kernel does not change, so neither may these)."""
    src = KERNEL_H4.read_text()
    for line in ("const int mine = 1 + c, other = 2 - c;",  # barrier 1 + c: consumer c may issue
                 "if (c == 1) named_bar_arrive(1, 256);",  # consumer 0 takes the first turn
                 "if (!(c == 1 && t == ntiles)) named_bar_arrive(other, 256);",  # the last turn hands over to no one
                 "for (; t <= ntiles; ++t) {"):  # turns past the causal end are still taken
        assert line in src, line
    assert src.count("named_bar_sync(mine, 256);") == 4  # turn 0, middle turns, the last product, empty turns


@pytest.mark.parametrize("bad", [dict(consumer=2, ntiles=3, my_tiles=3), dict(consumer=0, ntiles=2, my_tiles=3),
                                 dict(consumer=1, ntiles=-1, my_tiles=0)])
def test_pingpong_ops_refuse_impossible_blocks(bad):
    with pytest.raises(ValueError, match="my_tiles <= ntiles"):
        pipeline.pingpong_ops(**bad)
    with pytest.raises(TypeError, match="integer"):
        pipeline.pingpong_ops(0, 2.0, 1)


@pytest.mark.parametrize("ntiles", [0, 1, 2, 5])
def test_the_course_s_turns_run_to_the_end(ntiles):
    for mine in range(ntiles + 1):
        programs = [pipeline.pingpong_ops(0, ntiles, mine), pipeline.pingpong_ops(1, ntiles, ntiles)]
        for seed in range(20):
            out = pipeline.simulate_turns(programs, seed=seed)
            assert out.ok and out.steps == sum(map(len, programs)), (ntiles, mine, seed, out.problem)


def _drop_first_arrive(ops):
    return ops[1:] if ops[:1] == [("arrive", 1)] else ops


@pytest.mark.parametrize("name,consumer0,consumer1,symptom", [
    ("no first arrival", pipeline.pingpong_ops(0, 3, 3), _drop_first_arrive(pipeline.pingpong_ops(1, 3, 3)),
     "deadlock: consumer 0 waits at bar.sync 1 in its turn 0"),
    ("consumer 1 hands over after its last turn", pipeline.pingpong_ops(0, 3, 3),
     pipeline.pingpong_ops(1, 3, 3) + [("arrive", 1)], "barrier 1 holds the bar.arrive of consumer 1"),
    ("consumer 0 stops at its causal end", pipeline.pingpong_ops(0, 1, 1), pipeline.pingpong_ops(1, 3, 3),
     "deadlock: consumer 1 waits at bar.sync 2 in its turn 2"),
    ("hands over before issuing", [("sync", 1), ("arrive", 2), ("S", 0)], [("arrive", 1), ("sync", 2)],
     "consumer 0 issued S_0 outside its turn"),
    ("barrier 0", [("sync", 0), ("S", 0)], [("arrive", 0)], "barrier 0 is __syncthreads()'s"),
    ("both hold the turn", [("sync", 1), ("S", 0)], [("sync", 1), ("S", 1)], "while consumer"),
])
def test_each_broken_handshake_is_caught(name, consumer0, consumer1, symptom):
    problems = {pipeline.simulate_turns([consumer0, consumer1], seed=s).problem for s in range(10)}
    assert "" not in problems, f"{name}: an interleaving ran to the end"
    assert any(symptom in p for p in problems), (name, problems)


def test_simulate_turns_refuses_malformed_programs():
    with pytest.raises(ValueError, match="op 1 is 'x'"):
        pipeline.simulate_turns([[("sync", 1), "x"]])
    with pytest.raises(ValueError, match="named barriers are 0 .. 15"):
        pipeline.simulate_turns([[("arrive", 16)]])
    with pytest.raises(TypeError, match="list of"):
        pipeline.simulate_turns([None])
    with pytest.raises(ValueError, match="at least one arrival"):
        pipeline.simulate_turns([[]], count=0)
