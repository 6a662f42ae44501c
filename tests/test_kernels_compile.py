"""Every kernel compiles with nvcc for each GPU architecture it claims, and none spills where the plan chooses it.

The architectures are flashlab.gpu.COMPILED_ARCHS: sm_75 (T4), sm_80 (A100), sm_86 (A10, RTX 30x0), sm_89 (RTX 40x0,
L4) and sm_90 (H100, H200). A forward rung is compiled for those at or above its ``min_cc``; chapter 8's kernel files
for those at or above the ``min_cc`` of the kernels they hold (the scalar backward's file and the first two decoding
files from sm_75, the tensor-core backward and decoding files from sm_80); so are the tile variants the plan may
choose (``flashlab.gpu.PLANNED_VARIANTS``) and the block-sparse kernels (``flashlab.gpu.SPARSE_KERNELS``, spills in
``flashlab.gpu.SPARSE_SPILLS``). The resource usage of every kernel (registers, static shared memory, spills) is
printed (``pytest -s``). Spills must be exactly those recorded in ``flashlab.gpu.SPILLS`` (which the plan reads),
none where the plan chooses a kernel, and none at all on sm_90. No GPU needed; the compilations run in parallel.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil

import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import backward, decoding, hopper

ARCHS = fgpu.COMPILED_ARCHS
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")
# (the Hopper backward is built for sm_90a alone: tests/test_hopper_compile.py)
CH8_FILES = tuple(f for f in backward.KERNEL_FILES if not hopper.is_hopper(f)) + decoding.KERNEL_FILES
# Each chapter-8 file from the oldest architecture a kernel of it claims
CH8_MIN_CC = {**decoding.FILE_MIN_CC,
              **{mk.file: mk.min_cc for mk in backward.MAIN_KERNELS.values()}}
HALF = ("f16", "bf16")


def _jobs() -> list[tuple[str, tuple[str, ...], int]]:
    """(file, defines, arch) of every compilation: each kernel file for every architecture it claims."""
    # one compilation per file and defines; the Hopper file is built for sm_90a alone (tests/test_hopper_compile.py)
    sparse = {(r.file, r.defines): r for r in fgpu.SPARSE_KERNELS.values() if not hopper.is_hopper(r.file)}
    forward = [*fgpu.RUNGS.values(), *fgpu.PLANNED_VARIANTS.values(), *sparse.values()]
    jobs = [(r.file, r.defines, a) for r in forward for a in ARCHS if a >= r.min_cc]
    jobs += [(f, (), a) for f, cc in fgpu.MEASURE_FILES.items() for a in ARCHS if a >= cc]
    return jobs + [(f, (), a) for f in CH8_FILES for a in ARCHS if a >= CH8_MIN_CC[f]]


def _compile(file: str, defines: tuple[str, ...], arch: int) -> dict[str, dict]:
    report = fgpu.compile_report(fgpu.Rung(file, file, 0, 0, (), 0, 0, "", defines), arch)
    assert report, f"no kernels reported for {file} {defines} sm_{arch}"
    return {k["kernel"]: k for k in report}


def _spilled(k: dict) -> bool:
    return bool(k["spill_store_bytes"] or k["spill_load_bytes"])


@pytest.fixture(scope="module")
def usage() -> dict[tuple[str, tuple[str, ...], int], dict[str, dict]]:
    """(file, defines, arch) -> {kernel function: its resource usage}, for every job, printed."""
    if NVCC is None:
        pytest.skip("nvcc (CUDA toolkit) not installed")
    jobs = _jobs()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1)) as pool:
        reports = dict(zip(jobs, pool.map(lambda job: _compile(*job), jobs), strict=True))
    for (file, defines, arch), kernels in reports.items():
        print(f"--- {file} {' '.join(defines)} sm_{arch}")
        for k in kernels.values():
            print(f"    {k['kernel']:<28} {k['registers']:>3} registers, {k['shared_bytes']} B static shared, "
                  f"spills {k['spill_store_bytes']}/{k['spill_load_bytes']} B{'  SPILLS' if _spilled(k) else ''}")
    return reports


def test_every_kernel_file_is_a_registered_rung():
    """Every .cu file is a forward rung, a chapter-8 kernel, the block-sparse file or a measuring kernel, so every
    one is compiled below."""
    files = sorted(p.name for p in fgpu.KERNEL_DIR.glob("*.cu"))
    assert files == sorted([r.file for r in fgpu.RUNGS.values()] + list(CH8_FILES) + [fgpu.SPARSE_FILE]
                           + list(fgpu.MEASURE_FILES))


@needs_nvcc
def test_each_kernel_is_compiled_for_every_architecture_it_claims(usage):
    for rung in fgpu.RUNGS.values():
        claimed = {a for (f, dfn, a) in usage if f == rung.file and dfn == rung.defines}
        assert claimed == {a for a in ARCHS if a >= rung.min_cc}, rung.name
        for arch in claimed:  # each dtype and head dimension the launcher asks for is there
            assert {f"attn_fwd_{dt}_d{d}" for dt in rung.dtypes for d in fgpu.HEAD_DIMS} <= set(
                usage[rung.file, rung.defines, arch]), (rung.name, arch)


@needs_nvcc
def test_sparse_kernels_are_compiled_and_spill_exactly_as_recorded(usage):
    """Both sm_80 block-sparse kernels (one file) for every architecture they claim, every dtype and d; their spills are
    flashlab.gpu.SPARSE_SPILLS (which the plan reads), no more, no fewer."""
    found: dict[tuple[str, int], set[int]] = {}
    for name, rung in fgpu.SPARSE_KERNELS.items():
        if hopper.is_hopper(rung.file):  # sm_90a only: tests/test_hopper_compile.py
            continue
        stem = "attn_blocks" if name == "sparse_blocks" else "attn_window"
        claimed = {a for (f, dfn, a) in usage if f == rung.file and dfn == rung.defines}
        assert claimed == {a for a in ARCHS if a >= rung.min_cc}, name
        for arch in claimed:
            kernels = usage[rung.file, rung.defines, arch]
            for dt in rung.dtypes:
                for d in fgpu.HEAD_DIMS:
                    if _spilled(kernels[f"{stem}_{dt}_d{d}"]):
                        found.setdefault((name, d), set()).add(arch)
    assert found == {key: set(archs) for key, archs in fgpu.SPARSE_SPILLS.items()}


@needs_nvcc
def test_forward_spills_are_exactly_the_recorded_ones(usage):
    """flashlab.gpu.SPILLS, which the plan reads, is what the compiler says: no more, no fewer."""
    found: dict[tuple[str, tuple[str, ...], int], set[int]] = {}
    forward_files = {r.file for r in fgpu.RUNGS.values()}
    for (file, defines, arch), kernels in usage.items():
        for name, k in kernels.items():
            if file in forward_files and _spilled(k):
                found.setdefault((file, defines, int(name.rsplit("_d", 1)[1])), set()).add(arch)
    assert found == {key: set(archs) for key, archs in fgpu.SPILLS.items()}


@needs_nvcc
def test_no_kernel_spills_where_the_plan_chooses_it(usage):
    """On each simulated GPU, for every dtype and d: the kernels that the forward, the backward and decoding
    would launch do not spill on that GPU's architecture."""
    spills = []
    for lim in fgpu.KNOWN_DEVICES.values():
        arch = fgpu.compiled_arch(lim.cc)
        chosen = []  # (file, defines, function)
        for dt in ("f32", *HALF):
            for d in fgpu.HEAD_DIMS:
                for positive_scale in (True, False):
                    rung = fgpu._forward_plan(dt, d, positive_scale, "best", lim).spec
                    chosen.append((rung.file, rung.defines, f"attn_fwd_{dt}_d{d}"))
                    for sparse in fgpu.SPARSE_MODES:  # the block-sparse kernels, where the plan runs them
                        if dt != "f32" and fgpu.cannot_run("forward", lim, dtype=dt, d=d, sparse=sparse,
                                                           positive_scale=positive_scale) is None:
                            spec = fgpu.plan_for("forward", lim, dtype=dt, d=d, sparse=sparse,
                                                 positive_scale=positive_scale).spec
                            chosen.append((spec.file, spec.defines, f"attn_{sparse}_{dt}_d{d}"))
        for d in fgpu.HEAD_DIMS:
            mk = backward._backward_plan(d, "best", lim).spec
            split = decoding._decode_plan(d, "best", lim)
            for dt in HALF:
                chosen += [(mk.file, (), f"{mk.stem}_{dt}_d{d}"), (backward.KERNEL_FILE, (), f"bwd_dot_{dt}_d{d}"),
                           (backward.KERNEL_FILE, (), f"bwd_dq_{dt}"),
                           (decoding.KERNEL_FILE, (), f"decode_merge_{dt}_d{d}")]
                if split.kernel == "mma":
                    chosen.append((split.file, (), f"decode_mma_{dt}_d{d}"))
                else:
                    chosen += [(split.file, (), f"decode_keys_{dt}_d{d}_r{r}") for r in decoding.KEYS_ROWS]
        for file, defines, function in chosen:
            if hopper.is_hopper(file):  # built for sm_90a alone, by flashlab.gpu.hopper (sm_90's "best")
                k = {r["kernel"]: r for r in hopper.compile_report(file, defines)}[function]
            else:
                k = usage[file, defines, arch][function]
            if _spilled(k):
                spills.append(f"{lim.name}: {file} {function} sm_{arch}")
    assert not spills, "the plan chooses kernels that spill: " + ", ".join(sorted(set(spills)))


@needs_nvcc
def test_nothing_spills_on_sm_90(usage):
    spills = [f"{file} {name}" for (file, _, arch), kernels in usage.items() if arch == 90
              for name, k in kernels.items() if _spilled(k)]
    assert not spills, "register spills on sm_90: " + ", ".join(spills)


@needs_nvcc
def test_chapter8_kernels_hold_static_shared_memory_only(usage):
    """Above 48 KB a kernel must opt in; chapter 8's kernels keep their static arrays below that."""
    for (file, _, arch), kernels in usage.items():
        if file in CH8_FILES:
            for k in kernels.values():
                assert k["shared_bytes"] <= fgpu.STATIC_SMEM_LIMIT, (file, arch, k)


def test_resource_usage_parser():
    log = """ptxas info    : Function properties for attn_fwd_f16_d128
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size, 416 bytes cmem[0]"""
    (k,) = fgpu.parse_resource_usage(log)
    got = (k["kernel"], k["registers"], k["spill_store_bytes"], k["spill_load_bytes"])
    assert got == ("attn_fwd_f16_d128", 255, 4, 8)


@needs_nvcc
def test_a_dependent_merge_block_fits_beside_an_sm_s_split_blocks_on_sm_90(usage):
    """docs/kernels.md (Split-KV decoding): at d = 128 on sm_90, one merge block fits on an SM beside the
    MMA_BLOCKS_PER_SM split blocks of decode_mma_*, in registers and in shared memory, so that a merge launched as a
    programmatic dependent can wait there; and the numbers the notes give are the compiler's."""
    split = usage[(decoding.MMA_FILE, (), 90)]["decode_mma_f16_d128"]
    merge = usage[(decoding.KERNEL_FILE, (), 90)]["decode_merge_f16_d128"]

    def regs(k, threads):  # registers are allocated per warp, in units of 256
        return -(-k["registers"] * 32 // 256) * 256 * (threads // 32)

    split_regs, merge_regs = regs(split, decoding.MMA_THREADS), regs(merge, decoding.MERGE_THREADS)
    assert decoding.MMA_BLOCKS_PER_SM * split_regs + merge_regs <= 65536
    reserved = 1024  # shared memory the driver reserves per block from sm_80 on
    sm_shared = 228 * 1024
    assert (decoding.MMA_BLOCKS_PER_SM * (split["shared_bytes"] + reserved) + merge["shared_bytes"] + reserved
            <= sm_shared)
    notes = " ".join((fgpu.KERNEL_DIR.parents[2] / "docs" / "kernels.md").read_text().split())
    assert (f"a split block takes {split_regs:,} registers and {split['shared_bytes'] // 1024} KB of shared memory "
            f"and a merge block {merge_regs:,} registers and {merge['shared_bytes']:,} B") in notes
