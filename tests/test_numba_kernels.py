"""The Numba kernels: the @njit CPU forward against the float64 reference, the numba.cuda kernel in the CUDA
simulator (in a subprocess: the simulator is chosen once per process), the shared-memory race tracer, and the
same kernel on a real GPU (gpu marker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flashlab import numba_kernels, reference, tiled


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
        O, L = numba_kernels.tiled_forward(Q, K, V, block_q=bq, block_k=bk, causal=causal)
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
        got = numba_kernels.tiled_forward(Q, K, V, block_q=16, block_k=24, causal=causal)
        want = tiled.forward(Q, K, V, block_q=16, block_k=24, causal=causal)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)


def test_fully_masked_rows_one_row_and_huge_logits(rng):
    Q, K, V = rng.standard_normal((10, 4)), rng.standard_normal((4, 4)), rng.standard_normal((4, 3))
    O, L = numba_kernels.tiled_forward(Q, K, V, block_q=3, block_k=2, causal=True)
    assert np.all(O[:6] == 0) and np.all(np.isneginf(L[:6]))  # queries 0..5 see no key when n - m = 6
    O_ref, L_ref = reference.attention(Q, K, V, causal=True)
    np.testing.assert_allclose(O, O_ref, atol=1e-12)
    np.testing.assert_allclose(L[6:], L_ref[6:], rtol=1e-12)

    q, k, v = (rng.standard_normal((1, 3)) for _ in range(3))
    np.testing.assert_allclose(numba_kernels.tiled_forward(q, k, v)[0], v, rtol=1e-12)

    Q = 1000 * rng.standard_normal((9, 4))
    K, V = rng.standard_normal((11, 4)), rng.standard_normal((11, 4))
    for dtype in (np.float64, np.float32):
        O, L = numba_kernels.tiled_forward(*(x.astype(dtype) for x in (Q, K, V)), block_q=4, block_k=3, scale=1.0)
        O_ref, L_ref = reference.attention(Q.astype(dtype), K.astype(dtype), V.astype(dtype), scale=1.0)
        assert np.all(np.isfinite(O)) and _rel(O, O_ref) <= (1e-12 if dtype == np.float64 else 1e-5)
        np.testing.assert_allclose(L, L_ref, rtol=1e-12 if dtype == np.float64 else 1e-6)


def test_float32_at_a_realistic_size(rng):
    Q, K, V = (rng.standard_normal((2, 700, 64)) for _ in range(3))
    O_ref, L_ref = reference.attention(Q, K, V, causal=True)
    O, L = numba_kernels.tiled_forward(*(x.astype(np.float32) for x in (Q, K, V)), causal=True)
    assert _rel(O, O_ref) <= 1e-5 and _rel(L, L_ref) <= 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_exp_is_as_accurate_as_numpy(dtype):
    from numba import njit

    @njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = numba_kernels.exp_nonpositive(x[i])
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
        numba_kernels.tiled_forward(x.astype(int), x, x)
    with pytest.raises(TypeError, match="float32, float64"):
        numba_kernels.tiled_forward(x.astype(np.float16), x, x)
    with pytest.raises(ValueError, match="block_q"):
        numba_kernels.tiled_forward(x, x, x, block_q=0)
    with pytest.raises(ValueError, match="head dimension"):
        numba_kernels.tiled_forward(x, np.ones((4, 2)), x)
    with pytest.raises(TypeError, match="block_k"):
        numba_kernels.cuda_forward(x, x, x, block_k=2.5)


def test_compiles_without_a_writable_cache():
    # A function numba cannot cache (no source file: like a read-only install with no writable home) still
    # compiles, uncached, instead of failing at import.
    from numba import njit

    ns: dict = {}
    exec("def add_one(x):\n    return x + 1", ns)
    with pytest.raises(RuntimeError, match="cannot cache"):
        njit(cache=True)(ns["add_one"])
    assert numba_kernels._njit()(ns["add_one"])(41) == 42


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

    numba_kernels.tiled_forward(Q, K, V)  # compile and warm up first
    s_bytes = n * n * 4
    assert _peak_rss_growth(naive, Q, K, V) >= s_bytes  # the measurement sees an n x n float32 matrix...
    assert _peak_rss_growth(numba_kernels.tiled_forward, Q, K, V) <= s_bytes / 10  # ...and none here


def test_workspace_account_is_small():
    est = numba_kernels.tiled_forward_workspace_bytes(4096, 64, 64, threads=2)
    assert 4096 * 65 * 4 < est < 4096 * 4096 * 4 / 10


# --------------------------------------------------------------------------- numba.cuda kernel in the simulator
def _in_simulator(code: str, timeout: float = 300, seed: int = 0) -> dict:
    """Run ``code`` in a fresh Python with the CUDA simulator on (``SEED`` = seed); it must print one JSON line last."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = "import json, time\nimport numpy as np\nfrom flashlab import numba_kernels as nk, reference\n"
    script += f"SEED = {seed}\n"
    script += "nk.use_simulator()\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cuda_forward_in_simulator_matches_reference(rng):
    seed = int(rng.integers(2**31))
    res = _in_simulator(f"""
        rng = np.random.default_rng({seed})
        cases = [(1, 1, 1, 1, 1, 4, 4, False, "float64")]  # one query, one key
        cases.append((1, 7, 3, 4, 2, 4, 2, True, "float64"))  # causal with n > m: fully masked rows
        for _ in range(5):
            batch = int(rng.integers(1, 3))
            n, m = (int(x) for x in rng.integers(1, 45, size=2))
            d, dv = (int(x) for x in rng.integers(1, 9, size=2))
            bq, bk = (int(x) for x in rng.choice([4, 8, 16, 32], size=2))
            cases.append((batch, n, m, d, dv, bq, bk, bool(rng.integers(2)), str(rng.choice(["float32", "float64"]))))
        report = []
        for batch, n, m, d, dv, bq, bk, causal, dtype in cases:
            Q = rng.standard_normal((batch, n, d)).astype(dtype)
            K = rng.standard_normal((batch, m, d)).astype(dtype)
            V = rng.standard_normal((batch, m, dv)).astype(dtype)
            t0 = time.perf_counter()
            O, L = nk.cuda_forward(Q, K, V, block_q=bq, block_k=bk, causal=causal)
            seconds = time.perf_counter() - t0
            O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
            fin = np.isfinite(L_ref)
            report.append(dict(case=[batch, n, m, d, dv, bq, bk, causal, dtype], seconds=seconds,
                               o_err=float(np.abs(O - O_ref).max()),
                               l_err=float(np.abs(L[fin] - L_ref[fin]).max()) if fin.any() else 0.0,
                               masked_ok=bool(np.array_equal(np.isneginf(L), ~fin)), dtype=str(O.dtype)))
        print(json.dumps(report))
    """)
    for r in res:
        tol = 1e-12 if r["case"][-1] == "float64" else 2e-6
        assert r["o_err"] <= tol and r["l_err"] <= tol and r["masked_ok"], r
        assert r["dtype"] == r["case"][-1]
        assert r["seconds"] < 10, f"simulated run too slow for CI: {r}"


def test_tracer_finds_missing_barriers_and_none_in_the_kernel():
    res = _in_simulator("""
        from numba import cuda, float64
        BQ, BK, D = 8, 8, 4

        def make(first_barrier, second_barrier):
            @cuda.jit
            def kern(Q, K, V, O, L, n, m, scale, causal):
                t = cuda.threadIdx.x
                row = cuda.blockIdx.x * BQ + t
                tile = cuda.shared.array((BK, D), float64)
                acc = 0.0
                for k0 in range(0, m, BK):
                    for e in range(t, BK * D, BQ):
                        tile[e // D, e % D] = K[0, k0 + e // D, e % D] if k0 + e // D < m else 0
                    if first_barrier:
                        cuda.syncthreads()
                    for j in range(min(BK, m - k0)):
                        acc += tile[j, 0]
                    if second_barrier:
                        cuda.syncthreads()
                if row < n:
                    L[0, row] = acc
            return kern

        rng = np.random.default_rng(0)
        Q, K, V = (rng.standard_normal((1, 20, D)) for _ in range(3))
        out = {}
        for name, flags in {"both": (True, True), "no_first": (False, True), "no_second": (True, False),
                            "none": (False, False)}.items():
            counts = []
            for _ in range(3):  # the verdict must not depend on how the simulator scheduled the threads
                with nk.trace_shared_memory() as trace:
                    nk.launch(make(*flags), Q, K, V, block_q=BQ)
                counts.append(len(trace.races))
            out[name] = counts
        errors = []
        for _ in range(4):  # tracing must not change what the kernel computes
            with nk.trace_shared_memory(keep_accesses=True) as trace:
                O, _ = nk.cuda_forward(Q, K, V, block_q=8, block_k=8)
            errors.append(float(np.abs(O - reference.attention(Q, K, V)[0]).max()))
        out["kernel"] = [len(trace.races), sorted(trace.shapes.values()), len(trace.accesses), max(errors)]
        out["first_race"] = str(trace.races[0]) if trace.races else ""
        print(json.dumps(out))
    """)
    assert res["both"] == [0, 0, 0]
    for name in ("no_first", "no_second", "none"):
        assert all(c > 0 for c in res[name]), (name, res[name])
    races, shapes, accesses, error = res["kernel"]
    assert races == 0 and shapes == [[8, 4], [8, 4]] and accesses > 0 and error < 1e-12


def test_use_simulator_refuses_after_a_real_import():
    code = (
        "import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None)\n"
        "from numba import cuda\n"
        "from flashlab import numba_kernels as nk\n"
        "try:\n    nk.use_simulator()\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: numba.cuda was already imported" in out.stdout, out.stderr[-2000:]


def test_command_line_check_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "flashlab.numba_kernels", "--simulator", "--n", "20", "--m", "13", "--d", "4",
           "--block-q", "8", "--block-k", "4", "--causal", "--dtype", "float64"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["simulator"] and res["o_rel_error"] <= 1e-12 and res["l_rel_error"] <= 1e-12


# ---------------------------------------------------------------------------------------------- real GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_on_gpu_matches_reference(dtype, causal):
    # A subprocess with the simulator explicitly off: this test must run on the device, whatever this process did.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    tol = 1e-5 if dtype == "float32" else 1e-12
    for n, m, d, batch, bq, bk in ((1000, 777, 64, 6, 32, 32), (129, 300, 40, 2, 64, 16), (1, 1, 8, 1, 32, 32)):
        cmd = [sys.executable, "-m", "flashlab.numba_kernels", "--gpu", "--n", str(n), "--m", str(m), "--d", str(d),
               "--batch", str(batch), "--block-q", str(bq), "--block-k", str(bk), "--dtype", dtype]
        out = subprocess.run(cmd + (["--causal"] if causal else []), env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.stdout.strip(), out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["simulator"] is False
        assert res["o_rel_error"] <= tol and res["l_rel_error"] <= tol, res


# ---------------------------------------------------------------------------------- lab 05's diagnoses
def test_lab05_names_each_classic_kernel_mistake(rng):
    """Variants of the solution's kernel, each with one classic mistake, graded by lab 05 in the simulator."""
    res = _in_simulator(seed=int(rng.integers(2**31)), code="""
        import math
        import nbformat
        from numba import cuda, float64
        from flashlab.grading import run_question

        nb = nbformat.read("solutions/lab05_numba_cuda.ipynb", as_version=4)
        sources = {c.source.split("(")[0]: c.source for c in nb.cells if c.cell_type == "code"}
        kernel_src = "\\n".join(x for x in sources["def make_kernel"].splitlines() if "### " not in x)
        launch_src = "\\n".join(x for x in sources["def run_kernel"].splitlines() if "### " not in x)
        first = "cuda.syncthreads()                           # the tile is complete"
        second = "cuda.syncthreads()                           # everyone is done"
        guard = "if k0 + j < m else 0.0"
        variants = {
            "solution": kernel_src,
            "no_first_barrier": kernel_src.replace(first, "pass  #"),
            "no_second_barrier": kernel_src.replace(second, "pass  #"),
            "unguarded_load": kernel_src.replace(guard, "if True else 0.0"),
            "whole_last_tile": kernel_src.replace("range(min(BLOCK_K, m - k0))", "range(BLOCK_K)"),
            "tile_block_q": kernel_src.replace("shared.array((BLOCK_K, D)", "shared.array((BLOCK_Q, D)"),
        }
        out = {}
        for name, src in variants.items():
            assert name == "solution" or src != kernel_src, name
            ns = {"cuda": cuda, "float64": float64, "math": math, "np": np}
            exec(compile(src, name, "exec"), ns)
            r = run_question("lab05", "q1", [ns["make_kernel"]], seed=SEED)
            out[name] = [r.score, r.max_score, r.feedback]
        for name, src in {"launch": launch_src, "floor_grid": launch_src.replace("(n + BLOCK_Q - 1)", "n")}.items():
            ns = {"cuda": cuda, "math": math, "np": np}
            exec(compile(src, name, "exec"), ns)
            r = run_question("lab05", "q2", [ns["run_kernel"]], seed=SEED)
            out[name] = [r.score, r.max_score, r.feedback]
        print(json.dumps(out))
    """)
    assert res["solution"][0] == res["solution"][1] == 6, res["solution"][2]
    assert res["launch"][0] == res["launch"][1] == 2, res["launch"][2]
    for name in ("no_first_barrier", "no_second_barrier"):
        score, _, feedback = res[name]
        assert score <= 1 and "missing barrier" in feedback, (name, feedback)
        assert "[FAIL] no data races" in feedback
    for name in ("unguarded_load", "whole_last_tile"):
        score, _, feedback = res[name]
        assert score < 6 and ("ragged tile" in feedback), (name, feedback)
    score, _, feedback = res["tile_block_q"]
    assert score < 6 and "shared tile of the wrong size" in feedback, feedback
    score, _, feedback = res["floor_grid"]
    assert score == 0 and "last ragged block of queries" in feedback, feedback


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

