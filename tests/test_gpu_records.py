"""The recorded GPU results in data/ (CPU only): provenance present, rows well formed, summaries reproducible.

The chapters plot these files on machines without a GPU, so they must stay loadable and self-consistent; and
every summary JSON in data/ncu must be exactly what `python -m flashlab.gpu.profile summarize` makes of its CSV.
"""

from __future__ import annotations

import json

import pytest

import flashlab.gpu as fgpu
from flashlab import bench
from flashlab.gpu import profile

BENCHMARKS = sorted((bench.DATA_DIR / "benchmarks").glob("*.json"))
ROW_KEYS = {"impl", "pass", "dtype", "d", "n", "batch", "heads", "causal", "median_ms", "tflops"}
PROVENANCE_KEYS = {"date_utc", "command", "gpu", "cupy", "numpy", "torch", "cuda_runtime", "nvidia_smi"}


def test_flop_count():
    assert bench.flop(1024, 64, 2, 3, causal=False) == 4 * 1024**2 * 64 * 2 * 3
    assert bench.flop(1024, 64, 2, 3, causal=True) == 2 * 1024**2 * 64 * 2 * 3


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_recorded_benchmarks_have_provenance_and_consistent_rows(path):
    data = json.loads(path.read_text())
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    assert data["rows"]
    for r in data["rows"]:
        if "error" in r or "nwarps" in r:  # failed runs (out of memory) and tuning rows carry no pass/dtype
            continue
        assert ROW_KEYS <= set(r), (path.name, sorted(ROW_KEYS - set(r)))
        assert r["repeat"] >= 20
        expected = bench.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"]) / (r["median_ms"] * 1e-3) / 1e12
        assert r["tflops"] == pytest.approx(expected, rel=1e-3), (path.name, r)


def test_ladder_has_every_rung_and_the_references_in_one_run():
    rows = bench.load_recorded("ladder")["rows"]
    impls = {r["impl"] for r in rows}
    assert set(fgpu.RUNGS) | set(bench.REFERENCES) <= impls
    table = bench.ladder_markdown(rows)
    for name in fgpu.RUNGS:
        assert f"| {name} |" in table


@pytest.mark.parametrize("name", [p.stem for p in sorted((bench.DATA_DIR / "ncu").glob("*.json"))
                                  if p.stem != "provenance" and not p.stem.startswith("provenance_")])
def test_ncu_summaries_are_reproducible_from_their_csv(name):
    data = bench.load_recorded(name)
    csv_path = bench.DATA_DIR / "ncu" / pathlib_name(data["source"])
    assert profile.summarize(csv_path.read_text()) == data["processes"]
    assert data["provenance"]["gpu"]


def pathlib_name(source: str) -> str:
    return source.rsplit("/", 1)[-1]


def test_recorded_best_rungs_are_the_fastest_tensor_core_rungs():
    rows = [r for r in bench.load_recorded("ladder")["rows"] if "error" not in r]
    for d in fgpu.HEAD_DIMS:
        best = fgpu.BEST[("f16", d)]
        for n, causal in {(r["n"], r["causal"]) for r in rows if r["d"] == d and r["impl"] == best}:
            same = {r["impl"]: r["tflops"] for r in rows if (r["d"], r["n"], r["causal"]) == (d, n, causal)}
            fastest = max((t, i) for i, t in same.items() if i in fgpu.RUNGS)[1]
            assert fastest == best, (d, n, causal, fastest)


# ------------------------------------------------------------------------------------------- chapter 8 (data/ch8)
CH8 = sorted((bench.DATA_DIR / "ch8").glob("*.json"))


@pytest.mark.parametrize("path", CH8, ids=lambda p: p.name)
def test_chapter8_records_have_provenance_and_consistent_rows(path):
    from flashlab.gpu import bench8

    data = json.loads(path.read_text())
    assert PROVENANCE_KEYS <= set(data["provenance"]), sorted(PROVENANCE_KEYS - set(data["provenance"]))
    assert data["provenance"]["command"].startswith("python -m flashlab.gpu.bench8 ")
    rows = [r for r in data["rows"] if "error" not in r]
    assert rows
    for r in rows:
        if r["pass"] == "bwd":
            f = bench8.bwd_flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"])
            assert f == pytest.approx(2.5 * bench.flop(r["n"], r["d"], r["batch"], r["heads"], r["causal"]))
            assert r["tflops"] == pytest.approx(f / (r["median_ms"] * 1e-3) / 1e12, rel=1e-3), r
            assert r["repeat"] >= 20
        elif r["pass"] == "decode":
            assert r["kv_bytes"] == 2 * r["batch"] * r["kv_heads"] * r["m"] * r["d"] * 2  # K and V, fp16
            assert r["gbps"] == pytest.approx(r["kv_bytes"] / (r["median_ms"] * 1e-3) / 1e9, rel=1e-3), r
            assert r["x_read_once"] == pytest.approx(r["median_ms"] / r["read_once_ms"], rel=1e-3), r
            assert r["read_once_ms"] == pytest.approx(r["kv_bytes"] / (r["copy_gbps"] * 1e9) * 1e3, rel=1e-3), r
            assert r["repeat"] >= 20
        elif r["pass"] == "train":
            assert len(r["losses"]) == r["steps"] and r["final_loss"] == r["losses"][-1], r["impl"]
        else:
            assert r["pass"] == "memory" and r["kept_bytes"] > 0 and r["backward_extra_bytes"] >= 0, r
    assert bench8.format_rows(data["rows"])  # what chapter 8 prints


def test_write_record_and_print_recorded_round_trip(tmp_path, capsys):
    prov = {"gpu": "G", "date_utc": "D", "command": "python -m flashlab bench"}
    path = bench.write_record(tmp_path / "sub", "x", prov, [{"impl": "a"}])
    assert json.loads(path.read_text()) == {"provenance": prov, "rows": [{"impl": "a"}]}
    bench.print_recorded(path, lambda rows: "|".join(r["impl"] for r in rows))
    out = capsys.readouterr().out
    assert "G, D, `python -m flashlab bench`" in out and out.rstrip().endswith("a")
    with pytest.raises(SystemExit, match="at least 20"):
        bench.check_repeat(19)
