"""The @njit CPU forwards (flashlab.numba_cpu: the readable tiled_forward and fast_forward, whose tile products
are BLAS calls) against the float64 reference and chapter 2's NumPy tiles, the vectorisable exponential, their
memory, and the CPU benchmark rows that measure them."""

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


# --------------------------------------------------------------------------------------------- CPU: fast_forward
def _naive_same_precision(Q, K, V, causal):
    """Naive attention in the inputs' dtype (the whole score matrix), masked as flashlab.reference masks."""
    S = (Q @ np.swapaxes(K, -1, -2)) * Q.dtype.type(1 / np.sqrt(Q.shape[-1]))
    if causal:
        n, m = S.shape[-2:]
        S = np.where(np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n), S, -np.inf)
    row_max = S.max(axis=-1, keepdims=True)
    P = np.exp(S - np.where(np.isneginf(row_max), 0, row_max))
    row_sum = P.sum(axis=-1, keepdims=True)
    return (P @ V) / np.where(row_sum > 0, row_sum, 1)


def _assert_fast_matches(Q, K, V, causal, where, **kw):
    """fast_forward against float64 by CONTRIBUTING.md, Correctness: the relative error (1e-12 in float64, 1e-5 in
    float32), in float32 also the max error at most twice that of naive attention in float32 (naive float64 is
    the reference itself), L as well as O, -inf rows where the reference has them, no NaN."""
    dtype = Q.dtype
    O, L = numba_cpu.fast_forward(Q, K, V, causal=causal, **kw)
    O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
    assert O.dtype == dtype and L.dtype == dtype and O.shape == O_ref.shape and L.shape == L_ref.shape, where
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert _rel(O, O_ref) <= tol, where
    if dtype == np.float32:
        naive_err = np.abs(_naive_same_precision(Q, K, V, causal) - O_ref).max()
        # The floor, 8 units in the last place of the largest output: on a few keys naive may round almost exactly.
        allowed = max(2 * naive_err, 8 * np.finfo(dtype).eps * np.abs(O_ref).max())
        assert np.abs(O - O_ref).max() <= allowed, where
    assert np.array_equal(np.isneginf(L), np.isneginf(L_ref)), where
    finite = np.isfinite(L_ref)
    np.testing.assert_allclose(L[finite], L_ref[finite], rtol=tol, atol=tol, err_msg=where)
    assert not np.isnan(O).any() and not np.isnan(L).any(), where


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blas", [True, False])
def test_fast_forward_matches_reference_random_shapes(rng, dtype, causal, blas):
    for case in range(8):
        Q, K, V = _random_case(rng, dtype)
        blocks = {} if case % 2 else {"block_q": int(rng.integers(1, 80)), "block_k": int(rng.integers(1, 160))}
        where = f"shapes {Q.shape} {K.shape} {V.shape}, {blocks or 'default blocks'}"
        _assert_fast_matches(Q, K, V, causal, where, blas=blas, **blocks)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fast_forward_edge_shapes(rng, dtype):
    # n = 1, m = 1, primes, n < a tile, m != n both ways, d_v != d, n and m past several default tiles.
    for n, m, d, dv in ((1, 1, 1, 1), (1, 7, 5, 3), (7, 1, 3, 5), (13, 257, 8, 24), (257, 131, 16, 16),
                        (600, 1031, 64, 32), (1031, 600, 32, 64)):
        Q, K, V = (rng.standard_normal(s).astype(dtype) for s in ((n, d), (m, d), (m, dv)))
        for causal in (False, True):
            _assert_fast_matches(Q, K, V, causal, f"n={n} m={m} d={d} dv={dv} causal={causal}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fast_kernel_writes_every_output(rng, dtype):
    # CONTRIBUTING.md, Correctness: outputs poisoned with NaN first, so an element the kernel forgot shows up; causal
    # with n > m leaves rows that see no key, and 37 rows in blocks of 8 leave a ragged last block.
    Q, K, V = (rng.standard_normal(s).astype(dtype) for s in ((2, 37, 8), (2, 23, 8), (2, 23, 5)))
    gemm = numba_cpu.blas_gemm(dtype) or numba_cpu._loop_gemm(dtype)
    for causal in (False, True):
        O, L = np.full((2, 37, 5), np.nan, dtype), np.full((2, 37), np.nan, dtype)
        numba_cpu._fast_kernel(gemm[0], Q, K, V, O, L, 8, 16, causal, 23 - 37, dtype(1 / np.sqrt(8)))
        assert not np.isnan(O).any() and not np.isnan(L).any()
        np.testing.assert_allclose(O, reference.attention(Q, K, V, causal=causal)[0], atol=1e-5)


def test_fast_forward_fully_masked_rows_one_row_and_huge_logits(rng):
    Q, K, V = rng.standard_normal((10, 4)), rng.standard_normal((4, 4)), rng.standard_normal((4, 3))
    O, L = numba_cpu.fast_forward(Q, K, V, block_q=3, block_k=2, causal=True)
    assert np.all(O[:6] == 0) and np.all(np.isneginf(L[:6]))  # queries 0..5 see no key when n - m = 6
    np.testing.assert_allclose(O, reference.attention(Q, K, V, causal=True)[0], atol=1e-12)

    q, k, v = (rng.standard_normal((1, 3)) for _ in range(3))
    np.testing.assert_allclose(numba_cpu.fast_forward(q, k, v)[0], v, rtol=1e-12)

    Q = 1000 * rng.standard_normal((9, 4))
    K, V = rng.standard_normal((11, 4)), rng.standard_normal((11, 4))
    for dtype in (np.float64, np.float32):
        q, k, v = (x.astype(dtype) for x in (Q, K, V))
        O, L = numba_cpu.fast_forward(q, k, v, block_q=4, block_k=3, scale=1.0)
        O_ref, L_ref = reference.attention(q, k, v, scale=1.0)
        assert np.all(np.isfinite(O)) and _rel(O, O_ref) <= (1e-12 if dtype == np.float64 else 1e-5)
        np.testing.assert_allclose(L, L_ref, rtol=1e-12 if dtype == np.float64 else 1e-6)


def test_fast_forward_equals_the_readable_kernel_and_keeps_the_leading_axes(rng):
    Q, K, V = (rng.standard_normal((2, 3, 300, 64)).astype(np.float32) for _ in range(3))
    for causal in (False, True):
        fast, readable = numba_cpu.fast_forward(Q, K, V, causal=causal), numba_cpu.tiled_forward(Q, K, V, causal=causal)
        for f, r in zip(fast, readable, strict=True):
            assert f.shape == r.shape and f.dtype == np.float32
            np.testing.assert_allclose(f, r, rtol=2e-5, atol=2e-6)


def test_a_gemm_is_checked_on_numbers_before_it_is_used():
    import ctypes

    for dtype in (np.float32, np.float64):
        assert numba_cpu._gemm_works(numba_cpu._loop_gemm(dtype)[0], np.dtype(dtype))  # the compiled stand-in
        real = ctypes.c_float if dtype == np.float32 else ctypes.c_double
        does_nothing = numba_cpu._gemm_prototype(real, ctypes.c_int64)(lambda *args: None)
        assert not numba_cpu._gemm_works(does_nothing, np.dtype(dtype))


def test_fast_forward_uses_the_blas_numpy_uses():
    # NumPy's wheels export CBLAS gemm under a name blas_gemm knows; where none is found the loops stand in.
    found = numba_cpu.blas_gemm(np.float32)
    if found is None:
        pytest.skip("this NumPy's BLAS exports no CBLAS gemm under a known name: fast_forward uses compiled loops")
    _, name = found
    assert "sgemm" in name and "dgemm" in numba_cpu.blas_gemm(np.float64)[1]


def test_fast_forward_thread_counts_give_the_same_result(rng):
    from numba import get_num_threads, set_num_threads

    Q, K, V = (rng.standard_normal((700, 32)).astype(np.float32) for _ in range(3))
    before = get_num_threads()
    results = []
    try:
        for threads in sorted({1, before}):
            set_num_threads(threads)
            results.append(numba_cpu.fast_forward(Q, K, V, block_q=64, causal=True))
    finally:
        set_num_threads(before)
    for got in results[1:]:  # a query block is one task, computed the same way whichever thread runs it
        np.testing.assert_array_equal(got[0], results[0][0])


def test_fast_block_q_gives_every_thread_work():
    assert numba_cpu.fast_block_q(1, 4096, threads=2) == 256  # 16 tasks of 256 rows
    assert numba_cpu.fast_block_q(1, 256, threads=2) == 64  # 4 tasks of 64 rows rather than 1 of 256
    assert numba_cpu.fast_block_q(1, 5, threads=8) == 32  # never below 32 rows
    assert numba_cpu.fast_block_q(64, 256, threads=8) == 256  # the batch already gives every thread work


def test_fast_forward_bad_input_is_a_clear_error():
    x = np.ones((4, 3))
    with pytest.raises(TypeError, match="float32, float64"):
        numba_cpu.fast_forward(x.astype(np.float16), x, x)
    with pytest.raises(ValueError, match="block_k"):
        numba_cpu.fast_forward(x, x, x, block_k=0)
    with pytest.raises(ValueError, match="head dimension"):
        numba_cpu.fast_forward(x, np.ones((4, 2)), x)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_fast_forward_holds_a_tenth_of_naive_attentions_memory(rng):
    from flashlab import cpu_bench

    n, d = 4096, 64
    Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
    numba_cpu.fast_forward(Q, K, V)  # compile and warm up first
    naive_peak = _peak_rss_growth(cpu_bench.naive_attention, Q, K, V)
    assert naive_peak >= 2 * n * n * 4  # the measurement sees naive's n x n float32 matrices...
    assert _peak_rss_growth(numba_cpu.fast_forward, Q, K, V) <= naive_peak / 10  # ...and a tenth of that here
    assert numba_cpu.fast_forward_workspace_bytes(n, d, d, threads=2) <= n * n * 4 / 10  # and so says the account


# ---------------------------------------------------------------------------------------- CPU benchmark
def test_cpu_bench_rows_are_checked_and_measured():
    from flashlab import cpu_bench

    rows = cpu_bench.run(sizes=(96,), repeat=1, rounds=1, verbose=False, threads=(1, 2))
    assert [(r["threads"], r["implementation"]) for r in rows] == [
        (t, name) for t in (1, 2) for name in cpu_bench.IMPLEMENTATIONS]
    for r in rows:
        assert r["rel_error_vs_float64"] <= 1e-5 and r["median_s"] > 0 and len(r["times_s"]) == 1
    naive = rows[0]
    assert naive["tracemalloc_peak_bytes"] >= 96 * 96 * 4  # the score matrix is there, and tracemalloc sees it
    for r in rows:
        if r["implementation"] in cpu_bench.NUMBA_IMPLEMENTATIONS:
            assert r["analytic_peak_bytes"] > 0 and r["numba_threads"] == r["threads"]
    table = cpu_bench.format_table(rows)
    assert "numba_fast" in table and "min-max ms" in table
    result = cpu_bench.summary(rows)
    assert result["n"] == 96 and [e["threads"] for e in result["settings"]] == [1, 2]
    for e in result["settings"]:
        by = {r["implementation"]: r for r in rows if r["threads"] == e["threads"]}
        assert e["speedup_fast_vs_naive"] == by["numpy_naive"]["median_s"] / by["numba_fast"]["median_s"]
        assert e["target_met_fast"] == (e["speedup_fast_vs_naive"] >= 2 and e["memory_ratio_fast_vs_naive"] <= 0.1)
    assert result["target_met"] == all(e["target_met_numba"] and e["target_met_fast"] for e in result["settings"])
    assert "1 thread(s)" in cpu_bench.format_summary(result)


def test_thread_setting_sets_blas_and_numba_alike_and_restores_numba():
    from numba import get_num_threads
    from threadpoolctl import threadpool_info

    from flashlab import cpu_bench

    before = get_num_threads()
    with cpu_bench.thread_setting(1):
        assert get_num_threads() == 1
        assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
    assert get_num_threads() == before
