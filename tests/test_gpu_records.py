"""The recorded GPU results in data/ (CPU only): provenance present, rows well formed, summaries reproducible.

The chapters plot these files on machines without a GPU, so they must stay loadable and self-consistent; and
every summary JSON in data/ncu must be exactly what `python -m flashlab bench profile summarize` makes of its CSV
in data/raw/ncu. Each file is named here (data/README.md lists them all, with what reads and regenerates them).
"""

from __future__ import annotations

import pathlib

import pytest

import flashlab.gpu as fgpu
from flashlab import records
from flashlab.bench import backward, decode, forward, host, memory, profile, train

FORWARD = ("benchmarks/ladder", "benchmarks/memory_sweep", "benchmarks/memory_sweep_rung2", "benchmarks/protocols")
# records timed under both protocols: every timed implementation and shape has a row of each
BOTH_PROTOCOLS = ("benchmarks/protocols", "ch8/bwd", "ch8/decode")
ROW_KEYS = {"impl", "pass", "dtype", "d", "n", "batch", "heads", "causal", "median_ms", "tflops"}
PROVENANCE_KEYS = {"date_utc", "command", "gpu", "cupy", "numpy", "torch", "cuda_runtime", "nvidia_smi"}
# summary -> the Nsight Compute CSV it is made from
NCU_SUMMARIES = {
    "ncu/ladder_metrics": "raw/ncu/ncu_ladder_metrics.csv",
    "ncu/paper_shape_dram": "raw/ncu/ncu_paper_shape.csv",
    "ncu/paper_shape_dram_lean": "raw/ncu/ncu_paper_lean.csv",
    "ncu/paper_shape_dram_final": "raw/ncu/ncu_paper_final.csv",
    "ncu/instructions_lean_addressing": "raw/ncu/ncu_r9.csv",
    "ncu/pipes_warp32_lean": "raw/ncu/ncu_pipes.csv",
}
# the tile-size sweeps behind the rungs' default tiles (docs/kernels.md)
TUNE = ("benchmarks/tune_exp2_tiles", "benchmarks/tune_warp32", "benchmarks/tune_lean")
# record -> (the benchmark that makes it now, the command that made it before `python -m flashlab bench KIND`)
TRAINING = {
    "ch8/bwd": (backward, "python -m flashlab.gpu.bench8 bwd"),
    "ch8/decode": (decode, "python -m flashlab.gpu.bench8 decode"),
    "ch8/memory": (memory, "python -m flashlab.gpu.bench8 memory"),
    "ch8/train": (train, "python -m flashlab.gpu.bench8 train"),
}


def test_flop_count():
    assert forward.flop(1024, 64, 2, 3, causal=False) == 4 * 1024**2 * 64 * 2 * 3
    assert forward.flop(1024, 64, 2, 3, causal=True) == 2 * 1024**2 * 64 * 2 * 3


@pytest.mark.parametrize("name", FORWARD)
def test_recorded_benchmarks_have_provenance_and_consistent_rows(name):
    data = records.read_record(name)
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    assert data["provenance"]["command"].startswith("python -m flashlab bench ")
    assert data["rows"]
    for r in data["rows"]:
        if "error" in r:  # failed runs (out of memory) carry no time
            continue
        assert ROW_KEYS <= set(r), (name, sorted(ROW_KEYS - set(r)))
        assert r["repeat"] >= records.MIN_REPEAT
        expected = forward.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"]) / (r["median_ms"] * 1e-3) / 1e12
        assert r["tflops"] == pytest.approx(expected, rel=1e-3), (name, r)
    assert forward.format_rows(data["rows"]) and forward.markdown_table(data["rows"])  # what --table prints


@pytest.mark.parametrize("name", TUNE)
def test_tile_size_sweeps_have_provenance_and_consistent_rows(name):
    data = records.read_record(name)
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    rung = name.split("tune_", 1)[1]
    assert rung in fgpu.RUNGS
    for r in data["rows"]:
        assert r["impl"].startswith(f"{rung}_w{r['nwarps']}_c{r['bc']}"), r
        expected = forward.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"]) / (r["median_ms"] * 1e-3) / 1e12
        assert r["tflops"] == pytest.approx(expected, rel=1e-3), (name, r)
        assert r["max_abs_diff_vs_default"] < 1e-2, r  # the same attention as the default tiles, in fp16


def test_rung_6_default_tiles_are_the_fastest_recorded_at_d128():
    """docs/kernels.md: rung 6's tile sizes were chosen from its sweep, where they win at d = 128."""
    default = fgpu.RUNGS["exp2_tiles"]
    rows = records.read_record("benchmarks/tune_exp2_tiles")["rows"]
    configs = {(r["nwarps"], r["bc"]) for r in rows}
    chosen = [c for c in configs if (fgpu.rung6_variant(*c).threads, fgpu.rung6_variant(*c).smem_per_d)
              == (default.threads, default.smem_per_d)]
    assert len(chosen) == 1, configs
    for n, causal in {(r["n"], r["causal"]) for r in rows if r["d"] == 128}:
        same = [r for r in rows if (r["d"], r["n"], r["causal"]) == (128, n, causal)]
        fastest = max(same, key=lambda r: r["tflops"])
        assert (fastest["nwarps"], fastest["bc"]) == chosen[0], (n, causal, fastest["impl"])


def test_ladder_has_every_rung_and_the_references_in_one_run():
    rows = records.read_record("benchmarks/ladder")["rows"]
    impls = {r["impl"] for r in rows}
    ladder = set(fgpu.RUNGS) - set(fgpu.SIDE_STEPS)  # a side step (the Turing rung) is not on the H200 ladder
    assert ladder | set(forward.REFERENCES) <= impls
    table = forward.ladder_markdown(rows)
    for name in ladder:
        assert f"| {name} |" in table


@pytest.mark.parametrize("name", NCU_SUMMARIES)
def test_ncu_summaries_are_reproducible_from_their_csv(name):
    data = records.read_record(name)
    csv_path = records.record_path(NCU_SUMMARIES[name])
    assert pathlib.PurePosixPath(data["source"]).name == csv_path.name  # the file it was made from, then
    assert profile.summarize(csv_path.read_text()) == data["processes"]
    assert data["provenance"]["gpu"]


def test_recorded_best_rungs_are_the_fastest_tensor_core_rungs():
    """In the ladder's record, BEST is the fastest rung at every shape by the throughput protocol (back to back: the
    steady state the choice is made for). One call then a synchronize (latency) is noisier from one run to the
    next (a few per cent between the ladder's run and the one that timed rungs 9-11): there BEST is within 5 % of
    the fastest rung."""
    rows = [r for r in records.read_record("benchmarks/ladder")["rows"] if "error" not in r]
    for protocol, slack in (("throughput", 1.0), ("latency", 0.95)):
        for d in fgpu.HEAD_DIMS:
            best = fgpu.BEST[("f16", d)]
            shapes = {(r["n"], r["causal"]) for r in rows if r["d"] == d and r["impl"] == best}
            assert shapes
            for n, causal in shapes:
                same = {r["impl"]: r["tflops"] for r in rows
                        if (r["d"], r["n"], r["causal"], records.protocol_of(r)) == (d, n, causal, protocol)}
                fastest = max(t for i, t in same.items() if i in fgpu.RUNGS)
                assert same[best] >= slack * fastest, (protocol, d, n, causal, same)


def test_best_rung_is_the_fastest_in_the_run_that_timed_rungs_9_to_11():
    """BEST was chosen from the run of rungs 9-11 (both protocols): faster than rung 9 at every row, and the fastest
    rung of that run at every row but where another was within 1% (one run: differences that small are noise)."""
    rows = [r for r in records.read_record(forward.RUNG_PROBE)["rows"] if "error" not in r]
    ms = {(r["impl"], r["protocol"], r["d"], r["n"], r["causal"]): r["median_ms"] for r in rows}
    rungs = {r["impl"] for r in rows} & set(fgpu.RUNGS)
    assert {"addressing", "one_barrier", "k_lanes"} <= rungs
    for d in fgpu.HEAD_DIMS:
        best = fgpu.BEST[("f16", d)]
        shapes = {k[1:] for k in ms if k[0] == best and k[2] == d}
        assert len(shapes) == 2 * len({k[3:] for k in ms if k[2] == d})  # every shape, both protocols
        for shape in shapes:
            assert ms[(best, *shape)] < ms[("addressing", *shape)], shape
            fastest = min(ms[(name, *shape)] for name in rungs)
            assert ms[(best, *shape)] <= 1.01 * fastest, shape


@pytest.mark.parametrize("name", TRAINING)
def test_training_and_decoding_records_have_provenance_and_consistent_rows(name):
    module, earlier = TRAINING[name]
    data = records.read_record(name)
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    command = data["provenance"]["command"]
    kind = module.__name__.rsplit(".", 1)[1]
    assert command.startswith((f"python -m flashlab bench {kind} ", f"{earlier} ")), command
    rows = [r for r in data["rows"] if "error" not in r]
    assert rows
    for r in rows:
        if r["pass"] == "bwd":
            f = backward.bwd_flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"])
            assert f == pytest.approx(2.5 * forward.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"]))
            assert r["tflops"] == pytest.approx(f / (r["median_ms"] * 1e-3) / 1e12, rel=1e-3), r
            assert r["repeat"] >= records.MIN_REPEAT
        elif r["pass"] == "decode":
            assert r["kv_bytes"] == 2 * r["batch"] * r["kv_heads"] * r["m"] * r["d"] * 2  # K and V, fp16
            assert r["gbps"] == pytest.approx(r["kv_bytes"] / (r["median_ms"] * 1e-3) / 1e9, rel=1e-3), r
            assert r["x_read_once"] == pytest.approx(r["median_ms"] / r["read_once_ms"], rel=1e-3), r
            assert r["read_once_ms"] == pytest.approx(r["kv_bytes"] / (r["copy_gbps"] * 1e9) * 1e3, rel=1e-3), r
            assert r["repeat"] >= records.MIN_REPEAT
        elif r["pass"] == "train":
            assert len(r["losses"]) == r["steps"] and r["final_loss"] == r["losses"][-1], r["impl"]
        else:
            assert r["pass"] == "memory" and r["kept_bytes"] > 0 and r["backward_extra_bytes"] >= 0, r
    assert {r["pass"] for r in rows} == {{"backward": "bwd"}.get(kind, kind)}  # one kind of row per file
    assert module.format_rows(data["rows"])  # what chapter 8 prints


@pytest.mark.parametrize("name", BOTH_PROTOCOLS)
def test_records_of_both_protocols_time_every_row_under_each(name):
    rows = [r for r in records.read_record(name)["rows"] if "error" not in r]
    assert all(r["protocol"] in records.PROTOCOLS for r in rows)
    shapes = {}
    for r in rows:
        key = (r["impl"], r["d"], r["n"], r.get("m"), r.get("causal"))
        shapes.setdefault(key, []).append(r["protocol"])
    assert all(sorted(p) == sorted(records.PROTOCOLS) for p in shapes.values()), shapes
    # the references are in the same run, under both protocols, for every shape the course's kernels ran at
    refs = ("sdpa_flash", "sdpa_cudnn")
    for impl, d, n, m, causal in shapes:
        for ref in refs:
            assert (ref, d, n, m, causal) in shapes, (name, impl, ref)


def test_protocol_of_a_row_recorded_without_one_is_throughput():
    # Records made before both protocols were timed have no "protocol" field: their rows are back-to-back runs
    old = [{k: v for k, v in r.items() if k != "protocol"} for r in records.read_record("benchmarks/ladder")["rows"]
           if records.protocol_of(r) == "throughput"]
    assert old and all(records.protocol_of(r) == "throughput" for r in old)
    table = forward.ladder_markdown(old)
    assert "| throughput |" in table and "| latency |" not in table
    both = forward.ladder_markdown(records.read_record("benchmarks/protocols")["rows"])
    assert "| addressing | throughput |" in both and "| addressing | latency |" in both


def test_host_time_record_measures_every_launcher_before_and_after():
    data = records.read_record("benchmarks/host")
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    assert data["provenance"]["command"].startswith("python -m flashlab bench host ")
    rows = data["rows"]
    us = {(r["op"], r["version"], r["call"]): r for r in rows}
    versions = {r["version"] for r in rows}
    assert "current" in versions and len(versions) == 2  # the current launchers and the baseline of the same run
    for op in host.OPS:
        for version in versions:
            assert (op, version, "plain") in us, (op, version)
        assert (op, "current", "preallocated") in us, op
    for r in rows:
        assert r["repeat"] >= records.MIN_REPEAT and r["pass"] == "host"
        assert 0 < r["host_us_q1"] <= r["host_us"] <= r["host_us_q3"], r
    table = host.format_rows(rows)
    assert all(f"`{op}`" in table for op in host.OPS)
