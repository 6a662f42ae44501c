"""``--rounds`` of the forward and backward benchmarks (flashlab.bench.run_grid) and of the decoding benchmark: a
shape's implementations timed again in reverse order, every row's median over the calls of every round. Run on the
CPU with tools/hostemu's NumPy stand-in for CuPy, with stand-in implementations that log their calls."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

_HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"
_spec = importlib.util.spec_from_file_location("hostemu_rounds", _HOSTEMU)
hostemu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostemu)


def _run(monkeypatch, rounds: int, impls=("a", "b", "c"), broken=()):
    monkeypatch.setitem(sys.modules, "cupy", hostemu.fake_cupy())
    from flashlab import bench

    calls: list[str] = []

    def impl(name, arrays, causal):
        if name in broken:
            raise RuntimeError(f"{name} cannot run here")

        def fn():
            calls.append(name)

        return "cupy", fn, lambda: hostemu._wrap(np.zeros(4, np.float32))

    args = argparse.Namespace(dtypes=["float16"], d=[64], n=[128, 256], batch=1, tokens=256, heads=1, causal="no",
                              impls=list(impls), repeat=3, warmup=1, protocols=["throughput", "latency"],
                              rounds=rounds)
    rows: list[dict] = []
    bench.run_grid(args, rows, pass_name="fwd", inputs=1, impl=impl, flop=lambda *a: 1.0)
    return rows, calls


def _runs(calls: list[str]) -> list[str]:
    """The names in the order their runs of calls came (a name called many times in a row counts once)."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


def test_two_rounds_time_each_shape_in_order_then_in_reverse(monkeypatch):
    rows, calls = _run(monkeypatch, 2)
    # per shape a, b, c, then c, b, a again (c's two rounds run into each other, and so do the shapes' a's)
    assert _runs(calls) == ["a", "b", "c", "b", "a", "b", "c", "b", "a"]
    assert len(calls) == 2 * 3 * 2 * 2 * (1 + 3)  # shapes x impls x rounds x protocols x (warmup + repeat)
    assert [r["impl"] for r in rows] == ["a", "a", "b", "b", "c", "c"] * 2 and all(r["rounds"] == 2 for r in rows)


def test_one_round_is_the_protocol_the_records_were_made_with(monkeypatch):
    rows, calls = _run(monkeypatch, 1)
    assert _runs(calls) == ["a", "b", "c"] * 2
    assert all("rounds" not in r for r in rows) and len(rows) == 12


def test_an_implementation_that_fails_is_recorded_and_left_out_of_later_rounds(monkeypatch):
    rows, calls = _run(monkeypatch, 3, broken=("b",))
    assert "b" not in calls and [r["impl"] for r in rows if "error" in r] == ["b", "b"]
    assert _runs(calls) == ["a", "c", "a", "c"] * 2  # per shape a, c; c, a; a, c
    assert len(calls) == 2 * 2 * 3 * 2 * (1 + 3) and all(r["rounds"] == 3 for r in rows if "error" not in r)


@pytest.mark.parametrize("rounds", [0, -1])
def test_rounds_below_one_mean_one(monkeypatch, rounds):
    rows, calls = _run(monkeypatch, rounds)
    assert _runs(calls) == ["a", "b", "c"] * 2


def _run_decode(monkeypatch, rounds: int, broken=(), extra=()):
    """bench decode's loop over one cache length, with decode() replaced by a stand-in that logs its calls (by
    kernel and split count, as the impl names them) and PyTorch absent."""
    monkeypatch.setitem(sys.modules, "cupy", hostemu.fake_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)
    import flashlab.gpu as fgpu
    from flashlab.bench import decode as bdecode
    from flashlab.gpu import decoding

    calls: list[str] = []

    def decode(q, k, v, *, num_splits=None, kernel="best", out=None, workspace=None, dependent_merge=False):
        name = kernel + ("" if num_splits is None else "_unsplit" if num_splits == 1 else f"_split_{num_splits}")
        name += "_dependent_merge" if dependent_merge else ""
        if name in broken:
            raise RuntimeError(f"{name} cannot run here")
        if out is not None:
            calls.append(name)
        return hostemu._wrap(np.zeros(q.shape, np.float16)), None

    monkeypatch.setattr(fgpu, "decode", decode)
    monkeypatch.setattr(decoding, "default_splits_here", lambda *a: 7)
    monkeypatch.setattr(bdecode, "copy_gbps", lambda nbytes, repeat, warmup: 2 * nbytes / 1e6)  # a copy of 1 ms
    args = bdecode.parser().parse_args(["--m", "64", "--heads", "2", "--kernels", "rows", "keys", "--splits", "4",
                                        "--repeat", "3", "--warmup", "1", "--rounds", str(rounds), *extra])
    rows: list[dict] = []
    bdecode.run(args, rows)
    return rows, calls


def test_decode_rounds_time_in_order_then_in_reverse(monkeypatch):
    rows, calls = _run_decode(monkeypatch, 2)
    order = ["rows", "rows_unsplit", "rows_split_4", "keys", "keys_unsplit", "keys_split_4"]
    assert _runs(calls) == order + order[-2::-1]  # keys_split_4's two rounds run into each other
    assert len(calls) == 6 * (1 + 2 * 2 * (1 + 3))  # impls x (the check + rounds x protocols x (warmup + repeat))
    assert [r["impl"] for r in rows] == [name for name in order for _ in range(2)]
    assert all(r["rounds"] == 2 and r["x_read_once"] > 0 for r in rows)
    assert [r["num_splits"] for r in rows[:6]] == [7, 7, 1, 1, 4, 4]


def test_decode_one_round_and_a_failing_kernel(monkeypatch):
    rows, calls = _run_decode(monkeypatch, 1)
    assert all("rounds" not in r for r in rows) and len(rows) == 12
    rows, calls = _run_decode(monkeypatch, 3, broken=("keys_unsplit",))
    assert "keys_unsplit" not in calls and [r["impl"] for r in rows if "error" in r] == ["keys_unsplit"]
    assert all(r["rounds"] == 3 for r in rows if "error" not in r) and len(calls) == 5 * (1 + 3 * 2 * (1 + 3))


def test_decode_dependent_merge_adds_a_row_per_split_kernel_that_says_how_its_merge_ran(monkeypatch):
    rows, calls = _run_decode(monkeypatch, 1, extra=("--dependent-merge",))
    order = ["rows", "rows_unsplit", "rows_split_4", "keys", "keys_unsplit", "keys_split_4", "rows_dependent_merge",
             "keys_dependent_merge"]
    assert _runs(calls) == order
    assert {r["impl"]: r["merge_launch"] for r in rows} == {
        name: "dependent" if name.endswith("_dependent_merge") else "ordinary" for name in order}
    assert [r["num_splits"] for r in rows if r["impl"].endswith("_dependent_merge")] == [7, 7, 7, 7]


def test_only_the_benchmarks_that_time_in_rounds_take_rounds():
    """--rounds is honoured by bench forward and backward (run_grid) and decode; the others refuse it rather than
    ignore it."""
    from flashlab.bench import backward, decode, forward, sparse

    for mod in (forward, backward, decode):
        assert mod.parser().parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        sparse.parser().parse_args(["--rounds", "2"])
