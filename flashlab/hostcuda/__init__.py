"""CUDA kernels on a CPU: compile a kernel's source with g++ against a host version of CUDA, and run it.

``cuda_host.h`` (beside this module) is what the course's kernels use of CUDA, written for the host in C++20:
``threadIdx``/``blockIdx``, ``__syncthreads``, warp shuffles and votes, ``atomicAdd``, the fp16/bf16 conversions,
``ldmatrix`` and ``mma.sync`` for the tensor-core kernels, the common math intrinsics, and a launcher. A thread
block runs as one OS thread per CUDA thread, or, built with ``-DHOSTCUDA_SERIAL`` (:data:`SERIAL`), one thread
after another on the caller's thread, which is much faster for kernels whose threads never wait for each other.

Two ways to run a kernel:

* :func:`library` compiles trusted code (the course's own kernel files) into a shared library, cached by a hash
  of its text, and :class:`Kernel` launches one of its kernels in this process through ``ctypes`` on NumPy
  arrays (``tools/hostemu`` builds a NumPy stand-in for CuPy on it);
* :func:`program` compiles code that may be hostile (a learner's kernel) into an executable, inside the sandbox
  of :mod:`flashlab.grading.sandbox` when ``bwrap`` is there and as a plain process with limits otherwise, and
  :func:`run` runs its launches in a fresh process the same way, with a time limit: an endless loop, a crash or
  a flood of output ends that process, never the caller. What finished before it ended is still returned.

A kernel with inline PTX (``mma.sync``, ``ldmatrix``...) is first made host C++ by :func:`host_source`
(:mod:`flashlab.hostcuda.ptx`), which rewrites the instructions the header emulates and refuses the others.

Where g++ is missing (or too old for C++20's ``<barrier>``), :func:`compiler_problem` says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
from collections.abc import Sequence

import numpy as np

from .ptx import UnknownPTX, host_source

HERE = pathlib.Path(__file__).resolve().parent
HEADER = HERE / "cuda_host.h"
DRIVER = HERE / "driver.cpp"
# -O2 vectorises elementwise loops, which rounds as the scalar code does; no -march=native, whose FMA contraction
# would round differently from the CPU emulations that tests compare with.
FLAGS = ("-std=c++20", "-O2", "-pthread", "-w", "-fmax-errors=20")
SERIAL = "-DHOSTCUDA_SERIAL"
SOURCE_NAME = "kernel.cu"  # compiler messages about the kernel's own lines name this file, counting from 1
COMPILE_TIMEOUT = 120.0
LOG_CAP = 64 << 10  # bytes of a compiler log read back
PROGRAM_CAP = 256 << 20  # bytes of a compiled program read back from the sandbox
# The checkout a graded kernel must not read (solutions/ lives there); the sandbox hides /home and /root anyway.
_CHECKOUT = HERE.parents[1]


class CompileError(RuntimeError):
    """g++ rejected the source; ``log`` holds its messages (lines of the kernel's own text name ``kernel.cu``)."""

    def __init__(self, log: str) -> None:
        super().__init__(log)
        self.log = log


class LaunchFailed(RuntimeError):
    """A launch of :func:`run` did not finish: the program crashed, ran out of time, or never reached it."""


# ------------------------------------------------------------------------------------------------ the compiler
def compiler() -> str | None:
    """Path of ``g++`` on the PATH, or None."""
    return shutil.which("g++")


@functools.lru_cache(maxsize=None)
def compiler_problem() -> str | None:
    """None when g++ compiles the header here, else why not (no g++, or one without C++20's ``<barrier>``)."""
    gxx = compiler()
    if gxx is None:
        return "no C++ compiler (g++) on the PATH"
    if os.name != "posix":
        return "the host version of CUDA runs on Linux and macOS only"
    probe = header() + '\nextern "C" __global__ void probe(float* x) { x[threadIdx.x] = expf(0.f); }\n'
    passed = _cached(probe, FLAGS, ".probe-ok")  # a probe once per compiler and header, not at every import
    if passed.exists():
        return None
    try:
        res = subprocess.run([gxx, *FLAGS, "-fsyntax-only", "-x", "c++", "-"], input=probe, capture_output=True,
                             text=True, timeout=COMPILE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{gxx} could not run: {e}"
    if res.returncode:
        first = next((line for line in res.stderr.splitlines() if "error" in line), res.stderr.strip()[:200])
        return f"{gxx} cannot compile the host version of CUDA (C++20 with <barrier>, GCC 11 or newer): {first}"
    passed.touch()
    return None


def header() -> str:
    """The text of ``cuda_host.h``."""
    return HEADER.read_text()


def kernel_names(source: str) -> list[str]:
    """Every ``extern "C" __global__`` kernel of ``source``, read after g++'s preprocessor (kernel files define
    their kernels through macros). For trusted sources: the preprocessor runs here, unsandboxed."""
    gxx = compiler()
    if gxx is None:
        raise RuntimeError("the host version of CUDA needs g++ (C++20, with <barrier>)")
    res = subprocess.run([gxx, "-E", "-P", "-x", "c++", "-D__launch_bounds__(...)=", "-"], input=source,
                         capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    if res.returncode:
        raise RuntimeError(f"the preprocessor failed on a kernel file:\n{res.stderr[-4000:]}")
    return list(dict.fromkeys(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', res.stdout)))


def _check_names(names: Sequence[str]) -> None:
    for name in names:
        if not re.fullmatch(r"[A-Za-z_]\w{0,200}", name):
            raise ValueError(f"not a kernel name: {name!r}")


def _unit(source: str, tail: str) -> str:
    # '#line' makes the compiler count the kernel's lines from 1, in a file named kernel.cu.
    return f'{header()}\n#line 1 "{SOURCE_NAME}"\n{source}\n#line 1 "hostcuda-launchers.cpp"\n{tail}'


def _exports(names: Sequence[str]) -> str:
    return "\n".join(f'extern "C" void launch_{n}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** a) '
                     f"{{ launch({n}, gx, gy, gz, bx, a); }}" for n in names) + "\n"


def _table(names: Sequence[str]) -> str:
    rows = ",\n".join(f'    {{"{n}", arity({n}), [](unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** a) '
                      f"{{ launch({n}, gx, gy, gz, bx, a); }}}}" for n in names)
    return ("struct HostcudaEntry {\n    const char* name;\n    unsigned arity;\n"
            "    void (*launch)(unsigned, unsigned, unsigned, unsigned, void**);\n};\n"
            f"static const HostcudaEntry hostcuda_kernels[] = {{\n{rows}\n}};\n" + DRIVER.read_text())


def cache_dir() -> pathlib.Path:
    """This user's folder of compiled kernels (in the temp directory, private to the user: its files are run)."""
    path = pathlib.Path(tempfile.gettempdir()) / f"flashlab-hostcuda-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private folder of this user; remove it")
    return path


def _cached(unit: str, options: Sequence[str], suffix: str) -> pathlib.Path:
    gxx = os.path.realpath(compiler() or "")
    stamp = f"{gxx}:{os.stat(gxx).st_mtime_ns}" if os.path.exists(gxx) else ""
    tag = hashlib.sha256("\0".join([unit, *options, stamp]).encode()).hexdigest()[:24]
    return cache_dir() / f"{tag}{suffix}"


def _tidy_log(log: str, unit_path: pathlib.Path) -> str:
    """The compiler's log naming the generated file ``hostcuda.cpp`` rather than a temporary path."""
    return log.replace(str(unit_path), "hostcuda.cpp").replace(unit_path.name, "hostcuda.cpp")


@functools.lru_cache(maxsize=64)
def library(source: str, names: tuple[str, ...], defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile trusted ``source`` (kernels ``names``) into a shared library with g++, cached by a hash, and load it
    into this process. Raises :class:`CompileError` with g++'s messages."""
    _check_names(names)
    gxx = compiler()
    if gxx is None:
        raise RuntimeError("the host version of CUDA needs g++ (C++20, with <barrier>)")
    options = (*FLAGS, "-shared", "-fPIC", *defines)
    unit = _unit(source, _exports(names))
    out = _cached(unit, options, ".so")
    if not out.exists():
        with tempfile.TemporaryDirectory(prefix="flashlab-hostcuda-", dir=cache_dir()) as tmp:
            cpp, so = pathlib.Path(tmp) / "unit.cpp", pathlib.Path(tmp) / "unit.so"
            cpp.write_text(unit)
            res = subprocess.run([gxx, *options, "-o", str(so), str(cpp)], capture_output=True, text=True,
                                 timeout=COMPILE_TIMEOUT)
            if res.returncode:
                raise CompileError(_tidy_log(res.stderr[-LOG_CAP:], cpp))
            os.replace(so, out)  # atomic: a concurrent compile of the same text finds a whole file or none
    return ctypes.CDLL(str(out))


# --------------------------------------------------------------------------------- launching in this process
class Kernel:
    """Kernel ``name`` of a :func:`library`, launched like CuPy's: ``kernel(grid, block, args)`` with NumPy arrays
    (C-contiguous; the kernel reads and writes them in place) and ``np.int32``/``np.float32``/``np.int64``."""

    def __init__(self, lib: ctypes.CDLL, name: str) -> None:
        self.fn = getattr(lib, "launch_" + name)
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        values = []
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError("kernel arguments must be C-contiguous")
                values.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                values.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.uint32):
                values.append(ctypes.c_uint(int(a)))
            elif isinstance(a, np.float32):
                values.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.int64):
                values.append(ctypes.c_longlong(int(a)))
            elif isinstance(a, np.void):  # a struct passed by value (a Hopper tensor map): its bytes
                values.append(ctypes.create_string_buffer(a.tobytes(), len(a.tobytes())))
            else:
                raise TypeError(f"unsupported kernel argument {type(a).__name__}")
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self.fn(*(ctypes.c_uint(int(g)) for g in grid), ctypes.c_uint(int(block[0])), ptrs)


# ------------------------------------------------------------------------------------ a separate process
def _limits(timeout: float, threads: int, file_size: int):
    from ..grading import sandbox

    return sandbox.Limits(memory=4 << 30, processes=threads + 64, cpu_seconds=int(timeout) + 10,
                          file_size=file_size, output=LOG_CAP)


def _hidden() -> list[pathlib.Path]:
    return [_CHECKOUT] if (_CHECKOUT / "solutions").is_dir() else []


def _isolated(argv: Sequence[str], work: pathlib.Path, timeout: float, threads: int,
              file_size: int) -> tuple[int, bool]:
    """Run ``argv`` in ``work``, sandboxed when bwrap works here (limits alone otherwise): (returncode, timed out).

    The command's stdout and stderr are redirected to files by the command itself; the process is killed, with
    everything it started, when this returns or raises (a question's time limit interrupts the wait)."""
    from ..grading import sandbox

    proc, _ = sandbox.popen(list(argv), workdir=work, hide=_hidden(), limits=_limits(timeout, threads, file_size),
                            allow_unsandboxed=True)
    try:
        try:
            return proc.wait(timeout), False
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL, True
    finally:
        sandbox.stop(proc)
        proc.stdout.close()
        proc.stderr.close()


def _redirected(argv: Sequence[str], log: str) -> list[str]:
    return ["/bin/sh", "-c", f'exec "$0" "$@" >/dev/null 2>{log}', *argv]


def _read(path: pathlib.Path, cap: int) -> bytes:
    from ..grading.remote import read_untrusted

    try:
        return read_untrusted(path, cap)
    except OSError:
        return b""


def _log(path: pathlib.Path) -> str:
    """The first :data:`LOG_CAP` bytes of a log the sandboxed command wrote (a regular file; a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, LOG_CAP).decode("utf-8", "replace") if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Program:
    """An executable built by :func:`program`: its kernels, and whether their blocks run one thread at a time."""

    path: pathlib.Path
    names: tuple[str, ...]
    serial: bool


# What makes a block's threads wait for each other: a kernel using any of it runs with one OS thread per CUDA thread.
_SYNC = re.compile(r"\b(__syncthreads|__syncwarp|__shfl\w*|__any_sync|__all_sync|__ballot_sync|ldsm_x4\w*|mma\w*|"
                   r"warp_sync|cp_async\w*|hostcuda_(?:ldmatrix|mma)\w*)\b")


def program(source: str, names: Sequence[str], *, trusted: bool = False, timeout: float = COMPILE_TIMEOUT,
            serial: bool | None = None) -> Program:
    """Compile ``source`` with kernels ``names`` into an executable (cached by a hash) that :func:`run` launches.

    Untrusted source is compiled in the sandbox (the compiler's messages could quote any file it may read).
    ``serial`` (default: when the text uses no barrier, warp operation or async copy) builds with
    :data:`SERIAL`. Raises :class:`CompileError` with g++'s messages (the kernel's lines name ``kernel.cu``, from
    1), or RuntimeError when g++ is missing or does not finish in ``timeout`` seconds.
    """
    names = tuple(names)
    _check_names(names)
    gxx = compiler()
    if gxx is None:
        raise RuntimeError("the host version of CUDA needs g++ (C++20, with <barrier>)")
    serial = not _SYNC.search(source) if serial is None else serial
    options = (*FLAGS, *((SERIAL,) if serial else ()))
    unit = _unit(source, _table(names))
    out = _cached(unit, options, ".bin")
    if out.exists():
        return Program(out, names, serial)
    with tempfile.TemporaryDirectory(prefix="flashlab-hostcuda-") as tmp:
        work = pathlib.Path(tmp)
        (work / "unit.cpp").write_text(unit)
        argv = [gxx, *options, "-o", "program", "unit.cpp"]
        if trusted:
            res = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=timeout)
            code, late, log = res.returncode, False, res.stderr[-LOG_CAP:]
        else:
            code, late = _isolated(_redirected(argv, "compile.log"), work, timeout, 16, PROGRAM_CAP)
            log = _log(work / "compile.log")
        if late:
            raise RuntimeError(f"g++ did not finish compiling the kernel within {timeout:g} s")
        if code:
            raise CompileError(_tidy_log(log, work / "unit.cpp"))
        binary = _read(work / "program", PROGRAM_CAP)
        if not binary:
            raise RuntimeError("g++ reported success but wrote no program")
        fd, staged = tempfile.mkstemp(dir=out.parent, suffix=".tmp")  # unique: graders may compile in threads
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        os.chmod(staged, 0o700)
        os.replace(staged, out)
    return Program(out, names, serial)


@dataclasses.dataclass
class Launch:
    """One kernel launch for :func:`run`: ``args`` are NumPy arrays and ``np.int32``/``np.float32``/``np.int64``
    scalars in the kernel's parameter order; the arrays at positions ``outputs`` are read back after it."""

    kernel: str
    grid: tuple[int, ...]
    block: int
    args: tuple
    outputs: tuple[int, ...] = ()


def _jobs(launches: Sequence[Launch]) -> bytes:
    buffers: list[tuple[bool, np.ndarray]] = []
    index: dict[int, int] = {}

    def buffer(a: np.ndarray, out: bool) -> int:
        if not out and id(a) in index:
            return index[id(a)]
        buffers.append((out, np.ascontiguousarray(a)))
        if not out:
            index[id(a)] = len(buffers) - 1
        return len(buffers) - 1

    body = [struct.pack("<I", len(launches))]
    for launch in launches:
        grid = tuple(int(g) for g in launch.grid) + (1,) * (3 - len(launch.grid))
        name = launch.kernel.encode()
        body.append(struct.pack("<I", len(name)) + name + struct.pack("<IIIII", *grid, launch.block,
                                                                        len(launch.args)))
        for position, a in enumerate(launch.args):
            if isinstance(a, np.ndarray):
                body.append(b"b" + struct.pack("<I", buffer(a, position in launch.outputs)))
            elif isinstance(a, np.int32):
                body.append(b"i" + struct.pack("<i", int(a)))
            elif isinstance(a, np.float32):
                body.append(b"f" + a.tobytes())
            elif isinstance(a, np.int64):
                body.append(b"l" + struct.pack("<q", int(a)))
            else:
                raise TypeError(f"unsupported kernel argument {type(a).__name__}")
    head = [b"HCJ1", struct.pack("<I", len(buffers))]
    for out, a in buffers:
        head.append(struct.pack("<BQ", out, a.nbytes) + a.tobytes())
    return b"".join(head + body)


def _why(code: int, timed_out: bool, timeout: float, log: str) -> str:
    """What ended the program, in words (its own messages kept, never the kernel's printing)."""
    ours = [line for line in log.splitlines() if line.startswith("hostcuda:") or "launched one thread after" in line]
    if timed_out:
        return f"did not finish within {timeout:g} s (an endless loop?)"
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = {"SIGSEGV": " (a read or write outside an array?)", "SIGBUS": " (a read or write outside an array?)",
                "SIGFPE": " (an integer division by zero?)", "SIGXCPU": " (too much CPU time)",
                "SIGXFSZ": " (wrote too much)", "SIGKILL": " (killed: too much memory or output?)"}.get(name, "")
        return f"crashed with {name}{hint}" + (": " + ours[-1][:300] if ours else "")
    return f"stopped with exit status {code}" + (": " + ours[-1][:300] if ours else "")


def run(prog: Program, launches: Sequence[Launch], *, timeout: float = 30.0) -> list[tuple[np.ndarray, ...] |
                                                                                      LaunchFailed]:
    """Run ``launches`` in order in one fresh, isolated process of ``prog``; per launch, its output arrays (new
    arrays, shaped like the ones given) or the :class:`LaunchFailed` that stopped it (also for the launches after a
    failed one, which never ran). Output arrays are sent with their contents: fill them (e.g. with NaN) first."""
    sizes = [sum(launch.args[i].nbytes for i in launch.outputs) for launch in launches]
    with tempfile.TemporaryDirectory(prefix="flashlab-hostcuda-run-") as tmp:
        work = pathlib.Path(tmp)
        shutil.copyfile(prog.path, work / "program")
        (work / "program").chmod(0o755)
        (work / "jobs").write_bytes(_jobs(launches))
        threads = 1 if prog.serial else max((launch.block for launch in launches), default=1)
        code, late = _isolated(_redirected(["./program", "jobs", "out"], "log"), work, timeout, threads,
                               sum(sizes) + LOG_CAP)
        data = _read(work / "out", sum(sizes))
        log = _log(work / "log") if (code or late) else ""
    results: list[tuple[np.ndarray, ...] | LaunchFailed] = []
    offset = 0
    for launch, size in zip(launches, sizes, strict=True):
        if offset + size > len(data):
            break
        outs = []
        for i in launch.outputs:
            like = launch.args[i]
            outs.append(np.frombuffer(data, like.dtype, like.size, offset).reshape(like.shape).copy())
            offset += like.nbytes
        results.append(tuple(outs))
    if len(results) < len(launches):
        why = _why(code, late, timeout, log) if (code or late) else "the program ended early"
        results.append(LaunchFailed(f"the launch {why}"))
        while len(results) < len(launches):
            results.append(LaunchFailed(f"not run: an earlier launch {why}"))
    return results


__all__ = ["CompileError", "HEADER", "Kernel", "Launch", "LaunchFailed", "Program", "SERIAL", "UnknownPTX", "cache_dir",
           "compiler", "compiler_problem", "header", "host_source", "kernel_names", "library", "program", "run"]
