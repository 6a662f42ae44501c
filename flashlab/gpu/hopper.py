"""Building the Hopper kernels (``kernels/hopper/``) for sm_90a, a target CuPy's RawModule does not ask for.

wgmma (and later setmaxnreg) exist only in the architecture-specific target sm_90a: code built for it runs on
compute capability 9.0 (H100, H200) and nowhere else, not even on newer GPUs. ``cupy.RawModule(code=...)``
always compiles for the plain target of the current device (``-arch=sm_90``), where ptxas rejects wgmma. So the
Hopper files are compiled here with NVRTC for ``-arch=sm_90a`` (through CuPy's own NVRTC binding, which every
CuPy install has), the machine code is written once per process to a temporary file and loaded with
``cupy.RawModule(path=...)``; from there a kernel is found in ``flashlab.gpu``'s dictionary like any other.

The kernels include ``wgmma.cuh``, the helpers they share; NVRTC is handed it by name.
"""

from __future__ import annotations

import atexit
import hashlib
import pathlib
import re
import shutil
import subprocess
import tempfile

from . import KERNEL_DIR, parse_resource_usage

HOPPER_DIR = KERNEL_DIR / "hopper"
PREFIX = "hopper/"
#: The only compute capability whose GPUs run sm_90a code.
CC = 90
NVRTC_ARCH = "-arch=sm_90a"
# nvcc 13.0's -arch=sm_90a shorthand also ran a plain sm_90 pass that rejects wgmma; the -gencode form does not.
NVCC_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
_TMP: pathlib.Path | None = None


def is_hopper(file: str) -> bool:
    """Whether a kernel file (relative to ``kernels/``) is one of the sm_90a files."""
    return file.startswith(PREFIX)


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(HOPPER_DIR.glob("*.cuh"))}


def inlined_source(file: str) -> str:
    """``kernels/FILE`` with its ``#include "wgmma.cuh"`` replaced by the header's text (for the host emulation,
    ``tools/hostemu``, which compiles one text)."""
    text = (KERNEL_DIR / file).read_text()
    for name, header in _headers().items():
        text = text.replace(f'#include "{name}"', header)
    return text


def cubin(file: str, defines: tuple[str, ...] = ()) -> bytes:
    """Machine code for sm_90a of ``kernels/FILE``, compiled by NVRTC (raises RuntimeError with the log)."""
    from cupy_backends.cuda.libs import nvrtc

    source = (KERNEL_DIR / file).read_text()
    headers = _headers()
    prog = nvrtc.createProgram(source, file, tuple(headers.values()), tuple(headers))
    try:
        try:
            nvrtc.compileProgram(prog, (NVRTC_ARCH, "--std=c++17", *defines))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC could not compile {file} for sm_90a:\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def module(file: str, defines: tuple[str, ...] = ()):
    """``file`` built for sm_90a and loaded as a ``cupy.RawModule`` (its kernels are RawKernels)."""
    import cupy

    global _TMP
    code = cubin(file, defines)
    if _TMP is None:
        _TMP = pathlib.Path(tempfile.mkdtemp(prefix="flashlab-sm90a-"))
        atexit.register(shutil.rmtree, _TMP, True)
    path = _TMP / (hashlib.sha256(code).hexdigest()[:16] + ".cubin")
    path.write_bytes(code)
    return cupy.RawModule(path=str(path))


def compile_report(file: str, defines: tuple[str, ...] = (), timeout: float = 300) -> list[dict] | None:
    """ptxas's resource usage of ``kernels/FILE`` built by nvcc for sm_90a (None without nvcc), as
    ``flashlab.gpu.compile_report`` gives it for the other files."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", NVCC_ARCH, "--std=c++17", "--resource-usage", *defines,
               "-o", str(pathlib.Path(tmp) / "k.cubin"), str(KERNEL_DIR / file)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return parse_resource_usage(res.stderr + res.stdout)


def compiler_notes(file: str, defines: tuple[str, ...] = ()) -> list[str]:
    """ptxas's performance notes on ``file`` (e.g. C7519: a warpgroup.arrive it had to insert because registers
    that a wgmma reads were written while an earlier wgmma ran). Empty without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([nvcc, "-cubin", NVCC_ARCH, "--std=c++17", "--resource-usage", *defines, "-o",
                              str(pathlib.Path(tmp) / "k.cubin"), str(KERNEL_DIR / file)],
                             capture_output=True, text=True, timeout=300)
    return [line for line in (res.stderr + res.stdout).splitlines() if re.search(r"\(C\d{4}\)", line)]
