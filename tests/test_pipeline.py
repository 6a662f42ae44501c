"""flashlab.pipeline: the mbarrier ring of chapter 11's warp-specialised rung, simulated."""

from __future__ import annotations

import dataclasses

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
