"""FlashAttention forward on the GPU: CUDA kernels in ``kernels/*.cu``, loaded with ``cupy.RawModule``.

The kernels form a ladder (chapters 6 and 7), one file per rung, each a readable step from the last::

    scalar        one thread per query row; chapters 1-2's online softmax in C
    smem_tiles    K/V tiles in shared memory, shared by the 64 rows of a block (chapter 3's tiling)
    mma           tensor cores: mma.sync m16n8k16 with S, P and O in registers; a warp owns 16 rows
    ldmatrix      swizzled shared memory and ldmatrix: no bank conflicts, one instruction per 4 fragments
    cp_async      cp.async double buffering: the next tile's copy overlaps this tile's math
    exp2_tiles    exp2 with log2(e) folded into the scale, one division by l, larger blocks, causal skipping
    warp32        a warp owns 32 query rows, so each fragment loaded from shared memory feeds two mma
    lean          one FFMA per exponent, O rescaled only when a row's max moved, 64-key tiles at d = 128
    addressing    the same math with a quarter fewer instructions: 32-bit shared addresses, unrolled copies
    one_barrier   one barrier per key tile: the next tile's copy is issued after the barrier that opens this one
    k_lanes       K's own ldmatrix lane pattern: each mma finds its two K registers side by side, no moves

``attention(q, k, v)`` checks its inputs, picks a rung and launches it. This module imports without CuPy (the
course runs on CPU machines); only calling a GPU function needs CuPy and a GPU.

The host path of a call is kept short: each kernel is compiled, loaded and configured once per (file, defines,
function, device) by ``kernel_function`` and then found in a dictionary (no file read, no module built, no
attribute set on later calls); ``out=`` on ``attention``, ``attention_backward`` and ``decode`` writes into the
caller's arrays, and a ``Workspace`` keeps the scratch buffers of the backward and of decoding from call to call.
``python -m flashlab bench host`` measures what a call costs the host.

bfloat16: CuPy has no bfloat16 dtype (cupy/cupy#7527). bf16 tensors therefore travel as their raw 16-bit
patterns in ``uint16`` arrays, and ``attention(..., bf16=True)`` says how to read them; ``to_bf16`` and
``from_bf16`` convert from and to float32 on the GPU. From NumPy with ml_dtypes: ``cupy.asarray(a.view(np.uint16))``;
from PyTorch: ``cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint16)``. A raw ``uint16`` array without
``bf16=True`` is refused rather than guessed at.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._checks import check_scale

KERNEL_DIR = pathlib.Path(__file__).parent / "kernels"
HEAD_DIMS = (64, 128)
STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (max_dynamic_shared_size_bytes)


@dataclasses.dataclass(frozen=True)
class Rung:
    """One step of the kernel ladder: its file, launch shape and what it supports."""

    name: str
    file: str
    block_rows: int  # query rows per thread block
    threads: int  # threads per block
    dtypes: tuple[str, ...]  # "f32", "f16", "bf16"
    min_cc: int  # lowest compute capability (75 = sm_75)
    smem_per_d: int | tuple[int, int]  # dynamic shared memory in bytes per unit of d (or one per d in HEAD_DIMS)
    summary: str
    defines: tuple[str, ...] = ()  # -D options (tile sizes of the tunable rung)

    @property
    def path(self) -> pathlib.Path:
        return KERNEL_DIR / self.file

    def shared_bytes(self, d: int) -> int:
        if isinstance(self.smem_per_d, int):
            return self.smem_per_d * d
        return dict(zip(HEAD_DIMS, self.smem_per_d, strict=True))[d] * d

    def source(self) -> str:
        return self.path.read_text()


RUNGS: dict[str, Rung] = {
    r.name: r
    for r in (
        Rung("scalar", "r1_scalar.cu", 128, 128, ("f32", "f16", "bf16"), 75, 0,
             "one thread per query row, online softmax key by key, K/V read from global memory"),
        Rung("smem_tiles", "r2_smem_tiles.cu", 64, 64, ("f32", "f16", "bf16"), 75, (64 + 2 * 8) * 4,
             "K/V tiles of 8 keys in shared memory, shared by a block's 64 rows; one rescale per tile"),
        Rung("mma", "r3_mma.cu", 64, 128, ("f16", "bf16"), 80, 2 * 64 * 2,
             "tensor cores (mma.sync m16n8k16), S/P/O in registers, a warp owns 16 rows"),
        Rung("ldmatrix", "r4_ldmatrix.cu", 64, 128, ("f16", "bf16"), 80, (64 + 2 * 64) * 2,
             "swizzled shared memory (no bank conflicts) and ldmatrix / ldmatrix.trans fragment loads"),
        Rung("cp_async", "r5_cp_async.cu", 64, 128, ("f16", "bf16"), 80, (64 + 4 * 64) * 2,
             "cp.async double buffering: the next K/V tile loads while this one is computed"),
        Rung("exp2_tiles", "r6_exp2_tiles.cu", 128, 256, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
             "exp2 with log2(e) in the scale, one division by l, 128-row blocks, causal tiles skipped"),
        Rung("warp32", "r7_warp32.cu", 128, 128, ("f16", "bf16"), 80, ((128 + 4 * 64) * 2, (128 + 4 * 32) * 2),
             "a warp owns 32 rows: every K/V fragment feeds two mma; Q re-read from shared memory"),
        Rung("lean", "r8_lean_softmax.cu", 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
             "one FFMA per exponent, O rescaled only when a row max moves, 64-key tiles at d = 128 (scale > 0)"),
        Rung("addressing", "r9_addressing.cu", 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
             "32-bit shared addresses, precomputed swizzles, unrolled copies: a quarter fewer instructions"),
        Rung("one_barrier", "r10_one_barrier.cu", 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
             "one barrier per key tile: the next tile's copy is issued after the barrier that opens this one"),
        Rung("k_lanes", "r11_k_lanes.cu", 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
             "K loaded by ldmatrix in mma B order: each mma's two K registers adjacent, no register moves"),
        Rung("three_blocks", "r12_three_blocks.cu", 128, 128, ("f16", "bf16"), 80,
             ((128 + 4 * 64) * 2 + 2 * 2 * 128 * 4 // 64, (128 + 4 * 64) * 2),
             "three blocks per SM at d = 64: P packed as soon as it is computed, the row sums in shared memory"),
        # A side step of the ladder for Turing (sm_75, the T4): rung 4's tensor-core forward on what sm_75 has.
        Rung("turing", "r3t_mma_m16n8k8.cu", 64, 128, ("f16",), 75, (2 * 64 * 2, 2 * 32 * 2),
             "Turing: two mma.sync m16n8k8 per k16 step, ldmatrix, K/V prefetched through registers, 16 KB shared"),
    )
}


def _tma_rung_shared(rows) -> tuple[int, ...]:
    """Shared memory (in units of d, as Rung takes it) of a TMA rung holding ``rows(d)`` rows of d 16-bit elements
    (Q's buffers, the K/V ring, O's staging tiles), the 1024-byte alignment of the swizzle and 128 bytes of
    barriers."""
    return tuple(-(-(rows(d) * d * 2 + 1024 + 128) // d) for d in HEAD_DIMS)


# The rungs with a three-stage ring of 128-key tiles (H5-H9): Q and three stages of K and V.
_THREE_STAGE_SHARED = _tma_rung_shared(lambda d: 128 + 6 * 128)
# Rung 10 (and the block-sparse kernel built on the same loop): two buffers of Q and a ring of K and V of
# MERGED_STAGES[d] stages (three would not fit beside the second Q at d = 128).
MERGED_STAGES = {64: 3, 128: 2}
_MERGED_SHARED = _tma_rung_shared(lambda d: 2 * 128 + 2 * MERGED_STAGES[d] * 128)
# Rung 11 (and the block-sparse kernel): rung 10's, and O's staging tiles, 16 rows of d for each of the 8
# consumer warps.
_STAGED_SHARED = _tma_rung_shared(lambda d: 2 * 128 + 2 * MERGED_STAGES[d] * 128 + 8 * 16)
# Hopper's rungs (kernels/hopper/, chapter 11): warpgroup MMAs, built for sm_90a, so they run on compute
# capability 9.0 only (H100, H200), never on older or newer GPUs. Named by kernel=; "best" takes them on sm_90
# (HOPPER_BEST).
HOPPER_RUNGS = {
    "wgmma": Rung("wgmma", "hopper/h1_wgmma.cu", 64, 128, ("f16", "bf16"), 90,
                  (((64 + 4 * 128) * 64 * 2 + 1024) // 64, ((64 + 4 * 64) * 128 * 2 + 1024) // 128),
                  "wgmma: a warpgroup of 4 warps owns 64 rows; Q, K and V read by the tensor cores from shared memory"),
    "tma": Rung("tma", "hopper/h2_tma.cu", 64, 128, ("f16", "bf16"), 90,
                (-(-((64 + 4 * 128) * 64 * 2 + 1024 + 64) // 64), -(-((64 + 4 * 64) * 128 * 2 + 1024 + 64) // 128)),
                "TMA: one thread asks the copy engine for each tile through a tensor map; mbarriers say it landed"),
    "specialized": Rung("specialized", "hopper/h3_warp_specialized.cu", 128, 384, ("f16", "bf16"), 90,
                        (-(-((128 + 4 * 128) * 64 * 2 + 1024 + 64) // 64),
                         -(-((128 + 4 * 64) * 128 * 2 + 1024 + 64) // 128)),
                        "warp specialisation: a producer warpgroup issues the copies into a ring, two consumers "
                        "compute; full and empty mbarriers per stage"),
    "overlap": Rung("overlap", "hopper/h4_overlap.cu", 128, 384, ("f16", "bf16"), 90,
                    (-(-((128 + 4 * 128) * 64 * 2 + 1024 + 64) // 64),
                     -(-((128 + 4 * 128) * 128 * 2 + 1024 + 64) // 128)),
                    "overlap: each consumer's softmax runs under its next products, and the two consumers take "
                    "turns at the tensor cores (ping-pong, named barriers); 128-key tiles"),
    "three_stages": Rung("three_stages", "hopper/h5_three_stages.cu", 128, 384, ("f16", "bf16"), 90,
                         _THREE_STAGE_SHARED,
                         "a third stage in the ring: each tile's copy has two turns to land"),
    "fused_exp": Rung("fused_exp", "hopper/h6_fused_exp.cu", 128, 384, ("f16", "bf16"), 90,
                      _THREE_STAGE_SHARED,
                      "the scale inside the exponential's FMA: the maximum over raw scores, one FFMA per score "
                      "(scale > 0)"),
    "rescale_under_s": Rung("rescale_under_s", "hopper/h7_rescale_under_s.cu", 128, 384, ("f16", "bf16"), 90,
                            _THREE_STAGE_SHARED,
                            "O rescaled in the next turn, while the tensor cores compute S, instead of between "
                            "turns (FlashAttention-3's order; scale > 0)"),
    "persistent": Rung("persistent", "hopper/h8_persistent.cu", 128, 384, ("f16", "bf16"), 90,
                       _THREE_STAGE_SHARED,
                       "a persistent grid: a block per SM walks the output tiles, loading the next tile's Q and K "
                       "under this one's last products (scale > 0)"),
    "balanced": Rung("balanced", "hopper/h9_balanced.cu", 128, 384, ("f16", "bf16"), 90,
                     _THREE_STAGE_SHARED,
                     "a balanced causal schedule: the persistent blocks take the causal tiles of all heads longest "
                     "first, dealt in a snake (scale > 0)"),
    "merged": Rung("merged", "hopper/h10_merged.cu", 128, 384, ("f16", "bf16"), 90, _MERGED_SHARED,
                   "merged turns: the next tile's first S with this tile's last P V, O stored after them, "
                   "Q double-buffered (two K/V stages at d = 128; scale > 0)"),
    "staged": Rung("staged", "hopper/h11_staged_store.cu", 128, 384, ("f16", "bf16"), 90, _STAGED_SHARED,
                   "O stored through shared memory: stmatrix into a swizzled staging tile, then 16-byte stores of "
                   "whole rows instead of 4-byte ones (scale > 0)"),
    "stream_k": Rung("stream_k", "hopper/h12_stream_k.cu", 128, 384, ("f16", "bf16"), 90, _STAGED_SHARED,
                     "the last round shared out by key tiles (no mask): every block gets the same number of key "
                     "tiles, a tile cut in two is merged by the warp that finishes second (scale > 0)"),
}


def hopper_files_from(first: str) -> frozenset[str]:
    """The files of the Hopper rungs from ``first`` on, in the order of HOPPER_RUNGS: each rung keeps what the rungs
    before it added (a rung that dropped one would be listed by hand instead)."""
    names = list(HOPPER_RUNGS)
    return frozenset(HOPPER_RUNGS[name].file for name in names[names.index(first):])


# Hopper rungs that keep the maximum of the raw scores, and so need scale > 0 (the plan refuses them otherwise;
# "best" then runs HOPPER_ANY_SCALE's rung): H6 on.
HOPPER_POSITIVE_SCALE_ONLY = hopper_files_from("fused_exp")


def hopper_problem(lim: DeviceLimits | None = None) -> str | None:
    """Why this GPU (or ``lim``) cannot run the sm_90a kernels of ``kernels/hopper/`` (None: it can)."""
    cc = (lim or device_limits()).cc
    if cc != 90:
        return (f"the Hopper kernels are built for sm_90a (wgmma), which only compute capability 9.0 runs; "
                f"this GPU is sm_{cc}")
    return None


# Kernels built with __launch_bounds__(threads, 1) for blocks of more than 256 threads: ptxas caps their registers at
# 65536 / threads (rounded down to 8), so such a block fits the register file where 255 a thread would not.
# The 384-thread ones: H3 on, and the block-sparse kernel built on them.
REGISTER_CAPS = {**{file: 168 for file in sorted(hopper_files_from("specialized"))}, "hopper/sparse_h8.cu": 168}
# The fastest rung per (dtype, d), by flashlab.bench.forward.fastest_rung over data/benchmarks/r12_probe.json (rungs 11
# and 12 and SDPA in one run, fp16 and bf16, both protocols): rung 12 at d = 64 (about 10 % faster), rung 11 at
# d = 128, where the two are within 1 % (there rung 12 differs from rung 11 only in packing P early). Rung 11 was
# the fastest of data/benchmarks/r10_probe.json, rung 9 of the ladder before rungs 10-12 existed. fp32 has no
# tensor-core rung.
BEST = {("f32", 64): "smem_tiles", ("f32", 128): "smem_tiles",
        ("f16", 64): "three_blocks", ("f16", 128): "k_lanes", ("bf16", 64): "three_blocks", ("bf16", 128): "k_lanes"}
# The fastest Hopper rung per (dtype, d), which "best" runs on sm_90 (compute capability 9.0) only: by
# flashlab.bench.forward.fastest_rung over data/benchmarks/hopper.json (rungs H1-H9, rungs 11-12 and SDPA in one
# run on an H200, fp16 and bf16, both protocols), then, for each later rung, between the choice so far and that rung
# over the runs that timed them side by side (flashlab.bench.forward.HOPPER_LATER_PROBES: H10 in hopper_merged.json,
# H11 in hopper_staged.json, H12 in hopper_stream_k.json and hopper_stream_k_first.json): H12 at d = 128, H2 at
# d = 64 (three 128-thread blocks an SM).
HOPPER_BEST = {("f16", 64): "tma", ("f16", 128): "stream_k", ("bf16", 64): "tma", ("bf16", 128): "stream_k"}
# The fastest of the Hopper rungs that take any scale, by the same rule over the same run: "best" runs it where the
# scale is not positive and HOPPER_BEST needs it to be (H6 keeps the maximum of the raw scores).
HOPPER_ANY_SCALE = {64: "tma", 128: "three_stages"}
# (file, d) -> the blocks per SM a rung is built for at d: "best" passes it over where the GPU's shared memory per SM
# holds fewer of its blocks (a choice of speed, not of correctness: named, it runs). Rung 12 at d = 64 needs 50 KB
# a block: three fit on sm_80 (164 KB per SM) and sm_90 (228 KB), one on sm_86/89 (100 KB), where rung 11's 48 KB
# blocks fit twice.
BLOCKS_PER_SM = {("r12_three_blocks.cu", 64): 3}
# Shared memory per SM that a block cannot have: the per-block opt-in limit is the SM's memory less this much, and
# every resident block costs it again (CUDA C++ Programming Guide, "Shared Memory" of each compute capability).
RESERVED_SMEM_PER_BLOCK = 1024


def blocks_per_sm_by_shared(shared_bytes: int, lim: DeviceLimits) -> int:
    """How many blocks of ``shared_bytes`` dynamic shared memory fit an SM of ``lim`` at once (shared memory alone)."""
    per_sm = lim.smem_per_block + RESERVED_SMEM_PER_BLOCK
    return per_sm // (shared_bytes + RESERVED_SMEM_PER_BLOCK)
# Rungs beside the ladder rather than on it: written for GPUs older than the one the ladder was recorded on, so
# data/benchmarks/ladder.json (an H200) has no row for them.
SIDE_STEPS = ("turing",)
# rung -> the rung "best" falls back to when scale <= 0 (these keep the max of unscaled scores)
POSITIVE_SCALE_ONLY = {"lean": "warp32", "addressing": "warp32", "one_barrier": "warp32", "k_lanes": "warp32",
                       "three_blocks": "warp32"}
# What "best" tries after BEST's rung, fastest first: rungs 12 and 11 (r12_probe.json), 10 and 9 in the order of
# r10_probe.json, then the ladder's order in ladder.json. "addressing_c32" (below) stands in for rung 9 where rung 9
# spills; rung 11 spills nowhere and fits wherever rung 9 does, so on the GPUs of KNOWN_DEVICES "best" stops at rung
# 11 or 12 whenever scale > 0, and with scale <= 0 passes rungs 8-12 (and the variant, rung 9's file) for rung 7.
# "turing", not timed there, comes after every sm_80 rung (it is chosen where they cannot run: sm_75); then the
# scalar rungs.
LADDER_ORDER = ("three_blocks", "k_lanes", "one_barrier", "addressing", "addressing_c32", "lean", "warp32",
                "exp2_tiles", "cp_async", "ldmatrix", "mma", "turing", "smem_tiles", "scalar")
# Kernels that measure the GPU rather than compute attention (file -> lowest compute capability): the tensor-core
# ceiling of mma.sync that chapter 7 sets the rungs against (python -m flashlab bench peak).
MEASURE_FILES = {"peak_mma.cu": 80}
# The architectures the kernels are compiled for in the tests (tests/test_kernels_compile.py), each kernel for those
# of them at or above its min_cc: T4, A100, A10 / RTX 30x0, RTX 40x0, H100 / H200.
COMPILED_ARCHS = (75, 80, 86, 89, 90)
# Register spills that nvcc 13 reports (--resource-usage): (file, defines, d) -> the architectures where that
# kernel spills. tests/test_kernels_compile.py compiles every kernel for every architecture it claims and fails
# when this table and the compiler disagree. Rungs 8-10 at d = 128 keep 64-key tiles in 255 registers on sm_90;
# sm_80-89 need a few more, so the plan passes them over there. Rung 11 spills nowhere.
SPILLS = {("r8_lean_softmax.cu", (), 128): (80, 86, 89), ("r9_addressing.cu", (), 128): (80, 86, 89),
          ("r10_one_barrier.cu", (), 128): (80, 86, 89)}


def rung6_variant(nwarps: int, bc: int) -> Rung:
    """Rung 6 compiled with other tile sizes (NWARPS warps of 16 query rows, BC keys per tile)."""
    base = RUNGS["exp2_tiles"]
    return dataclasses.replace(base, name=f"exp2_tiles_w{nwarps}_c{bc}", block_rows=16 * nwarps,
                               threads=32 * nwarps, smem_per_d=(16 * nwarps + 4 * bc) * 2,
                               defines=(f"-DNWARPS={nwarps}", f"-DBC={bc}"))


def rung7_variant(nwarps: int, bc64: int, bc128: int = 32, base: str = "warp32") -> Rung:
    """Rung 7, 8 or 9 (base) with other tile sizes: NWARPS warps of 32 rows; keys per tile at d = 64 and 128."""
    base_rung = RUNGS[base]
    rows = 32 * nwarps
    return dataclasses.replace(base_rung, name=f"{base}_w{nwarps}_c{bc64}_{bc128}", block_rows=rows,
                               threads=32 * nwarps, smem_per_d=((rows + 4 * bc64) * 2, (rows + 4 * bc128) * 2),
                               defines=(f"-DNWARPS={nwarps}", f"-DBC_D64={bc64}", f"-DBC_D128={bc128}"))


# Rung 9 with 32-key tiles at d = 128 (231 registers on sm_80, no spill): rung 9's stand-in on the GPUs where it
# spills. "best" reaches it only where rung 11 cannot run and rung 9 spills (no GPU of KNOWN_DEVICES).
PLANNED_VARIANTS = {"addressing_c32": dataclasses.replace(rung7_variant(4, 64, 32, base="addressing"),
                                                          name="addressing_c32")}


def compiled_arch(cc: int) -> int:
    """The architecture of COMPILED_ARCHS whose compiler results stand for compute capability ``cc`` (the highest
    at or below it: sm_87 is judged by sm_86, sm_100 by sm_90)."""
    return max((a for a in COMPILED_ARCHS if a <= cc), default=cc)


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (chapters switch between live runs and data/)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU here"
        return False


def compile_report(rung: Rung | str, arch: int = 90, timeout: float = 300) -> list[dict] | None:
    """Compile a rung's .cu with nvcc for sm_``arch`` and return ptxas's resource usage per kernel.

    Each entry: kernel, registers, shared_bytes (static), stack_bytes, spill_store_bytes, spill_load_bytes.
    Returns None when nvcc is not installed (the chapters then say so); raises RuntimeError if it fails.
    """
    rung = RUNGS[rung] if isinstance(rung, str) else rung
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "--std=c++17", "--resource-usage", *rung.defines,
               "-o", str(pathlib.Path(tmp) / "k.cubin"), str(rung.path)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return parse_resource_usage(res.stderr + res.stdout)


def parse_resource_usage(log: str) -> list[dict]:
    """Parse ``nvcc --resource-usage`` (ptxas) output into one dict per kernel."""
    out: list[dict] = []
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            out.append({"kernel": m.group(1), "registers": None, "shared_bytes": 0, "stack_bytes": 0,
                        "spill_store_bytes": 0, "spill_load_bytes": 0})
        elif out and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                     line)):
            out[-1].update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif out and (m := re.search(r"Used (\d+) registers", line)):
            out[-1]["registers"] = int(m.group(1))
            if sm := re.search(r"(\d+) bytes smem", line):
                out[-1]["shared_bytes"] = int(sm.group(1))
    return out


def _cupy():
    """Import CuPy on first use, with an error that says what is missing."""
    cupy = sys.modules.get("cupy")  # every launch asks: a dictionary lookup once CuPy is imported
    if cupy is not None:
        return cupy
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "flashlab.gpu needs CuPy and an NVIDIA GPU (pip install cupy-cuda12x or cupy-cuda13x); "
            "on a CPU-only machine use flashlab.tiled instead"
        ) from e
    return cupy


def cuda_driver(purpose: str):
    """NVIDIA's driver binding (``cuda.bindings.driver``), for what CuPy does not wrap; an ImportError that says what
    needed it (``purpose``) and how to install it where it is missing."""
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(f"{purpose} with NVIDIA's driver binding: pip install cuda-bindings "
                          "(the major version of your CUDA, e.g. cuda-bindings 13.* for CUDA 13)") from e
    return driver


def _device_id(cp) -> int:
    """The current device's ordinal (0 where the device object has none, as in the host emulation)."""
    return getattr(cp.cuda.Device(), "id", 0)


_CAPABILITY: dict[int, int] = {}  # device ordinal -> compute capability
_SM_COUNT: dict[int, int] = {}  # device ordinal -> multiprocessors
_FUNCTIONS: dict[Any, Any] = {}  # (file, defines, function, device) -> compiled and configured kernel;
# "decode steps" -> decoding's planned launches (flashlab.gpu.decoding._steps)


def compute_capability() -> int:
    """Compute capability of the current device as an int, e.g. 90 for sm_90 (asked once per device)."""
    cp = _cupy()
    dev = _device_id(cp)
    if dev not in _CAPABILITY:
        _CAPABILITY[dev] = int(cp.cuda.Device().compute_capability)
    return _CAPABILITY[dev]


def sm_count() -> int:
    """Streaming multiprocessors of the current device (asked once per device: CuPy's ``Device().attributes``
    queries every attribute of the device each time it is read)."""
    cp = _cupy()
    dev = _device_id(cp)
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    return _SM_COUNT[dev]



@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What a GPU allows one thread block, as the driver reports it: the limits a kernel choice must respect."""

    cc: int  # compute capability, e.g. 75 for sm_75
    smem_per_block: int  # bytes of shared memory one block may opt in to (MaxSharedMemoryPerBlockOptin)
    regs_per_block: int  # 32-bit registers of one block (MaxRegistersPerBlock)
    threads_per_block: int  # MaxThreadsPerBlock
    sm_count: int  # MultiProcessorCount
    name: str = ""

    def __str__(self) -> str:
        what = f"{self.name}, " if self.name else ""
        return (f"{what}sm_{self.cc}, {self.smem_per_block:,} B shared memory per block, "
                f"{self.regs_per_block:,} registers per block, {self.sm_count} SMs")


# The opt-in shared memory per block of each architecture (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability"): used only where a driver does not report MaxSharedMemoryPerBlockOptin.
ARCH_SHARED_BYTES = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# Attribute sets of the GPUs learners have, for planning without them (tests, chapters without a GPU).
KNOWN_DEVICES = {
    "T4": DeviceLimits(75, 64 * 1024, 65536, 1024, 40, "T4"),
    "A10": DeviceLimits(86, 99 * 1024, 65536, 1024, 72, "A10"),
    "RTX 3090": DeviceLimits(86, 99 * 1024, 65536, 1024, 82, "RTX 3090"),
    "RTX 4090": DeviceLimits(89, 99 * 1024, 65536, 1024, 128, "RTX 4090"),
    "L4": DeviceLimits(89, 99 * 1024, 65536, 1024, 58, "L4"),
    "A100": DeviceLimits(80, 163 * 1024, 65536, 1024, 108, "A100"),
    "H100": DeviceLimits(90, 227 * 1024, 65536, 1024, 132, "H100"),
    "H200": DeviceLimits(90, 227 * 1024, 65536, 1024, 132, "H200"),
}
MAX_REGISTERS_PER_THREAD = 255  # every kernel is compiled with __launch_bounds__: at most this many per thread
_LIMITS: dict[int, DeviceLimits] = {}  # device ordinal -> its limits


def device_limits() -> DeviceLimits:
    """The current device's limits (asked once per device, like ``compute_capability``)."""
    cp = _cupy()
    dev = _device_id(cp)
    lim = _LIMITS.get(dev)
    if lim is None:
        cc = compute_capability()
        attrs = cp.cuda.Device().attributes
        smem = attrs.get("MaxSharedMemoryPerBlockOptin", ARCH_SHARED_BYTES.get(cc, STATIC_SMEM_LIMIT))
        name = cp.cuda.runtime.getDeviceProperties(dev).get("name", b"")
        lim = DeviceLimits(cc, int(smem), int(attrs.get("MaxRegistersPerBlock", 65536)),
                           int(attrs.get("MaxThreadsPerBlock", 1024)), sm_count(),
                           name.decode() if isinstance(name, bytes) else str(name))
        _LIMITS[dev] = lim
    return lim


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel a call will launch on a device, and why: the faster kernels passed over, each with its reason."""

    op: str  # "forward", "backward" or "decode"
    kernel: str  # its name (a key of RUNGS, backward.MAIN_KERNELS or decoding.KERNELS)
    file: str  # its .cu file
    shared_bytes: int  # dynamic shared memory per block
    threads: int  # threads per block
    device: DeviceLimits
    passed_over: tuple[tuple[str, str], ...] = ()  # (faster kernel, why it cannot run here)
    spec: Any = dataclasses.field(default=None, compare=False, repr=False)  # the Rung / MainKernel

    @property
    def reason(self) -> str:
        """One sentence: what was chosen and why the faster ones were not (kernels with one reason grouped)."""
        smem = f"{self.shared_bytes:,} B dynamic shared memory" if self.shared_bytes else "static shared memory only"
        text = f"{self.op}: {self.kernel!r} ({self.file}, {smem}), the fastest kernel this device runs"
        groups: dict[str, list[str]] = {}
        for name, why in self.passed_over:
            groups.setdefault(why, []).append(repr(name))
        return text + "".join(f"; passed over {', '.join(names)}: {why}" for why, names in groups.items())

    def __str__(self) -> str:
        return f"{self.reason}\n  on {self.device}"


def launch_problem(what: str, *, min_cc: int, shared_bytes: int, threads: int, lim: DeviceLimits,
                   registers: int = MAX_REGISTERS_PER_THREAD) -> str | None:
    """Why a kernel needing sm_``min_cc``, ``shared_bytes`` per block and ``threads`` of at most ``registers``
    registers each cannot run on ``lim`` (None when it can). Each reason names the limit, so that no call reaches
    the driver to fail there."""
    if lim.cc < min_cc:
        return f"needs sm_{min_cc} or newer{what}; this GPU is sm_{lim.cc} (compute capability)"
    if shared_bytes > lim.smem_per_block:
        return (f"needs {shared_bytes:,} B of shared memory per block{what}; this GPU allows "
                f"{lim.smem_per_block:,} B (MaxSharedMemoryPerBlockOptin)")
    if threads > lim.threads_per_block:
        return f"needs {threads} threads per block; this GPU allows {lim.threads_per_block} (MaxThreadsPerBlock)"
    if threads * registers > lim.regs_per_block:
        return (f"may use {threads} x {registers} registers per block; this GPU has "
                f"{lim.regs_per_block:,} (MaxRegistersPerBlock)")
    return None


def choose(op: str, candidates: dict[str, Any], problem: Callable[[str, Any, bool], str | None], requested: str,
           lim: DeviceLimits, default: str = "best") -> tuple[str, Any, tuple[tuple[str, str], ...]]:
    """The first of ``candidates`` (name -> spec, fastest first) that ``problem(name, spec, best)`` (a reason or
    None; ``best``: judged for the default choice, which also avoids what only slows a kernel down) lets run, as
    ``(name, spec, passed_over)``; ``requested`` names one kernel or is ``default``. Raises ValueError naming
    every limit when nothing runs."""
    if requested != default:
        reason = problem(requested, candidates[requested], False)
        if reason is not None:
            try:
                other = f"; {default!r} would choose {choose(op, candidates, problem, default, lim, default)[0]!r}"
            except ValueError:
                other = ""
            raise ValueError(f"{op} kernel {requested!r} {reason}{other}")
        return requested, candidates[requested], ()
    passed = []
    for name, spec in candidates.items():
        reason = problem(name, spec, True)
        if reason is None:
            return name, spec, tuple(passed)
        passed.append((name, reason))
    raise ValueError(f"no {op} kernel runs this call on this GPU ({lim}): "
                     + "; ".join(f"{k!r} {w}" for k, w in passed))


@functools.lru_cache(maxsize=None)
def _module(file: str, defines: tuple[str, ...]):
    # Read once per process: a call must not touch the file system. An edited .cu takes effect in a new process
    # (CuPy's compile cache keys on the source text, so it then recompiles).
    if file.startswith("hopper/"):  # sm_90a, which RawModule(code=...) cannot target
        from . import hopper

        return hopper.module(file, defines)
    return _cupy().RawModule(code=(KERNEL_DIR / file).read_text(), options=("--std=c++17", *defines))


# The oldest NVRTC (the CUDA toolkit's runtime compiler, which CuPy runs) that builds every kernel: 12.0 cannot
# assemble the Hopper backward's vector reductions. tests/test_nvrtc_builds.py builds them all with 12.1 and 13.0.
NVRTC_MIN = (12, 1)


def nvrtc_advice() -> str:
    """A sentence for a failed build when this machine's NVRTC is older than NVRTC_MIN, else ''."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        version = tuple(nvrtc.getVersion())
    except Exception:  # noqa: BLE001 - no CuPy or no NVRTC: the build's own error says so
        return ""
    if version >= NVRTC_MIN:
        return ""
    return (f" This machine's NVRTC is {version[0]}.{version[1]}; the course's kernels need the runtime compiler of"
            f" CUDA {NVRTC_MIN[0]}.{NVRTC_MIN[1]} or newer (update the CUDA toolkit, or pip install"
            f" 'cupy-cuda12x[ctk]' for CuPy's own copy from PyPI).")


def kernel_function(file: str, name: str, *, defines: tuple[str, ...] = (), shared_bytes: int = 0):
    """The kernel ``name`` of kernels/FILE compiled with ``defines``, loaded on the current device and allowed
    ``shared_bytes`` of dynamic shared memory: built and configured on the first call for a (file, defines, name,
    device), then returned from a dictionary, so that a launch costs no file read, no compilation lookup and no
    attribute call (CONTRIBUTING.md, Kernels)."""
    cp = _cupy()
    key = (file, defines, name, _device_id(cp))
    kern = _FUNCTIONS.get(key)
    if kern is None:
        try:
            kern = _module(file, defines).get_function(name)
        except Exception as e:  # CuPy's CompileException, which CuPy does not export under one name
            if type(e).__name__ == "CompileException" and (advice := nvrtc_advice()):
                raise RuntimeError(f"{file} did not compile.{advice}") from e
            raise
        if shared_bytes > STATIC_SMEM_LIMIT:
            kern.max_dynamic_shared_size_bytes = shared_bytes
        _FUNCTIONS[key] = kern
    return kern


def get_kernel(rung: Rung, dtype: str, d: int, nomask: bool = False):
    """The compiled kernel of ``rung`` for one dtype and head dimension, ready to launch; ``nomask``: for a call
    without a mask and with keys, the kernel a stream-K rung has for it (its ``attn_fwd_*_nomask``)."""
    name = f"attn_fwd_{dtype}_d{d}"
    if nomask and rung.file.startswith("hopper/"):  # only a Hopper rung can have a kernel of its own for it
        from .hopper import forward_entry

        name = forward_entry(rung.file, dtype, d, nomask)
    return kernel_function(rung.file, name, defines=rung.defines, shared_bytes=rung.shared_bytes(d))


class Workspace:
    """Scratch buffers that the launchers reuse from call to call: decoding's split partials, the backward's fp32
    dQ accumulator and its D vector. Pass one ``Workspace`` to every call of a loop (``workspace=``) and no call
    allocates beyond its outputs; a buffer grows when a call needs more and is otherwise kept.

    Calls that share a workspace must run on one CUDA stream (the next call overwrites what the last one left),
    which is how every launcher of this package runs.
    """

    def __init__(self) -> None:
        self._flat: dict[str, Any] = {}
        self._views: dict[tuple, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype, zero: bool = False) -> Any:
        """The buffer ``name`` as an array of ``shape`` and ``dtype``, holding what the last call that used it left
        there; uninitialised when new, or zeros with ``zero=True`` (counters that every call leaves at zero)."""
        key = (name, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        cp = _cupy()
        size = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.size < size or flat.dtype != dtype:
            flat = (cp.zeros if zero else cp.empty)(max(size, 1), dtype=dtype)
            self._flat[name] = flat
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
        view = flat[:size].reshape(shape)
        self._views[key] = view
        return view

    @property
    def nbytes(self) -> int:
        """Bytes held on the GPU."""
        return sum(int(b.nbytes) for b in self._flat.values())


def _outputs(q, out):
    """``attention``'s (o, lse): new arrays, or ``out``'s after checking them."""
    cp = _cupy()
    if out is None:
        return cp.empty_like(q), cp.empty(q.shape[:-1], dtype=cp.float32)
    o, lse = out
    _check_out("out[0]", o, q.shape, q.dtype)
    _check_out("out[1]", lse, q.shape[:-1], cp.float32)
    return o, lse


def _check_out(name: str, x, shape: tuple[int, ...], dtype) -> None:
    """An array given in ``out=`` must have exactly the shape and dtype the call would have allocated."""
    cp = _cupy()
    if not (isinstance(x, cp.ndarray) and x.shape == shape and x.dtype == dtype and x.flags.c_contiguous):
        raise ValueError(f"{name} must be a C-contiguous CuPy array of shape {shape} and dtype {np.dtype(dtype)}; "
                         f"got {type(x).__name__} {getattr(x, 'shape', '')} {getattr(x, 'dtype', '')}")


def _dtype_key(x, bf16: bool) -> str:
    cp = _cupy()
    if bf16:
        if x.dtype != cp.uint16:
            raise TypeError(f"bf16=True expects uint16 arrays holding bfloat16 bit patterns; got dtype {x.dtype}")
        return "bf16"
    if x.dtype == cp.float16:
        return "f16"
    if x.dtype == cp.float32:
        return "f32"
    if x.dtype == cp.uint16:
        raise TypeError("a uint16 array is accepted only as bfloat16 bit patterns: pass bf16=True")
    raise TypeError(f"dtype must be float16, float32 or (with bf16=True) bfloat16 bits in uint16; got {x.dtype}")


def _check_inputs(q, k, v, bf16: bool):
    cp = _cupy()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cp.ndarray):
            hint = " (move it with cupy.asarray)" if isinstance(x, np.ndarray) else ""
            kind = f"{type(x).__module__}.{type(x).__name__}"
            raise TypeError(f"{name} must be a CuPy array on the GPU; got {kind}{hint}")
    dts = {_dtype_key(x, bf16) for x in (q, k, v)}
    if len(dts) != 1:
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (2, 4)):
        raise ValueError(
            f"q, k, v must all be (n, d) or all (batch, heads, n, d); got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dimension; got {d} and {k.shape[-1]}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dimension d must be one of {HEAD_DIMS}; got {d}")
    if q.shape[-2] < 1 or k.shape[-2] < 1:
        raise ValueError(f"need at least one query and one key; got n = {q.shape[-2]}, m = {k.shape[-2]}")
    if q.ndim == 4:
        for name, x in (("q", q), ("k", k)):
            if 0 in x.shape[:2]:
                raise ValueError(
                    f"{name} has an empty axis (shape {x.shape}); attention needs batch >= 1 and heads >= 1"
                )
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k/v must have the same batch size; got {q.shape[0]} and {k.shape[0]}")
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"k/v heads must divide q heads (grouped-query attention); got {k.shape[1]} and {q.shape[1]}"
            )
        if q.shape[0] > 65535 or q.shape[1] > 65535:
            raise ValueError(f"batch and heads must each be at most 65535 (CUDA grid limit); got {q.shape[:2]}")
    _check_contiguous({"q": q, "k": k, "v": v})
    return dts.pop()


def _check_contiguous(arrays: dict[str, Any]) -> None:
    """Every kernel reads its arrays as dense rows: each must be C-contiguous."""
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (use cupy.ascontiguousarray); got strides {x.strides}")


def _check_half_launch(what: str, dt: str, arrays: dict[str, Any]) -> None:
    """What chapter 8's kernels need beyond ``_check_inputs``: 16-bit inputs and arrays that start on 16 bytes
    (every load is 16 bytes wide). The device's limits are the plans' (``plan_backward``, ``plan_decode``)."""
    if dt == "f32":
        raise TypeError(f"{what} takes float16 or (with bf16=True) bfloat16 bits in uint16; got float32")
    for name, x in arrays.items():
        if x.data.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (the kernel loads 16 bytes at a time)")


def forward_problem(rung: Rung, dt: str, d: int, positive_scale: bool, lim: DeviceLimits,
                    avoid_spills: bool = True) -> str | None:
    """Why ``rung`` cannot run a forward of dtype ``dt`` at head dimension ``d`` on ``lim`` (None: it can);
    ``avoid_spills``: a kernel that spills registers on this architecture (``SPILLS``) counts as one that cannot
    (kernel="best" avoids it; a kernel asked for by name runs, spills and all)."""
    if dt not in rung.dtypes:
        return f"supports {', '.join(rung.dtypes)}, not {dt}"
    if rung.file.startswith("hopper/") and (problem := hopper_problem(lim)):  # not "sm_90 or newer": sm_90 only
        return problem
    problem = launch_problem(f" at d = {d}", min_cc=rung.min_cc, shared_bytes=rung.shared_bytes(d),
                             threads=rung.threads, lim=lim,
                             registers=REGISTER_CAPS.get(rung.file, MAX_REGISTERS_PER_THREAD))
    if problem is None and avoid_spills and compiled_arch(lim.cc) in SPILLS.get((rung.file, rung.defines, d), ()):
        problem = (f"spills registers at d = {d} on sm_{compiled_arch(lim.cc)} (more than the "
                   f"{MAX_REGISTERS_PER_THREAD} registers a thread may hold; flashlab.gpu.SPILLS)")
    if problem is None and not positive_scale and (rung.file in HOPPER_POSITIVE_SCALE_ONLY
                                                   or rung.file in {RUNGS[n].file for n in POSITIVE_SCALE_ONLY}):
        return "needs scale > 0 (it keeps the max of unscaled scores)"
    want = BLOCKS_PER_SM.get((rung.file, d))
    if problem is None and avoid_spills and want and (fit := blocks_per_sm_by_shared(rung.shared_bytes(d), lim)) < want:
        problem = (f"is built for {want} blocks per SM at d = {d}; this GPU's shared memory per SM holds {fit} of its "
                   f"{rung.shared_bytes(d):,} B blocks (flashlab.gpu.BLOCKS_PER_SM)")
    return problem


@functools.lru_cache(maxsize=256)
def _forward_plan(dt: str, d: int, positive_scale: bool, kernel: str | Rung, lim: DeviceLimits) -> Plan:
    """``plan``'s decision, cached per (dtype, d, sign of the scale, request, device): a call costs one lookup."""
    if isinstance(kernel, Rung) or kernel in HOPPER_RUNGS:
        kernel = HOPPER_RUNGS.get(kernel, kernel)
        candidates, requested = {kernel.name: kernel}, kernel.name
    else:
        if kernel != "best" and kernel not in RUNGS:
            raise ValueError(f"unknown kernel {kernel!r}; choose 'best' or one of {sorted([*RUNGS, *HOPPER_RUNGS])}")
        # On sm_90 the recorded fastest Hopper rung comes first; elsewhere it is not a candidate at all, so the
        # plans (and what they pass over) of every other GPU are the ladder's alone.
        hop = ((HOPPER_BEST[(dt, d)], HOPPER_ANY_SCALE[d]) if (dt, d) in HOPPER_BEST and hopper_problem(lim) is None
               else ())
        order = dict.fromkeys((*hop, BEST[(dt, d)], *LADDER_ORDER))
        candidates = {name: RUNGS.get(name) or HOPPER_RUNGS.get(name) or PLANNED_VARIANTS[name] for name in order}
        requested = kernel
    name, rung, passed = choose("forward", candidates,
                                lambda _, r, best: forward_problem(r, dt, d, positive_scale, lim, best), requested,
                                lim)
    return Plan("forward", name, rung.file, rung.shared_bytes(d), rung.threads, lim, passed, rung)


# ------------------------------------------------------------------------------------ block-sparse attention
# The block-sparse forward (sparse_r9_window.cu): rung 11's loop over the computed tiles of a pattern only. One file,
# two kernels: "sparse_window" takes a sliding window (and a dilation) as numbers, "sparse_blocks" any pattern as a
# list of computed tiles per query block with the bits of its partial tiles. Not rungs of the ladder: they answer
# another question (which tiles), so "best" never picks them for a dense call, nor a rung for a sparse one.
SPARSE_FILE = "sparse_r9_window.cu"
SPARSE_KERNELS: dict[str, Rung] = {
    "sparse_window": Rung("sparse_window", SPARSE_FILE, 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
                          "rung 11 over the key tiles a sliding (dilated) window reaches, classified from its formula"),
    "sparse_blocks": Rung("sparse_blocks", SPARSE_FILE, 128, 128, ("f16", "bf16"), 80, (128 + 4 * 64) * 2,
                          "rung 11 over a list of computed tiles per query block; partial tiles masked by their bits"),
    # The window kernel with 32-key tiles at d = 128 (236-245 registers on sm_80-90, no spill): the plan's fallback
    # where 64-key tiles would spill. On rung 11's loop they spill nowhere (SPARSE_SPILLS is empty), so it runs
    # when asked for by name.
    "sparse_window_c32": Rung("sparse_window_c32", SPARSE_FILE, 128, 128, ("f16", "bf16"), 80,
                              ((128 + 4 * 64) * 2, (128 + 4 * 32) * 2),
                              "the window kernel with 32-key tiles at d = 128, for the GPUs where 64 spill",
                              defines=("-DBC_D128=32",)),
}
# The same two kernels on Hopper rung 8 (kernels/hopper/sparse_h8.cu): wgmma, TMA, a producer warpgroup and a
# persistent grid, 128 x 128 tiles. sm_90a only, like the rungs it is built on.
HOPPER_SPARSE_FILE = "hopper/sparse_h8.cu"
# Its loop is rung 10's (merged turns, two Q buffers) and its epilogue rung 11's, and so is its shared memory.
HOPPER_SPARSE_STAGES = MERGED_STAGES
HOPPER_SPARSE_SHARED = _STAGED_SHARED
SPARSE_KERNELS.update({
    "hopper_window": Rung("hopper_window", HOPPER_SPARSE_FILE, 128, 384, ("f16", "bf16"), 90, HOPPER_SPARSE_SHARED,
                          "Hopper rung 8 over the key tiles a sliding (dilated) window reaches, from its formula"),
    "hopper_blocks": Rung("hopper_blocks", HOPPER_SPARSE_FILE, 128, 384, ("f16", "bf16"), 90, HOPPER_SPARSE_SHARED,
                          "Hopper rung 8 over a list of computed tiles per query block; partial tiles masked by bits"),
})
# What each kind of call may run, fastest first (the plan takes the first this device runs without spilling).
SPARSE_MODES = {"window": ("hopper_window", "sparse_window", "sparse_window_c32"),
                "blocks": ("hopper_blocks", "sparse_blocks")}
# Tile (queries x keys) of each kernel per head dimension. A block mask is given in sparse_blocks' tiles
# (sparse_block(d)); the Hopper kernel takes it re-blocked into its own (the mask keeps its pattern: exact).
SPARSE_TILES = {"sparse_window": {64: (128, 64), 128: (128, 64)}, "sparse_blocks": {64: (128, 64), 128: (128, 64)},
                "sparse_window_c32": {64: (128, 64), 128: (128, 32)},
                "hopper_window": {64: (128, 128), 128: (128, 128)}, "hopper_blocks": {64: (128, 128), 128: (128, 128)}}
# (kernel, d) -> the architectures where its functions spill (nvcc 13, --resource-usage), as SPILLS for the rungs.
# None: on rung 9's K lanes the window kernel spilled at d = 128 on sm_80-89 (the plan took sparse_window_c32
# there) and the list kernel needed 32-key tiles at d = 128; rung 11's K lanes freed the registers (ptxas had
# copied K's fragments into mma order).
SPARSE_SPILLS: dict[tuple[str, int], tuple[int, ...]] = {}


def sparse_block(d: int) -> tuple[int, int]:
    """``(block_q, block_k)``: the tiles a ``block_mask=`` for ``attention`` must be built with at head dimension
    ``d``, e.g. ``pattern.block_mask(n, m, *flashlab.gpu.sparse_block(128))``."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head dimension d must be one of {HEAD_DIMS}; got {d}")
    return SPARSE_TILES["sparse_blocks"][d]


def sparse_problem(name: str, dt: str, d: int, positive_scale: bool, lim: DeviceLimits) -> str | None:
    """Why the block-sparse kernel ``name`` cannot run dtype ``dt`` at head dimension ``d`` on ``lim`` (None: it
    can). Its spills count as a reason, as for "best": no other kernel can stand in for it."""
    rung = SPARSE_KERNELS[name]
    if dt not in rung.dtypes:
        return f"takes float16 or bfloat16 (it is a tensor-core loop), not {dt}"
    if rung.file.startswith("hopper/") and (problem := hopper_problem(lim)):  # not "sm_90 or newer": sm_90 only
        return problem
    problem = launch_problem(f" at d = {d}", min_cc=rung.min_cc, shared_bytes=rung.shared_bytes(d),
                             threads=rung.threads, lim=lim,
                             registers=REGISTER_CAPS.get(rung.file, MAX_REGISTERS_PER_THREAD))
    if problem is None and compiled_arch(lim.cc) in SPARSE_SPILLS.get((name, d), ()):
        problem = (f"spills registers at d = {d} on sm_{compiled_arch(lim.cc)} (more than the "
                   f"{MAX_REGISTERS_PER_THREAD} registers a thread may hold; flashlab.gpu.SPARSE_SPILLS)")
    if problem is None and not positive_scale:
        problem = "needs scale > 0 (it keeps the max of unscaled scores, as rungs 9-11)"
    return problem


@functools.lru_cache(maxsize=64)
def _sparse_plan(mode: str, dt: str, d: int, positive_scale: bool, kernel: str | Rung, lim: DeviceLimits) -> Plan:
    """The plan of a block-sparse call (``mode`` "window" or "blocks"): the first kernel of ``SPARSE_MODES[mode]``
    this device runs, or a clear refusal naming each limit (cached like ``_forward_plan``)."""
    names = SPARSE_MODES[mode]
    if kernel != "best" and kernel not in names:
        raise ValueError(f"a {'window' if mode == 'window' else 'block_mask'} call runs a block-sparse kernel, one of "
                         f"{names}; got kernel={kernel!r} (give kernel='best' or one of those)")
    name, rung, passed = choose("forward", {n: SPARSE_KERNELS[n] for n in names},
                                lambda n, _, best: sparse_problem(n, dt, d, positive_scale, lim), kernel, lim)
    return Plan("forward", name, rung.file, rung.shared_bytes(d), rung.threads, lim, passed, rung)


def _check_window(window, dilation, causal: bool, n: int, m: int) -> tuple[int, int, int]:
    """``window=(left, right)`` (and ``dilation``, ``causal``) as the kernel's three numbers, "no limit" as n + m;
    a side wider than the sequence is refused (``blocksparse.Window.check``)."""
    from .. import blocksparse

    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window must be a pair (left, right) of token counts (None: no limit); got {window!r}")
    if isinstance(dilation, bool) or not isinstance(dilation, (int, np.integer)) or dilation < 1:
        raise ValueError(f"dilation must be an integer >= 1 (every dilation-th token); got {dilation!r}")
    left, right = window
    pattern = blocksparse.dilated(int(dilation), left=left, right=right)
    pattern.check(n, m)
    if causal:
        right = 0 if right is None else min(right, 0)
    return (n + m if left is None else int(left)), (n + m if right is None else int(right)), int(dilation)


@dataclasses.dataclass(frozen=True, eq=False)
class SparseLayout:
    """A block mask on the GPU as a list kernel reads it (made by ``sparse_layout``; reuse it across calls).

    ``row_ptr``/``tiles``: the computed key tiles of each query tile (``BlockMask.tile_list``) in the kernel's tiles;
    ``slots``: -1 for a FULL tile, else the PARTIAL tile's slot in ``bits``; ``bits``: for each partial tile, each
    thread's visibility bits in the order of its accumulators (``pack_fragment_bits`` for ``sparse_blocks``'s mma,
    ``pack_wgmma_bits`` for ``hopper_blocks``'s wgmma).
    A short last key tile is PARTIAL here even where the pattern sees all of it: its missing keys must be masked,
    and FULL tiles are never masked."""

    n: int
    m: int
    block_q: int
    block_k: int
    row_ptr: Any
    tiles: Any
    slots: Any
    bits: Any
    reverse: bool  # later query tiles compute more tiles: launch them first
    counts: dict[str, int]  # tiles of each kind, as the kernel sees them
    kernel: str = "sparse_blocks"  # the kernel it is laid out for (SPARSE_MODES["blocks"])
    # heads -> the Hopper kernels' order of the output tiles (sparse_order), made on the first call with those heads
    orders: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes the layout holds on the GPU."""
        return sum(int(x.nbytes) for x in (self.row_ptr, self.tiles, self.slots, self.bits))


def pack_fragment_bits(masks: np.ndarray) -> np.ndarray:
    """Element masks of partial tiles, ``(P, 128, BC)`` booleans, as ``sparse_blocks`` reads them: uint32 words
    ``(P, 2, 128)``, word ``(p, mt, thread)`` holding the bits of that thread's elements of 16-row tile ``mt`` of its
    warp's 32 rows, bit ``e2 * BC / 4 + 2 nt + e1`` for row ``32 warp + 16 mt + 8 e2 + lane / 4`` and column
    ``8 nt + 2 (lane % 4) + e1`` (the m16n8k16 accumulator layout), so that a thread needs one load per 16 rows."""
    p, rows, bc = masks.shape
    if rows != 128 or bc not in (32, 64):
        raise ValueError(f"partial-tile masks must be (P, 128, 32 or 64); got {masks.shape}")
    # axes: tile, warp, mt, e2, g | nt, tg, e1  ->  tile, mt, (warp, g, tg), (e2, nt, e1)
    x = masks.reshape(p, 4, 2, 2, 8, bc // 8, 4, 2).transpose(0, 2, 1, 4, 6, 3, 5, 7).reshape(p, 2, 128, bc // 2)
    packed = np.packbits(x, axis=-1, bitorder="little")  # bit b of the word: byte b // 8, bit b % 8
    return packed.view("<u2" if bc == 32 else "<u4")[..., 0].astype(np.uint32)


def pack_wgmma_bits(masks: np.ndarray) -> np.ndarray:
    """Element masks of partial 128 x 128 tiles, ``(P, 128, 128)`` booleans, as ``hopper_blocks`` reads them: uint32
    words ``(P, 2, 2, 128)``, word ``(p, c, w, t)`` holding thread t of consumer warpgroup c: bit ``4 (jj % 8) + e`` of
    word ``w = jj // 8`` for its accumulator ``4 jj + e`` of the wgmma m64n128 layout, row ``64 c + 16 (t // 32) +
    (t % 32) // 4 + 8 (e // 2)`` and column ``8 jj + 2 (t % 4) + e % 2``: two coalesced loads a thread per tile."""
    p, rows, bc = masks.shape
    if rows != 128 or bc != 128:
        raise ValueError(f"partial-tile masks must be (P, 128, 128); got {masks.shape}")
    # rows: c, warp, e2, g; columns: w, jl, tg, e1  ->  tile, c, w, (warp, g, tg), (jl, e2, e1)
    x = masks.reshape(p, 2, 4, 2, 8, 2, 8, 4, 2).transpose(0, 1, 5, 2, 4, 7, 6, 3, 8).reshape(p, 2, 2, 128, 32)
    return np.packbits(x, axis=-1, bitorder="little").view("<u4")[..., 0].astype(np.uint32)


# BlockMask -> {(device, kernel): its layout}: kept while the mask lives (a mask is immutable: its layout cannot go
# stale)
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _list_kernel(kernel: str) -> str:
    """The list kernel a layout is made for: ``kernel``, or for "best" the one a ``block_mask=`` call runs here."""
    names = SPARSE_MODES["blocks"]
    if kernel == "best":
        return next((n for n in names if sparse_problem(n, "f16", 64, True, device_limits()) is None), names[-1])
    if kernel not in names:
        raise ValueError(f"a block mask is laid out for one of {names}; got kernel={kernel!r}")
    return kernel


def sparse_layout(block_mask, kernel: str = "best") -> SparseLayout:
    """A ``blocksparse.BlockMask`` (built with ``sparse_block(d)`` tiles) on the GPU, ready for
    ``attention(..., block_mask=layout)``: made once, so that a loop of calls does no host work for the mask.
    ``kernel``: the list kernel it is for (SPARSE_MODES["blocks"]); "best", the one a call runs on this GPU (a call
    given the layout with kernel="best" runs the kernel it was made for). A kernel whose tiles differ from the
    mask's (Hopper's 128 x 128) takes the mask's pattern re-blocked into its tiles, which is exact."""
    from .. import blocksparse

    cp = _cupy()
    if not isinstance(block_mask, blocksparse.BlockMask):
        raise TypeError(f"block_mask must be a flashlab.blocksparse.BlockMask (pattern.block_mask(n, m, "
                        f"*flashlab.gpu.sparse_block(d))) or a SparseLayout; got {type(block_mask).__name__}")
    bq, bk = block_mask.block_q, block_mask.block_k
    if (bq, bk) not in set(SPARSE_TILES["sparse_blocks"].values()):
        dims: dict[tuple[int, int], list[str]] = {}  # each tile shape once, with the head dimensions that read it
        for d, tile in SPARSE_TILES["sparse_blocks"].items():
            dims.setdefault(tile, []).append(str(d))
        raise ValueError(f"the block mask has tiles of {bq} x {bk}; the block-sparse kernel reads tiles of "
                         + " or ".join(f"{a} x {b} (d = {' or '.join(ds)})" for (a, b), ds in dims.items())
                         + ": build it with pattern.block_mask(n, m, *flashlab.gpu.sparse_block(d))")
    kernel = _list_kernel(kernel)
    tiles = SPARSE_TILES[kernel][HEAD_DIMS[0]]
    if (bq, bk) != tiles:
        block_mask = block_mask.pattern.block_mask(block_mask.n, block_mask.m, *tiles)
        bq, bk = tiles
    kinds = block_mask.kinds.copy()
    if block_mask.m % bk:  # a short last key tile: its missing keys need the mask
        kinds[:, -1] = np.where(kinds[:, -1] == blocksparse.FULL, blocksparse.PARTIAL, kinds[:, -1])
    padded = dataclasses.replace(block_mask, kinds=kinds)
    row_ptr, cols = padded.tile_list()
    partial = kinds[kinds != blocksparse.EMPTY] == blocksparse.PARTIAL  # in tile_list order (row-major)
    slots = np.where(partial, np.cumsum(partial) - 1, -1).astype(np.int32)
    pack = pack_wgmma_bits if bk == 128 else pack_fragment_bits
    bits = pack(padded.partial_masks())
    per_row = np.diff(row_ptr)
    return SparseLayout(block_mask.n, block_mask.m, bq, bk, cp.asarray(row_ptr), cp.asarray(cols if cols.size else
                        np.zeros(1, np.int32)), cp.asarray(slots if slots.size else np.zeros(1, np.int32)),
                        cp.asarray(bits if bits.size else np.zeros((1, 2, 128), np.uint32)),
                        bool(per_row.size > 1 and per_row[-1] > per_row[0]), padded.counts(), kernel)


def _layout_for(block_mask, n: int, m: int, d: int, kernel: str) -> SparseLayout:
    """``block_mask`` (a BlockMask or a SparseLayout) checked against the call and made the layout of ``kernel``
    (kept with the mask object while it lives, so that a loop of calls with one mask builds it once)."""
    from .. import blocksparse

    if isinstance(block_mask, blocksparse.BlockMask):
        per_device = _LAYOUTS.setdefault(block_mask, {})
        key = (_device_id(_cupy()), kernel)
        layout = per_device.get(key)
        if layout is None:
            layout = per_device[key] = sparse_layout(block_mask, kernel)
    elif isinstance(block_mask, SparseLayout):
        layout = block_mask
    else:
        raise TypeError(f"block_mask must be a flashlab.blocksparse.BlockMask or a flashlab.gpu.SparseLayout; got "
                        f"{type(block_mask).__name__} (for an n x m boolean mask: "
                        "blocksparse.from_mask(mask).block_mask(n, m, *flashlab.gpu.sparse_block(d)))")
    if (layout.n, layout.m) != (n, m):
        raise ValueError(f"the block mask is for n = {layout.n} queries and m = {layout.m} keys; this call has "
                         f"n = {n}, m = {m}")
    if layout.kernel != kernel:
        raise ValueError(f"the layout was made for {layout.kernel}; this call runs {kernel}: make it with "
                         f"flashlab.gpu.sparse_layout(block_mask, kernel={kernel!r}) (or kernel='best')")
    return layout


def sparse_order(tiles_per_block, heads: int) -> np.ndarray:
    """The order in which the Hopper kernels' persistent blocks take the output tiles (int32, ``qb + nqb * hb`` for
    query block qb of head-and-batch-entry hb of ``heads``): most computed tiles first, so that the longest start first
    and the last round is short (rung 9's rule); tiles with as many key tiles by head, then query block, so that
    neighbouring query blocks of a window, which share most of their keys, run together and find them in L2."""
    counts = np.asarray(tiles_per_block, dtype=np.int64)
    nqb = counts.size
    qb, hb = np.meshgrid(np.arange(nqb), np.arange(heads), indexing="xy")
    rank = np.lexsort((qb.ravel(), hb.ravel(), -counts[qb.ravel()]))
    return (qb.ravel()[rank] + nqb * hb.ravel()[rank]).astype(np.int32)


def window_tiles_per_block(n: int, m: int, left: int, right: int, block_q: int, block_k: int) -> np.ndarray:
    """Key tiles each query block of a window reaches (the window kernels' range; a dilation's rare empty tile
    counted): query i sees keys i + m - n - left .. i + m - n + right."""
    q0 = np.arange(0, n, block_q, dtype=np.int64)
    qlast = np.minimum(q0 + block_q, n) - 1
    lo = np.maximum(0, q0 + (m - n) - left)
    hi = np.minimum(m - 1, qlast + (m - n) + right)
    return np.where(hi >= lo, hi // block_k - lo // block_k + 1, 0)


_ORDERS: dict[tuple, Any] = {}  # (device, window, heads) -> a sparse_order on the GPU
_ORDERS_KEPT = 64


def _order(what: tuple, heads: int, tiles_per_block):
    """``sparse_order`` on the GPU, made once per window (``what``: its numbers) and number of heads;
    ``tiles_per_block``: a function giving the counts, called on the first use only."""
    key = (_device_id(_cupy()), what, heads)
    order = _ORDERS.get(key)
    if order is None:
        order = _cupy().asarray(sparse_order(tiles_per_block(), heads))
        if len(_ORDERS) >= _ORDERS_KEPT:
            _ORDERS.pop(next(iter(_ORDERS)))
        _ORDERS[key] = order
    return order


def _layout_kernel(block_mask, kernel):
    """The kernel a block-sparse call asks for: a layout given with kernel="best" runs the kernel it was made for."""
    return block_mask.kernel if isinstance(block_mask, SparseLayout) and kernel == "best" else kernel


_NO_LIST: dict[int, Any] = {}  # device -> a one-element int32 array: the window kernel's unused list arguments


@dataclasses.dataclass(frozen=True)
class _SparseCall:
    """A block-sparse launch worked out for one signature by ``_plan_sparse``: what a later call with that signature
    (a window call: shapes, dtypes, window, dilation, scale, kernel asked for, device) only has to launch."""

    kern: Any
    grid: tuple[int, int, int]
    threads: int
    shared: int
    tma: tuple | None  # (dt, d, file, classes) when the kernel takes tensor maps of q, k and v in their place
    tail: tuple  # the arguments after o and lse


_SPARSE_KEPT = 256  # window signatures a process keeps planned


def _plan_sparse(q, k, dt: str, d: int, scale: float, causal: bool, kernel, window, dilation,
                 block_mask) -> _SparseCall:
    """Every check of a block-sparse call (``attention`` with ``window=`` or ``block_mask=``), its plan, kernel,
    grid and arguments."""
    cp = _cupy()
    B, H, n = (1, 1, q.shape[0]) if q.ndim == 2 else q.shape[:3]
    Hk, m = (1, k.shape[0]) if k.ndim == 2 else k.shape[1:3]
    if window is not None and block_mask is not None:
        raise ValueError("give window= or block_mask=, not both (a window is a pattern: "
                         "blocksparse.sliding_window(left, right) & other)")
    if block_mask is not None:
        if causal:
            raise ValueError("causal=True with block_mask= is ambiguous: put it in the pattern "
                             "(pattern & blocksparse.causal()) and pass causal=False")
        if dilation != 1:
            raise ValueError("dilation= goes with window=; for a block mask put the dilation in the pattern "
                             "(blocksparse.dilated)")
        mode = "blocks"
    else:
        mode = "window"
    kernel = _layout_kernel(block_mask, kernel)
    rung = _sparse_plan(mode, dt, d, scale > 0, kernel, device_limits()).spec
    hopper_file = rung.file.startswith("hopper/")
    classes = 1  # residue classes of a dilation (the Hopper window kernel)
    if mode == "window":
        left, right, stride = _check_window(window, dilation, causal, n, m)
        classes = residue_classes(rung.name, stride, n, m)
        if classes > 1:  # the problem of one class: a plain window over every classes-th token
            n, m, left, right = class_window(n, m, left, right, classes)
            stride = 1
        dev = _device_id(cp)
        lists = _NO_LIST.get(dev)
        if lists is None:
            lists = _NO_LIST[dev] = cp.zeros(1, dtype=cp.int32)
        lists = (lists, lists, lists, lists)
        schedule = left >= n + m  # sm_80: no left limit, later blocks see more keys: launch them first
        if hopper_file:  # the output tiles ranked by their key tiles, most first (the Hopper kernel's schedule)
            tiles = SPARSE_TILES[rung.name][d]
            schedule = _order(("window", n, m, left, right, tiles), H * B * classes,
                             lambda: window_tiles_per_block(n, m, left, right, *tiles))
        fn = f"attn_window_{dt}_d{d}"
    else:
        layout = _layout_for(block_mask, n, m, d, rung.name)
        left = right = stride = 0
        lists = (layout.row_ptr, layout.tiles, layout.slots, layout.bits)
        schedule = layout.reverse
        if hopper_file:
            schedule = layout.orders.get(H * B)
            if schedule is None:
                schedule = layout.orders[H * B] = cp.asarray(sparse_order(np.diff(layout.row_ptr.get()), H * B))
        fn = f"attn_blocks_{dt}_d{d}"
    kern = kernel_function(rung.file, fn, defines=rung.defines, shared_bytes=rung.shared_bytes(d))
    grid, more, tma = (math.ceil(n / rung.block_rows), H, B * classes), (), None
    if hopper_file:  # tensor maps for q, k and v; a persistent grid, which takes the batch size and classes last
        from . import hopper

        grid, more = hopper.launch_shape(rung.file, grid, device_limits().sm_count)
        more = (*more, np.int32(classes))
        tma = (dt, d, rung.file, classes) if rung.file in hopper.TMA_FILES else None
    # the sm_80 kernels take whether to run the query blocks last first; the Hopper kernel the order array
    tail = (np.int32(n), np.int32(m), np.int32(H), np.int32(Hk), np.float32(scale), np.int32(left), np.int32(right),
            np.int32(stride), schedule if hopper_file else np.int32(schedule), *lists, *more)
    return _SparseCall(kern, grid, rung.threads, rung.shared_bytes(d), tma, tail)


def residue_classes(kernel: str, dilation: int, n: int, m: int) -> int:
    """The residue classes a window call of ``kernel`` runs as: the dilation r when the kernel takes them (the
    Hopper window kernel) and r divides n and m, so that every class holds n / r queries and m / r keys and sees
    only its own class's keys (kernels/hopper/sparse_h8.cu); else 1, the dilation masked element by element."""
    if kernel == "hopper_window" and dilation > 1 and n % dilation == 0 and m % dilation == 0:
        return dilation
    return 1


def class_window(n: int, m: int, left: int, right: int, classes: int) -> tuple[int, int, int, int]:
    """The window of one residue class, as the kernel's numbers ``(n, m, left, right)``: n / r queries, m / r keys
    and floor(left / r), floor(right / r) positions; a side of n + m or more ("no limit") stays "no limit"."""
    limit = n + m
    n, m = n // classes, m // classes
    return n, m, *(n + m if side >= limit else side // classes for side in (left, right))


def _launch_sparse(call: _SparseCall, q, k, v, o, lse) -> None:
    if call.tma is not None:
        from . import hopper

        q, k, v = hopper.tma_maps(q, k, v, *call.tma)
    call.kern(call.grid, (call.threads,), (q, k, v, o, lse, *call.tail), shared_mem=call.shared)


def plan(q, k, v, *, causal: bool = False, scale: float | None = None, kernel: str | Rung = "best",
         bf16: bool = False, window: tuple[int | None, int | None] | None = None, dilation: int = 1,
         block_mask=None) -> Plan:
    """The forward kernel ``attention(q, k, v, ...)`` launches on this GPU with these arguments, and why.

    ``kernel="best"`` takes the fastest rung that the device runs: its compute capability, the shared memory a
    block may use (``MaxSharedMemoryPerBlockOptin``) and its registers decide (``device_limits``); a named
    kernel that cannot run raises ValueError naming the limit. ``print(plan(q, k, v))`` says what was chosen and
    why each faster rung was passed over. The backward and decoding have ``plan_backward`` and ``plan_decode``.
    A block-sparse call (``window=`` or ``block_mask=``) runs a kernel of ``SPARSE_MODES``: on an H100 or H200
    ``hopper_window`` or ``hopper_blocks`` (wgmma, sm_90a), elsewhere ``sparse_window`` (or ``sparse_window_c32``
    where it would spill: ``SPARSE_SPILLS``) or ``sparse_blocks``; where this GPU runs none, ValueError says why.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    dt = _check_inputs(q, k, v, bf16)
    d = q.shape[-1]
    if window is not None or block_mask is not None:
        mode = "blocks" if block_mask is not None else "window"
        kernel = _layout_kernel(block_mask, kernel)
        return _sparse_plan(mode, dt, d, check_scale(scale, d) > 0, kernel, device_limits())
    return _forward_plan(dt, d, check_scale(scale, d) > 0, kernel, device_limits())


def plan_for(op: str, device: DeviceLimits | None = None, *, dtype: str = "f16", d: int = 128,
             kernel: str = "best", positive_scale: bool = True, sparse: str | None = None) -> Plan:
    """The plan of ``op`` ("forward", "backward" or "decode") without arrays: on ``device`` (a ``DeviceLimits``,
    e.g. ``KNOWN_DEVICES["T4"]``; default this GPU, ``device_limits()``) for ``dtype`` ("f32", "f16", "bf16")
    and head dimension ``d``; ``sparse="window"`` or ``"blocks"``: a block-sparse forward (``window=`` or
    ``block_mask=``). The chapters ask it what a GPU runs; ValueError, naming the limit, when it runs nothing."""
    from . import backward, decoding

    lim = device_limits() if device is None else device
    if sparse is not None:
        if op != "forward" or sparse not in ("window", "blocks"):
            raise ValueError(f"sparse= is 'window' or 'blocks', for op='forward'; got op={op!r}, sparse={sparse!r}")
        return _sparse_plan(sparse, dtype, d, positive_scale, kernel, lim)
    if op == "forward":
        return _forward_plan(dtype, d, positive_scale, kernel, lim)
    if dtype == "f32":
        raise ValueError(f"{op} takes float16 or bfloat16; there is no float32 {op} kernel")
    if op == "backward":
        return backward._backward_plan(d, kernel, lim)
    if op == "decode":
        return decoding._decode_plan(d, kernel, lim)
    raise ValueError(f"op must be 'forward', 'backward' or 'decode'; got {op!r}")


def cannot_run(op: str, device: DeviceLimits | None = None, **what) -> str | None:
    """None when ``plan_for(op, device, **what)`` finds a kernel, else why not (the limit it names)."""
    try:
        plan_for(op, device, **what)
    except ValueError as e:
        return str(e)
    return None


def cannot_run_here(op: str = "forward", *kernels: str, **what) -> str | None:
    """Why this machine cannot run ``op`` live with each of ``kernels`` (default "best"), or None when it can: "there is
    no GPU here" without one, else the limit that ``cannot_run`` names for the first kernel this GPU cannot run.
    ``what``: dtype and d as for ``plan_for``. The chapters ask it before a cell that launches kernels and show
    the recorded run instead when it answers."""
    if not gpu_available():
        return "there is no GPU here"
    for kernel in kernels or ("best",):
        why = cannot_run(op, kernel=kernel, **what)
        if why is not None:
            return why
    return None


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, kernel: str | Rung = "best",
              bf16: bool = False, out: tuple[Any, Any] | None = None,
              window: tuple[int | None, int | None] | None = None, dilation: int = 1, block_mask=None):
    """FlashAttention forward on the GPU. Returns ``(o, lse)``.

    q is (n, d) or (batch, heads, n, d); k and v are (m, d) or (batch, heads_kv, m, d) with heads_kv dividing
    heads (grouped-query / multi-query attention). CuPy arrays, C-contiguous, float16 or float32, or bfloat16
    bit patterns in uint16 with ``bf16=True``; d is 64 or 128; any n >= 1 and m >= 1. ``causal`` masks as in
    ``flashlab.reference``: query i sees keys j <= i + (m - n). ``scale`` defaults to 1/sqrt(d). ``kernel``
    names a rung of ``RUNGS`` (or is a ``Rung``) or is "best": the fastest rung this GPU runs for the dtype and d
    (``plan(q, k, v)`` says which and why). A kernel the GPU cannot run raises ValueError naming the limit.
    ``out`` = (o, lse) writes into given arrays instead of allocating (benchmarks; tests poison them first).

    Block-sparse attention (``flashlab.blocksparse``; fp16/bf16, scale > 0): ``window=(left, right)`` lets query
    i see key j when ``i + m - n - left <= j <= i + m - n + right`` (None: no limit on that side; ``(left, 0)``
    is causal local attention; with ``causal=True`` the right side is cut at 0), ``dilation=r`` keeps every r-th of
    those keys (``j - (i + m - n)`` a multiple of r). ``block_mask=`` takes any pattern as a
    ``blocksparse.BlockMask`` built with ``sparse_block(d)`` tiles, or that mask made a ``SparseLayout`` once by
    ``sparse_layout`` (no host work per call); the mask is shared by every batch and head. Empty tiles are never
    loaded or computed, full tiles never masked (``plan`` names the kernel).

    o has q's shape and dtype; lse (q's shape without d, float32) is the logsumexp of each row of scaled
    scores. A row that sees no key (causal with n > m, or outside its window) gets o = 0 and lse = -inf.
    """
    cp = _cupy()
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    key = calls = None
    if (window is not None and block_mask is None and isinstance(kernel, str) and isinstance(q, cp.ndarray)
            and isinstance(k, cp.ndarray) and isinstance(v, cp.ndarray) and isinstance(window, (tuple, list))):
        # a window call planned before: check what its signature does not fix (the layout), then launch
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, bool(bf16), bool(causal), kernel, *window,
               dilation, scale, _device_id(cp))
        calls = _FUNCTIONS.setdefault("sparse calls", {})
        try:
            call = calls.get(key)
        except TypeError:  # something unhashable where a number belongs: the full checks below say what
            call = key = None
        if call is not None:
            _check_contiguous({"q": q, "k": k, "v": v})
            o, lse = _outputs(q, out)
            _launch_sparse(call, q, k, v, o, lse)
            return o, lse
    dt = _check_inputs(q, k, v, bf16)
    d = q.shape[-1]
    scale = check_scale(scale, d)
    sparse = window is not None or block_mask is not None
    if not sparse and dilation != 1:
        raise ValueError("dilation= applies to a window: give window=(left, right) too (window=(None, 0): causal)")
    rung = None if sparse else _forward_plan(dt, d, scale > 0, kernel, device_limits()).spec
    B, H, n = (1, 1, q.shape[0]) if q.ndim == 2 else q.shape[:3]
    Hk, m = (1, k.shape[0]) if k.ndim == 2 else k.shape[1:3]
    if sparse:
        call = _plan_sparse(q, k, dt, d, scale, bool(causal), kernel, window, dilation, block_mask)
        o, lse = _outputs(q, out)
        _launch_sparse(call, q, k, v, o, lse)
        if key is not None:
            while len(calls) >= _SPARSE_KEPT:
                calls.pop(next(iter(calls)))
            calls[key] = call
        return o, lse
    o, lse = _outputs(q, out)

    kern = get_kernel(rung, dt, d, not causal and m > 0)
    grid = (math.ceil(n / rung.block_rows), H, B)
    more = ()
    if rung.file.startswith("hopper/"):
        from . import hopper

        (q, k, v), grid, more = hopper.launch_inputs(rung.file, q, k, v, dt, d, grid, device_limits().sm_count,
                                                     hopper.device_scratch(cp))
    args = (q, k, v, o, lse, np.int32(n), np.int32(m), np.int32(H), np.int32(Hk), np.float32(scale),
            np.int32(bool(causal)), *more)
    kern(grid, (rung.threads,), args, shared_mem=rung.shared_bytes(d))
    return o, lse


def to_bf16(x):
    """float32 CuPy array -> uint16 array of bfloat16 bit patterns (round to nearest even)."""
    cp = _cupy()
    u = cp.ascontiguousarray(x, dtype=cp.float32).view(cp.uint32)
    rounded = ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)
    nan = (u & cp.uint32(0x7FFFFFFF)) > cp.uint32(0x7F800000)
    return cp.where(nan, cp.uint16(0x7FC0), rounded)


def from_bf16(x):
    """uint16 CuPy array of bfloat16 bit patterns -> float32 (exact)."""
    cp = _cupy()
    return (cp.ascontiguousarray(x).astype(cp.uint32) << 16).view(cp.float32)


def naive_attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Standard attention in CuPy with the score matrix S materialised: the baseline the kernels must beat.

    The products run in the inputs' precision (cuBLAS, fp32 accumulation), the softmax in float32, as a
    framework's eager attention does. Returns ``(o, lse)`` like ``attention``. float16/float32 only.
    """
    cp = _cupy()
    d = q.shape[-1]
    scale = check_scale(scale, d)
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = cp.repeat(k, group, axis=1), cp.repeat(v, group, axis=1)
    s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * np.float32(scale)
    n, m = q.shape[-2], k.shape[-2]
    if causal:
        s = cp.where(cp.arange(m)[None, :] <= cp.arange(n)[:, None] + (m - n), s, -cp.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = cp.where(cp.isfinite(mx), mx, 0)
    p = cp.exp(s - mx)
    total = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (mx + cp.log(total))[..., 0]
    p = (p / cp.where(total > 0, total, 1)).astype(q.dtype)
    return cp.matmul(p, v), lse


# Chapter 8: split-KV decoding and the backward pass, in their own modules.
from .backward import attention_backward as attention_backward  # noqa: E402  (re-export)
from .backward import plan_backward as plan_backward  # noqa: E402  (re-export)
from .decoding import decode as decode  # noqa: E402  (re-export)
from .decoding import plan_decode as plan_decode  # noqa: E402  (re-export)
