"""The numba.cuda kernel (flashlab.numba_cuda): in the CUDA simulator (in a subprocess: the simulator is chosen once
per process), its command line, its input checks, and the same kernel on a real GPU (gpu marker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flashlab.numba_cuda import cuda_forward, run_in_simulator


def test_bad_input_is_a_clear_error():
    x = np.ones((4, 3))
    with pytest.raises(TypeError, match="block_k"):
        cuda_forward(x, x, x, block_k=2.5)
    with pytest.raises(ValueError, match="at most 1024"):
        cuda_forward(x, x, x, block_q=2048)
    most = 48 * 1024 // ((8 + 3) * 8)  # keys whose K (d = 8) and V (dv = 3) rows of float64 fit in 48 KB
    with pytest.raises(ValueError, match=rf"smaller block_k \(here at most {most}\)"):
        cuda_forward(np.ones((4, 8)), np.ones((4, 8)), x, block_k=most + 1)


def test_run_in_simulator_says_why_a_snippet_failed():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_in_simulator("print(1 / 0)", timeout=120)


def test_cuda_forward_in_simulator_matches_reference(rng):
    seed = int(rng.integers(2**31))
    res = run_in_simulator(f"""
        import json, time
        import numpy as np
        from flashlab import numba_cuda as nk, reference

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


@pytest.mark.parametrize("how", ["use_simulator", "environment"])
def test_a_simulated_block_that_raises_leaves_no_thread_running(how):
    """One thread raises while the others are still in their loop: the launch returns only once they stopped, so
    they cannot run on into the shared tiles of the next launch (which made one kernel's IndexError change the
    next one's traced result, depending on thread scheduling)."""
    code = """
        import json, threading
        import numpy as np
        from numba import cuda, float64
        from numba.cuda.simulator.kernel import BlockThread
        from flashlab import numba_cuda, racetrace

        @cuda.jit
        def kernel(out):
            tile = cuda.shared.array(8, float64)
            t = cuda.threadIdx.x
            if t == 0:
                tile[99] = 1.0  # IndexError at once
            acc = 0.0
            for i in range(20000):  # the other threads are still here when thread 0 raises
                acc += i
            cuda.syncthreads()
            out[t] = acc

        out = np.zeros(8)
        raised = False
        with racetrace.trace_shared_memory():
            try:
                kernel[1, 8](out)
            except IndexError:
                raised = True
            alive = sum(isinstance(t, BlockThread) and t.is_alive() for t in threading.enumerate())
        print(json.dumps([raised, alive]))
    """
    if how == "environment":  # the simulator chosen without use_simulator(): the trace installs the wait
        out = subprocess.run([sys.executable, "-c", __import__("textwrap").dedent(code)], capture_output=True,
                             text=True, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        raised, alive = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        raised, alive = run_in_simulator(code)
    assert raised and alive == 0, (raised, alive)


def test_use_simulator_refuses_after_a_real_import():
    code = (
        "import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None)\n"
        "from numba import cuda\n"
        "from flashlab import numba_cuda as nk\n"
        "try:\n    nk.use_simulator()\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: numba.cuda was already imported" in out.stdout, out.stderr[-2000:]


def test_command_line_check_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "flashlab.numba_cuda", "--simulator", "--n", "20", "--m", "13", "--d", "4",
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
        cmd = [sys.executable, "-m", "flashlab.numba_cuda", "--gpu", "--n", str(n), "--m", str(m), "--d", str(d),
               "--batch", str(batch), "--block-q", str(bq), "--block-k", str(bk), "--dtype", dtype]
        out = subprocess.run(cmd + (["--causal"] if causal else []), env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.stdout.strip(), out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["simulator"] is False
        assert res["o_rel_error"] <= tol and res["l_rel_error"] <= tol, res
