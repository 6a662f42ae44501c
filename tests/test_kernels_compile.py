"""Every kernel of the ladder compiles with nvcc for the GPUs the course targets (no GPU needed).

sm_75 is Colab's T4, sm_80 the A100, sm_90 the H100/H200. Rungs that use sm_80 instructions (mma.sync
m16n8k16, ldmatrix, cp.async, bf16 conversions) declare it in flashlab.gpu.RUNGS and are compiled for sm_80 and up
only. The resource usage (registers, shared memory, spills) is printed; a spill on sm_90 is a defect.
"""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import subprocess

import pytest

import flashlab.gpu as fgpu

ARCHS = (75, 80, 90)
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")


def _compile(path, arch: int, tmp) -> str:
    out = tmp / f"{path.stem}_sm{arch}.cubin"
    cmd = [NVCC, "-cubin", f"-arch=sm_{arch}", "--std=c++17", "--resource-usage", "-o", str(out), str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
    return res.stderr + res.stdout


def test_every_kernel_file_is_a_registered_rung():
    files = sorted(p.name for p in fgpu.KERNEL_DIR.glob("*.cu"))
    assert files == sorted(r.file for r in fgpu.RUNGS.values())


@needs_nvcc
def test_kernels_compile_without_spills(tmp_path):
    jobs = [(r, a) for r in fgpu.RUNGS.values() for a in ARCHS if a >= r.min_cc]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        logs = list(pool.map(lambda job: _compile(job[0].path, job[1], tmp_path), jobs))
    spills = []
    for (rung, arch), log in zip(jobs, logs, strict=True):
        print(f"--- {rung.file} sm_{arch}")
        func = None
        for line in log.splitlines():
            if m := re.search(r"Function properties for (\w+)", line):
                func = m.group(1)
            elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
                if arch == 90 and (int(m.group(1)) or int(m.group(2))):
                    spills.append(f"{rung.file} {func} sm_{arch}: {line.strip()}")
            elif "Used" in line:
                print(f"    {func}: {line.split(':', 1)[1].strip()}")
    assert not spills, "register spills on sm_90:\n" + "\n".join(spills)
