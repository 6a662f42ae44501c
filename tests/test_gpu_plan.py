"""Kernel choice by the device's limits (flashlab.gpu.plan, plan_backward, plan_decode), without those GPUs.

The GPUs learners have are simulated by their attribute sets (compute capability, MaxSharedMemoryPerBlockOptin,
MaxRegistersPerBlock, ...): first as ``DeviceLimits`` handed to the planners, then through the public calls on
the NumPy stand-in for CuPy of tools/hostemu, whose device reports those attributes and whose kernels record
their launches instead of running. What is checked: the chosen kernel runs within every limit, no faster kernel
that would also run was passed over, each kernel passed over is named with the limit it breaks, and a call that
cannot run raises ValueError naming the limit before anything reaches the driver.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
import sys

import numpy as np
import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import backward as gbwd
from flashlab.gpu import decoding, hopper

DEVICES = list(fgpu.KNOWN_DEVICES.values())
T4, A10, RTX4090, A100, H100 = (fgpu.KNOWN_DEVICES[n] for n in ("T4", "A10", "RTX 4090", "A100", "H100"))
LIMIT_NAMES = ("compute capability", "MaxSharedMemoryPerBlockOptin", "MaxThreadsPerBlock", "MaxRegistersPerBlock")


def _fits(lim: fgpu.DeviceLimits, min_cc: int, shared: int, threads: int,
          registers: int = fgpu.MAX_REGISTERS_PER_THREAD) -> bool:
    return (lim.cc >= min_cc and shared <= lim.smem_per_block and threads <= lim.threads_per_block
            and threads * registers <= lim.regs_per_block)


def _rung(name: str) -> fgpu.Rung:
    return fgpu.RUNGS.get(name) or fgpu.HOPPER_RUNGS.get(name) or fgpu.PLANNED_VARIANTS[name]


def _spills(rung: fgpu.Rung, d: int, lim: fgpu.DeviceLimits) -> bool:
    return fgpu.compiled_arch(lim.cc) in fgpu.SPILLS.get((rung.file, rung.defines, d), ())


def _too_few_blocks(rung: fgpu.Rung, d: int, lim: fgpu.DeviceLimits) -> bool:
    """A rung built for several blocks per SM, on a GPU whose shared memory holds fewer of them."""
    want = fgpu.BLOCKS_PER_SM.get((rung.file, d))
    return bool(want) and fgpu.blocks_per_sm_by_shared(rung.shared_bytes(d), lim) < want


# ------------------------------------------------------------------------------------------ the planners alone
@pytest.mark.parametrize("lim", DEVICES, ids=lambda lim: lim.name)
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", fgpu.HEAD_DIMS)
@pytest.mark.parametrize("positive_scale", [True, False])
def test_forward_takes_the_first_rung_of_the_order_that_runs(lim, dt, d, positive_scale):
    p = fgpu._forward_plan(dt, d, positive_scale, "best", lim)
    rung = _rung(p.kernel)
    assert p.spec == rung and dt in rung.dtypes and _fits(
        lim, rung.min_cc, rung.shared_bytes(d), rung.threads,
        fgpu.REGISTER_CAPS.get(rung.file, fgpu.MAX_REGISTERS_PER_THREAD))
    assert not _spills(rung, d, lim) and not _too_few_blocks(rung, d, lim)
    needs_positive = {fgpu.RUNGS[name].file for name in fgpu.POSITIVE_SCALE_ONLY}
    assert positive_scale or rung.file not in needs_positive
    # on sm_90 the recorded fastest Hopper rung, then the fastest that takes any scale
    hop = ((fgpu.HOPPER_BEST[(dt, d)], fgpu.HOPPER_ANY_SCALE[d]) if lim.cc == 90 and (dt, d) in fgpu.HOPPER_BEST
           else ())
    order = list(dict.fromkeys((*hop, fgpu.BEST[(dt, d)], *fgpu.LADDER_ORDER)))
    passed = order[:order.index(p.kernel)]
    assert [name for name, _ in p.passed_over] == passed
    for name, why in p.passed_over:
        r = _rung(name)
        assert (dt not in r.dtypes or not _fits(lim, r.min_cc, r.shared_bytes(d), r.threads) or _spills(r, d, lim)
                or (not positive_scale and r.file in needs_positive) or _too_few_blocks(r, d, lim)), (name, why)
        assert ("supports" in why or "scale > 0" in why or "spills registers" in why or "blocks per SM" in why
                or any(s in why for s in LIMIT_NAMES)), why
    assert p.kernel in p.reason and str(lim.cc) in str(p)


def test_each_gpu_gets_its_fastest_forward():
    best = {d: fgpu.BEST[("f16", d)] for d in fgpu.HEAD_DIMS}
    # the recorded fastest rung spills nowhere, so every sm_80 GPU runs it at both d
    assert not any(_spills(_rung(best[d]), d, lim) for lim in DEVICES for d in fgpu.HEAD_DIMS)
    for lim in DEVICES:
        for d in fgpu.HEAD_DIMS:
            fp16 = fgpu._forward_plan("f16", d, True, "best", lim).kernel
            bf16 = fgpu._forward_plan("bf16", d, True, "best", lim).kernel
            # rung 12 at d = 64 is built for three blocks per SM; where shared memory holds one, rung 11 runs
            fastest = "k_lanes" if _too_few_blocks(_rung(best[d]), d, lim) else best[d]
            if lim.cc == 90:  # the recorded fastest Hopper rung, on sm_90 only
                fastest = fgpu.HOPPER_BEST[("f16", d)]
                assert fgpu.HOPPER_BEST[("bf16", d)] == fastest
            assert (fp16, bf16) == (("turing", "smem_tiles") if lim.cc < 80 else (fastest, fastest)), (lim, d)
            assert fgpu._forward_plan("f32", d, True, "best", lim).kernel == "smem_tiles"
    # with scale <= 0 the raw-max rungs step aside; on sm_80 rung 10 (like rung 9) is also passed over for its spills
    a100 = fgpu._forward_plan("f16", 128, False, "best", A100)
    assert a100.kernel == fgpu.POSITIVE_SCALE_ONLY[best[128]]
    why = dict(a100.passed_over)
    assert "scale > 0" in why[best[128]] and "spills registers at d = 128 on sm_80" in why["one_barrier"]
    assert fgpu._forward_plan("f16", 128, True, "addressing", A100).kernel == "addressing"  # asked for: it runs
    assert fgpu.RUNGS["turing"].shared_bytes(128) <= T4.smem_per_block  # the T4's tensor-core rung fits it
    # 100 KB of shared memory per SM (sm_86 / sm_89) holds one 50 KB block, 164 KB (sm_80) or 228 KB (sm_90) three
    few = {lim.name for lim in DEVICES if lim.cc >= 80 and _too_few_blocks(_rung(best[64]), 64, lim)}
    assert few == {lim.name for lim in DEVICES if lim.cc in (86, 89)} and {"A10", "RTX 4090"} <= few
    assert not any(_too_few_blocks(_rung(best[128]), 128, lim) for lim in DEVICES)
    why = dict(fgpu._forward_plan("f16", 64, True, "best", A10).passed_over)
    assert "built for 3 blocks per SM at d = 64" in why[best[64]]
    assert fgpu._forward_plan("f16", 64, True, best[64], A10).kernel == best[64]  # asked for: it runs


def test_a_named_forward_kernel_that_cannot_run_names_the_limit():
    with pytest.raises(ValueError, match=r"'addressing' needs sm_80 .* sm_75 \(compute capability\).*'turing'"):
        fgpu._forward_plan("f16", 128, True, "addressing", T4)
    variant = fgpu.rung6_variant(4, 128)  # 128-key tiles: 147,456 B at d = 128
    for lim in (A10, RTX4090):
        with pytest.raises(ValueError, match=r"147,456 B of shared memory .*MaxSharedMemoryPerBlockOptin"):
            fgpu._forward_plan("f16", 128, True, variant, lim)
    for lim in (A100, H100):
        assert fgpu._forward_plan("f16", 128, True, variant, lim).shared_bytes == 147456
    with pytest.raises(ValueError, match="supports f16, not bf16"):
        fgpu._forward_plan("bf16", 64, True, "turing", H100)


@pytest.mark.parametrize("lim", DEVICES, ids=lambda lim: lim.name)
@pytest.mark.parametrize("d", fgpu.HEAD_DIMS)
def test_backward_takes_the_fastest_kernel_whose_shared_memory_fits(lim, d):
    kernels = {name: gbwd.MAIN_KERNELS[name] for name in gbwd.FASTEST_FIRST}
    feasible = [name for name, mk in kernels.items() if _fits(lim, mk.min_cc, mk.shared_bytes(d), mk.threads)]
    if not feasible:
        with pytest.raises(ValueError, match=rf"no backward kernel .*needs sm_80 or newer.*this GPU is sm_{lim.cc}"):
            gbwd._backward_plan(d, "best", lim)
        return
    p = gbwd._backward_plan(d, "best", lim)
    assert p.kernel == feasible[0] and p.shared_bytes == gbwd.MAIN_KERNELS[p.kernel].shared_bytes(d)
    assert [k for k, _ in p.passed_over] == list(gbwd.FASTEST_FIRST[:gbwd.FASTEST_FIRST.index(p.kernel)])


@pytest.mark.parametrize("kernel", [k for k, mk in gbwd.MAIN_KERNELS.items() if mk.hopper])
def test_hopper_backward_kernels_run_on_sm90_only_and_say_why_elsewhere(kernel):
    for d in fgpu.HEAD_DIMS:
        p = gbwd._backward_plan(d, kernel, H100)
        assert p.kernel == kernel and p.shared_bytes == gbwd.MAIN_KERNELS[kernel].shared_bytes(d) <= H100.smem_per_block
        for lim in (T4, A10, RTX4090, A100):
            with pytest.raises(ValueError, match=rf"backward kernel '{kernel}' .*sm_90a.*this GPU is sm_{lim.cc}.*"
                                                 rf"'best' would choose '(pipe|mma|smem)'"):
                gbwd._backward_plan(d, kernel, lim)
    assert gbwd._backward_plan(128, "best", H100).kernel == gbwd.FASTEST_FIRST[0]  # "best": the measured order


def test_backward_at_d128_takes_mma_on_99_kb_cards_and_says_why():
    assert gbwd.MAIN_KERNELS["pipe"].shared_bytes(128) == 115200
    for lim in (A10, RTX4090):
        p = gbwd._backward_plan(128, "best", lim)
        assert p.kernel == "mma"
        (hopper, hopper_why), (name, why) = p.passed_over
        assert hopper == gbwd.HOPPER_BEST and "sm_90a" in hopper_why
        assert name == "pipe" and "115,200 B" in why and "101,376 B (MaxSharedMemoryPerBlockOptin)" in why
        with pytest.raises(ValueError, match=r"'pipe' needs 115,200 B .*'best' would choose 'mma'"):
            gbwd._backward_plan(128, "pipe", lim)
        assert gbwd._backward_plan(64, "best", lim).kernel == "pipe"
    assert gbwd._backward_plan(128, "best", A100).kernel == "pipe"
    assert gbwd._backward_plan(128, "best", H100).kernel == gbwd.HOPPER_BEST


# Older than any GPU the course supports: what every public call must refuse with a clear message.
VOLTA = dataclasses.replace(T4, name="V100 (simulated)", cc=70)


@pytest.mark.parametrize("lim", [*DEVICES, VOLTA], ids=lambda lim: lim.name)
def test_decode_runs_mma_from_sm80_keys_on_sm75_and_names_the_limit_below(lim):
    if lim.cc >= 80:
        plan = decoding._decode_plan(128, "best", lim)
        assert plan.kernel == "mma" and plan.threads == decoding.MMA_THREADS and not plan.passed_over
    elif lim.cc >= 75:  # the tensor-core kernel needs sm_80: passed over with the reason named
        plan = decoding._decode_plan(128, "best", lim)
        assert plan.kernel == "keys" and "'mma'" in plan.reason and "needs sm_80 or newer" in plan.reason
        with pytest.raises(ValueError, match=r"decode kernel 'mma' needs sm_80 or newer"):
            decoding._decode_plan(128, "mma", lim)
    else:
        with pytest.raises(ValueError, match=r"'keys' needs sm_75 or newer; this GPU is sm_70"):
            decoding._decode_plan(128, "best", lim)
    if lim.cc >= 75:
        assert decoding._decode_plan(128, "rows", lim).file == decoding.KERNEL_FILE
    with pytest.raises(ValueError, match="kernel must be one of"):
        decoding._decode_plan(128, "fast", lim)


# ------------------------------------------------------------------------------- through the public calls
_HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"
_spec = importlib.util.spec_from_file_location("hostemu", _HOSTEMU)
hostemu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostemu)


@pytest.fixture
def gpu_like(monkeypatch):
    """``gpu_like(lim)``: ``import cupy`` gives the stand-in, its device reports ``lim``'s attributes, and every
    launch is recorded as (file, function, dynamic shared memory) instead of run."""
    launches: list[tuple[str, str, int]] = []
    files = hostemu.kernel_texts()

    class Module:
        def __init__(self, code, options=()):
            self.file = files[code]

        def get_function(self, name):
            def launch(grid, block, args, shared_mem=0):
                launches.append((self.file, name, shared_mem))
            return launch

    def simulate(lim: fgpu.DeviceLimits):
        cp = hostemu.fake_cupy()
        cp.RawModule = Module
        device = type("Device", (), {
            "compute_capability": str(lim.cc), "synchronize": lambda self: None,
            "attributes": {"MultiProcessorCount": lim.sm_count, "MaxSharedMemoryPerBlockOptin": lim.smem_per_block,
                           "MaxRegistersPerBlock": lim.regs_per_block, "MaxThreadsPerBlock": lim.threads_per_block}})
        cp.cuda.Device = device
        monkeypatch.setitem(sys.modules, "cupy", cp)
        hostemu.stand_in_hopper(monkeypatch)  # the sm_90a rungs: an H100's "best"
        for cache in ("_FUNCTIONS", "_CAPABILITY", "_SM_COUNT", "_LIMITS"):
            monkeypatch.setattr(fgpu, cache, {})
        fgpu._module.cache_clear()
        return launches

    yield simulate
    fgpu._module.cache_clear()


def _arrays(*shape, dtype=np.float16):
    return hostemu._wrap(np.random.default_rng(0).standard_normal(shape).astype(dtype))


@pytest.mark.parametrize("lim", DEVICES, ids=lambda lim: lim.name)
def test_public_calls_launch_what_the_plan_says(gpu_like, lim):
    launches = gpu_like(lim)
    for d in fgpu.HEAD_DIMS:
        q, k, v, o, do = (_arrays(1, 2, 40, d) for _ in range(5))
        lse = _arrays(1, 2, 40, dtype=np.float32)
        q1 = q[:, :, :1].copy()  # one new token
        p = fgpu.plan(q, k, v)
        assert p.device == fgpu.device_limits() == dataclasses.replace(lim, name="host emulation (no GPU)")
        fgpu.attention(q, k, v)  # without a mask a stream-K rung launches its kernel with that deal (_nomask)
        nomask = "_nomask" if p.file in hopper.STREAM_K_FILES else ""
        assert launches[-1] == (p.file, f"attn_fwd_f16_d{d}{nomask}", p.shared_bytes)
        fgpu.attention(q, k, v, causal=True)
        assert launches[-1] == (p.file, f"attn_fwd_f16_d{d}", p.shared_bytes)
        assert fgpu.plan(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)).kernel == "smem_tiles"
        pb = fgpu.plan_backward(q, k, v)
        assert pb.kernel == ("smem" if lim.cc < 80 else pb.kernel)  # Turing: the scalar backward, no tensor cores
        fgpu.attention_backward(q, k, v, o, lse, do)
        assert launches[-2] == (pb.file, f"{pb.spec.stem}_f16_d{d}", pb.shared_bytes)
        pd = fgpu.plan_decode(q1, k, v)
        fgpu.decode(q1, k, v)
        name = f"decode_keys_f16_d{d}_r1" if lim.cc < 80 else f"decode_mma_f16_d{d}"
        assert pd.kernel == ("keys" if lim.cc < 80 else "mma") and launches[-2][:2] == (pd.file, name)


def test_a_forward_request_the_t4_cannot_run_is_refused_before_the_driver(gpu_like):
    launches = gpu_like(T4)
    q = _arrays(1, 1, 16, 128)
    with pytest.raises(ValueError, match=r"'exp2_tiles' needs sm_80.*'best' would choose 'turing'"):
        fgpu.attention(q, q, q, kernel="exp2_tiles")
    assert not launches and not fgpu._FUNCTIONS  # nothing compiled, nothing launched
    qb = _arrays(1, 1, 16, 64, dtype=np.uint16)
    assert fgpu.plan(qb, qb, qb, bf16=True).kernel == "smem_tiles"  # no bf16 tensor cores on sm_75
    text = str(fgpu.plan(q, q, q, scale=-0.1))
    assert re.search(rf"'turing'.*passed over '{fgpu.BEST[('f16', 128)]}', .*'mma': needs sm_80", text)
    assert "on host emulation (no GPU), sm_75" in text  # the device as it names itself


def test_backward_on_a_99_kb_card_launches_mma_at_d128(gpu_like):
    launches = gpu_like(RTX4090)
    q, k, v, o, do = (_arrays(1, 2, 40, 128) for _ in range(5))
    lse = _arrays(1, 2, 40, dtype=np.float32)
    fgpu.attention_backward(q, k, v, o, lse, do)
    assert [f for f, _, _ in launches] == [gbwd.KERNEL_FILE, gbwd.MMA_FILE, gbwd.KERNEL_FILE]
    with pytest.raises(ValueError, match=r"115,200 B .*this GPU allows 101,376 B \(MaxSharedMemoryPerBlockOptin\)"):
        fgpu.attention_backward(q, k, v, o, lse, do, kernel="pipe")


def test_selfcheck_skips_what_the_gpu_cannot_run_and_says_why(gpu_like, capsys):
    from flashlab.gpu import selfcheck

    launches = gpu_like(T4)
    assert selfcheck.forward(["addressing", "exp2_tiles"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped: needs sm_80 or newer") == 2 * 2 * len(fgpu.HEAD_DIMS) and not launches
    launches = gpu_like(VOLTA)
    assert selfcheck.backward_and_decode(quick=True) == 0 and not launches
    assert "backward and decoding skipped: no backward kernel runs" in capsys.readouterr().out
    gpu_like(A10)
    assert gbwd._backward_plan(128, "best", fgpu.device_limits()).kernel == "mma"
    with pytest.raises(ValueError, match="MaxSharedMemoryPerBlockOptin"):  # what selfcheck skips at d = 128
        gbwd._backward_plan(128, "pipe", fgpu.device_limits())


def test_plan_for_answers_without_arrays_what_a_gpu_runs():
    for lim in DEVICES:
        assert fgpu.plan_for("forward", lim, dtype="f16", d=64) == fgpu._forward_plan("f16", 64, True, "best", lim)
        for op in ("backward", "decode"):
            assert fgpu.cannot_run(op, lim, d=128) is None, (lim, op)  # every GPU from sm_75 up
    assert fgpu.plan_for("backward", T4).kernel == "smem" and fgpu.plan_for("decode", T4).kernel == "keys"
    for op in ("forward", "backward", "decode"):
        why = fgpu.cannot_run(op, VOLTA, d=128)
        assert "needs sm_75 or newer" in why and "sm_70" in why, (op, why)
    assert fgpu.plan_for("backward", A10).kernel == "mma" and fgpu.plan_for("backward", A10, d=64).kernel == "pipe"
    assert "no float32" in fgpu.cannot_run("backward", H100, dtype="f32")
    assert fgpu.cannot_run("forward", T4, kernel="addressing").startswith("forward kernel 'addressing' needs sm_80")
    with pytest.raises(ValueError, match="op must be"):
        fgpu.plan_for("sideways", H100)
