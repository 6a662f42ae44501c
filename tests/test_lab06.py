"""Lab 06 (the online-softmax update in a CUDA kernel): compile-only grading with nvcc, the stub, the notebook's
kernel against the grader's template, q2's scoring and diagnoses on a float32 NumPy emulation of the kernel (CPU),
and on a GPU the real thing: the solution scores full marks and every CUDA mutant is diagnosed.

The GPU tests read the solution's CUDA source from the notebook's JSON (no Jupyter needed):
``python3 -m pytest -q -m gpu tests/test_lab06.py``.
"""

from __future__ import annotations

import ast
import json
import math
import pathlib
import shutil
import sys
import types

import numpy as np
import pytest

from flashlab import hostcuda, reference
from flashlab.grading import get_lab, lab06, run_question, sandbox
from flashlab.grading.core import Trial, mistake_title

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "lab06_cuda_online_softmax.ipynb"
RELEASED = ROOT / "labs" / "lab06_cuda_online_softmax.ipynb"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")


def kernel_of(path: pathlib.Path) -> str:
    """The value of ``KERNEL = r\"\"\"...\"\"\"`` in a lab notebook, read from its JSON (no nbformat, no Jupyter)."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if source.startswith("KERNEL ="):
            (assign,) = ast.parse(source).body
            return ast.literal_eval(assign.value)
    raise AssertionError(f"{path.name}: no cell assigns KERNEL")


# --------------------------------------------------------------------------------- the notebook and the stub
def test_the_notebooks_kernel_is_the_graders_template_with_the_solution():
    kernel = kernel_of(SOLUTION)
    without_markers = "\n".join(line for line in kernel.split("\n") if not line.strip().startswith("### "))
    assert without_markers == lab06.render(lab06.SOLUTION)  # the mutants are mutations of this very kernel
    # marker lines become blank lines, so compiler line numbers still count from the cell's first line
    assert lab06.clean_source(kernel).count("\n") == kernel.count("\n")


def test_marker_lines_match_the_release_step():
    from flashlab.grading import release

    assert lab06.MARKER_LINES == (release.BEGIN, release.END, release.STUB[0])


def test_the_released_stub_is_not_implemented_yet():
    stub = kernel_of(RELEASED)
    assert "raise NotImplementedError" in stub
    with pytest.raises(NotImplementedError):
        lab06.clean_source(stub)
    for q in ("q1", "q2"):
        r = run_question("lab06", q, [stub])
        assert r.score == 0 and "not implemented yet" in r.feedback


def test_kernel_must_be_a_string():
    r = run_question("lab06", "q1", [42])
    assert r.score == 0 and "KERNEL must be a str" in r.feedback


# ------------------------------------------------------------------------------------ compile-only (nvcc, CPU)
@needs_nvcc
def test_solution_compiles_and_scores_q1():
    r = run_question("lab06", "q1", [kernel_of(SOLUTION)])
    assert r.max_score == lab06.Q1_POINTS and r.score == r.max_score, r.feedback


@needs_nvcc
def test_a_compile_error_scores_zero_and_names_the_line(monkeypatch):
    monkeypatch.setattr(lab06, "_has_gpu", lambda: False)  # the nvcc path, also on a GPU machine
    kernel = kernel_of(SOLUTION)
    broken = kernel.replace("mx = mnew;", "mx = mnew_typo;", 1)  # inside the student's region
    line = next(i for i, text in enumerate(broken.split("\n"), start=1) if "mnew_typo" in text)
    r = run_question("lab06", "q1", [broken])
    assert r.score == 0 and "does not compile" in r.feedback and "mnew_typo" in r.feedback, r.feedback
    # the line number is the cell's: KERNEL = r"""... starts on the cell's first line, marker lines stay blank
    assert f"kernel.cu({line}): error" in r.feedback, (line, r.feedback)
    assert ("q2 runs the kernel on the CPU" if lab06._host_cc() else "q2: 5 points need a GPU") in r.feedback
    missing_semicolon = run_question("lab06", "q1", [kernel.replace("mx = mnew;", "mx = mnew", 1)])
    assert missing_semicolon.score == 0 and "does not compile" in missing_semicolon.feedback


@needs_nvcc
def test_a_missing_entry_point_scores_zero(monkeypatch):
    monkeypatch.setattr(lab06, "_has_gpu", lambda: False)
    renamed = kernel_of(SOLUTION).replace("attn_lab_d32(", "attn_lab_d33(")
    r = run_question("lab06", "q1", [renamed])
    assert r.score == 0 and "missing: attn_lab_d32" in r.feedback, r.feedback


@needs_nvcc
def test_every_mutant_compiles_without_spills():
    ok, log, usage = lab06.nvcc_compile(lab06.mutant_source())
    assert ok, log
    names = {u["kernel"] for u in usage}
    assert names == {f"attn_{mu.tag}_d{d}" for mu in lab06.MUTANTS for d in lab06.HEAD_DIMS}
    assert all(u["spill_store_bytes"] == 0 for u in usage), usage


@needs_nvcc
def test_compile_report_gives_registers_per_kernel():
    report = lab06.compile_report(kernel_of(SOLUTION))
    assert {r["kernel"] for r in report} == set(lab06.ENTRY_POINTS)
    assert all(r["registers"] > 0 for r in report)


@pytest.fixture
def no_gxx(monkeypatch):
    """A machine without g++ (and without a GPU): shutil.which finds no compiler for flashlab.hostcuda."""
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "g++" else which(name, *a, **k))
    monkeypatch.setattr(lab06, "_has_gpu", lambda: False)
    hostcuda.compiler_problem.cache_clear()
    yield
    hostcuda.compiler_problem.cache_clear()


def test_without_gpu_nvcc_and_gxx_nothing_is_graded_and_nothing_crashes(monkeypatch, no_gxx):
    monkeypatch.setattr(lab06, "_nvcc", lambda: None)
    for q in ("q1", "q2"):
        r = run_question("lab06", q, [kernel_of(SOLUTION)])
        assert r.score == 0 and "not graded here" in r.feedback, r.feedback
        assert "q2: 5 points need a GPU or a C++ compiler (g++)" in r.feedback, r.feedback
    assert "q1: 1 point needs a GPU, nvcc or a C++ compiler (g++)" in lab06.machine()
    assert "q2: 5 points need a GPU or a C++ compiler (g++)" in lab06.machine()
    assert lab06.compile_report(kernel_of(SOLUTION)) is None
    with pytest.raises(RuntimeError, match="neither is here"):
        lab06.attention(kernel_of(SOLUTION), *np.ones((3, 2, 16), np.float32))


def test_without_gpu_and_gxx_q2_says_which_points_need_what(no_gxx):
    r = run_question("lab06", "q2", [kernel_of(SOLUTION)])
    assert r.score == 0 and r.feedback == "q2: 5 points need a GPU or a C++ compiler (g++); not graded here."
    if shutil.which("nvcc"):
        assert "q2: 5 points need a GPU or a C++ compiler (g++)" in run_question("lab06", "q1", [kernel_of(SOLUTION)]
                                                                                 ).feedback


def test_max_score_counts_only_what_this_machine_can_grade():
    lab = get_lab("lab06")
    gpu, nvcc, gxx = lab06._has_gpu(), shutil.which("nvcc") is not None, hostcuda.compiler_problem() is None
    expected = (lab06.Q1_POINTS if (gpu or nvcc or gxx) else 0) + (lab06.Q2_POINTS if (gpu or gxx) else 0)
    assert lab.max_score == expected
    assert lab06.NEEDS_GPU == (not (gpu or gxx))  # flashlab.mistakes runs the mistakes where q2 can run


# --------------------------------------------------------------- q2 on a float32 emulation of the kernel (CPU)
# How each variant's loop body differs from the solution's, statement by statement (see lab06.MUTANTS).
SPECS: dict[str, dict[str, str]] = {
    "solution": {},
    "no_rescale": {"l": "plain", "acc": "plain"},
    "no_rescale_acc": {"acc": "plain"},
    "no_rescale_l": {"l": "plain"},
    "flipped": {"corr": "flipped"},
    "no_max": {"p": "raw", "l": "plain", "acc": "plain"},
    "no_max_at_all": {"guard": "none", "p": "raw", "l": "plain", "acc": "plain", "mx": "keep"},
    "unguarded": {"guard": "none"},
    "divide_in_loop": {"acc": "divide_all"},
    "divide_in_loop_only_new": {"acc": "divide_new"},
    "v_for_vj": {"acc": "v0"},
    "k_for_vj": {"acc": "k"},
    "unweighted_value": {"acc": "unweighted"},
    "short_value_loop": {"acc": "short"},
    "mx_not_updated": {"mx": "keep"},
    "mx_is_s": {"mx": "s"},
    "p_old_max": {"p": "old"},
    "p_without_max": {"p": "raw"},
    "rescaled_after_adding": {"l": "after", "acc": "after"},
    "ratio_of_exps": {"corr": "ratio", "p": "ratio"},
    "scaled_twice": {"scale": "twice"},
    "guard_on_mx": {"guard": "mx"},
    "guard_returns": {"guard": "return"},
    "masked_again": {"guard": "top_left"},
}


def _acc_step(kind: str, acc, l, l2, corr, p, vj, kj, v00):
    """acc after one key, as the variant's value loop computes it."""
    c, pc = corr[..., None], p[..., None]
    if kind == "plain":
        return acc + pc * vj
    if kind == "after":
        return (acc + pc * vj) * c
    if kind == "divide_all":
        return (acc * (l * corr)[..., None] + pc * vj) / l2[..., None]
    if kind == "divide_new":
        return (acc * c + pc * vj) / l2[..., None]
    if kind == "unweighted":
        return acc * c + vj
    new = acc * c + pc * {"rescale": vj, "short": vj, "v0": v00, "k": kj}[kind]
    return np.concatenate([new[..., :-1], acc[..., -1:]], axis=-1) if kind == "short" else new


def emulate(variant: str, case: lab06.Case) -> tuple[np.ndarray, np.ndarray]:
    """What TEMPLATE computes with the update ``variant`` ("solution" or a mutant's tag), in float32 NumPy.

    All rows at once, key by key, with the same formulas (fmaxf ignores NaN like np.fmax)."""
    spec = {"guard": "skip", "corr": "rescale", "p": "shifted", "l": "rescale", "acc": "rescale", "mx": "mnew",
            "scale": "once", **SPECS[variant]}
    q, k, v = case.q, case.k, case.v
    B, n, m, d = case.shape
    S = (np.einsum("bnd,bmd->bnm", q.astype(np.float64), k.astype(np.float64)).astype(np.float32)
         * np.float32(case.scale))
    hidden = np.arange(m)[None, None, :] > np.arange(n)[None, :, None] + (m - n)
    if case.causal:
        S = np.where(hidden, np.float32(-np.inf), S)
    if spec["scale"] == "twice":
        S = S * np.float32(case.scale)
    mx = np.full((B, n), -np.inf, np.float32)
    l = np.zeros((B, n), np.float32)
    acc = np.zeros((B, n, d), np.float32)
    alive = np.ones((B, n), dtype=bool)  # rows whose thread has not returned
    with np.errstate(all="ignore"):
        for j in range(m):
            s, vj = S[:, :, j], v[:, None, j, :]
            mnew = np.fmax(mx, s)
            corr = (np.exp(mnew - mx) if spec["corr"] == "flipped" else np.exp(mx) / np.exp(mnew)
                    if spec["corr"] == "ratio" else np.exp(mx - mnew))
            p = (np.exp(s) if spec["p"] == "raw" else np.exp(s - mx) if spec["p"] == "old"
                 else np.exp(s) / np.exp(mnew) if spec["p"] == "ratio" else np.exp(s - mnew))
            l2 = l + p if spec["l"] == "plain" else (l + p) * corr if spec["l"] == "after" else l * corr + p
            acc2 = _acc_step(spec["acc"], acc, l, l2, corr, p, vj, k[:, None, j, :], v[0, 0])
            mx2 = {"mnew": mnew, "keep": mx, "s": s}[spec["mx"]]
            masked = s == -np.inf
            if spec["guard"] == "return":
                alive &= ~masked
            keep = {"skip": ~masked, "none": np.ones_like(masked), "mx": mx != -np.inf, "return": alive,
                    "top_left": ~masked & ~(case.causal & (np.arange(n)[None, :] < j))}[spec["guard"]]
            l = np.where(keep, l2, l).astype(np.float32)
            acc = np.where(keep[..., None], acc2, acc).astype(np.float32)
            mx = np.where(keep, mx2, mx).astype(np.float32)
        inv = np.where(l > 0, np.float32(1) / np.where(l > 0, l, 1), 0).astype(np.float32)
        O = acc * inv[..., None]
        L = np.where(l > 0, mx + np.log(np.where(l > 0, l, 1)), -np.inf).astype(np.float32)
    # A thread that returned never wrote its row: the NaN the outputs were filled with stays.
    return np.where(alive[..., None], O, np.nan).astype(np.float32), np.where(alive, L, np.nan).astype(np.float32)


def _key(source: str) -> str:
    return "\n".join(line for line in source.split("\n") if line.strip())  # marker lines are blanked when graded


VARIANTS = {_key(lab06.render(lab06.SOLUTION)): "solution",
            **{_key(lab06.render(mu.update)): mu.tag for mu in lab06.MUTANTS}}


@pytest.fixture
def emulated_gpu(monkeypatch):
    """Pretend there is a GPU: q2 runs the emulation of whichever variant the source is."""
    monkeypatch.setattr(lab06, "_has_gpu", lambda: True)
    monkeypatch.setattr(lab06, "_cupy_compile", lambda source, names: None)

    def runner(source):
        student = VARIANTS[_key(source)]

        def run(prefix, case):
            return emulate(student if prefix == "attn_lab" else prefix[len("attn_"):], case)

        return run

    monkeypatch.setattr(lab06, "_gpu_runner", runner)
    monkeypatch.setattr(get_lab("lab06").questions["q2"], "points", float(lab06.Q2_POINTS))


def test_emulated_solution_scores_full_marks(emulated_gpu):
    r = run_question("lab06", "q2", [kernel_of(SOLUTION)], time_limit=None)
    assert r.score == r.max_score == lab06.Q2_POINTS, r.feedback


@pytest.mark.parametrize("mutant", lab06.MUTANTS, ids=lambda mu: mu.tag)
def test_emulated_mutant_is_diagnosed(emulated_gpu, mutant):
    r = run_question("lab06", "q2", [lab06.render(mutant.update)], time_limit=None)
    assert r.score < r.max_score, r.feedback
    assert f"Likely mistake (all failing inputs match it): {mutant.message}" in r.feedback, r.feedback


def test_only_keyless_rows_fail_without_the_guard(emulated_gpu):
    unguarded = next(mu for mu in lab06.MUTANTS if mu.tag == "unguarded")
    r = run_question("lab06", "q2", [lab06.render(unguarded.update)], time_limit=None)
    assert "[ok  ] random shapes" in r.feedback and "[FAIL] causal" in r.feedback, r.feedback


def test_the_emulated_solution_is_within_the_fp32_tolerance_by_a_margin(rng):
    """The rule (1e-5) is not borderline for a correct fp32 kernel: the emulation stays 10x below it."""
    t = Trial(int(rng.integers(2**31)))
    for cases in lab06.random_cases(t).values():
        for case in cases:
            e = lab06._errors_of(emulate("solution", case), lab06._reference(case))
            assert e["err_O"] < lab06.TOLERANCE / 10 and e["err_L"] < lab06.TOLERANCE / 10, (case.label, e)


class _StandInKernel:
    """Checks the launch the way the CUDA kernel reads it, then computes the emulation into the outputs."""

    def __init__(self, source: str, name: str) -> None:
        self.source, self.name = source, name

    def __call__(self, grid, block, args):
        q, k, v, o, lse, n, m, scale, causal = args
        assert [type(x) for x in (n, m, scale, causal)] == [np.int32, np.int32, np.float32, np.int32]
        assert grid == (math.ceil(int(n) / lab06.THREADS), q.shape[0]) and block == (lab06.THREADS,)
        assert all(x.dtype == np.float32 and x.flags.c_contiguous for x in (q, k, v, o, lse))
        assert np.isnan(o).all() and np.isnan(lse).all()  # poisoned before every launch
        prefix, d = self.name.rsplit("_d", 1)
        assert int(d) == q.shape[2] == k.shape[2] and (q.shape[1], k.shape[1]) == (n, m)
        variant = VARIANTS[_key(self.source)] if prefix == "attn_lab" else prefix[len("attn_"):]
        o[...], lse[...] = emulate(variant, lab06.Case(q, k, v, bool(causal), float(scale), ""))


class _StandInModule:
    def __init__(self, code: str, options=()) -> None:
        assert options == ("--std=c++17",)
        self.code = code

    def get_function(self, name: str):
        if f"\n{name}(" not in self.code:
            raise RuntimeError("CUDA_ERROR_NOT_FOUND: named symbol not found")
        return _StandInKernel(self.code, name)


@pytest.fixture
def stand_in_cupy(monkeypatch):
    """A CuPy whose kernels run the emulation: the GPU path's Python (compile, launch, poison, diagnose) on CPU."""
    cupy = types.ModuleType("cupy")
    cupy.RawModule, cupy.float32, cupy.nan = _StandInModule, np.float32, np.nan
    cupy.asarray = lambda x, dtype=None: np.asarray(x, dtype=dtype)
    cupy.ascontiguousarray, cupy.full, cupy.asnumpy = np.ascontiguousarray, np.full, np.array
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(lab06, "_has_gpu", lambda: True)
    monkeypatch.setattr(get_lab("lab06").questions["q2"], "points", float(lab06.Q2_POINTS))
    lab06._module.cache_clear()
    yield
    lab06._module.cache_clear()  # never leave stand-in modules in the cache


def test_gpu_path_on_a_stand_in_cupy(stand_in_cupy):
    kernel = kernel_of(SOLUTION)
    assert run_question("lab06", "q1", [kernel]).score == lab06.Q1_POINTS
    r = run_question("lab06", "q2", [kernel], time_limit=None)
    assert r.score == lab06.Q2_POINTS, r.feedback
    no_rescale = next(mu for mu in lab06.MUTANTS if mu.tag == "no_rescale")
    r = run_question("lab06", "q2", [lab06.render(no_rescale.update)], time_limit=None)
    assert r.score == 0 and no_rescale.message in r.feedback, r.feedback
    r = run_question("lab06", "q1", [kernel.replace("attn_lab_d32(", "attn_lab_d33(")])
    assert r.score == 0 and "missing: attn_lab_d32" in r.feedback, r.feedback
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal(s).astype(np.float32) for s in ((130, 32), (77, 32), (77, 32)))
    O, L = lab06.attention(kernel, Q.T.copy().T, K, V, causal=True)  # a non-contiguous Q is copied
    assert O.shape == (130, 32) and np.isneginf(L[:53]).all() and (O[:53] == 0).all()
    with pytest.raises(ValueError, match="d must be one of"):
        lab06.attention(kernel, Q[:, :30], K[:, :30], V[:, :30])


# ------------------------------------------------------------------------ on the CPU: the kernel compiled by g++
needs_gxx = pytest.mark.skipif(hostcuda.compiler_problem() is not None,
                               reason=f"no host compiler for CUDA here: {hostcuda.compiler_problem()}")
HOSTILE_SPOT = "if (s == NEG_INF) continue;"  # a line of the solution's loop body


@pytest.fixture
def cpu(monkeypatch):
    """This machine without a GPU and without nvcc: q1 compiles with g++, q2 runs the kernel on the CPU."""
    monkeypatch.setattr(lab06, "_has_gpu", lambda: False)
    monkeypatch.setattr(lab06, "_nvcc", lambda: None)
    for name, points in (("q1", lab06.Q1_POINTS), ("q2", lab06.Q2_POINTS)):
        monkeypatch.setattr(get_lab("lab06").questions[name], "points", float(points))


def _hostile(edit: str) -> str:
    """The solution's kernel with ``edit`` (C statements) inserted at the top of its loop body."""
    kernel = kernel_of(SOLUTION)
    assert HOSTILE_SPOT in kernel
    return kernel.replace(HOSTILE_SPOT, edit + "\n" + lab06.INDENT + HOSTILE_SPOT, 1)


@needs_gxx
def test_cpu_solution_scores_full_marks_and_the_stub_zero(cpu):
    for name, points in (("q1", lab06.Q1_POINTS), ("q2", lab06.Q2_POINTS)):
        r = run_question("lab06", name, [kernel_of(SOLUTION)], time_limit=None)
        assert r.score == r.max_score == points, r.feedback
        stub = run_question("lab06", name, [kernel_of(RELEASED)], time_limit=None)
        assert stub.score == 0 and "not implemented yet" in stub.feedback, stub.feedback
    assert "compiles for the CPU with g++" in run_question("lab06", "q1", [kernel_of(SOLUTION)]).feedback


@needs_gxx
@pytest.mark.parametrize("mutant", lab06.MUTANTS, ids=lambda mu: mu.tag)
def test_cpu_mutant_is_diagnosed(cpu, mutant):
    r = run_question("lab06", "q2", [lab06.render(mutant.update)], time_limit=None)
    assert r.score < r.max_score, r.feedback
    assert f"Likely mistake (all failing inputs match it): {mutant.message}" in r.feedback, r.feedback
    assert mistake_title(mutant.message) in r.diagnoses


@needs_gxx
def test_cpu_each_mutant_alone_is_named_over_many_seeds():
    """Over fresh inputs, each mutant graded as the student is named, and no other mistake is named beside it.

    q2's parts and diagnosis, run on every variant's outputs for a seed at once (one launch of the mutants' module
    per seed): a graded mutant's own kernel computes what its copy in that module does. ``python -m flashlab
    mistakes --labs lab06 --seeds 40`` grades each one in full."""
    names = tuple(f"attn_{mu.tag}_d{d}" for mu in lab06.MUTANTS for d in lab06.HEAD_DIMS)
    module = hostcuda.program(lab06.mutant_source(), names, trusted=True)
    parts = [("random shapes", 2, "plain"), ("causal", 2, "causal"), ("huge logits", 1, "huge")]
    for seed in range(5):
        cases = lab06.random_cases(Trial(seed))
        flat = [c for part in cases.values() for c in part]
        jobs = [(mu.tag, c) for mu in lab06.MUTANTS for c in flat]
        outs = hostcuda.run(module, [lab06._host_launch(f"attn_{tag}", c) for tag, c in jobs], timeout=600)
        table = {(tag, id(c)): out for (tag, c), out in zip(jobs, outs, strict=True)}
        for mu in lab06.MUTANTS:
            t, passed = Trial(seed), []
            for label, points, key in parts:
                lab06._check_part(t, label, points, lambda prefix, case, mu=mu, table=table: table[(
                    mu.tag if prefix == "attn_lab" else prefix[len("attn_"):], id(case))], cases[key], passed)
            r = t.result("q2", lab06.Q2_POINTS)
            assert r.score < r.max_score and mu.message in r.feedback, (mu.tag, seed, r.feedback)
            assert set(r.diagnoses) == {mistake_title(mu.message)}, (mu.tag, seed, r.diagnoses)
            if mu.tag == "unguarded":  # one mistake, one part: the missing guard keeps the overflow point
                assert [got for label, got, *_ in t.parts if label.startswith("huge")] == [1.0], (seed, t.parts)


@needs_gxx
def test_cpu_emulation_agrees_with_the_host_compiled_kernels(rng):
    """The float32 emulation above describes what each variant's kernel computes, here compiled by g++."""
    t = Trial(int(rng.integers(2**31)))
    cases = [c for cs in lab06.random_cases(t).values() for c in cs]
    run = lab06._host_runner(lab06.render(lab06.SOLUTION), cases)
    for case in cases:
        assert lab06.same(run("attn_lab", case), emulate("solution", case)), case.label
        for mu in lab06.MUTANTS:
            assert lab06.same(run(f"attn_{mu.tag}", case), emulate(mu.tag, case)), (mu.tag, case.label)


@needs_gxx
def test_cpu_compile_errors_name_the_cells_line_and_missing_kernels(cpu):
    kernel = kernel_of(SOLUTION)
    broken = kernel.replace("mx = mnew;", "mx = mnew_typo;", 1)
    line = next(i for i, text in enumerate(broken.split("\n"), start=1) if "mnew_typo" in text)
    for name in ("q1", "q2"):
        r = run_question("lab06", name, [broken])
        assert r.score == 0 and "does not compile" in r.feedback and f"kernel.cu:{line}:" in r.feedback, r.feedback
    r = run_question("lab06", "q1", [kernel.replace("attn_lab_d32(", "attn_lab_d33(")])
    assert r.score == 0 and r.feedback == "compiles, but these kernels are missing: attn_lab_d32", r.feedback


@needs_gxx
@pytest.mark.parametrize("edit, expect", [
    ("for (;;) {}", "did not finish within 2 s (an endless loop?)"),
    ("o[((size_t)1 << 40) + i] = 1.f;", "crashed with SIGSEGV (a read or write outside an array?)"),
    ('for (;;) fputs("a flood of output, forever\\n", stderr);', "crashed with SIGXFSZ (wrote too much)"),
    ('for (;;) printf("a flood of output, forever\\n");', "did not finish within 2 s"),
], ids=["endless_loop", "write_out_of_bounds", "flood_stderr", "flood_stdout"])
def test_cpu_a_hostile_kernel_neither_hangs_nor_crashes_the_grader(cpu, monkeypatch, edit, expect):
    monkeypatch.setattr(lab06, "RUN_TIMEOUT", 2.0)
    r = run_question("lab06", "q2", [_hostile(edit)], time_limit=120)
    assert r.score == 0 and f"the launch {expect}" in r.feedback, r.feedback
    assert run_question("lab06", "q2", [kernel_of(SOLUTION)], time_limit=None).score == lab06.Q2_POINTS


@needs_gxx
def test_cpu_kernel_and_compiler_run_in_the_sandbox(cpu, tmp_path):
    if sandbox.sandbox_problem() is not None:
        pytest.skip(f"needs the sandbox: {sandbox.sandbox_problem()}")
    secret = tmp_path / "secret.h"
    secret.write_text("#error the compiler read a file outside its sandbox\n")
    r = run_question("lab06", "q1", [f'#include "{secret}"\n' + kernel_of(SOLUTION)])
    assert r.score == 0 and "No such file" in r.feedback and "outside its sandbox" not in r.feedback, r.feedback
    escaped = tmp_path / "escaped"
    writes = f'{{ FILE* f = fopen("{escaped}", "w"); if (f) {{ fputs("out", f); fclose(f); }} }}'
    r = run_question("lab06", "q2", [_hostile(writes)], time_limit=None)
    assert r.score == lab06.Q2_POINTS and not escaped.exists(), r.feedback


@needs_gxx
def test_cpu_attention_helper_matches_the_reference(cpu, rng):
    n, m, d = 130, 77, 32
    Q, K, V = (rng.standard_normal(s).astype(np.float32) for s in ((n, d), (m, d), (m, d)))
    O, L = lab06.attention(kernel_of(SOLUTION), Q, K, V, causal=True)
    scale = float(np.float32(1 / math.sqrt(d)))
    assert lab06.close((O, L), reference.attention(Q.astype(np.float64), K, V, causal=True, scale=scale))
    assert np.isneginf(L[: n - m]).all() and (O[: n - m] == 0).all()
    with pytest.raises(hostcuda.LaunchFailed, match="crashed with SIGSEGV"):
        lab06.attention(_hostile("o[((size_t)1 << 40) + i] = 1.f;"), Q, K, V)


@needs_gxx
def test_cpu_batch_grading_names_the_mistake(tmp_path):
    """python -m flashlab grade: the kernel string comes back from the notebook's sandbox and runs, compiled by g++,
    in a sandbox of its own."""
    import nbformat

    from flashlab.grading import batch

    if lab06._has_gpu():
        pytest.skip("a GPU is here: the batch grader runs the kernel on it (tests/test_gpu_grading.py)")
    mutant = next(mu for mu in lab06.MUTANTS if mu.tag == "v_for_vj")
    nb = nbformat.read(SOLUTION, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("KERNEL ="))
    cell.source = cell.source.replace("p * vj[c]", "p * v[c]")
    path = tmp_path / "wrong.ipynb"
    nbformat.write(nb, path)
    row = batch.grade_one(path, seed=5, sandboxed=sandbox.sandbox_problem() is None)
    q = {x["name"]: x for x in row["questions"]}
    assert q["q1"]["score"] == q["q1"]["max_score"] == lab06.Q1_POINTS, row
    assert q["q2"]["max_score"] == lab06.Q2_POINTS and q["q2"]["score"] < lab06.Q2_POINTS, row
    assert mutant.message in q["q2"]["feedback"], row


# ------------------------------------------------------------------------------------------ the pass rule
def test_close_and_same_on_numbers():
    rng = np.random.default_rng(0)
    Or, Lr = rng.standard_normal((1, 4, 3)), rng.standard_normal((1, 4))
    Lr[0, 0], Or[0, 0] = -np.inf, 0  # a row that sees no key
    assert lab06.close((Or, Lr), (Or, Lr))
    assert lab06.close((Or * (1 + 1e-7), Lr), (Or, Lr))
    assert not lab06.close((Or * (1 + 1e-3), Lr), (Or, Lr))
    nan_row = Or.copy()
    nan_row[0, 0] = np.nan
    assert not lab06.close((nan_row, Lr), (Or, Lr))  # the keyless row must be 0, not NaN
    finite_L = Lr.copy()
    finite_L[0, 0] = 0.0
    assert not lab06.close((Or, finite_L), (Or, Lr))  # and its L -inf
    assert lab06.same((nan_row, Lr), (nan_row.copy(), Lr))
    assert not lab06.same((nan_row, Lr), (Or, Lr))


# ------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_gpu_solution_scores_full_marks():
    kernel = kernel_of(SOLUTION)
    for q, points in (("q1", lab06.Q1_POINTS), ("q2", lab06.Q2_POINTS)):
        r = run_question("lab06", q, [kernel])
        assert r.max_score == points and r.score == points, r.feedback


@pytest.mark.gpu
@pytest.mark.parametrize("mutant", lab06.MUTANTS, ids=lambda mu: mu.tag)
def test_gpu_mutant_is_diagnosed(mutant):
    r = run_question("lab06", "q2", [lab06.render(mutant.update)])
    assert r.score < r.max_score, r.feedback
    assert mutant.message in r.feedback, r.feedback


@pytest.mark.gpu
def test_gpu_emulation_agrees_with_the_kernel(rng):
    """The CPU tests above stand in for the GPU: each variant's emulation matches its CUDA kernel."""
    t = Trial(int(rng.integers(2**31)))
    cases = [c for cs in lab06.random_cases(t).values() for c in cs]
    run = lab06._gpu_runner(lab06.render(lab06.SOLUTION))
    for case in cases:
        assert lab06.same(run("attn_lab", case), emulate("solution", case)), case.label
        for mu in lab06.MUTANTS:
            emulated, got = emulate(mu.tag, case), run(f"attn_{mu.tag}", case)
            if "huge" in case.label and (_overflows(emulated) or _overflows(got) or mu.tag in _ROUNDING_BOUND):
                continue  # overflowing near 3.4e38: a fused multiply-add may round where NumPy overflows
            assert lab06.same(got, emulated), (mu.tag, case.label)


# Mutants whose huge-logit outputs are differences of huge, nearly equal terms: the GPU's fused multiply-adds
# round them otherwise than NumPy's separate products (seen on an H200: rescaled_after_adding, huge logits, causal).
_ROUNDING_BOUND = ("rescaled_after_adding",)


def _overflows(out) -> bool:
    """O not finite, or an L of +inf or nan (-inf is a row that saw no key, not an overflow)."""
    O, L = (np.asarray(x, dtype=np.float64) for x in out)
    return not np.isfinite(O).all() or bool(np.isnan(L).any() or np.isposinf(L).any())


@pytest.mark.gpu
def test_gpu_outputs_are_poisoned_so_unwritten_rows_fail():
    lazy = kernel_of(SOLUTION).replace("if (i >= n) return;", "if (i >= n || i == n - 1) return;")
    r = run_question("lab06", "q2", [lazy])
    assert r.score == 0 and "NaN" in r.feedback, r.feedback


@pytest.mark.gpu
def test_gpu_q1_reports_a_compile_error():
    r = run_question("lab06", "q1", [kernel_of(SOLUTION).replace("mx = mnew;", "mx = mnew", 1)])
    assert r.score == 0 and "does not compile" in r.feedback and "error" in r.feedback, r.feedback


@pytest.mark.gpu
def test_gpu_attention_helper_matches_the_reference(rng):
    n, m, d = 130, 77, 32
    Q, K, V = (rng.standard_normal(s).astype(np.float32) for s in ((n, d), (m, d), (m, d)))
    O, L = lab06.attention(kernel_of(SOLUTION), Q, K, V, causal=True)
    scale = float(np.float32(1 / math.sqrt(d)))
    O_ref, L_ref = reference.attention(Q.astype(np.float64), K, V, causal=True, scale=scale)
    assert lab06.close((O, L), (O_ref, L_ref))
    assert np.isneginf(L[: n - m]).all() and (O[: n - m] == 0).all()


@needs_gxx
def test_the_try_it_cell_reports_a_kernel_that_does_not_compile(capsys):
    """The lab's own "try it" cell, run with a KERNEL missing a semicolon: the compiler's message, no traceback."""
    import nbformat

    nb = nbformat.read(RELEASED, as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and "lab06.attention(KERNEL" in c.source]
    broken = lab06.render(lab06.SOLUTION).replace("const float corr = expf(mx - mnew);",
                                                  "const float corr = expf(mx - mnew)")
    with pytest.raises(lab06.CompileFailed, match="error"):
        lab06.attention(broken, *np.ones((3, 2, 16), dtype=np.float32))
    namespace = {"np": np, "lab06": lab06, "reference": reference, "KERNEL": broken,
                 "gpu_available": lambda: False}
    exec(cell.source, namespace)  # noqa: S102 - the lab's own cell
    out = capsys.readouterr().out
    assert "does not compile" in out and "error" in out, out
