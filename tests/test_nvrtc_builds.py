"""Every kernel builds with NVRTC, the compiler CuPy runs on the reader's machine, not only with nvcc.

tests/test_kernels_compile.py and tests/test_hopper_compile.py build the kernels with nvcc, for their resource
usage. A reader's CuPy compiles them with the NVRTC of the reader's CUDA instead, and the two accept different code:
NVRTC 13.0 takes a generic lambda in device code for host code (an error), which nvcc 13.0 compiles; NVRTC 12.0
cannot assemble the vector reductions (`red.global.add.v2.f32`) of the Hopper backward, which every later one can.
So every kernel file is built here, with the options the package passes, by NVIDIA's NVRTC of the oldest CUDA the
course supports (12.1) and of CUDA 13.0, both from their pip wheels (requirements-dev.txt) and loaded with ctypes:
no GPU and no CuPy needed. The other files are built for each architecture they claim
(flashlab.gpu.COMPILED_ARCHS), the Hopper files for sm_90a with their headers passed in memory, as
flashlab.gpu.hopper.cubin does.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib.metadata
import os
import pathlib
import sys
import types

import pytest

# the builds nvcc makes in the two compile tests (the tests directory is on sys.path: pytest's rootdir import)
from test_hopper_compile import FILES as HOPPER_FILES
from test_kernels_compile import _jobs

import flashlab.gpu as fgpu
from flashlab.gpu import hopper

# distribution -> (the version requirements-dev.txt pins, the library's name in it)
WHEELS = {"nvidia-cuda-nvrtc-cu12": ("12.1.105", "libnvrtc.so.12"), "nvidia-cuda-nvrtc": ("13.0.88", "libnvrtc.so.13")}


def _library(dist: str) -> pathlib.Path | None:
    """The NVRTC library of an installed wheel, its builtins library loaded first (NVRTC opens that one by name,
    and the wheel's directory is on no search path); None when the wheel is not installed."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = {f.name: pathlib.Path(f.locate()) for f in files}
    lib = paths.get(WHEELS[dist][1])
    if lib is None:
        return None
    for name, path in paths.items():
        if name.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return lib


class Nvrtc:
    """The part of NVRTC's C API a build needs."""

    def __init__(self, path: pathlib.Path):
        self.lib = ctypes.CDLL(str(path))
        major, minor = ctypes.c_int(), ctypes.c_int()
        assert self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
        self.version = (major.value, minor.value)

    def build(self, source: str, name: str, options: list[str], headers: dict[str, str]) -> tuple[int, str]:
        """(NVRTC's result code, its log): 0 when the program compiled."""
        def strings(xs):
            return (ctypes.c_char_p * len(xs))(*(x.encode() for x in xs))

        prog = ctypes.c_void_p()
        assert self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(headers),
                                           strings(list(headers.values())), strings(list(headers))) == 0
        try:
            code = self.lib.nvrtcCompileProgram(prog, len(options), strings(options))
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            return code, log.value.decode(errors="replace")
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _builds() -> list[tuple[str, tuple[str, ...], str]]:
    """(file, defines, architecture option) of every build: what tests/test_kernels_compile.py builds with nvcc,
    and each Hopper file for sm_90a."""
    builds = [(file, defines, f"-arch=sm_{arch}") for file, defines, arch in _jobs()]
    return builds + [(file, (), hopper.NVRTC_ARCH) for file in HOPPER_FILES]


def test_the_builds_cover_every_kernel_file():
    built = {file for file, _, _ in _builds()}
    assert built == {str(p.relative_to(fgpu.KERNEL_DIR)) for p in fgpu.KERNEL_DIR.rglob("*.cu")}


def test_the_pinned_wheels_are_the_ones_named_here():
    """requirements-dev.txt installs the NVRTC versions this file claims to build with."""
    text = (fgpu.KERNEL_DIR.parents[2] / "requirements-dev.txt").read_text()
    for dist, (version, _) in WHEELS.items():
        assert f"\n{dist}=={version};" in text, dist


@pytest.mark.parametrize("dist", WHEELS)
def test_every_kernel_builds_with_this_nvrtc(dist):
    lib = _library(dist)
    if lib is None:
        pytest.skip(f"{dist} is not installed (requirements-dev.txt installs it on Linux x86_64)")
    nvrtc = Nvrtc(lib)
    assert ".".join(map(str, nvrtc.version)) == ".".join(WHEELS[dist][0].split(".")[:2])
    headers = hopper._headers()

    def build(job):
        file, defines, arch = job
        return nvrtc.build((fgpu.KERNEL_DIR / file).read_text(), file, [arch, "--std=c++17", *defines],
                           headers if hopper.is_hopper(file) else {})

    jobs = _builds()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1)) as pool:
        results = list(pool.map(build, jobs))
    failed = [f"{file} {' '.join(defines)} {arch}:\n{log[:2000]}"
              for (file, defines, arch), (code, log) in zip(jobs, results, strict=True) if code != 0]
    assert not failed, f"NVRTC {nvrtc.version} could not build:\n" + "\n".join(failed)


def test_a_failed_build_on_an_old_nvrtc_names_the_version_it_needs(monkeypatch):
    """What a reader whose CUDA toolkit is too old reads (here through a stand-in of CuPy's NVRTC module): the log,
    and which NVRTC the machine has and which the course needs. With a recent enough NVRTC the log alone."""
    class NVRTCError(Exception):
        pass

    def fail(prog, options):
        raise NVRTCError("NVRTC_ERROR_COMPILATION (6)")

    nvrtc = types.SimpleNamespace(NVRTCError=NVRTCError, getVersion=lambda: (12, 0), compileProgram=fail,
                                  createProgram=lambda *args: "program", destroyProgram=lambda prog: None,
                                  getProgramLog=lambda prog: "error: Vector qualifier is not allowed for 'red'")
    for name in ("cupy_backends", "cupy_backends.cuda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = nvrtc
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", nvrtc)
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC is 12\.0.*CUDA 12\.1 or newer.*Vector qualifier"):
        hopper.cubin("hopper/bwd_h1_wgmma.cu")
    nvrtc.getVersion = lambda: (12, 4)
    with pytest.raises(RuntimeError) as err:
        hopper.cubin("hopper/bwd_h1_wgmma.cu")
    assert "Vector qualifier" in str(err.value) and "or newer" not in str(err.value)
