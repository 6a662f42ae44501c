"""The @njit CPU forward (flashlab.numba_cpu) against the float64 reference and chapter 2's NumPy tiles, its
vectorisable exponential, its memory, and the CPU benchmark rows that measure it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashlab import numba_cpu, reference, tiled


def _rel(x, ref):
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300)


def _random_case(rng, dtype):
    batch = tuple(int(x) for x in rng.integers(1, 4, size=int(rng.integers(0, 3))))
    n, m = (int(x) for x in rng.integers(1, 150, size=2))
    d, dv = (int(x) for x in rng.integers(1, 40, size=2))
    return [rng.standard_normal(batch + s).astype(dtype) for s in ((n, d), (m, d), (m, dv))]


# ------------------------------------------------------------------------------------------- CPU: tiled_forward
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_forward_matches_reference_random_shapes_and_blocks(rng, dtype, causal):
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for _ in range(6):
        Q, K, V = _random_case(rng, dtype)
        bq, bk = (int(x) for x in rng.integers(1, 80, size=2))
        O, L = numba_cpu.tiled_forward(Q, K, V, block_q=bq, block_k=bk, causal=causal)
        O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
        where = f"shapes {Q.shape} {K.shape} {V.shape}, blocks {bq}x{bk}"
        assert O.dtype == dtype and L.dtype == dtype and O.shape == O_ref.shape and L.shape == L_ref.shape
        assert _rel(O, O_ref) <= tol, where
        assert np.array_equal(np.isneginf(L), np.isneginf(L_ref)), where
        finite = np.isfinite(L_ref)
        np.testing.assert_allclose(L[finite], L_ref[finite], rtol=tol, atol=tol, err_msg=where)


def test_tiled_forward_equals_numpy_tiled_forward(rng):
    for _ in range(4):
        Q, K, V = _random_case(rng, np.float64)
        causal = bool(rng.integers(2))
        got = numba_cpu.tiled_forward(Q, K, V, block_q=16, block_k=24, causal=causal)
        want = tiled.forward(Q, K, V, block_q=16, block_k=24, causal=causal)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)


def test_fully_masked_rows_one_row_and_huge_logits(rng):
    Q, K, V = rng.standard_normal((10, 4)), rng.standard_normal((4, 4)), rng.standard_normal((4, 3))
    O, L = numba_cpu.tiled_forward(Q, K, V, block_q=3, block_k=2, causal=True)
    assert np.all(O[:6] == 0) and np.all(np.isneginf(L[:6]))  # queries 0..5 see no key when n - m = 6
    O_ref, L_ref = reference.attention(Q, K, V, causal=True)
    np.testing.assert_allclose(O, O_ref, atol=1e-12)
    np.testing.assert_allclose(L[6:], L_ref[6:], rtol=1e-12)

    q, k, v = (rng.standard_normal((1, 3)) for _ in range(3))
    np.testing.assert_allclose(numba_cpu.tiled_forward(q, k, v)[0], v, rtol=1e-12)

    Q = 1000 * rng.standard_normal((9, 4))
    K, V = rng.standard_normal((11, 4)), rng.standard_normal((11, 4))
    for dtype in (np.float64, np.float32):
        O, L = numba_cpu.tiled_forward(*(x.astype(dtype) for x in (Q, K, V)), block_q=4, block_k=3, scale=1.0)
        O_ref, L_ref = reference.attention(Q.astype(dtype), K.astype(dtype), V.astype(dtype), scale=1.0)
        assert np.all(np.isfinite(O)) and _rel(O, O_ref) <= (1e-12 if dtype == np.float64 else 1e-5)
        np.testing.assert_allclose(L, L_ref, rtol=1e-12 if dtype == np.float64 else 1e-6)


def test_float32_at_a_realistic_size(rng):
    Q, K, V = (rng.standard_normal((2, 700, 64)) for _ in range(3))
    O_ref, L_ref = reference.attention(Q, K, V, causal=True)
    O, L = numba_cpu.tiled_forward(*(x.astype(np.float32) for x in (Q, K, V)), causal=True)
    assert _rel(O, O_ref) <= 1e-5 and _rel(L, L_ref) <= 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_exp_is_as_accurate_as_numpy(dtype):
    from numba import njit

    @njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = numba_cpu.exp_nonpositive(x[i])
        return out

    x = -np.concatenate([np.linspace(0, 800, 200_001), [np.inf, 1e-30, 0.0]]).astype(dtype)
    got = apply(x)
    want = np.exp(x.astype(np.float64))
    tiny = np.finfo(dtype).tiny
    normal = want > 4 * tiny
    ulp = np.finfo(dtype).eps
    assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) <= 4 * ulp
    assert np.all(got[~normal] <= 4 * tiny) and got[-3] == 0 and got[-1] == 1


def test_bad_input_is_a_clear_error():
    x = np.ones((4, 3))
    with pytest.raises(TypeError, match="floating"):
        numba_cpu.tiled_forward(x.astype(int), x, x)
    with pytest.raises(TypeError, match="float32, float64"):
        numba_cpu.tiled_forward(x.astype(np.float16), x, x)
    with pytest.raises(ValueError, match="block_q"):
        numba_cpu.tiled_forward(x, x, x, block_q=0)
    with pytest.raises(ValueError, match="head dimension"):
        numba_cpu.tiled_forward(x, np.ones((4, 2)), x)
    with pytest.raises(TypeError, match="block_k"):
        numba_cpu.tiled_forward(x, x, x, block_k=2.5)


def test_compiles_without_a_writable_cache():
    # A function numba cannot cache (no source file: like a read-only install with no writable home) still
    # compiles, uncached, instead of failing at import.
    from numba import njit

    ns: dict = {}
    exec("def add_one(x):\n    return x + 1", ns)
    with pytest.raises(RuntimeError, match="cannot cache"):
        njit(cache=True)(ns["add_one"])
    assert numba_cpu._njit()(ns["add_one"])(41) == 42


def _peak_rss_growth(fn, *args):
    """Bytes the resident set grew by during fn(*args): Linux's high-water mark, reset just before."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = status("VmRSS:")
    fn(*args)
    return status("VmHWM:") - base


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_tiled_forward_never_holds_the_score_matrix(rng):
    n, d = 4096, 64
    Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))

    def naive(Q, K, V):
        S = Q @ K.T
        return np.exp(S - S.max(axis=1, keepdims=True)) @ V

    numba_cpu.tiled_forward(Q, K, V)  # compile and warm up first
    s_bytes = n * n * 4
    assert _peak_rss_growth(naive, Q, K, V) >= s_bytes  # the measurement sees an n x n float32 matrix...
    assert _peak_rss_growth(numba_cpu.tiled_forward, Q, K, V) <= s_bytes / 10  # ...and none here


def test_workspace_account_is_small():
    est = numba_cpu.tiled_forward_workspace_bytes(4096, 64, 64, threads=2)
    assert 4096 * 65 * 4 < est < 4096 * 4096 * 4 / 10


# ---------------------------------------------------------------------------------------- CPU benchmark
def test_cpu_bench_rows_are_checked_and_measured():
    from flashlab import cpu_bench

    rows = cpu_bench.run(sizes=(96,), repeat=1, rounds=1, verbose=False)
    assert [r["implementation"] for r in rows] == list(cpu_bench.IMPLEMENTATIONS)
    for r in rows:
        assert r["rel_error_vs_float64"] <= 1e-5 and r["median_s"] > 0
    naive = rows[0]
    assert naive["tracemalloc_peak_bytes"] >= 96 * 96 * 4  # the score matrix is there, and tracemalloc sees it
    numba_row = rows[2]
    assert numba_row["analytic_peak_bytes"] > 0 and "numba_threads" in numba_row
    assert "numba_tiled" in cpu_bench.format_table(rows)
    assert set(cpu_bench.summary(rows)) >= {"speedup_numba_vs_naive", "memory_ratio_numba_vs_naive", "target_met"}
