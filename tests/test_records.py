"""flashlab.records (timing protocols, provenance, writing and reading records) and the recorded CPU run.

The timing and provenance code runs here without a GPU, against the NumPy stand-in for CuPy of
tools/hostemu, whose events read the host clock.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import time

import pytest

import flashlab.gpu as fgpu
from flashlab import cpu_bench, records
from flashlab.bench import cpu as bench_cpu

RECORDED_CPU = "cpu_bench/xeon-2core"
_HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"
_spec = importlib.util.spec_from_file_location("hostemu", _HOSTEMU)
hostemu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostemu)


@pytest.fixture
def fake_cupy(monkeypatch):
    """``import cupy`` gives the host stand-in; its device counts synchronizations in ``log``."""
    cp = hostemu.fake_cupy()
    log: list[str] = []

    class Device:
        compute_capability = "90"

        def synchronize(self):
            log.append("sync")

    cp.cuda.Device = Device
    monkeypatch.setitem(sys.modules, "cupy", cp)
    return log


@pytest.mark.parametrize("protocol", records.PROTOCOLS)
def test_cuda_times_brackets_each_call_and_synchronizes_per_protocol(fake_cupy, protocol):
    def fn():
        fake_cupy.append("call")
        time.sleep(0.002)

    times = records.cuda_times(fn, repeat=4, warmup=2, protocol=protocol)
    assert len(times) == 4 and min(times) >= 2.0  # each pair of events brackets one 2 ms call
    warm, timed = ["call", "call", "sync"], fake_cupy[3:]
    assert fake_cupy[:3] == warm
    if protocol == "throughput":
        assert timed == ["call"] * 4 + ["sync"]  # back to back, one synchronize at the end
    else:
        assert timed == ["call", "sync"] * 4 + ["sync"]  # one public call, then synchronize


@pytest.mark.parametrize("protocol", records.PROTOCOLS)
def test_a_pinned_call_is_timed_inside_its_setting_entered_once(fake_cupy, protocol):
    import contextlib

    @contextlib.contextmanager
    def backend():
        fake_cupy.append("enter")
        yield
        fake_cupy.append("exit")

    pinned = records.Pinned(backend, lambda: fake_cupy.append("call"))
    times = records.cuda_times(pinned, repeat=3, warmup=1, protocol=protocol)
    assert len(times) == 3
    # entered before the first (warm-up) call and left after the last synchronize, never between calls
    assert fake_cupy[0] == "enter" and fake_cupy[-1] == "exit"
    assert fake_cupy.count("enter") == 1 and fake_cupy.count("call") == 4
    fake_cupy.clear()
    pinned()  # a call alone, such as the check of its result, enters its setting itself
    assert fake_cupy == ["enter", "call", "exit"]


def test_median_ms_is_the_median_of_the_times(monkeypatch):
    monkeypatch.setattr(records, "cuda_times", lambda fn, repeat, warmup, **kw: [3.0, 1.0, 2.0, 10.0, 4.0])
    assert records.median_ms(lambda: None, 5, 0) == statistics.median([3.0, 1.0, 2.0, 10.0, 4.0]) == 3.0


def test_unknown_protocol_or_event_kind_is_refused(fake_cupy):
    with pytest.raises(ValueError, match="protocol"):
        records.cuda_times(lambda: None, 1, 0, protocol="wall")
    with pytest.raises(ValueError, match="kind"):
        records.cuda_times(lambda: None, 1, 0, kind="numpy")


def test_check_repeat_refuses_fewer_than_the_minimum():
    records.check_repeat(records.MIN_REPEAT)
    with pytest.raises(SystemExit, match=f"at least {records.MIN_REPEAT}"):
        records.check_repeat(records.MIN_REPEAT - 1)


def test_command_line_quotes_arguments_as_typed():
    assert records.command_line("python -m flashlab bench forward", []) == "python -m flashlab bench forward"
    assert (records.command_line("python -m flashlab bench cpu", ["--record", "a b"])
            == "python -m flashlab bench cpu --record 'a b'")


def test_gpu_provenance_names_the_machine_the_versions_and_the_kernels(fake_cupy):
    prov = records.gpu_provenance("python -m flashlab bench forward --repeat 20")
    assert prov["command"] == "python -m flashlab bench forward --repeat 20"
    for key in ("date_utc", "gpu", "compute_capability", "cuda_runtime", "cuda_driver_api", "cupy", "numpy",
                "python", "nvidia_smi", "torch", "git_commit", "git_dirty"):
        assert key in prov, key
    assert prov["gpu"] == "host emulation (no GPU)" and prov["cupy"] == "hostemu"
    assert prov["package_sha256"] == records.package_hash() and len(prov["package_sha256"]) == 16
    hopper = sorted(fgpu.KERNEL_DIR.glob("hopper/*.cu*"))
    assert prov["kernel_sha256"] == {
        **{r.file: hashlib.sha256(r.source().encode()).hexdigest()[:16] for r in fgpu.RUNGS.values()},
        **{f"hopper/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in hopper}}
    # every Hopper rung and header is named, so a record says which version of them it timed
    assert {r.file for r in fgpu.HOPPER_RUNGS.values()} | {"hopper/wgmma.cuh", "hopper/tma.cuh"} <= set(
        prov["kernel_sha256"])


def test_gpu_state_reads_the_clocks_or_says_why_not(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[1])
        if "clocks_event_reasons.active" in cmd[1]:  # an older driver: the field has its old name
            return subprocess.CompletedProcess(cmd, 2, "", 'Field "clocks_event_reasons.active" is not a valid field')
        return subprocess.CompletedProcess(cmd, 0, "1980 MHz, 3201 MHz, 41, 120.50 W, 0x0000000000000000\n", "")

    monkeypatch.setattr(records.subprocess, "run", fake_run)
    state = records.gpu_state()
    assert state.startswith("clocks.sm, clocks.mem, temperature.gpu, power.draw, clocks_throttle_reasons.active: ")
    assert state.endswith("1980 MHz, 3201 MHz, 41, 120.50 W, 0x0000000000000000") and len(calls) == 2

    def missing(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    monkeypatch.setattr(records.subprocess, "run", missing)
    assert records.gpu_state().startswith("unavailable: ") and "nvidia-smi" in records.gpu_state()


def test_a_gpu_benchmark_records_the_gpu_state_before_and_after_its_run(fake_cupy, tmp_path, monkeypatch):
    from flashlab.bench import gpu_main, record_parser

    states = iter(["before", "after"])
    monkeypatch.setattr(records, "gpu_state", lambda: next(states))
    seen = []

    def run(args, rows):
        seen.append("run")
        rows.append({"impl": "x"})

    p = record_parser("toy", "a toy benchmark", name="toy", out=records.DATA_DIR / "benchmarks", repeat=20, warmup=1)
    assert gpu_main("toy", ["--repeat", "20", "--out", str(tmp_path)], p, run, lambda rows: "table") == 0
    rec = json.loads((tmp_path / "toy.json").read_text())
    assert seen == ["run"] and rec["rows"] == [{"impl": "x"}]
    assert rec["provenance"]["gpu_state_start"] == "before" and rec["provenance"]["gpu_state_end"] == "after"


def test_write_read_and_print_a_record(tmp_path, monkeypatch, capsys):
    prov = {"gpu": "G", "date_utc": "D", "command": "python -m flashlab bench forward"}
    path = records.write_record(tmp_path / "benchmarks", "x", prov, [{"impl": "a"}], summary={"n": 1})
    assert list(json.loads(path.read_text())) == ["provenance", "summary", "rows"]
    monkeypatch.setattr(records, "DATA_DIR", tmp_path)
    assert records.read_record("benchmarks/x") == {"provenance": prov, "summary": {"n": 1}, "rows": [{"impl": "a"}]}
    assert records.record_path("benchmarks/x.json") == records.record_path("benchmarks/x") == path
    with pytest.raises(FileNotFoundError, match="data/README.md"):
        records.read_record("benchmarks/y")
    records.print_recorded(path, lambda rows: "|".join(r["impl"] for r in rows))
    out = capsys.readouterr().out
    assert "G, D, `python -m flashlab bench forward`" in out and out.rstrip().endswith("a")


# ------------------------------------------------------------------------------------------------------- CPU
def test_recorded_cpu_run_carries_provenance_and_its_summary():
    record = records.read_record(RECORDED_CPU)
    assert cpu_bench.load() == record  # chapter 5 reads this named run
    prov = record["provenance"]
    for key in ("cpu", "logical_cpus", "numba", "numpy", "date_utc", "command"):
        assert prov.get(key), key
    assert "python -m flashlab.cpu_bench" in prov["command"] or "python -m flashlab bench cpu" in prov["command"]
    assert {r["implementation"] for r in record["rows"]} == set(cpu_bench.IMPLEMENTATIONS)
    assert all(r["rel_error_vs_float64"] <= 1e-5 for r in record["rows"])
    assert record["summary"] == cpu_bench.summary(record["rows"])  # the summary follows from the rows
    assert "loadavg" in record["machine_activity"]["before"]


def test_bench_cpu_records_a_run_like_the_recorded_one(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cpu, "OUT_DIR", tmp_path)
    assert bench_cpu.main(["--sizes", "64", "--repeat", "1", "--rounds", "1", "--record", "tiny"]) == 0
    record = json.loads((tmp_path / "tiny.json").read_text())
    assert list(record) == list(records.read_record(RECORDED_CPU))  # same fields, same order
    assert set(record["provenance"]) == set(records.read_record(RECORDED_CPU)["provenance"])
    assert record["provenance"]["command"].endswith(
        "python -m flashlab bench cpu --sizes 64 --repeat 1 --rounds 1 --record tiny")
    assert record["summary"] == cpu_bench.summary(record["rows"]) and record["summary"]["n"] == 64
    with pytest.raises(SystemExit):
        bench_cpu.main(["--record", "../escape"])


def test_package_hash_names_the_python_sources(tmp_path, monkeypatch):
    """The hash follows every Python file of the package, its path included: an edit, a new module or a renamed one
    gives another hash; running it twice gives the same."""
    copy = tmp_path / "flashlab"
    for path in pathlib.Path(records.__file__).resolve().parent.rglob("*.py"):
        target = copy / path.relative_to(pathlib.Path(records.__file__).resolve().parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    monkeypatch.setattr(records, "__file__", str(copy / "records.py"))
    first = records.package_hash()
    assert first == records.package_hash()
    (copy / "tiled.py").write_text((copy / "tiled.py").read_text() + "\n# an edit\n")
    edited = records.package_hash()
    (copy / "tiled.py").rename(copy / "tiled2.py")
    assert len({first, edited, records.package_hash()}) == 3
