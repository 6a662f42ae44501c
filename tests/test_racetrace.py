"""The shared-memory race tracer (flashlab.racetrace) in the CUDA simulator, in a subprocess (the simulator is
chosen once per process): it finds a missing barrier whatever the thread order, none in the course's kernel, and
lab 05's grader names each classic kernel mistake with it."""

from __future__ import annotations

import pathlib
import textwrap

from flashlab.numba_cuda import run_in_simulator

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tracer_finds_missing_barriers_and_none_in_the_kernel():
    res = run_in_simulator("""
        import json
        import numpy as np
        from numba import cuda, float64
        from flashlab import numba_cuda as nk, reference
        from flashlab.racetrace import trace_shared_memory
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
                with trace_shared_memory() as trace:
                    nk.launch(make(*flags), Q, K, V, block_q=BQ)
                told = sorted({r.missing for r in trace.races if r.certain})
                counts.append([len(trace.races), told])
            out[name] = counts
        errors = []
        for _ in range(4):  # tracing must not change what the kernel computes
            with trace_shared_memory(keep_accesses=True) as trace:
                O, _ = nk.cuda_forward(Q, K, V, block_q=8, block_k=8)
            errors.append(float(np.abs(O - reference.attention(Q, K, V)[0]).max()))
        out["kernel"] = [len(trace.races), sorted(trace.shapes.values()), len(trace.accesses), max(errors)]
        out["first_race"] = str(trace.races[0]) if trace.races else ""
        print(json.dumps(out))
    """)
    assert res["both"] == [[0, []]] * 3
    for name in ("no_first", "no_second", "none"):
        assert all(c > 0 for c, _ in res[name]), (name, res[name])
    # which barrier is missing, from the threads' own order: the same on every run
    assert [told for _, told in res["no_first"]] == [["after loading"]] * 3, res["no_first"]
    assert [told for _, told in res["no_second"]] == [["after using"]] * 3, res["no_second"]
    races, shapes, accesses, error = res["kernel"]
    assert races == 0 and shapes == [[8, 4], [8, 4]] and accesses > 0 and error < 1e-12


# ---------------------------------------------------------------------------------- lab 05's diagnoses
def test_lab05_names_each_classic_kernel_mistake(rng):
    """Variants of the solution's kernel, each with one classic mistake, graded by lab 05 in the simulator."""
    code = textwrap.dedent("""
        import json
        import math
        import numpy as np
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
        # the tiles and barriers of the solution, and nothing computed: O left as the launcher filled it, or zeros
        hollow = [
            "def make_kernel(BLOCK_Q, BLOCK_K, D, DV):",
            "    @cuda.jit",
            "    def kernel(Q, K, V, O, L, n, m, scale, causal):",
            "        Ks = cuda.shared.array((BLOCK_K, D), float64)",
            "        Vs = cuda.shared.array((BLOCK_K, DV), float64)",
            "        t = cuda.threadIdx.x",
            "        for k0 in range(0, m, BLOCK_K):",
            "            cuda.syncthreads()",
            "        ZERO",
            "    return kernel",
        ]
        zeros = ["b = cuda.blockIdx.y", "        i = cuda.blockIdx.x * BLOCK_Q + t", "        if i < n:",
                 "            for c in range(DV):", "                O[b, i, c] = 0.0", "            L[b, i] = 0.0"]
        variants["hollow"] = chr(10).join(hollow).replace("ZERO", "pass")
        variants["hollow_zeros"] = chr(10).join(hollow).replace("ZERO", chr(10).join(zeros))
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
    res = run_in_simulator(f"SEED = {int(rng.integers(2**31))}\n{code}", cwd=ROOT)
    assert res["solution"][0] == res["solution"][1] == 6, res["solution"][2]
    assert res["launch"][0] == res["launch"][1] == 2, res["launch"][2]
    for name, which, other in (("no_first_barrier", "after loading", "after using"),
                               ("no_second_barrier", "after using", "after loading")):
        score, _, feedback = res[name]
        assert score <= 1 and f"missing barrier {which}" in feedback, (name, feedback)
        assert f"missing barrier {other}" not in feedback, (name, feedback)
        assert "[FAIL] no data races" in feedback
    for name in ("unguarded_load", "whole_last_tile"):
        score, _, feedback = res[name]
        assert score < 6 and ("ragged tile" in feedback), (name, feedback)
    for name in ("hollow", "hollow_zeros"):
        score, _, feedback = res[name]
        assert score == 0 and "structure not credited" in feedback, (name, feedback)
    score, _, feedback = res["tile_block_q"]
    assert score < 6 and "shared tile of the wrong size" in feedback, feedback
    score, _, feedback = res["floor_grid"]
    assert score == 0 and "last ragged block of queries" in feedback, feedback
