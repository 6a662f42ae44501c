"""What a T4 runs, run on the GPU at hand: the T4's plan, its kernels built as Turing code (CONTRIBUTING.md, Kernels).

No T4 is needed. The device's limits are replaced by the T4's attribute set (``KNOWN_DEVICES["T4"]``), so every
public call plans as on a T4: the Turing forward rung for fp16, rung 2 for bf16 and fp32, the scalar backward, the
split decoding kernels of sm_75 ("keys", where sm_80 and newer take "mma"). Every kernel file is
compiled by nvcc (or NVRTC without it) to PTX for ``compute_75``
(``__CUDA_ARCH__`` = 750: the Turing branches of the sources, such as the hand-rounded bf16 store) and loaded as
PTX, which the driver compiles for the GPU it runs on. The results are checked by the project's rule with the
same helpers as the other GPU tests. What this cannot show is the T4's speed, nor a limit the larger GPU does
not enforce (the tests of ``plan`` check those against the T4's attribute set on the CPU).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import backward as gbwd
from flashlab.gpu import decoding

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.gpu


@pytest.fixture
def as_t4(monkeypatch, tmp_path_factory):
    """This GPU planned as a T4 and running kernels compiled for compute_75; returns the files built."""
    import cupy as cp

    dev = cp.cuda.Device().id
    built: list[str] = []
    out = tmp_path_factory.mktemp("turing_ptx")

    def turing_module(file: str, defines: tuple[str, ...]):
        ptx = out / f"{pathlib.Path(file).stem}{''.join(defines).replace('=', '_').replace('-', '_')}.ptx"
        if not ptx.exists():
            if NVCC:
                subprocess.run([NVCC, "-ptx", "-arch=compute_75", "--std=c++17", *defines, "-o", str(ptx),
                                str(fgpu.KERNEL_DIR / file)], check=True, capture_output=True, text=True)
            else:  # NVRTC, as CuPy compiles, asked for compute_75 PTX
                from cupy.cuda import nvrtc

                prog = nvrtc.createProgram((fgpu.KERNEL_DIR / file).read_text(), file, [], [])
                try:
                    nvrtc.compileProgram(prog, ["-arch=compute_75", "--std=c++17", *defines])
                except nvrtc.NVRTCError as e:
                    raise RuntimeError(nvrtc.getProgramLog(prog)) from e
                code = nvrtc.getPTX(prog)
                ptx.write_text(code.decode() if isinstance(code, bytes) else code)
        built.append(file)
        return cp.RawModule(path=str(ptx))

    t4 = dataclasses.replace(fgpu.KNOWN_DEVICES["T4"], sm_count=fgpu.sm_count(), name="T4 (simulated)")
    monkeypatch.setitem(fgpu._LIMITS, dev, t4)
    monkeypatch.setattr(fgpu, "_FUNCTIONS", {})
    monkeypatch.setattr(fgpu, "_module", turing_module)
    return built


def _helpers():
    import test_gpu_attention as tga
    import test_gpu_backward as tgb
    import test_gpu_decode as tgd

    return tga, tgb, tgd


def test_the_t4_plan_is_what_runs(as_t4):
    import cupy as cp

    q = cp.zeros((1, 2, 100, 128), cp.float16)
    assert fgpu.plan(q, q, q).kernel == "turing"
    assert fgpu.plan(q.view(cp.uint16), q.view(cp.uint16), q.view(cp.uint16), bf16=True).kernel == "smem_tiles"
    assert fgpu.plan_backward(q, q, q).kernel == "smem"
    assert fgpu.plan_decode(cp.zeros((1, 2, 1, 128), cp.float16), q, q).kernel == "keys"
    with pytest.raises(ValueError, match=r"needs sm_80 or newer.*this GPU is sm_75"):
        fgpu.attention(q, q, q, kernel="addressing")
    assert not as_t4  # refused before anything was built


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
def test_forward_as_turing_code_matches_reference(rng, as_t4, dt):
    tga, _, _ = _helpers()
    for trial in range(8):
        d = int(rng.choice(fgpu.HEAD_DIMS))
        n, m = tga._random_length(rng, 64), tga._random_length(rng, 64)
        Hk = int(rng.integers(1, 3))
        tga._check(rng, "best" if dt != "f32" else "smem_tiles", dt, int(rng.integers(1, 3)),
                   Hk * int(rng.integers(1, 4)), Hk, n, m, d, bool(trial % 2))
    tga._check(rng, "best", dt, 1, 2, 1, 300, 4097, 128, True)  # long rows, GQA
    assert set(as_t4) == ({"r3t_mma_m16n8k8.cu"} if dt == "f16" else {"r2_smem_tiles.cu"})


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_backward_as_turing_code_matches_reference(rng, as_t4, dt):
    _, tgb, _ = _helpers()
    for trial in range(6):
        d = int(rng.choice([64, 128]))
        n, m = (int(rng.choice([1, int(rng.choice(tgb.PRIMES)), int(rng.integers(1, 300))])) for _ in range(2))
        Hk = int(rng.integers(1, 3))
        tgb._check_backward(rng, dt, int(rng.integers(1, 3)), Hk * int(rng.integers(1, 4)), Hk, n, m, d,
                            bool(trial % 2), kernel="best")
    tgb._check_backward(rng, dt, 1, 4, 1, 96, 640, 128, False, kernel="best")  # MQA
    tgb._check_backward(rng, dt, 1, 2, 2, 256, 256, 64, True, kernel="best", magnitude=30.0)  # huge logits
    assert gbwd.KERNEL_FILE in as_t4 and not {gbwd.MMA_FILE, gbwd.PIPE_FILE} & set(as_t4)


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_decoding_as_turing_code_matches_reference(rng, as_t4, dt):
    _, _, tgd = _helpers()
    for trial in range(6):
        d = int(rng.choice([64, 128]))
        B, Hk, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 4, 8]))
        m = int(rng.choice([1, 31, int(rng.integers(1000, 5000))]))
        lengths = [int(x) for x in rng.integers(1, m + 1, size=B)]
        tgd._check_decode(rng, dt, B, Hk * G, Hk, int(rng.choice([1, 3])), m, d, bool(trial % 2), None, lengths,
                          kernel="best")
    # sm_80 and newer would take the "mma" kernel; a T4 runs "keys"
    assert set(as_t4) >= {f for f, cc in decoding.FILE_MIN_CC.items() if cc <= 75} and decoding.MMA_FILE not in as_t4


def test_bf16_store_rounds_ties_to_even_in_turing_code(rng, as_t4):
    """The hand-written bf16 rounding (sm_75 has no conversion to bf16) on ties: two identical keys give every value
    half the weight, so o = (v1 + v2) / 2 exactly in fp32; with v2 one bf16 step above v1 that is a tie, and the
    store must round it to the even neighbour, as NumPy's rounding does."""
    import cupy as cp

    tga, _, _ = _helpers()
    q = tga._round(rng.standard_normal((1, 1, 1, 64)), "bf16")
    k = np.repeat(tga._round(rng.standard_normal((1, 1, 1, 64)), "bf16"), 2, axis=2)
    v1 = tga._round(rng.standard_normal((1, 1, 1, 64)) * np.float32(2.0) ** rng.integers(-20, 20, (1, 1, 1, 64)),
                    "bf16").astype(np.float32)
    v2 = (v1.view(np.uint32) + np.uint32(1 << 16)).view(np.float32)  # one bf16 step further from zero
    v = np.concatenate([v1, v2], axis=2)
    tie = (v1 + v2) * np.float32(0.5)
    assert (tga._round(tie, "bf16") == v1).any() and (tga._round(tie, "bf16") == v2).any()  # both directions
    o, _ = fgpu.decode(*(tga._to_gpu(x, "bf16") for x in (q, k, v)), bf16=True)
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(tga._from_gpu(o, "bf16")[0, 0, 0], tga._round(tie, "bf16")[0, 0, 0])
