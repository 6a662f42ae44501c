"""flashlab.gpu.attention_backward against float64 gradients (CONTRIBUTING.md, Correctness); its schedule on CPU.

Rule: each gradient's max error against ``flashlab.reference.attention_backward`` (float64, on the same rounded
inputs) is at most twice that of the standard backward computed in the same precision, emulated in NumPy where
an eager framework rounds: S, P, O, dP, dS and the three gradients are stored in fp16/bf16, products accumulate in
fp32. The GPU path runs the package's forward (``flashlab.gpu.attention``) to get o and lse, as training does.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from flashlab import reference
from flashlab.gpu import backward as gbwd

PRIMES = (2, 3, 5, 7, 13, 31, 61, 67, 127, 131, 257)
HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"


# ---------------------------------------------------------------------------------------------- CPU-side checks
def test_numpy_schedule_matches_the_reference_gradients(rng):
    """The kernel's loop order (K/V blocks outer, causal tiles skipped, GQA heads summed) in float64."""
    for trial in range(10):
        B, Hk, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
        n, m = (int(rng.choice([1, *PRIMES[:8], int(rng.integers(1, 100))])) for _ in range(2))
        d = int(rng.integers(1, 9))
        causal = bool(trial % 2)
        q = rng.standard_normal((B, Hk * G, n, d))
        k, v = rng.standard_normal((B, Hk, m, d)), rng.standard_normal((B, Hk, m, d))
        do = rng.standard_normal(q.shape)
        o, lse = reference.attention(q, k, v, causal=causal)
        got = gbwd.numpy_backward(q, k, v, o, lse, do, causal=causal)
        want = reference.attention_backward(q, k, v, do, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=f"{name} n={n} m={m} causal={causal}")


def test_causal_skipping_visits_only_tiles_with_a_visible_key():
    # The first query tile a key block visits must contain the first row that sees the block's first key.
    for n, m in ((100, 100), (37, 300), (300, 37), (1, 64), (64, 1)):
        off = m - n
        for k0 in range(0, m, gbwd.BLOCK_KEYS):
            qstart = (max(0, k0 - off) // gbwd.BLOCK_ROWS) * gbwd.BLOCK_ROWS
            first_row = max(0, k0 - off)
            assert qstart <= first_row < qstart + gbwd.BLOCK_ROWS and first_row < n, (n, m, k0)


def test_block_order_numbers_every_block_once_longest_first_within_a_group():
    for key_blocks, heads in ((1, 1), (8, 5), (32, 64), (3, 7)):
        for group in (1, 2, 3, heads, heads + 4):
            order = gbwd.block_order(key_blocks, heads, group)
            every = [(kb, h) for kb in range(key_blocks) for h in range(heads)]
            assert sorted(order) == every, (key_blocks, heads, group)
            for g0 in range(0, heads, group):  # a group's blocks are contiguous, key block by key block
                mine = [i for i, (_, h) in enumerate(order) if g0 <= h < g0 + group]
                assert mine == list(range(mine[0], mine[0] + len(mine)))
                kbs = [order[i][0] for i in mine]
                assert kbs == sorted(kbs)
    assert gbwd.block_order(4, 3, 1) == [(kb, h) for h in range(3) for kb in range(4)]  # the other kernels' order
    with pytest.raises(ValueError, match="at least 1"):
        gbwd.block_order(4, 3, 0)


def test_balanced_order_shortens_the_causal_tail_on_132_sms():
    """The prediction behind bwd_h4_balanced.cu, by greedy list scheduling: at n = 4096 (16 heads, batch 4) the
    default order ends more than 5 % after the even share of the work, longest first within 1 %."""
    n, heads, sms = 4096, 64, 132
    key_blocks = n // 128

    def work(kb):  # query tiles of 64 rows a causal key block visits, and a little per block
        return n // 64 - 2 * kb + 0.5

    even = sum(work(kb) for kb in range(key_blocks)) * heads / sms
    group = gbwd.balanced_group(key_blocks, heads, causal=True)
    default = gbwd.makespan([work(kb) for kb, _ in gbwd.block_order(key_blocks, heads, 1)], sms)
    balanced = gbwd.makespan([work(kb) for kb, _ in gbwd.block_order(key_blocks, heads, group)], sms)
    assert default > 1.05 * even and balanced < 1.01 * even, (default / even, balanced / even, group)
    assert group == heads and gbwd.balanced_group(key_blocks, heads, causal=False) == 1


def test_kernel_file_has_every_entry_point():
    from flashlab.gpu import KERNEL_DIR

    text = (KERNEL_DIR / gbwd.KERNEL_FILE).read_text()
    mma = (KERNEL_DIR / gbwd.MMA_FILE).read_text()
    pipe = (KERNEL_DIR / gbwd.PIPE_FILE).read_text()
    assert "bwd_mma_##DT##_d##D(" in mma and "bwd_pipe_##DT##_d##D(" in pipe
    hopper = {f: (KERNEL_DIR / f).read_text() for f in gbwd.HOPPER_FILES}
    for name, mk in gbwd.MAIN_KERNELS.items():
        if mk.hopper:
            assert f"{mk.stem}_##DT##_d##D(" in hopper[mk.file], name
        if mk.dq_tiles:  # its own last kernel reads its tiled dQ buffer back
            assert "bwd_dq_tiles_##DT##_d##D(" in hopper[mk.file], name
    for dt in ("f16", "bf16"):
        assert f"bwd_dq_{dt}(" in text
        for d in (64, 128):
            assert f"DEFINE_KERNELS({dt}, {dt.upper()}, {d})" in text
            assert f"DEFINE_KERNELS({dt}, {dt.upper()}, {d})" in mma
            assert f"DEFINE_KERNELS({dt}, {dt.upper()}, {d})" in pipe
            assert all(f"DEFINE_KERNELS({dt}, {dt.upper()}, {d})" in t for t in hopper.values())


def test_backward_imports_without_cupy_and_says_so_when_called(monkeypatch):
    import flashlab.gpu as fgpu

    monkeypatch.setitem(sys.modules, "cupy", None)
    x = np.zeros((4, 64))
    with pytest.raises(ImportError, match="CuPy"):
        fgpu.attention_backward(x, x, x, x, np.zeros(4), x)


# A guard against a hang, not a timing: every CUDA thread of the emulation is an OS thread, and on a 2-core machine
# busy with other work the self-check took more than 15 minutes.
HOSTEMU_LIMIT = 2400


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
def test_kernels_pass_the_selfcheck_under_the_host_emulation():
    """The CUDA kernels themselves, compiled for the CPU by tools/hostemu: real index arithmetic, barriers and
    shuffles (no timing, no race detection), against float64."""
    res = subprocess.run([sys.executable, str(HOSTEMU), "--selfcheck", "--quick"],
                         capture_output=True, text=True, timeout=HOSTEMU_LIMIT)
    assert res.returncode == 0 and "selfcheck: all ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
def test_host_emulation_runs_the_gpu_proven_tensor_core_forward():
    """Rung 9 (mma.sync, ldmatrix, cp.async; correct on an H200) under the emulation: checks the emulation itself."""
    res = subprocess.run([sys.executable, str(HOSTEMU), "--forward-check"],
                         capture_output=True, text=True, timeout=HOSTEMU_LIMIT)
    assert res.returncode == 0 and "forward check: all ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------- helpers
def _tga():
    import test_gpu_attention as tga  # the forward's test helpers: rounding, transfers, error

    return tga


def _naive_backward_same_precision(q, k, v, do, causal, scale, dt):
    """Standard attention backward as an eager framework runs it in dtype dt (fp32 accumulation)."""
    R = _tga()._round
    Hk, H = (k.shape[-3], q.shape[-3]) if q.ndim >= 3 else (1, 1)
    if H != Hk:
        k, v = np.repeat(k, H // Hk, axis=-3), np.repeat(v, H // Hk, axis=-3)
    q, k, v, do = (np.asarray(x, np.float32) for x in (q, k, v, do))
    s = R(q @ np.swapaxes(k, -1, -2), dt) * np.float32(scale)
    if causal:
        s = np.where(reference.causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    tot = p.sum(axis=-1, keepdims=True)
    P = R(p / np.where(tot > 0, tot, 1), dt)
    O = R(P @ v, dt)
    dV = np.swapaxes(P, -1, -2) @ do
    dP = R(do @ np.swapaxes(v, -1, -2), dt)
    Dr = np.sum(do * O, axis=-1, keepdims=True)
    dS = R(P * (dP - Dr), dt)
    dQ = scale * (dS @ k)
    dK = scale * (np.swapaxes(dS, -1, -2) @ q)
    if H != Hk:
        dK = dK.reshape(dK.shape[:-3] + (Hk, H // Hk) + dK.shape[-2:]).sum(axis=-3)
        dV = dV.reshape(dV.shape[:-3] + (Hk, H // Hk) + dV.shape[-2:]).sum(axis=-3)
    return R(dQ, dt), R(dK, dt), R(dV, dt)


def _runs_here(kernel):
    """Skip a test of a kernel this GPU cannot run (the Hopper kernel off sm_90)."""
    import flashlab.gpu as fgpu

    if gbwd.MAIN_KERNELS[kernel].hopper and (why := fgpu.hopper_problem()):
        pytest.skip(why)


def _check_backward(rng, dt, B, H, Hk, n, m, d, causal, *, scale=None, magnitude=1.0, kernel="smem", qk=None):
    """``qk``: given (q, k) instead of random ones (rounded to dt here)."""
    import cupy as cp

    import flashlab.gpu as fgpu

    tga = _tga()
    lead_q, lead_k = ((B, H), (B, Hk)) if B else ((), ())
    q = tga._round(magnitude * rng.standard_normal(lead_q + (n, d)) if qk is None else qk[0], dt)
    k = tga._round(rng.standard_normal(lead_k + (m, d)) if qk is None else qk[1], dt)
    v = tga._round(rng.standard_normal(lead_k + (m, d)), dt)
    do = tga._round(rng.standard_normal(lead_q + (n, d)), dt)
    sc = fgpu.check_scale(scale, d)
    want = reference.attention_backward(*(x.astype(np.float64) for x in (q, k, v, do)), causal=causal, scale=sc)
    naive = _naive_backward_same_precision(q, k, v, do, causal, sc, dt)

    qg, kg, vg, dog = (tga._to_gpu(x, dt) for x in (q, k, v, do))
    bf = dt == "bf16"
    o, lse = fgpu.attention(qg, kg, vg, causal=causal, scale=scale, bf16=bf)
    got = fgpu.attention_backward(qg, kg, vg, o, lse, dog, causal=causal, scale=scale, bf16=bf, kernel=kernel)
    cp.cuda.Device().synchronize()
    got = [tga._from_gpu(x, dt) for x in got]
    what = f"{kernel} {dt} B={B} H={H} Hk={Hk} n={n} m={m} d={d} causal={causal} magnitude={magnitude}"
    # Recomputation's own price at huge logits: P = exp(S_bwd - L_fwd) subtracts two fp32 results of size |S| made
    # by different kernels in different summation orders; their difference, about sqrt(d) 2^-24 |S| (a random-walk
    # rounding estimate), comes back as a relative error of P. The naive emulation computes S once and does not
    # pay it. At |S| ~ 5 it is negligible; in the huge-logit test (|S| up to 4.5e3) the estimate is 3e-3 relative,
    # and the H200 showed 8e-4 (the scalar kernel's f16 dv: 4.9e-3 against naive 2.0e-3 at |dv| = 5.8).
    kk = np.repeat(k, H // Hk, axis=-3) if B and H != Hk else k  # GQA: each query head's own K/V head
    s_max = float(np.abs(reference.scores(q.astype(np.float64), kk.astype(np.float64), scale=sc)).max(initial=0))
    recompute = np.sqrt(d) * 2.0**-24 * s_max
    for name, g, w, nv in zip(("dq", "dk", "dv"), got, want, naive, strict=True):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.isfinite(g).all(), f"nan/inf in {name}: {what}"
        err, err_nv = tga._err(g, w), tga._err(nv, w)
        w_max = float(np.abs(w).max(initial=0))
        assert err <= 2 * err_nv + 1e-6 + (1e-5 + recompute) * w_max, (name, what, err, err_nv, recompute)
    return got


# ------------------------------------------------------------------------------------------------- GPU checks
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_backward_matches_reference_on_random_shapes(rng, dt, kernel):
    _runs_here(kernel)
    for trial in range(8):
        d = int(rng.choice([64, 128]))
        n, m = (int(rng.choice([1, int(rng.choice(PRIMES)), int(rng.integers(1, 32)), int(rng.integers(1, 300))]))
                for _ in range(2))
        causal = bool(trial % 2)
        if trial % 4 == 3:
            _check_backward(rng, dt, 0, 0, 0, n, m, d, causal, kernel=kernel)  # 2-D (n, d) inputs
        else:
            Hk = int(rng.integers(1, 3))
            _check_backward(rng, dt, int(rng.integers(1, 3)), Hk * int(rng.integers(1, 4)), Hk, n, m, d, causal,
                            kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_backward_exact_tiles_long_rows_and_gqa(rng, dt, kernel):
    _runs_here(kernel)
    for d in (64, 128):
        _check_backward(rng, dt, 1, 2, 2, 256, 256, d, True, kernel=kernel)
        _check_backward(rng, dt, 1, 4, 1, 96, 640, d, False, kernel=kernel)  # MQA: 4 query heads, 1 K/V head
        _check_backward(rng, dt, 2, 6, 2, 129, 97, d, True, kernel=kernel)
    _check_backward(rng, dt, 1, 2, 1, 1000, 1000, 128, True, kernel=kernel)  # long rows, many tiles


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_backward_fully_masked_rows_and_huge_logits(rng, dt, kernel):
    _runs_here(kernel)
    n, m = 150, 37  # causal with n > m: the first n - m rows see no key and get zero gradients
    dq, _, _ = _check_backward(rng, dt, 1, 2, 1, n, m, 64, True, kernel=kernel)
    assert (dq[..., : n - m, :] == 0).all()
    _check_backward(rng, dt, 1, 1, 1, 70, 90, 128, True, scale=1.0, magnitude=1000.0 / np.sqrt(128), kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_keys_past_the_cache_stay_masked_when_every_score_is_very_negative(rng, dt, kernel):
    """Every score -100, m not a multiple of any block's keys, no causal mask: a kernel that lets the zero-filled
    keys past m into P gets P = e^100 / 37 there (past fp32's range), and dS times K's zero rows makes dQ NaN."""
    _runs_here(kernel)
    for d in (64, 128):
        B, H, n, m = 1, 2, 5, 37
        q = np.full((B, H, n, d), -100.0 / d)
        k = np.ones((B, H, m, d))
        _check_backward(rng, dt, B, H, H, n, m, d, False, scale=1.0, kernel=kernel, qk=(q, k))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
def test_dk_dv_are_deterministic_and_dq_nearly(rng, kernel):
    _runs_here(kernel)
    import cupy as cp

    import flashlab.gpu as fgpu

    q, k, v, do = (cp.asarray(rng.standard_normal((1, 4, 300, 64)).astype(np.float16)) for _ in range(4))
    o, lse = fgpu.attention(q, k, v)
    a = fgpu.attention_backward(q, k, v, o, lse, do, kernel=kernel)
    b = fgpu.attention_backward(q, k, v, o, lse, do, kernel=kernel)
    np.testing.assert_array_equal(a[1].get(), b[1].get())  # dK, dV: one block owns each key, fixed order
    np.testing.assert_array_equal(a[2].get(), b[2].get())
    # dQ: fp32 atomics in any order, then one rounding to fp16: at most one fp16 step apart
    assert float(cp.abs(a[0].astype(cp.float32) - b[0].astype(cp.float32)).max()) <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", gbwd.KERNELS)
def test_out_and_a_dirty_workspace_give_the_same_gradients(rng, kernel):
    """out= receives the gradients; a reused workspace whose dq accumulator and D vector hold NaN from 'an earlier
    call' is cleared: dk, dv bit for bit as a plain call, dq within one fp16 step (atomics)."""
    _runs_here(kernel)
    import cupy as cp

    import flashlab.gpu as fgpu

    ws = fgpu.Workspace()
    for shape_q, shape_k, causal in (((1, 4, 300, 64), (1, 2, 300, 64), False), ((2, 2, 77, 128), (2, 1, 131, 128),
                                                                                  True)):
        q, do = (cp.asarray(rng.standard_normal(shape_q).astype(np.float16)) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal(shape_k).astype(np.float16)) for _ in range(2))
        o, lse = fgpu.attention(q, k, v, causal=causal)
        want = fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, kernel=kernel)
        out = tuple(cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v))
        ws.get("bwd_dq_acc", q.shape, cp.float32).fill(np.nan)
        ws.get("bwd_d", q.shape[:-1], cp.float32).fill(np.nan)
        got = fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, kernel=kernel, out=out, workspace=ws)
        assert all(a is b for a, b in zip(got, out, strict=True))
        np.testing.assert_array_equal(got[1].get(), want[1].get())
        np.testing.assert_array_equal(got[2].get(), want[2].get())
        top = max(1.0, float(cp.abs(want[0].astype(cp.float32)).max()))
        assert float(cp.abs(got[0].astype(cp.float32) - want[0].astype(cp.float32)).max()) <= 2e-3 * top
    with pytest.raises(ValueError, match="out\\[1\\]"):
        fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, out=(out[0], out[0], out[2]))


@pytest.mark.gpu
def test_naive_cupy_backward_agrees_with_the_kernel(rng):
    import cupy as cp

    import flashlab.gpu as fgpu

    q, k, v, do = (cp.asarray(rng.standard_normal(s).astype(np.float16))
                   for s in ((2, 4, 130, 64), (2, 2, 70, 64), (2, 2, 70, 64), (2, 4, 130, 64)))
    for causal in (False, True):
        o, lse = fgpu.attention(q, k, v, causal=causal)
        ours = fgpu.attention_backward(q, k, v, o, lse, do, causal=causal)
        naive = gbwd.naive_attention_backward(q, k, v, do, causal=causal)
        want = reference.attention_backward(*(x.get().astype(np.float64) for x in (q, k, v, do)), causal=causal)
        for a, b, w in zip(ours, naive, want, strict=True):
            assert a.shape == b.shape == w.shape
            scale = float(np.abs(w).max())
            assert np.abs(b.get().astype(np.float64) - w).max() <= 2e-2 * scale  # fp16 P and dS: a loose bound
            assert np.abs(a.get().astype(np.float64) - w).max() <= 2e-2 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_autograd_function_gradients_match_float64_like_sdpa(dtype_name):
    torch = pytest.importorskip("torch")  # the GPU machine has it; the function is only for PyTorch users
    from flashlab.gpu.autograd import flash_attention

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    # causal only with n == m: torch's is_causal aligns the mask top-left, the course's bottom-right (j <= i + m - n)
    for (n, m), causal in (((100, 150), False), ((130, 130), True)):
        q = torch.randn(2, 4, n, 64, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, 2, m, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        do = torch.randn(2, 4, n, 64, device="cuda", dtype=dtype)
        ours = torch.autograd.grad(flash_attention(q, k, v, causal), (q, k, v), do)
        sdpa = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True), (q, k, v), do)
        want = reference.attention_backward(*(x.detach().double().cpu().numpy() for x in (q, k, v, do)), causal=causal)
        for name, a, b, w in zip(("dq", "dk", "dv"), ours, sdpa, want, strict=True):
            err = np.abs(a.double().cpu().numpy() - w).max()
            err_sdpa = np.abs(b.double().cpu().numpy() - w).max()
            assert err <= 2 * err_sdpa + 1e-5 * np.abs(w).max(), (dtype_name, causal, name, err, err_sdpa)


@pytest.mark.gpu
def test_backward_bad_inputs_get_clear_errors():
    import cupy as cp

    import flashlab.gpu as fgpu

    x = cp.zeros((1, 2, 8, 64), dtype=cp.float16)
    lse = cp.zeros((1, 2, 8), dtype=cp.float32)
    with pytest.raises(TypeError, match="float32"):
        fgpu.attention_backward(*(x.astype(cp.float32),) * 4, lse, x.astype(cp.float32))
    with pytest.raises(ValueError, match="do must have"):
        fgpu.attention_backward(x, x, x, x, lse, x[:, :, :4])
    with pytest.raises(ValueError, match="lse"):
        fgpu.attention_backward(x, x, x, x, lse.astype(cp.float16), x)
    with pytest.raises(TypeError, match="CuPy"):
        fgpu.attention_backward(x, x, x, x.get(), lse, x)
    with pytest.raises(TypeError, match="causal"):
        fgpu.attention_backward(x, x, x, x, lse, x, causal=1)
    with pytest.raises(ValueError, match="kernel"):
        fgpu.attention_backward(x, x, x, x, lse, x, kernel="tensor")


@pytest.mark.gpu
def test_toy_model_trains_with_the_kernels_like_with_sdpa():
    pytest.importorskip("torch")
    from flashlab.gpu import toytrain

    flash, sdpa = toytrain.train("flash", 150), toytrain.train("sdpa", 150)
    # ln(16) = 2.77 at the start, and no model gets below it without attending to the previous token
    assert flash[-1] < 0.8 * flash[0], flash
    # same weights, same batches: the curves differ only by the attention's rounding (bf16 inside attention)
    assert max(abs(a - b) for a, b in zip(flash, sdpa, strict=True)) <= 0.1 * flash[0], (flash, sdpa)
