"""flashlab.gpu: every rung of the kernel ladder against the float64 reference (CONTRIBUTING.md, Correctness).

Rule (FlashAttention's own): a kernel's error against float64 may be at most twice the error of naive attention
computed in the same precision. The naive baseline is emulated here in NumPy, rounding where a framework's eager
attention rounds: the inputs, the score matrix S (output of a 16-bit matmul), P, and the output.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import flashlab.gpu as fgpu
from flashlab import reference

DTYPES = ("f32", "f16", "bf16")
CASES = [(name, dt) for name, rung in fgpu.RUNGS.items() for dt in rung.dtypes]
PRIMES = (2, 3, 5, 7, 13, 31, 61, 67, 127, 131, 257)


# ---------------------------------------------------------------------------------------------- CPU-side checks
def test_module_imports_without_cupy_and_says_so_when_called(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(ImportError, match="CuPy"):
        fgpu.attention(np.zeros((4, 64)), np.zeros((4, 64)), np.zeros((4, 64)))


def test_every_rung_has_its_kernel_file_and_entry_points():
    for rung in fgpu.RUNGS.values():
        src = rung.source()
        for dt in rung.dtypes:
            for d in fgpu.HEAD_DIMS:
                assert f"attn_fwd_{dt}_d{d}" in src, (rung.file, dt, d)
    for (dt, d), name in fgpu.BEST.items():
        assert dt in fgpu.RUNGS[name].dtypes and d in fgpu.HEAD_DIMS


# ----------------------------------------------------------------------------------------------------- helpers
def _round_bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _round(x, dt: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if dt == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dt == "bf16":
        return _round_bf16(x)
    return x


def _naive_same_precision(q, k, v, causal, scale, dt):
    """Eager attention in dtype dt (fp32 accumulation), on the CPU; q, k, v already representable in dt."""
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    s = _round(q @ np.swapaxes(k, -1, -2), dt) * np.float32(scale)
    if causal:
        s = np.where(reference.causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    tot = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (mx + np.log(tot))[..., 0]
    p = _round(p / np.where(tot > 0, tot, 1), dt)
    return _round(p @ v, dt), lse


def _to_gpu(x: np.ndarray, dt: str):
    import cupy as cp

    if dt == "f16":
        return cp.asarray(x.astype(np.float16))
    if dt == "bf16":
        return fgpu.to_bf16(cp.asarray(x.astype(np.float32)))
    return cp.asarray(x.astype(np.float32))


def _from_gpu(x, dt: str) -> np.ndarray:
    return (fgpu.from_bf16(x) if dt == "bf16" else x).get().astype(np.float64)


def _err(a, b):
    diff = np.abs(a - b)
    return float(diff.max()) if diff.size else 0.0


def _check(rng, name, dt, B, H, Hk, n, m, d, causal, *, scale=None, magnitude=1.0):
    import cupy as cp

    lead_q = (B, H) if B else ()
    lead_k = (B, Hk) if B else ()
    q = _round(magnitude * rng.standard_normal(lead_q + (n, d)), dt)
    k = _round(rng.standard_normal(lead_k + (m, d)), dt)
    v = _round(rng.standard_normal(lead_k + (m, d)), dt)
    sc = fgpu.check_scale(scale, d)
    O_ref, L_ref = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                       causal=causal, scale=sc)
    O_nv, L_nv = _naive_same_precision(q, k, v, causal, sc, dt)

    qg, kg, vg = (_to_gpu(x, dt) for x in (q, k, v))
    # Poison the outputs: every element must be written by the kernel.
    o = cp.full(qg.shape, 0xFFFF if dt == "bf16" else np.nan, dtype=qg.dtype)
    lse = cp.full(qg.shape[:-1], np.nan, dtype=cp.float32)
    fgpu.attention(qg, kg, vg, causal=causal, scale=scale, kernel=name, bf16=dt == "bf16", out=(o, lse))
    cp.cuda.Device().synchronize()
    O, L = _from_gpu(o, dt), lse.get().astype(np.float64)

    what = f"{name} {dt} B={B} H={H} Hk={Hk} n={n} m={m} d={d} causal={causal} magnitude={magnitude}"
    assert np.isfinite(O).all(), f"unwritten or nan outputs: {what}"
    assert not np.isnan(L).any(), f"unwritten or nan lse: {what}"
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref), err_msg=f"-inf rows differ: {what}")
    assert _err(O, O_ref) <= 2 * _err(O_nv, O_ref) + 1e-6, (what, _err(O, O_ref), _err(O_nv, O_ref))
    fin = np.isfinite(L_ref)
    lerr = _err(L[fin], L_ref[fin])
    assert lerr <= 2 * _err(L_nv[fin], L_ref[fin]) + 1e-5 * max(1.0, float(np.abs(L_ref[fin]).max(initial=0))), (
        what, lerr)
    if dt == "f32" and magnitude == 1.0:  # huge logits amplify fp32 rounding of S beyond 1e-5 (conditioning)
        rel = np.linalg.norm(O - O_ref) / max(np.linalg.norm(O_ref), 1e-30)
        assert rel <= 1e-5, (what, rel)
    return O, L


def _random_length(rng, block):
    kind = rng.integers(4)
    if kind == 0:
        return 1
    if kind == 1:
        return int(rng.choice(PRIMES))
    if kind == 2:
        return int(rng.integers(1, block))
    return int(rng.integers(1, 4 * block + 3))


# ------------------------------------------------------------------------------------------------- GPU checks
@pytest.mark.gpu
@pytest.mark.parametrize("name,dt", CASES)
def test_matches_reference_on_random_shapes(rng, name, dt):
    block = fgpu.RUNGS[name].block_rows
    for trial in range(8):
        d = int(rng.choice(fgpu.HEAD_DIMS))
        n, m = _random_length(rng, block), _random_length(rng, block)
        causal = bool(trial % 2)
        if trial % 4 == 3:
            _check(rng, name, dt, 0, 0, 0, n, m, d, causal)  # 2-D (n, d) inputs
        else:
            Hk = int(rng.integers(1, 3))
            H = Hk * int(rng.integers(1, 4))  # GQA when H > Hk, MQA when Hk = 1
            _check(rng, name, dt, int(rng.integers(1, 3)), H, Hk, n, m, d, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [("r6", 4, 64), ("r6", 8, 32), ("r6", 4, 128), ("r7", 8, 32), ("r7", 4, 32),
                                     ("r8", 4, 32), ("r8", 8, 64), ("r9", 4, 32), ("r9", 8, 64), ("r10", 8, 32),
                                     ("r11", 4, 32), ("r11", 8, 64)],
                         ids=lambda v: "-".join(map(str, v)))
def test_tunable_rungs_with_other_tile_sizes(rng, variant):
    which, nwarps, bc = variant
    if which == "r6":
        rung = fgpu.rung6_variant(nwarps, bc)
    elif which == "r7":
        rung = fgpu.rung7_variant(nwarps, bc)
    else:
        base = {"r8": "lean", "r9": "addressing", "r10": "one_barrier", "r11": "k_lanes"}[which]
        rung = fgpu.rung7_variant(nwarps, bc, bc, base=base)
    for trial in range(6):
        d = 64 if (which == "r6" and bc > 64) else int(rng.choice(fgpu.HEAD_DIMS))  # r6 BC=128 fits only at d=64
        n, m = _random_length(rng, rung.block_rows), _random_length(rng, bc)
        _check(rng, rung, "f16", 1, 2, 1, n, m, d, bool(trial % 2))


@pytest.mark.gpu
@pytest.mark.parametrize("name,dt", CASES)
def test_exact_tiles_and_long_rows(rng, name, dt):
    for d in fgpu.HEAD_DIMS:
        _check(rng, name, dt, 1, 2, 2, 256, 256, d, True)
        _check(rng, name, dt, 1, 2, 1, 128, 640, d, False)


@pytest.mark.gpu
@pytest.mark.parametrize("name,dt", CASES)
def test_fully_masked_rows_give_zeros_not_nan(rng, name, dt):
    # causal with n > m: query i sees keys j <= i - (n - m), so the first n - m rows see nothing.
    n, m = 150, 37
    O, L = _check(rng, name, dt, 1, 2, 1, n, m, 64, True)
    assert (O[..., : n - m, :] == 0).all()
    assert np.isneginf(L[..., : n - m]).all()
    assert np.isfinite(L[..., n - m :]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name,dt", CASES)
def test_huge_logits(rng, name, dt):
    # Scores of size ~1000 (scale 1): exp overflows unless the running max is subtracted first.
    for d, causal in ((64, False), (128, True)):
        _check(rng, name, dt, 1, 1, 1, 70, 90, d, causal, scale=1.0, magnitude=1000.0 / np.sqrt(d))


@pytest.mark.gpu
def test_negative_scale_falls_back_or_is_refused(rng):
    import cupy as cp

    for name in fgpu.POSITIVE_SCALE_ONLY:
        with pytest.raises(ValueError, match="scale > 0"):
            fgpu.attention(*(cp.ones((8, 64), cp.float16),) * 3, scale=-0.1, kernel=name)
    _check(rng, "best", "f16", 1, 2, 1, 40, 70, 64, True, scale=-0.125)  # best -> a rung that takes any scale


@pytest.mark.gpu
def test_default_kernel_matches_naive_cupy(rng):
    import cupy as cp

    q, k, v = (cp.asarray(rng.standard_normal((2, 4, 300, 64)).astype(np.float16)) for _ in range(3))
    for causal in (False, True):
        o, lse = fgpu.attention(q, k, v, causal=causal)
        o_ref, lse_ref = fgpu.naive_attention(q, k, v, causal=causal)
        assert float(cp.abs(o.astype(cp.float32) - o_ref.astype(cp.float32)).max()) < 5e-3
        assert float(cp.abs(lse - lse_ref).max()) < 5e-3


@pytest.mark.gpu
def test_bad_inputs_get_clear_errors():
    import cupy as cp

    x = cp.zeros((2, 2, 8, 64), dtype=cp.float16)
    with pytest.raises(TypeError, match="CuPy array"):
        fgpu.attention(np.zeros((8, 64), np.float16), x[0, 0], x[0, 0])
    with pytest.raises(TypeError, match="dtype"):
        fgpu.attention(*(cp.zeros((8, 64), cp.float64),) * 3)
    with pytest.raises(TypeError, match="bf16=True"):
        fgpu.attention(*(cp.zeros((8, 64), cp.uint16),) * 3)
    with pytest.raises(TypeError, match="share one dtype"):
        fgpu.attention(x, x.astype(cp.float32), x)
    with pytest.raises(ValueError, match="head dimension"):
        fgpu.attention(*(cp.zeros((8, 96), cp.float16),) * 3)
    with pytest.raises(ValueError, match="contiguous"):
        fgpu.attention(x[:, :, ::2], x, x)
    with pytest.raises(ValueError, match="divide"):
        fgpu.attention(x, x[:, :1].repeat(3, axis=1), x[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match="same shape"):
        fgpu.attention(x, x, x[:, :, :4])
    with pytest.raises(ValueError, match="unknown kernel"):
        fgpu.attention(x, x, x, kernel="warp_speed")
    with pytest.raises(ValueError, match="supports"):
        fgpu.attention(*(cp.zeros((8, 64), cp.float32),) * 3, kernel="mma")
    with pytest.raises(TypeError, match="causal"):
        fgpu.attention(x, x, x, causal="yes")
    with pytest.raises(ValueError, match="empty axis"):
        fgpu.attention(x[:0], x[:0], x[:0])
    with pytest.raises(ValueError, match="empty axis"):
        fgpu.attention(x[:, :0], x[:, :0], x[:, :0])


@pytest.mark.gpu
def test_bf16_conversion_round_trips_and_rounds_to_nearest_even(rng):
    import cupy as cp

    x = rng.standard_normal(1000).astype(np.float32)
    b = fgpu.to_bf16(cp.asarray(x))
    assert b.dtype == cp.uint16
    np.testing.assert_array_equal(fgpu.from_bf16(b).get(), _round_bf16(x))
