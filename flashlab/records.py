"""Recorded results in data/: how they are timed, what provenance they carry, how they are written and read.

Every benchmark of ``python -m flashlab bench`` writes one JSON file, ``{"provenance": ..., "rows": [...]}``, and
the chapters read those files by name on machines without a GPU (CONTRIBUTING.md, "Benchmarks"). This module is
the one place that knows the format:

* timing: :func:`cuda_times` and :func:`median_ms` time a call with CUDA events under one of two protocols,
  ``"throughput"`` (calls back to back, each bracketed by its pair of events: the GPU never idles between calls,
  so a call's time is its GPU time) or ``"latency"`` (one public call, then synchronize, each call on an idle
  GPU: the time a caller waits, launch overhead included); :data:`MIN_REPEAT` is the fewest timed runs a median
  may come from; :func:`protocol_of` reads a row's protocol (a row recorded before rows named one is
  throughput); :func:`host_times` measures what a call costs the host; :class:`Pinned` is a call made inside a
  setting (PyTorch's choice of SDPA backend) that the timing enters once, as a program sets it once;
* provenance: :func:`base_provenance` (date, command, Python, NumPy) and :func:`gpu_provenance` (GPU, driver,
  CUDA, CuPy, PyTorch, cuDNN, git commit, hashes of the kernel sources);
* files: :func:`write_record`, :func:`read_record` (``read_record("benchmarks/ladder")`` is
  ``data/benchmarks/ladder.json``) and :func:`print_recorded`.

Nothing here imports CuPy or PyTorch at module level: reading records needs neither.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import platform
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
MIN_REPEAT = 20
PROTOCOLS = ("throughput", "latency")


# ------------------------------------------------------------------------------------------------------ timing
def check_repeat(repeat: int) -> None:
    """Refuse a benchmark whose medians would come from fewer than :data:`MIN_REPEAT` timed runs."""
    if repeat < MIN_REPEAT:
        raise SystemExit(f"--repeat must be at least {MIN_REPEAT} "
                         f"(CONTRIBUTING.md, Benchmarks: medians of >= {MIN_REPEAT} runs)")


def _events(kind: str):
    """(make an event, elapsed ms between two events, synchronize the device) for CuPy or PyTorch."""
    if kind == "torch":
        import torch

        return (lambda: torch.cuda.Event(enable_timing=True)), (lambda a, b: a.elapsed_time(b)), torch.cuda.synchronize
    if kind != "cupy":
        raise ValueError(f"kind must be 'cupy' or 'torch'; got {kind!r}")
    import cupy as cp

    def sync() -> None:
        cp.cuda.Device().synchronize()

    return cp.cuda.Event, cp.cuda.get_elapsed_time, sync


class Pinned:
    """A call that needs a setting around it, such as ``torch.nn.attention.sdpa_kernel(backend)`` to make SDPA use
    one backend. Called alone it enters the setting itself; :func:`cuda_times` instead enters it once around all
    the calls it times, because a program picks its backend once, not per step. Entered per call, the setting's own
    Python runs before each launch and would count, under the latency protocol, as the backend's time."""

    def __init__(self, setting: Callable[[], object], fn: Callable[[], object]) -> None:
        self.setting, self.fn = setting, fn

    def __call__(self) -> object:
        with self.setting():
            return self.fn()


def cuda_times(fn: Callable[[], object], repeat: int, warmup: int, *, kind: str = "cupy",
               protocol: str = "throughput") -> list[float]:
    """Milliseconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones, measured with CUDA events.

    ``kind``: whose events and stream, ``"cupy"`` or ``"torch"`` (PyTorch's SDPA runs on PyTorch's stream).
    ``protocol``: ``"throughput"`` records the events around each call and launches the next call at once;
    ``"latency"`` synchronizes after each call, so that every call starts on an idle GPU. A :class:`Pinned` call
    is timed inside its setting, entered once.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}; got {protocol!r}")
    if isinstance(fn, Pinned):
        with fn.setting():
            return cuda_times(fn.fn, repeat, warmup, kind=kind, protocol=protocol)
    make, elapsed, sync = _events(kind)
    for _ in range(warmup):
        fn()
    sync()
    events = [(make(), make()) for _ in range(repeat)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
        if protocol == "latency":
            sync()
    sync()
    return [elapsed(start, stop) for start, stop in events]


def median_ms(fn: Callable[[], object], repeat: int, warmup: int, *, kind: str = "cupy",
              protocol: str = "throughput") -> float:
    """The median of :func:`cuda_times`: the number a benchmark row records."""
    return statistics.median(cuda_times(fn, repeat, warmup, kind=kind, protocol=protocol))


def protocol_of(row: dict) -> str:
    """The timing protocol of a recorded row: its ``protocol`` field, or ``"throughput"`` for the rows recorded
    before rows carried one (every benchmark then timed back-to-back calls; CONTRIBUTING.md, Benchmarks)."""
    return row.get("protocol", "throughput")


def host_times(fn: Callable[[], object], repeat: int, warmup: int, *, sync: Callable[[], None]) -> list[float]:
    """Microseconds of host (wall-clock) time of ``repeat`` calls of ``fn``, after ``warmup`` untimed ones.

    The clock brackets the Python call alone: nothing inside it waits for the GPU. ``sync()`` runs after each
    call, outside the clock, so that every call finds an empty launch queue (a full queue would make a launch
    wait for the GPU, and the time would be the GPU's).
    """
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        sync()
        times.append((t1 - t0) / 1e3)
    return times


# -------------------------------------------------------------------------------------------------- provenance
def command_line(prog: str, argv: Iterable[str]) -> str:
    """The command a record came from, as typed: ``command_line("python -m flashlab bench forward", argv)``."""
    argv = list(argv)
    return f"{prog} {shlex.join(argv)}" if argv else prog


def base_provenance(command: str) -> dict:
    """What every record carries: the date (UTC), the command that made it, Python's and NumPy's versions."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def file_hashes(paths: Iterable[pathlib.Path]) -> dict[str, str]:
    """``{file name: first 16 hex digits of its SHA-256}``: which kernel sources a record was timed with."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in paths}


def package_hash() -> str:
    """First 16 hex digits of the SHA-256 of the package's Python sources (every ``flashlab/**/*.py``, by path): what
    names the launchers and benchmarks a record was made with where the git metadata beside the sources is missing or
    does not describe them (a copy of the working tree with an older ``.git``)."""
    digest = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def git_commit() -> str | None:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = res.stdout.strip()
    return sha if res.returncode == 0 and len(sha) == 40 else None


def git_dirty() -> bool | None:
    """Whether tracked files differ from HEAD (the commit alone does not name the sources then; the kernel hashes
    do), or None outside a git checkout."""
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(res.stdout.strip()) if res.returncode == 0 else None


# What nvidia-smi says of the GPU's state: the clocks, temperature and power it runs at, and why the clocks are
# below their maximum (a bit mask; 0: they are not held back). Newer drivers name the last field
# clocks_event_reasons, older ones clocks_throttle_reasons.
GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")


def gpu_state() -> str:
    """nvidia-smi's reading of GPU_STATE_FIELDS now (one CSV line per GPU), or why there is none. A benchmark takes
    one before its first timed call and one after its last: two runs of the same kernels that differ by a few per
    cent may differ in the clocks the GPU held."""
    for fields in (GPU_STATE_FIELDS, (*GPU_STATE_FIELDS[:-1], "clocks_throttle_reasons.active")):
        try:
            res = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unavailable: {e}"
        if res.returncode == 0:
            return f"{', '.join(fields)}: {res.stdout.strip()}"
    return f"unavailable: {(res.stderr or res.stdout).strip()[:200]}"


def gpu_provenance(command: str) -> dict:
    """The GPU, driver, CUDA, library versions, commit and forward kernel hashes a GPU record was made with."""
    import cupy as cp

    import flashlab.gpu as fgpu

    prov = {
        **base_provenance(command),
        "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "compute_capability": cp.cuda.Device().compute_capability,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver_api": cp.cuda.runtime.driverGetVersion(),
        "cupy": cp.__version__,
        "host": platform.node(),
    }
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        prov["nvidia_smi"] = smi.stdout.strip()
    except Exception as e:  # noqa: BLE001 - provenance is best effort, the error is recorded
        prov["nvidia_smi"] = f"unavailable: {e}"
    try:
        import torch

        prov["torch"] = torch.__version__
        prov["torch_cuda"] = torch.version.cuda
        prov["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        prov["torch"] = None
    prov["git_commit"] = git_commit()
    prov["git_dirty"] = git_dirty()
    prov["package_sha256"] = package_hash()
    prov["kernel_sha256"] = {r.file: hashlib.sha256(r.source().encode()).hexdigest()[:16] for r in fgpu.RUNGS.values()}
    # the Hopper rungs and the headers they include, by their path under kernels/
    prov["kernel_sha256"].update({f"hopper/{name}": h for name, h in
                                  file_hashes(sorted(fgpu.KERNEL_DIR.glob("hopper/*.cu*"))).items()})
    return prov


# ------------------------------------------------------------------------------------------------------- files
def write_record(out_dir: str | pathlib.Path, name: str, provenance: dict, rows: list[dict], **fields) -> pathlib.Path:
    """One run's table as OUT_DIR/NAME.json: ``{"provenance": ..., **fields, "rows": ...}``; returns the path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"provenance": provenance, **fields, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {path}")
    return path


def record_path(name: str) -> pathlib.Path:
    """``data/NAME.json`` for a record's name relative to data/ (``"benchmarks/ladder"``), or data/NAME itself."""
    path = DATA_DIR / name
    return path if path.suffix else path.with_suffix(".json")


def read_record(name: str) -> dict:
    """A recorded result by its name relative to data/: ``read_record("ch8/bwd")`` reads data/ch8/bwd.json."""
    path = record_path(name)
    if not path.exists():
        raise FileNotFoundError(f"no recorded result {name!r}: {path} does not exist (data/README.md lists them)")
    return json.loads(path.read_text())


def print_recorded(path: str | pathlib.Path, format_rows: Callable[[list[dict]], str]) -> None:
    """``--table FILE`` of the benchmarks: a recorded file's provenance line, then its rows formatted."""
    data = json.loads(pathlib.Path(path).read_text())
    prov = data["provenance"]
    print(f"{prov['gpu']}, {prov['date_utc']}, `{prov['command']}`\n")
    print(format_rows(data["rows"]))
