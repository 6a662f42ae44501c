"""The recorded GPU results in data/ (CPU only): provenance present, rows well formed, summaries reproducible.

The chapters plot these files on machines without a GPU, so they must stay loadable and self-consistent; and
every summary JSON in data/ncu must be exactly what `python -m flashlab bench profile summarize` makes of its CSV
in data/raw/ncu. Each file is named here (data/README.md lists them all, with what reads and regenerates them).
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics

import pytest

import flashlab.gpu as fgpu
from flashlab import records
from flashlab.bench import backward, decode, forward, host, memory, peak, profile, train

FORWARD = ("benchmarks/ladder", "benchmarks/memory_sweep", "benchmarks/memory_sweep_rung2", "benchmarks/protocols",
           "benchmarks/r12_probe", "benchmarks/hopper", "benchmarks/hopper_merged", "benchmarks/hopper_staged",
           "benchmarks/hopper_pinned")
# records timed under both protocols: every timed implementation and shape has a row of each
BOTH_PROTOCOLS = ("benchmarks/protocols", "ch8/bwd", "ch8/bwd_hopper", "ch8/decode", "ch8/decode_gqa",
                  "ch8/decode_dependent", "ch8/decode_mha", "benchmarks/r12_probe", "benchmarks/hopper",
                  "benchmarks/hopper_merged", "benchmarks/hopper_staged", "benchmarks/hopper_pinned")
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
    "ncu/occupancy_k_lanes_three_blocks": "raw/ncu/ncu_occupancy_r12.csv",
    "ncu/stalls_bwd_pipe": "raw/ncu/ncu_bwd_pipe.csv",
    "ncu/stalls_bwd_sdpa_flash": "raw/ncu/ncu_bwd_sdpa.csv",
    "ncu/stalls_bwd_wgmma": "raw/ncu/ncu_bwd_wgmma.csv",
    "ncu/stalls_sparse_window": "raw/ncu/ncu_sparse_stalls.csv",
}
# the tile-size sweeps behind the rungs' default tiles (docs/kernels.md)
TUNE = ("benchmarks/tune_exp2_tiles", "benchmarks/tune_warp32", "benchmarks/tune_lean")
# record -> (the benchmark that makes it now, the command that made it before `python -m flashlab bench KIND`)
TRAINING = {
    "ch8/bwd": (backward, "python -m flashlab.gpu.bench8 bwd"),
    "ch8/bwd_hopper": (backward, "python -m flashlab bench backward"),
    "ch8/decode": (decode, "python -m flashlab.gpu.bench8 decode"),
    "ch8/decode_gqa": (decode, "python -m flashlab.gpu.bench8 decode"),
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


def test_decode_records_default_split_is_the_fastest_of_the_sweep_within_noise():
    """docs/kernels.md: one wave (the default split count) is within 1 % of the fastest split count of each decode
    record's sweep under throughput, for the default kernel ("mma") and for "keys" (the one-row sweeps put 64 and 41
    splits a fraction of a per cent ahead; the same launch timed twice, the default row and the sweep's row of its
    split count, differs by up to 0.3 % back to back); and the GQA record's group runs with 4 K/V heads' worth of
    rows per block (kv_heads = heads / 4)."""
    for name in ("ch8/decode", "ch8/decode_gqa"):
        for kernel, slack in (("mma", 1.01), ("keys", 1.01)):
            rows = [r for r in records.read_record(name)["rows"] if "error" not in r and r.get("kernel") == kernel
                    and records.protocol_of(r) == "throughput" and r["impl"] != f"{kernel}_unsplit"]
            default = next(r for r in rows if r["impl"] == kernel)
            fastest = min(r["median_ms"] for r in rows)
            assert default["median_ms"] <= slack * fastest, (name, kernel, default["num_splits"])
    gqa = records.read_record("ch8/decode_gqa")["rows"]
    assert {(r["heads"], r["kv_heads"]) for r in gqa} == {(32, 8)}


def test_ablation_record_recomputes_and_times_every_variant_where_it_acts():
    from flashlab.bench import ablate

    data = records.read_record("benchmarks/ablations")
    assert PROVENANCE_KEYS <= set(data["provenance"])
    rows = data["rows"]
    for r in rows:
        f = forward.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"])
        assert r["tflops"] == pytest.approx(f / (r["median_ms"] * 1e-3) / 1e12, rel=1e-3), r
        assert r["repeat"] >= records.MIN_REPEAT and r["max_abs_diff"] <= 1e-2
    shapes = {(r["d"], r["n"], r["causal"], r["protocol"]) for r in rows}
    for rung, (before, changes) in ablate.ABLATIONS.items():
        for d, n, causal, protocol in shapes:
            timed = {r["impl"] for r in rows if (r["rung"], r["d"], r["n"], r["causal"], r["protocol"])
                     == (rung, d, n, causal, protocol)}
            want = {before, rung} | {f"{rung}-{name}" for name, _, _, where in changes if ablate.acts(where, d, causal)}
            assert timed == want, (rung, d, n, causal, protocol)


def test_backward_profile_shows_pipe_issue_bound_beside_sdpa_flash():
    """docs/kernels.md: at d = 128 the backward kernel pipe executes about 3x the warp instructions of SDPA flash's
    main backward kernel, with fewer stall cycles per instruction and the same 8 warps per SM."""
    procs = {p["kernels"][0]["name"]: p["metrics"] for p in records.read_record("ncu/stalls_bwd_pipe")["processes"]}
    assert set(procs) == {"bwd_pipe_f16_d64", "bwd_pipe_f16_d128"}
    (sdpa,) = (p["metrics"] for p in records.read_record("ncu/stalls_bwd_sdpa_flash")["processes"])
    ours = procs["bwd_pipe_f16_d128"]

    assert 2.5 < ours["smsp__inst_executed.sum"] / sdpa["smsp__inst_executed.sum"] < 3.5
    assert profile.stall_cycles(ours) < profile.stall_cycles(sdpa)
    assert ours["gpu__time_duration.sum"] > sdpa["gpu__time_duration.sum"]
    warps = "sm__warps_active.avg.pct_of_peak_sustained_active"
    assert abs(ours[warps] - sdpa[warps]) < 0.5


def test_peak_record_recomputes_and_bounds_every_rung():
    """The mma.sync ceiling: TFLOP/s recomputed from each row's work and time; more warps per SM never lose much
    (the loop is the same); and no rung of the ladder's run (same GPU) is above it."""
    data = records.read_record("benchmarks/peak")
    assert PROVENANCE_KEYS <= set(data["provenance"])
    rows = data["rows"]
    assert {r["dtype"] for r in rows} == {"float16", "bfloat16"}
    assert {r["protocol"] for r in rows} == {*records.PROTOCOLS}
    for r in rows:
        flop = r["sms"] * r["warps_per_sm"] * r["iters"] * peak.ACC * peak.FLOP_PER_MMA
        assert r["tflops"] == pytest.approx(flop / (r["median_ms"] * 1e-3) / 1e12, rel=1e-3), r
        assert r["repeat"] >= records.MIN_REPEAT
    ceiling = peak.ceiling(rows)
    ladder = records.read_record("benchmarks/ladder")
    assert ladder["provenance"]["gpu"] == data["provenance"]["gpu"]
    assert max(r["tflops"] for r in ladder["rows"] if r.get("impl") in fgpu.RUNGS) < ceiling
    assert peak.format_rows(rows).count("ceiling") == 2


def test_occupancy_profile_shows_rung12_with_more_warps_and_a_busier_tensor_pipe():
    """What chapter 7 says of rung 12's profile: 1.5x the warps of rung 11 active, the tensor pipe busier, less
    time, at d = 64 (the profile's one kernel per rung)."""
    procs = {p["impl"]: p for p in records.read_record("ncu/occupancy_k_lanes_three_blocks")["processes"]}
    assert set(procs) == {"k_lanes", "three_blocks"}
    for p in procs.values():
        assert [k["name"] for k in p["kernels"]] == ["attn_fwd_f16_d64"]
    m11, m12 = procs["k_lanes"]["metrics"], procs["three_blocks"]["metrics"]
    warps = "sm__warps_active.avg.pct_of_peak_sustained_active"
    tensor = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    assert m12[warps] / m11[warps] == pytest.approx(1.5, rel=0.05)
    assert m12[tensor] > m11[tensor] and m12["gpu__time_duration.sum"] < m11["gpu__time_duration.sum"]


def test_recorded_best_rungs_are_near_the_fastest_tensor_core_rungs_of_the_ladder():
    """BEST was chosen in another run (the probe below); in the ladder's record it is within 5 % of the fastest rung at
    every shape by both protocols: rungs that close (11 and 12 at d = 128) swap places from one run to the next."""
    rows = [r for r in records.read_record("benchmarks/ladder")["rows"] if "error" not in r]
    for protocol in records.PROTOCOLS:
        for d in fgpu.HEAD_DIMS:
            best = fgpu.BEST[("f16", d)]
            shapes = {(r["n"], r["causal"]) for r in rows if r["d"] == d and r["impl"] == best}
            assert shapes
            for n, causal in shapes:
                same = {r["impl"]: r["tflops"] for r in rows
                        if (r["d"], r["n"], r["causal"], records.protocol_of(r)) == (d, n, causal, protocol)}
                fastest = max(t for i, t in same.items() if i in fgpu.RUNGS)
                assert same[best] >= 0.95 * fastest, (protocol, d, n, causal, same)


def test_best_rung_is_the_one_the_probe_run_chooses():
    """BEST is what ``fastest_rung`` picks from the run that timed the last rungs side by side, for both dtypes and at
    every d; that run timed every (dtype, n, mask) under both protocols for each of them."""
    rows = [r for r in records.read_record(forward.BEST_PROBE)["rows"] if "error" not in r]
    rungs = [name for name in reversed(fgpu.LADDER_ORDER) if name in {r["impl"] for r in rows}]
    assert len(rungs) >= 2, rungs
    for d in fgpu.HEAD_DIMS:
        timed = {(r["impl"], forward.dtype_of(r), records.protocol_of(r), r["n"], r["causal"])
                 for r in rows if r["d"] == d}
        shapes = {k[1:] for k in timed}
        assert {k[0] for k in shapes} == {"float16", "bfloat16"} and {k[1] for k in shapes} == set(records.PROTOCOLS)
        assert all((name, *k) in timed for name in rungs for k in shapes), d
        choice = forward.fastest_rung(rows, d, rungs)
        assert fgpu.BEST[("f16", d)] == fgpu.BEST[("bf16", d)] == choice, (d, choice)


def test_hopper_best_is_the_one_the_h200_run_chooses():
    """HOPPER_BEST is what ``fastest_rung`` picks among rungs H1-H9 from the H200 run that timed them side by side
    (every dtype, n, mask and protocol), then, rung by rung, between the choice so far and each later rung (H10,
    H11) from the run that timed that rung beside the rungs chosen before it; every run an sm_90 one."""
    record = records.read_record(forward.HOPPER_PROBE)
    assert str(record["provenance"]["compute_capability"]) == "90"
    rows = [r for r in record["rows"] if "error" not in r]
    later = list(forward.HOPPER_LATER_PROBES)
    assert later == list(fgpu.HOPPER_RUNGS)[-len(later):]  # the rungs after H9, in ladder order
    rungs = [name for name in fgpu.HOPPER_RUNGS if name in {r["impl"] for r in rows}]
    assert rungs == [name for name in fgpu.HOPPER_RUNGS if name not in later]
    shapes = {(r["dtype"], r["d"], r["n"], r["causal"], records.protocol_of(r)) for r in rows}
    choice = {d: forward.fastest_rung(rows, d, rungs) for d in fgpu.HEAD_DIMS}
    for name, probes in forward.HOPPER_LATER_PROBES.items():
        runs = []
        for probe in probes:
            run = records.read_record(probe)
            assert str(run["provenance"]["compute_capability"]) == "90", probe
            lrows = [r for r in run["rows"] if "error" not in r]
            assert {"sdpa_flash", "sdpa_cudnn", name, *choice.values()} <= {r["impl"] for r in lrows}, probe
            assert {(r["dtype"], r["d"], r["n"], r["causal"], records.protocol_of(r)) for r in lrows} == shapes, probe
            runs.append(lrows)
        # the later rung replaces the choice so far where it is faster over the runs that timed both
        choice = {d: forward.fastest_rung(runs[0], d, [choice[d], name], *runs[1:]) for d in fgpu.HEAD_DIMS}
    for d in fgpu.HEAD_DIMS:
        assert fgpu.HOPPER_BEST[("f16", d)] == fgpu.HOPPER_BEST[("bf16", d)] == choice[d], (d, choice)
        any_scale = [r for r in rungs if fgpu.HOPPER_RUNGS[r].file not in fgpu.HOPPER_POSITIVE_SCALE_ONLY]
        assert fgpu.HOPPER_ANY_SCALE[d] == forward.fastest_rung(rows, d, any_scale), d


def test_chapter_11_statements_hold_in_the_h200_run():
    """What chapter 11 says of the recorded Hopper run, row by row (both dtypes, every n and mask, both protocols):
    a re-recorded run that contradicts the text fails here."""
    rows = [r for r in records.read_record(forward.HOPPER_PROBE)["rows"] if "error" not in r]
    t = {(r["impl"], r["dtype"], r["d"], r["n"], r["causal"], records.protocol_of(r)): r["tflops"] for r in rows}
    shapes = {k[1:] for k in t}
    assert {s[1] for s in shapes} == {64, 128} and {s[4] for s in shapes} == set(records.PROTOCOLS)

    def at(impl, shape):
        return t[(impl, *shape)]

    hopper = [h for h in fgpu.HOPPER_RUNGS if h not in forward.HOPPER_LATER_PROBES]  # H1-H9: this run's rungs
    before_h10 = hopper
    for s in shapes:
        assert at("tma", s) > at("wgmma", s) and at("tma", s) > at("sdpa_flash", s), s
        if s[1] == 128:
            assert at("wgmma", s) < at("three_blocks", s), s  # H1 does not pass rung 12 at d = 128
            assert at("specialized", s) <= 1.02 * at("tma", s), s  # H3 gains nothing over H2
            assert all(at("sdpa_cudnn", s) > at(h, s) for h in before_h10), s
            if s[2] >= 4096:
                assert at("three_stages", s) > at("overlap", s), s  # the third stage pays at every long row
                assert at("fused_exp", s) > at("tma", s), s
        else:
            assert all(at("tma", s) >= at(h, s) for h in before_h10), s  # at d = 64 H2 is the fastest of H1-H9
    for s in shapes:
        if s[1] == 128 and s[2] >= 4096:
            assert at("overlap", s) > at("specialized", s), s  # H4's overlaps pay against H3
    assert {at("fused_exp", s) > at("three_stages", s) for s in shapes if s[1] == 128} == {True, False}
    # H4 alone: ahead of H2 at some long rows at d = 128, behind at others
    h4_vs_h2 = {at("overlap", s) > at("tma", s) for s in shapes if s[1] == 128 and s[2] >= 4096}
    assert h4_vs_h2 == {True, False}
    # H6 against H5 at d = 128: ahead at most rows, behind at a few
    h6_vs_h5 = [at("fused_exp", s) > at("three_stages", s) for s in shapes if s[1] == 128]
    assert sum(h6_vs_h5) > len(h6_vs_h5) / 2 and not all(h6_vs_h5)

    def geomean(impl, d):  # TFLOP/s over every row at d (the same rows for every impl)
        return math.exp(statistics.fmean(math.log(at(impl, s)) for s in shapes if s[1] == d))

    def ratios(a, b, **where):  # at(a) / at(b) over the rows whose dtype, d, n, mask and protocol match ``where``
        keys = ("dtype", "d", "n", "causal", "protocol")
        return [at(a, s) / at(b, s) for s in shapes if all(s[keys.index(k)] == v for k, v in where.items())]

    # H6's fused exponent pays where the exponentials weigh the most: at d = 64 about 9 % over H5 by the geometric
    # mean, ahead at every row but at most one
    assert 1.05 < geomean("fused_exp", 64) / geomean("three_stages", 64) < 1.15
    assert sum(r <= 1.0 for r in ratios("fused_exp", "three_stages", d=64)) <= 1
    # H7's rescale under S changed nothing measurable: within 5 % of H6 at all rows but two, about 1 % by the
    # geometric mean
    assert sum(abs(at("rescale_under_s", s) / at("fused_exp", s) - 1) > 0.05 for s in shapes) <= 2
    assert all(abs(geomean("rescale_under_s", d) / geomean("fused_exp", d) - 1) < 0.015 for d in (64, 128))
    # H8's persistent grid against H7: without a mask 4-10 % faster at every row of n = 1024, faster on average at
    # 4096 (some rows a few per cent slower), level (5 %) at 16384; with the causal mask slower at every row: about
    # 2/3 at d = 64 and 0.68-0.75 at d = 128 for n = 16384, 0.81-0.95 at 1024, within 5 % at 4096
    assert all(1.03 < r < 1.11 for r in ratios("persistent", "rescale_under_s", n=1024, causal=False))
    at_4096 = ratios("persistent", "rescale_under_s", n=4096, causal=False)
    assert statistics.geometric_mean(at_4096) > 1.0 and min(at_4096) < 1.0
    assert all(0.95 <= r <= 1.05 for r in ratios("persistent", "rescale_under_s", n=16384, causal=False))
    assert all(r < 1.0 for r in ratios("persistent", "rescale_under_s", causal=True))
    assert all(0.6 <= r <= 0.7 for r in ratios("persistent", "rescale_under_s", n=16384, causal=True, d=64))
    assert all(0.67 <= r <= 0.76 for r in ratios("persistent", "rescale_under_s", n=16384, causal=True, d=128))
    assert all(0.8 <= r <= 0.96 for r in ratios("persistent", "rescale_under_s", n=1024, causal=True))
    assert all(r >= 0.95 for r in ratios("persistent", "rescale_under_s", n=4096, causal=True))
    # H9's deal: with the mask 1.2-1.6x H8 at every row of n = 16384, H7's level again (within 3 % by the geometric
    # mean at each d, 0.94-1.18 row by row); at d = 64 ahead of H7 at every causal row of n = 1024 and 4096 (6-16 %)
    assert all(1.2 <= r <= 1.65 for r in ratios("balanced", "persistent", n=16384, causal=True))
    for d in fgpu.HEAD_DIMS:
        at_16384 = ratios("balanced", "rescale_under_s", n=16384, causal=True, d=d)
        assert abs(statistics.geometric_mean(at_16384) - 1) < 0.03 and all(0.93 <= r <= 1.18 for r in at_16384)
    assert all(1.06 <= r <= 1.17 for n in (1024, 4096)
               for r in ratios("balanced", "rescale_under_s", n=n, causal=True, d=64))
    # without the mask H9 runs H8's code: one kernel timed twice, within 6 % row by row
    assert all(0.94 <= r <= 1.06 for r in ratios("balanced", "persistent", causal=False))
    # by the geometric mean H9 is 2 % ahead of H6 at d = 128 (more than fastest_rung's margin), and cuDNN stays
    # ahead of it at every row there (0.75-0.99x)
    assert 1 + forward.TIE < geomean("balanced", 128) / geomean("fused_exp", 128) < 1.03
    assert all(0.74 <= r < 1.0 for r in ratios("balanced", "sdpa_cudnn", d=128))
    rungs = [r for r in hopper]
    assert forward.fastest_rung(rows, 128, rungs) == "balanced" and forward.fastest_rung(rows, 64, rungs) == "tma"


def test_fastest_rung_needs_a_margin_to_move_on():
    """The rule itself, on made-up rows: a later rung 0.5 % faster does not replace the earlier one; 5 % faster does."""
    def rows(later_ms):
        return [{"impl": impl, "dtype": "float16", "protocol": p, "d": 64, "n": 1024, "causal": False, "median_ms": ms}
                for impl, ms in (("early", 1.0), ("late", later_ms)) for p in records.PROTOCOLS]
    assert forward.fastest_rung(rows(0.995), 64, ["early", "late"]) == "early"
    assert forward.fastest_rung(rows(0.95), 64, ["early", "late"]) == "late"
    with pytest.raises(ValueError, match="d = 128"):
        forward.fastest_rung(rows(0.95), 128, ["early", "late"])


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
        key = (r["impl"], r.get("dtype"), r["d"], r["n"], r.get("m"), r.get("causal"))
        shapes.setdefault(key, []).append(r["protocol"])
    assert all(sorted(p) == sorted(records.PROTOCOLS) for p in shapes.values()), shapes
    # the references are in the same run, under both protocols, for every shape the course's kernels ran at
    refs = ("sdpa_flash", "sdpa_cudnn")
    for impl, dtype, d, n, m, causal in shapes:
        for ref in refs:
            assert (ref, dtype, d, n, m, causal) in shapes, (name, impl, ref)


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


def _times(probe: str) -> dict[tuple, float]:
    """(impl, dtype, d, n, causal, protocol) -> median ms of a record's timed rows."""
    return {(r["impl"], r["dtype"], r["d"], r["n"], r["causal"], records.protocol_of(r)): r["median_ms"]
            for r in records.read_record(probe)["rows"] if "error" not in r}


_SHAPE_KEYS = ("dtype", "d", "n", "causal", "protocol")


def _speedups(ms: dict[tuple, float], a: str, b: str, **where) -> list[float]:
    """time(b) / time(a) at every shape of ``ms`` matching ``where`` (above 1 where a is faster)."""
    shapes = {k[1:] for k in ms}
    return [ms[(b, *s)] / ms[(a, *s)] for s in shapes
            if all(s[_SHAPE_KEYS.index(k)] == v for k, v in where.items())]


def _span(v: list[float]) -> str:
    return f"{min(v):.2f}-{max(v):.2f}x"


def _gm(v: list[float]) -> str:
    return f"{statistics.geometric_mean(v):.2f}x"


def _chapter_11_cell(cell_id: str) -> str:
    """A cell of chapter 11, its whitespace collapsed as the statements are searched for."""
    cells = json.loads((records.ROOT / "notebooks" / "11_hopper.ipynb").read_text())["cells"]
    return " ".join("".join(next(c for c in cells if c.get("id") == cell_id)["source"]).split())


def test_chapter_11_statements_on_rung_h10_hold_in_its_run():
    """Chapter 11, section 13, against data/benchmarks/hopper_merged.json (H10 beside H2, H9 and SDPA, one run)."""
    rows = [r for r in records.read_record(forward.HOPPER_MERGED_PROBE)["rows"] if "error" not in r]
    ms = _times(forward.HOPPER_MERGED_PROBE)

    def speedups(a, b, **where):
        return _speedups(ms, a, b, **where)

    span = _span
    text = _chapter_11_cell("h10-merged-results")
    over_h9 = speedups("merged", "balanced")
    assert sum(r <= 1.0 for r in over_h9) == 1
    assert (f"at $d = 128$ {span(speedups('merged', 'balanced', d=128, n=16384))} at $n = 16384$ and "
            f"{span(speedups('merged', 'balanced', d=128))} overall" in text)
    d64 = speedups("merged", "balanced", d=64)
    assert f"{statistics.geometric_mean(d64):.2f}x by the geometric mean at $d = 64$ ({span(d64)} row by row)" in text
    assert forward.fastest_rung(rows, 128, ["balanced", "merged"]) == "merged"
    long = {dt: [x for n in (4096, 16384) for x in speedups("merged", "sdpa_cudnn", d=128, n=n, dtype=dt)]
            for dt in ("float16", "bfloat16")}
    both = long["float16"] + long["bfloat16"]
    assert f"reaches {statistics.geometric_mean(both):.2f}x by the geometric mean" in text
    assert f"({span(long['float16'])} row by row in fp16, {span(long['bfloat16'])} in bf16)" in text
    assert min(both) < 0.9  # "not met yet"
    h9 = [statistics.geometric_mean([x for n in (4096, 16384) for x in speedups("balanced", "sdpa_cudnn", d=128, n=n,
                                                                                 dtype=dt)])
          for dt in ("float16", "bfloat16")]
    assert f"where H9 had {min(h9):.2f}-{max(h9):.2f}x" in text
    assert statistics.geometric_mean(d64) > statistics.geometric_mean(speedups("merged", "balanced", d=128))
    causal, full = (speedups("merged", "balanced", d=128, n=1024, causal=c) for c in (True, False))
    assert f"the causal rows gain {100 * min(causal) - 100:.0f}-{100 * max(causal) - 100:.0f} %" in text
    assert f"the full ones {100 * min(full) - 100:.0f}-{100 * max(full) - 100:.0f} %" in text
    assert max(causal) < min(full)
    vs_h2 = statistics.geometric_mean(speedups("merged", "tma", d=64))
    assert vs_h2 < 1 and f"H10 at {vs_h2:.2f}x of H2" in text
    assert forward.fastest_rung(rows, 64, ["tma", "merged"]) == "tma"


def test_chapter_11_statements_on_rung_h11_hold_in_its_run():
    """Chapter 11, section 14, against data/benchmarks/hopper_staged.json (H11 beside H2, H10 and SDPA, one run)."""
    rows = [r for r in records.read_record(forward.HOPPER_STAGED_PROBE)["rows"] if "error" not in r]
    ms = _times(forward.HOPPER_STAGED_PROBE)

    def speedups(a, b, **where):
        return _speedups(ms, a, b, **where)

    span, gm = _span, _gm
    text = _chapter_11_cell("h11-staged-results")
    d128, d64 = speedups("staged", "merged", d=128), speedups("staged", "merged", d=64)
    assert (f"by the geometric mean at both head dimensions: {gm(d128)} at $d = 128$ and {gm(d64)} at $d = 64$ "
            f"({span(d128)} and {span(d64)} row by row, slower at {sum(x < 1 for x in d128 + d64)} of "
            f"{len(d128 + d64)} rows)") in text
    assert min(statistics.geometric_mean(d128), statistics.geometric_mean(d64)) > 1
    by_n = {n: gm(speedups("staged", "merged", d=128, n=n)) for n in (1024, 4096, 16384)}
    assert f"{by_n[1024]} at $n = 1024$, {by_n[4096]} at 4096 and at 16384" in text and by_n[4096] == by_n[16384]
    assert by_n[1024] > by_n[4096]  # "where the prediction put it"
    causal, full = (gm(speedups("staged", "merged", d=128, causal=c)) for c in (True, False))
    assert causal > full and f"more with the causal mask ({causal}) than without ({full})" in text
    at64 = {gm(speedups("staged", "merged", d=64, n=n)) for n in (1024, 4096, 16384)}
    assert len(at64) == 1 and f"({at64.pop()} at every $n$)" in text
    assert forward.fastest_rung(rows, 128, ["merged", "staged"]) == "staged"
    long = {dt: [x for n in (4096, 16384) for x in speedups("staged", "sdpa_cudnn", d=128, n=n, dtype=dt)]
            for dt in ("float16", "bfloat16")}
    both = long["float16"] + long["bfloat16"]
    h10 = [x for dt in ("float16", "bfloat16") for n in (4096, 16384)
           for x in speedups("merged", "sdpa_cudnn", d=128, n=n, dtype=dt)]
    assert (f"it reaches {gm(both)} by the geometric mean ({span(long['float16'])} row by row in fp16, "
            f"{span(long['bfloat16'])} in bf16; H10 {gm(h10)} in the same run): {sum(x >= 0.9 for x in both)} of those "
            f"{len(both)} rows are at 0.9x or above") in text
    assert sum(x < 0.9 for x in both) == 1  # "one is just below"
    vs_h2 = statistics.geometric_mean(speedups("staged", "tma", d=64))
    assert vs_h2 < 1 and f"H11 at {vs_h2:.2f}x of H2" in text
    assert forward.fastest_rung(rows, 64, ["tma", "staged"]) == "tma"
    # "H10 reached 0.91x of cuDNN in its own run, 0.93x here"
    h10_own = [x for n in (4096, 16384) for x in _speedups(_times(forward.HOPPER_MERGED_PROBE), "merged", "sdpa_cudnn",
                                                            d=128, n=n)]
    assert f"(H10 reached {gm(h10_own)[:-1]}x of cuDNN in its own run, {gm(h10)[:-1]}x here)" in text


def test_chapter_11_statements_on_rung_h12_hold_in_its_three_runs():
    """Chapter 11, section 15, against data/benchmarks/hopper_stream_k.json (H11 timed first within each shape),
    data/benchmarks/hopper_stream_k_first.json (H12 first) and data/benchmarks/hopper_stream_k_rounds.json (both
    orders, --rounds 2), and against the deal's prediction."""
    from flashlab.bench import peak as bench_peak
    from flashlab.gpu import hopper

    probes = forward.HOPPER_STREAM_K_PROBES
    commands = [records.read_record(p)["provenance"]["command"] for p in probes]
    assert [c.split("--impls ")[1].split()[:3] for c in commands] == [
        ["tma", "staged", "stream_k"], ["tma", "stream_k", "staged"], ["tma", "staged", "stream_k"]]
    assert commands[2].endswith("--rounds 2") and "--rounds" not in commands[0] + commands[1]
    assert all(r["rounds"] == 2 for r in records.read_record(probes[2])["rows"] if "error" not in r)
    times = [_times(p) for p in probes]
    text = _chapter_11_cell("h12-stream-k-results")
    gm = _gm

    def over(i, **where):  # time(H11) / time(H12) in run i
        return _speedups(times[i], "stream_k", "staged", **where)

    causal = [over(i, d=128, causal=True) for i in range(3)]
    full = [over(i, d=128, causal=False) for i in range(3)]
    assert (f"H12 came out at {gm(causal[0])} of H11 in the run that timed H11 first, at {gm(causal[1])} in the run "
            f"that timed H12 first and at {gm(causal[2])} in the run of both orders") in text
    assert statistics.geometric_mean(causal[0]) < 1 < statistics.geometric_mean(causal[1])
    assert abs(statistics.geometric_mean(causal[2]) - 1) < 0.015  # "timing both orders levels it"
    assert f"ahead in every run: {gm(full[0])}, {gm(full[1])} and {gm(full[2])}" in text
    assert min(statistics.geometric_mean(x) for x in full) > 1
    predicted = []
    for n, key_tiles in ((1024, 8), (4096, 32), (16384, 128)):
        longest = max(sum(t1 - t0 for _, t0, t1 in p) for p in hopper.stream_k_deal(2048, key_tiles, 132))
        predicted.append(f"{-(-2048 // 132) * key_tiles / longest:.3f}x")
        by_run = [gm(over(i, d=128, causal=False, n=n)) for i in range(3)]
        where = f"at $n = {n}$" if n == 1024 else f"at {n}"
        assert f"{by_run[0]}, {by_run[1]} and {by_run[2]} {where}" in text, (n, by_run)
    assert f"prediction of {predicted[0]}, {predicted[1]} and {predicted[2]}" in text
    rows = [[r for r in records.read_record(p)["rows"] if "error" not in r] for p in probes]
    assert forward.fastest_rung(rows[0], 128, ["staged", "stream_k"], *rows[1:]) == "stream_k"
    assert forward.fastest_rung(rows[0], 64, ["tma", "stream_k"], *rows[1:]) == "tma"
    at64 = [x for i in range(3) for x in _speedups(times[i], "stream_k", "tma", d=64)]
    assert f"(H12 at {gm(at64)} of H2)" in text
    h11_counts, below = [], {}
    for i, words in ((0, "in the run that timed H11 first, "), (1, "in the run that timed H12 first, "),
                     (2, "in the run of both orders, ")):
        long = [s for s in {k[1:] for k in times[i]} if s[1] == 128 and s[2] >= 4096]
        h12 = [times[i][("sdpa_cudnn", *s)] / times[i][("stream_k", *s)] for s in long]
        h11 = [times[i][("sdpa_cudnn", *s)] / times[i][("staged", *s)] for s in long]
        assert f"{_span(h12)[:-1]}x {words}{sum(x >= 0.9 for x in h12)} of 16" in text, (i, _span(h12))
        h11_counts.append(sum(x >= 0.9 for x in h11))
        below[i] = (sum(x < 0.9 for x in h12), sum(x < 0.9 for x in h11))
    assert f"(H11 in the same runs: {h11_counts[0]}, {h11_counts[1]} and {h11_counts[2]} of 16)" in text
    # "In each single-order run the rung timed second has the most rows below 0.9x"; "for H12 and for H11 alike"
    assert below[0][0] > below[0][1] and below[1][1] > below[1][0] and below[2] == (0, 0), below
    ceiling = bench_peak.ceiling(records.read_record("benchmarks/peak_hopper")["rows"], "bfloat16",
                                 "wgmma_m64n256k16")
    top = max(r["tflops"] for r in rows[2] if r["impl"] == "stream_k" and r["d"] == 128 and r["dtype"] == "bfloat16")
    assert f"reaches {top:.0f} TFLOP/s, {top / ceiling:.0%} of the `wgmma` ceiling" in text


def test_docs_read_the_stream_k_tail_from_its_profile():
    """docs/kernels.md's reading of data/raw/ncu/ncu_stream_k_tail.csv: the busiest SM's active cycles over the
    average SM's, and the kernel's time, for H11 and H12 (ncu's CSV: one row per kernel and metric)."""
    import csv

    rows = [r for r in csv.reader((records.ROOT / "data/raw/ncu/ncu_stream_k_tail.csv").read_text().splitlines())
            if len(r) == 15 and r[0] != "ID"]
    metric = {(r[4], r[12]): float(r[14].replace(",", "")) for r in rows}
    h11, h12 = "attn_fwd_f16_d128", "attn_fwd_f16_d128_nomask"  # H12 without a mask launches its _nomask kernel
    spread = {k: metric[(k, "sm__cycles_active.max")] / metric[(k, "sm__cycles_active.avg")] for k in (h11, h12)}
    us = {k: metric[(k, "gpu__time_duration.sum")] / 1e3 for k in (h11, h12)}
    text = " ".join((records.ROOT / "docs" / "kernels.md").read_text().split())
    assert (f"the busiest SM was active {spread[h11]:.3f}× the average SM's cycles under H11 (16 tiles against 15.5) "
            f"and {spread[h12]:.3f}× under H12, and the kernel took {us[h12]:.0f} µs against {us[h11]:.0f}") in text
    assert abs(spread[h11] - 16 / 15.5) < 0.005 and spread[h12] < 1.01


def _bwd_hopper_speedups():
    """(record's sm_90 rows, speedup(new, old, keep) -> the speedups of ``new`` over ``old`` on the rows kept)."""
    from flashlab.gpu import backward as gbwd

    record = records.read_record("ch8/bwd_hopper")
    assert str(record["provenance"]["compute_capability"]) == "90"
    rows = [r for r in record["rows"] if "error" not in r]
    ms = {(r["impl"], r["dtype"], r["d"], r["n"], r["causal"], records.protocol_of(r)): r["median_ms"] for r in rows}
    shapes = {k[1:] for k in ms}
    steps = [f"ours_{x}" for x, mk in gbwd.MAIN_KERNELS.items() if mk.hopper]
    assert {"sdpa_flash", "sdpa_cudnn", "ours_pipe", *steps} <= {k[0] for k in ms}
    assert {s[0] for s in shapes} == {"float16", "bfloat16"} and {s[1] for s in shapes} == set(fgpu.HEAD_DIMS)
    assert {s[3] for s in shapes} == {False, True} and {s[4] for s in shapes} == set(records.PROTOCOLS)

    def speedup(new, old, keep=lambda s: True):
        return [ms[(old, *s)] / ms[(new, *s)] for s in shapes if keep(s)]

    return rows, steps, speedup


def test_hopper_backward_best_is_the_one_the_h200_run_chooses():
    """HOPPER_BEST is what ``fastest_rung`` picks among the four Hopper backward kernels at every d, and "best"
    tries it first (on sm_90 alone)."""
    from flashlab.gpu import backward as gbwd

    rows, steps, _ = _bwd_hopper_speedups()
    for d in fgpu.HEAD_DIMS:
        assert forward.fastest_rung(rows, d, steps) == f"ours_{gbwd.HOPPER_BEST}", d
    assert gbwd.FASTEST_FIRST[0] == gbwd.HOPPER_BEST and gbwd.MAIN_KERNELS[gbwd.HOPPER_BEST].hopper


def test_chapter_11_backward_statements_hold_in_the_h200_run():
    """What chapter 11's section 16 says of the recorded run (every dtype, n, mask and protocol): a re-recorded
    run that contradicts the text fails here."""
    from flashlab.gpu import backward as gbwd

    _, (w1, w2, w3, w4), speedup = _bwd_hopper_speedups()
    d64, d128 = (lambda s: s[1] == 64), (lambda s: s[1] == 128)
    # step 1 beats SDPA flash on every row at d = 128, and is within 1 % of it or faster at d = 64
    assert min(speedup(w1, "sdpa_flash", d128)) > 1 and min(speedup(w1, "sdpa_flash", d64)) >= 0.99
    # step 2: a few per cent either way at d = 128, slower on every row at d = 64
    assert all(0.95 < x < 1.05 for x in speedup(w2, w1, d128)) and max(speedup(w2, w1, d64)) < 1
    # step 3 gains on every row, more at d = 128 than at d = 64
    assert min(speedup(w3, w2)) > 1 and min(speedup(w3, w2, d128)) > max(speedup(w3, w2, d64))
    # step 4: with the mask at n = 4096, 3-6 % faster back to back, under latency faster at d = 64 and slower at
    # d = 128; without the mask up to 4 % slower at d = 64 and up to 4 % faster at d = 128; never past greedy
    # scheduling's bound (6.4 %)
    masked = [speedup(w4, w3, lambda s, d=d, p=p: s[3] and s[2] == 4096 and s[1] == d and s[4] == p)
              for d in (64, 128) for p in ("throughput", "latency")]
    assert 1.025 < min(masked[0] + masked[2]) and max(masked[0] + masked[2]) < 1.06
    assert min(masked[1]) > 1 and max(masked[3]) < 1
    assert 0.955 < min(speedup(w4, w3, lambda s: not s[3] and s[1] == 64)) < 1
    assert 1 < max(speedup(w4, w3, lambda s: not s[3] and s[1] == 128)) < 1.04
    assert max(speedup(w4, w3)) < 1.064
    # "best" passes 0.9x SDPA flash on every row; cuDNN stays 1.2-1.6x ahead of it
    best = f"ours_{gbwd.HOPPER_BEST}"
    assert min(speedup(best, "sdpa_flash")) >= 0.9
    lead = [1 / x for x in speedup(best, "sdpa_cudnn")]
    assert 1.15 <= min(lead) and max(lead) <= 1.6


def test_chapter_11_backward_profile_statements_hold():
    """Chapter 11 section 16 on data/ncu/stalls_bwd_wgmma.json: with dQ added by the copy engine (step 3 against
    step 2), the global-memory stalls at d = 128 fall to less than a fifth and all stalls by about a quarter, for
    about as many instructions; at d = 64 the lg throttle was small to begin with, the long-scoreboard stalls fall
    by two thirds and all stalls by about a tenth. And the instruction counts of step 1 against pipe's."""
    procs = {p["kernels"][0]["name"]: p["metrics"] for p in records.read_record("ncu/stalls_bwd_wgmma")["processes"]}
    kernels = ("wgmma", "wgmma_overlap", "wgmma_bulk", "wgmma_balanced")
    assert set(procs) == {f"bwd_{k}_f16_d{d}" for k in kernels for d in (64, 128)}
    stall, total = profile.STALL, profile.stall_cycles

    def on_global(m):
        return m[stall.format("lg_throttle")] + m[stall.format("long_scoreboard")]

    step2, step3 = procs["bwd_wgmma_overlap_f16_d128"], procs["bwd_wgmma_bulk_f16_d128"]
    assert 0.15 < on_global(step3) / on_global(step2) < 0.25
    assert 0.7 < total(step3) / total(step2) < 0.8
    assert abs(step3["smsp__inst_executed.sum"] / step2["smsp__inst_executed.sum"] - 1) < 0.05
    step2, step3 = procs["bwd_wgmma_overlap_f16_d64"], procs["bwd_wgmma_bulk_f16_d64"]
    assert step2[stall.format("lg_throttle")] < 0.1 and 0.85 < total(step3) / total(step2) < 0.95
    assert 0.25 < step3[stall.format("long_scoreboard")] / step2[stall.format("long_scoreboard")] < 0.4
    # step 2 at d = 64 stalls more on fixed latencies (wait) than step 1
    assert step2[stall.format("wait")] > procs["bwd_wgmma_f16_d64"][stall.format("wait")]
    # step 1 issues fewer than two fifths of pipe's warp instructions at d = 128, about half at d = 64
    pipe = {p["kernels"][0]["name"]: p["metrics"] for p in records.read_record("ncu/stalls_bwd_pipe")["processes"]}
    count = "smsp__inst_executed.sum"
    ratio = {d: procs[f"bwd_wgmma_f16_d{d}"][count] / pipe[f"bwd_pipe_f16_d{d}"][count] for d in (64, 128)}
    assert ratio[128] < 0.4 and 0.45 < ratio[64] < 0.55


def test_best_forward_on_sm_90_against_sdpa_pinned_holds_to_its_record():
    """docs/kernels.md's reading of data/benchmarks/hopper_pinned.json: what "best" runs on sm_90 (HOPPER_BEST) against
    SDPA with each backend picked once, both protocols, every shape: ahead of flash everywhere, the ranges quoted."""
    rec = records.read_record("benchmarks/hopper_pinned")
    cmd = rec["provenance"]["command"]
    assert "--rounds 2" in cmd and cmd.split("--impls ")[1].split()[:2] == ["tma", "stream_k"]
    assert {fgpu.HOPPER_BEST[(dt, d)] for dt in ("f16", "bf16") for d in (64, 128)} == {"tma", "stream_k"}
    ms = _times("benchmarks/hopper_pinned")
    shapes = {k[1:5] for k in ms}
    assert len(shapes) == 24
    dt_key = {"float16": "f16", "bfloat16": "bf16"}

    def over(ref, protocol, keep=lambda shape: True):
        return [ms[(ref, *s, protocol)] / ms[(fgpu.HOPPER_BEST[(dt_key[s[0]], s[1])], *s, protocol)]
                for s in shapes if keep(s)]

    text = " ".join((records.ROOT / "docs" / "kernels.md").read_text().split())
    thr, lat = over("sdpa_flash", "throughput"), over("sdpa_flash", "latency")
    assert min(thr) > 1 and min(lat) > 1  # ahead of SDPA flash at every shape, both protocols
    assert f"(`hopper_pinned.json`, an H100: {min(lat):.2f}× at the least, under latency)" in text
    assert "H100" in rec["provenance"]["gpu"]
    assert (f"`\"best\"` is at {min(thr):.2f}-{max(thr):.2f}× back to back and {min(lat):.2f}-{max(lat):.2f}× under "
            "latency over all 24 shapes") in text
    low = min(shapes, key=lambda s: ms[("sdpa_flash", *s, "latency")] / ms[(fgpu.HOPPER_BEST[(dt_key[s[0]], s[1])],
                                                                                *s, "latency")])
    assert low[1:] == (128, 1024, True)  # "the lowest rows are causal at n = 1024, d = 128"
    long = [x for p in records.PROTOCOLS for x in over("sdpa_cudnn", p, lambda s: s[1] == 128 and s[2] >= 4096)]
    assert (f"at {min(long):.2f}-{max(long):.2f}× ({sum(x >= 0.9 for x in long)} of {len(long)} rows at 0.9× or "
            "above)") in text
    every = [x for p in records.PROTOCOLS for x in over("sdpa_cudnn", p)]
    assert f"over all {len(every)} rows at {min(every):.2f}-{max(every):.2f}×: behind at every d = 64 row" in text
    assert all(x < 1 for p in records.PROTOCOLS for x in over("sdpa_cudnn", p, lambda s: s[1] == 64))
    assert f"{min(long):.2f}-{max(long):.2f}× there and {min(every):.2f}-{max(every):.2f}× over all shapes" in text
    assert cmd.replace("python -m flashlab ", "") in text.replace("python -m flashlab ", "")
