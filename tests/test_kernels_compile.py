"""Every kernel of the ladder compiles with nvcc for the GPUs the course targets (no GPU needed).

sm_75 is Colab's T4, sm_80 the A100, sm_90 the H100/H200. Rungs that use sm_80 instructions (mma.sync
m16n8k16, ldmatrix, cp.async, bf16 conversions) declare it in flashlab.gpu.RUNGS and are compiled for sm_80 and up
only. The resource usage (registers, shared memory, spills) is printed; a spill on sm_90 is a defect.
"""

from __future__ import annotations

import concurrent.futures
import shutil

import pytest

import flashlab.gpu as fgpu

ARCHS = (75, 80, 90)
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")


def _compile(rung, arch: int) -> list[dict]:
    report = fgpu.compile_report(rung, arch)
    assert report, f"no kernels reported for {rung.file} sm_{arch}"
    return report


def test_every_kernel_file_is_a_registered_rung():
    """Every .cu file is a forward rung or a chapter-8 kernel, so every one is compiled below."""
    files = sorted(p.name for p in fgpu.KERNEL_DIR.glob("*.cu"))
    known = [r.file for r in fgpu.RUNGS.values()] + _chapter8_files()
    assert files == sorted(known)


@needs_nvcc
def test_kernels_compile_without_spills():
    jobs = [(r, a) for r in fgpu.RUNGS.values() for a in ARCHS if a >= r.min_cc]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(lambda job: _compile(*job), jobs))
    spills = []
    for (rung, arch), report in zip(jobs, reports, strict=True):
        print(f"--- {rung.file} sm_{arch}")
        for k in report:
            print(f"    {k['kernel']:<20} {k['registers']:>3} registers, {k['shared_bytes']} B static shared, "
                  f"spills {k['spill_store_bytes']}/{k['spill_load_bytes']} B")
            if arch == 90 and (k["spill_store_bytes"] or k["spill_load_bytes"]):
                spills.append(f"{rung.file} {k['kernel']} sm_{arch}")
    assert not spills, "register spills on sm_90: " + ", ".join(spills)


def test_resource_usage_parser():
    log = """ptxas info    : Function properties for attn_fwd_f16_d128
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size, 416 bytes cmem[0]"""
    (k,) = fgpu.parse_resource_usage(log)
    got = (k["kernel"], k["registers"], k["spill_store_bytes"], k["spill_load_bytes"])
    assert got == ("attn_fwd_f16_d128", 255, 4, 8)


def _chapter8_files() -> list[str]:
    from flashlab.gpu import backward, decoding

    return list(backward.KERNEL_FILES + decoding.KERNEL_FILES)


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("file", _chapter8_files())
def test_chapter8_kernels_compile_without_spills(file, arch):
    """Chapter 8's kernels (sm_80+: mma.sync, cp.async) hold static shared memory only and do not spill on sm_90."""
    report = fgpu.compile_report(fgpu.Rung("ch8", file, 0, 0, (), 80, 0, ""), arch)
    assert report, file
    for k in report:
        print(f"{file} sm_{arch} {k['kernel']:<24} {k['registers']:>3} registers, {k['shared_bytes']} B shared, "
              f"spills {k['spill_store_bytes']}/{k['spill_load_bytes']} B")
        assert k["shared_bytes"] <= 48 * 1024, (file, k)  # static shared memory only
        if arch == 90:
            assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, (file, k)
