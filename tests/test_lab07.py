"""Lab 07's grader: the solution scores full marks, the released stubs zero, and each known mistake is named — the
same mistake, with the same score, whatever the seed — while right answers written differently pass."""

from __future__ import annotations

import ast
import pathlib

import nbformat
import numpy as np
import pytest

from flashlab import fragments, hostcuda, mistakes
from flashlab.grading import get_lab, lab07, run_question
from flashlab.grading.core import mistake_title
from flashlab.grading.known import solution_object

ROOT = pathlib.Path(__file__).resolve().parent.parent
RELEASED = ROOT / "labs" / "lab07_tensor_cores.ipynb"
SEEDS = (0, 1, 2, 3, 4)


def _solution(question: str) -> list:
    return [solution_object("lab07", name) for name in get_lab("lab07").questions[question].objects]


def _released_namespace() -> dict:
    """The functions and the KERNEL string of the student's copy, defined as the notebook defines them (stubs)."""
    namespace: dict = {"np": np, "shfl_xor": fragments.shfl_xor}
    for cell in nbformat.read(RELEASED, as_version=4).cells:
        if cell.cell_type == "code":
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.FunctionDef) or (isinstance(node, ast.Assign)
                                                         and isinstance(node.value, ast.Constant)):
                    exec(compile(ast.Module([node], []), RELEASED.name, "exec"), namespace)  # noqa: S102
    return namespace


_CPP = pytest.mark.skipif(hostcuda.compiler_problem() is not None, reason="q5 runs the kernel on the CPU with g++")
QUESTIONS = ["q1", "q2", "q3", "q4", pytest.param("q5", marks=_CPP)]


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_solution_scores_full_marks(question):
    for seed in SEEDS:
        r = run_question("lab07", question, _solution(question), seed=seed)
        assert r.score == r.max_score > 0, r.feedback


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_released_stubs_score_zero(question):
    namespace = _released_namespace()
    objects = [namespace[name] for name in get_lab("lab07").questions[question].objects]
    r = run_question("lab07", question, objects, seed=1)
    assert r.score == 0 and "not implemented yet" in r.feedback, r.feedback


@_CPP
def test_the_lab_is_worth_sixteen_points_on_a_cpu_with_a_cpp_compiler():
    """Twelve for the NumPy tasks; q5's kernel compiles (1) and runs (3) on the CPU through g++."""
    assert get_lab("lab07").max_score == 16 and get_lab("lab07").questions["q5"].points == 4
    assert not mistakes.needs_gpu("lab07") and not mistakes.needs_simulator("lab07")


def _cases():
    for m in mistakes.catalogue(["lab07"]):
        yield pytest.param(m, id=f"{m.question}-{m.title[:50]}")


@pytest.mark.parametrize("mistake", list(_cases()))
def test_each_mistake_is_named_alone_with_one_score_over_seeds(mistake):
    if mistake.question == "q5" and hostcuda.compiler_problem() is not None:
        pytest.skip("q5 runs the kernel on the CPU with g++")
    scores = set()
    for seed in SEEDS:
        r = mistakes.grade(mistake, seed)
        scores.add(r.score)
        assert r.score < r.max_score, r.feedback
        assert mistake.message in r.feedback, f"seed {seed}:\n{r.feedback}"
        assert r.diagnoses == [mistake_title(mistake.message)], f"seed {seed} names {r.diagnoses}"
    assert len(scores) == 1, f"{mistake!r} scores {sorted(scores)} depending on the seed"


def test_there_are_many_known_mistakes_in_every_question():
    per_question = {q: sum(m.question == q for m in mistakes.catalogue(["lab07"])) for q in get_lab("lab07").questions}
    assert per_question["q1"] >= 8 and per_question["q2"] >= 10 and per_question["q3"] >= 5, per_question
    assert per_question["q4"] >= 4 and per_question["q5"] >= 8, per_question


def test_a_wrong_map_fails_the_product_too():
    a, b, c = _solution("q1")
    r = run_question("lab07", "q1", [a, lab07._b_no_pairs, c], seed=3)
    assert r.score == 2
    assert "D = A B + C is wrong at" in r.feedback and "B's k pairs start at t, not 2t" in r.feedback


def test_the_maps_are_m16n8k8_s_the_k_0_to_7_half_of_m16n8k16_s():
    """The relation the lab asks the learner to derive, and the Turing kernel relies on (r3t_mma_m16n8k8.cu): the
    m16n8k16 A fragment is m16n8k8's for k = 0..7, then the same for k = 8..15; B likewise; C is the same."""
    for lane in range(32):
        a8, b8, c8 = (fn(lane) for fn in lab07._K8_MAPS)
        assert fragments.a_positions(lane) == a8 + [(r, k + 8) for r, k in a8]
        assert fragments.b_positions(lane) == b8 + [(k + 8, c) for k, c in b8]
        assert fragments.c_positions(lane) == c8


def test_a_k16_product_is_two_emulated_k8_products(rng):
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    a8, b8, c8 = lab07._K8_MAPS
    D = fragments.gather(C, c8)
    for k0 in (0, 8):
        D = fragments.mma(fragments.gather(A[:, k0:k0 + 8], a8), fragments.gather(B[k0:k0 + 8], b8), D,
                          maps=lab07._K8_MAPS)
    assert np.allclose(fragments.scatter(D, c8, (16, 8)), A @ B + C, rtol=1e-13, atol=1e-13)


def test_the_package_s_m16n8k16_maps_handed_in_score_nothing():
    """Chapter 7 draws m16n8k16's maps from flashlab.fragments; reusing them for k8 is calling the course's answer."""
    r = run_question("lab07", "q1", [lambda lane: fragments.a_positions(lane)[:4],
                                     lambda lane: fragments.b_positions(lane)[:2], fragments.c_positions], seed=2)
    assert r.score == 0 and "calls flashlab.fragments.a_positions" in r.feedback, r.feedback


def test_a_map_of_the_wrong_length_is_explained():
    a, b, c = _solution("q1")
    r = run_question("lab07", "q1", [a, b, lambda lane: c(lane)[:2]], seed=3)
    assert r.score == 2 and "lane 0 gave 2 positions; it holds 4" in r.feedback, r.feedback


@pytest.mark.parametrize("swizzle", [lambda row, chunk: (chunk + row) % 16,
                                     lambda row, chunk: chunk ^ (row % 16),
                                     lambda row, chunk: chunk ^ (7 - row % 8)],
                         ids=["rotation", "xor row % 16", "xor reversed"])
def test_any_conflict_free_permutation_passes(swizzle):
    r = run_question("lab07", "q3", [swizzle], seed=2)
    assert r.score == r.max_score, r.feedback


def test_a_swizzle_for_one_element_at_a_time_is_graded_too():
    def one_at_a_time(row, chunk):
        if not isinstance(row, int):
            raise TypeError("ints only")
        return chunk ^ (row % 8)

    assert run_question("lab07", "q3", [one_at_a_time], seed=2).score == 2
    r = run_question("lab07", "q3", [lambda row, chunk: int(chunk) ^ int(row % 4)], seed=2)
    assert r.score == 1 and "XOR with row % 4" in r.feedback, r.feedback


def test_an_unknown_mistake_shows_the_failing_input_and_names_nothing():
    right = solution_object("lab07", "softmax_tile")

    def doubled(s, m, l, o):  # noqa: E741
        p, m_new, l_new, o_new = right(s, m, l, o)
        return p, m_new, 2 * l_new, o_new

    r = run_question("lab07", "q2", [doubled], seed=4)
    assert r.score == 0 and r.diagnoses == [] and "Smallest failing input" in r.feedback
    assert "l_new: largest difference" in r.feedback and "p: correct" in r.feedback
    # the input is shown under the names of the learner's own parameters, however the grader wraps the function
    assert "s = " in r.feedback and "o = " in r.feedback and "arg1" not in r.feedback, r.feedback


def test_chapter_9_reports_a_lab07_mistake_with_its_demo():
    text = mistakes.report(mistakes.find("lab07", "XOR with row // 8"))
    assert "(recognised)" in text and "worst passes per 8-row block" in text
    rows = mistakes.demo(mistakes.find("lab07", "one max for both rows"))
    assert rows is not None and any(row.differs for row in rows)


def test_ldmatrix_addresses_outside_the_tile_are_explained():
    r = run_question("lab07", "q4", [lambda lane: (lane, 0)], seed=5)
    assert r.score == 0 and "lane 16 points at row 16, chunk 0: outside the 16 × 16 tile" in r.feedback, r.feedback
    r = run_question("lab07", "q4", [lab07._ld_own_row], seed=5)
    assert "receives A at row 2, column 0, where the mma expects row 8, column 0" in r.feedback, r.feedback


def test_an_exception_in_a_map_is_feedback_and_the_other_parts_keep_their_points():
    a, b, c = _solution("q1")

    def c_breaks_on_lane_7(lane):
        if lane == 7:
            raise IndexError("list index out of range")
        return c(lane)

    r = run_question("lab07", "q1", [a, b, c_breaks_on_lane_7], seed=6)
    assert r.score == 2 and "lane 7: IndexError: list index out of range" in r.feedback, r.feedback


def _reduced_with(max_offsets, sum_offsets):
    """A learner's softmax_tile whose quad reductions use the given shfl_xor offsets (right: 1 and 2 for both)."""
    def softmax_tile(s, m, l, o):  # noqa: E741
        s, m, l, o = (np.asarray(x, dtype=np.float64) for x in (s, m, l, o))  # noqa: E741
        row_max = np.stack([s[:, :, 0:2].max(axis=(1, 2)), s[:, :, 2:4].max(axis=(1, 2))], axis=1)
        for k in max_offsets:
            row_max = np.maximum(row_max, fragments.shfl_xor(row_max, k))
        m_new = np.maximum(m, row_max)
        safe = np.where(np.isneginf(m_new), 0.0, m_new)
        alpha = np.exp(m - safe)
        p = np.exp(s - safe[:, None, [0, 0, 1, 1]])
        row_sum = np.stack([p[:, :, 0:2].sum(axis=(1, 2)), p[:, :, 2:4].sum(axis=(1, 2))], axis=1)
        for k in sum_offsets:
            row_sum = row_sum + fragments.shfl_xor(row_sum, k)
        return p, m_new, alpha * l + row_sum, o * alpha[:, None, [0, 0, 1, 1]]

    return softmax_tile


@pytest.mark.parametrize("max_offsets, sum_offsets, named", [
    ((1, 4), (1, 2), "the row max is reduced over the wrong lanes"),
    ((1,), (1, 2), "the row max is reduced over the wrong lanes"),
    ((1, 2), (1, 4), "the row sum is reduced over the wrong lanes"),
    ((1, 8), (1, 8), "the row max and sum are reduced over the wrong lanes"),
    ((2, 1), (2, 1), None),
])
def test_a_reduction_over_any_wrong_lanes_is_named(max_offsets, sum_offsets, named):
    for seed in SEEDS[:3]:
        r = run_question("lab07", "q2", [_reduced_with(max_offsets, sum_offsets)], seed=seed)
        if named is None:
            assert r.score == 4 and r.diagnoses == []
        else:
            assert r.score == 0 and [d for d in r.diagnoses if d.startswith(named)] == r.diagnoses != [], r.feedback


# ------------------------------------------------------------------------------ q5: the kernel's tensor-core lines
def _kernel_of(path: pathlib.Path) -> str:
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code" and cell.source.startswith("KERNEL ="):
            return ast.literal_eval(cell.source.split("=", 1)[1].strip())
    raise AssertionError(f"{path.name}: no cell assigns KERNEL")


def test_the_solution_notebook_holds_the_rendered_kernel():
    """The mutants are edits of the very kernel the notebook holds: the cell is the template with the solution's
    lines between the release markers."""
    kernel = _kernel_of(ROOT / "solutions" / "lab07_tensor_cores.ipynb")
    without_markers = "\n".join(line for line in kernel.split("\n") if "### " not in line)
    assert without_markers == lab07.render_kernel(lab07.KERNEL_SOLUTION)
    assert "raise NotImplementedError" in _kernel_of(RELEASED) and "mma.sync.aligned" not in _kernel_of(RELEASED)


_K8_LINES = """\
ldmatrix_x4(a, &qs[(lane % 16) * LD + k0 + 8 * (lane / 16)]);
b0 = *(const u32*)&ks[g * LD + k0 + 2 * t];
b1 = *(const u32*)&ks[g * LD + k0 + 8 + 2 * t];
// two Turing instructions: k0 .. k0 + 7 (a0, a1, b0), then k0 + 8 .. k0 + 15 (a2, a3, b1)
asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));"""

_SEPARATE_C = """\
ldmatrix_x4(a, &qs[(lane % 16) * LD + k0 + 8 * (lane / 16)]);
const u32 kb = g * LD + k0 + 2 * t;
b0 = *(const u32*)&ks[kb];
b1 = *(const u32*)&ks[kb + 8];
float d[4];
asm volatile(
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
    "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\\n"
    : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
for (int i = 0; i < 4; ++i) c[i] = d[i];"""


@_CPP
@pytest.mark.parametrize("lines", [_K8_LINES, _SEPARATE_C], ids=["two m16n8k8", "D apart from C"])
def test_right_kernels_written_differently_score_full_marks(lines):
    r = run_question("lab07", "q5", [lab07.render_kernel(lines)], seed=3, time_limit=None)
    assert r.score == r.max_score == 4 and r.diagnoses == [], r.feedback


def test_a_kernel_of_m16n8k8_alone_is_compiled_for_turing():
    assert lab07._arch(lab07.render_kernel(_K8_LINES)) == 75
    assert lab07._arch(lab07.render_kernel(lab07.KERNEL_SOLUTION)) == 80


@_CPP
def test_a_kernel_that_does_not_compile_is_not_run_and_the_line_is_the_cell_s():
    kernel = _kernel_of(ROOT / "solutions" / "lab07_tensor_cores.ipynb")
    broken = kernel.replace("b1 = *(const u32*)", "b1 = *(const u32*)undeclared + ")
    line = next(i for i, text in enumerate(broken.split("\n"), 1) if "undeclared" in text)
    r = run_question("lab07", "q5", [broken], seed=1, time_limit=None)
    assert r.score == 0 and (f"({line})" in r.feedback or f":{line}:" in r.feedback), r.feedback
    assert "cannot run: the kernel does not compile" in r.feedback, r.feedback


@_CPP
def test_an_instruction_the_emulation_does_not_know_is_named():
    lines = lab07.KERNEL_SOLUTION + '\nasm volatile("bar.warp.sync 0xffffffff;");'  # right, and nvcc takes it
    r = run_question("lab07", "q5", [lab07.render_kernel(lines)], seed=1, time_limit=None)
    assert r.score == 1 and "does not know the inline PTX 'bar.warp.sync" in r.feedback, r.feedback


@_CPP
def test_qk_scores_runs_the_notebook_s_kernel_and_refuses_the_stub(rng):
    Q, K = rng.standard_normal((32, 64)), rng.standard_normal((16, 64))
    S = lab07.qk_scores(_kernel_of(ROOT / "solutions" / "lab07_tensor_cores.ipynb"), Q, K)
    want = Q.astype(np.float16).astype(np.float64) @ K.astype(np.float16).astype(np.float64).T
    assert S.dtype == np.float32 and np.allclose(S, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(NotImplementedError):
        lab07.qk_scores(_kernel_of(RELEASED), Q, K)
    with pytest.raises(ValueError, match="multiple of 16"):
        lab07.qk_scores(_kernel_of(RELEASED), Q[:20], K)


# ---------------------------------------------------------------------------- the rewriting of inline PTX
def test_the_rewriting_turns_each_instruction_into_its_host_call_and_keeps_the_lines():
    mma = lab07.render_kernel(lab07.KERNEL_SOLUTION)
    host = hostcuda.host_source(mma)
    assert "asm" not in host and host.count("\n") == mma.count("\n")
    assert ("hostcuda_mma_m16n8k16<f16_val>((c[0]), (c[1]), (c[2]), (c[3]), (a[0]), (a[1]), (a[2]), (a[3]), (b0), "
            "(b1), (c[0]), (c[1]), (c[2]), (c[3]));") in host
    assert "hostcuda_ldmatrix_x4((r[0]), (r[1]), (r[2]), (r[3]), (addr), false);" in host
    bf16 = 'asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, ' \
           '{%0,%1,%2,%3};" : "+f"(x), "+f"(y), "+f"(z), "+f"(w) : "r"(p), "r"(q), "r"(r), "r"(s), "r"(u), "r"(v));'
    assert hostcuda.host_source(bf16).startswith("hostcuda_mma_m16n8k16<bf16_val>(")
    trans = 'asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r0), ' \
            '"=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr)); // ldmatrix in a comment: asm("nothing");'
    assert hostcuda.host_source(trans).startswith("hostcuda_ldmatrix_x4((r0), (r1), (r2), (r3), (addr), true);")
    assert hostcuda.host_source('asm("mov.u32 %0, %%ctaid.y;" : "=r"(b));') == "(b) = blockIdx.y;"


@pytest.mark.parametrize("statement, words", [
    ('asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));', "does not know the inline PTX"),
    ('asm("mov.u32 %0, %2;" : "=r"(r) : "r"(x));', "%2 names no operand: this asm statement has 2"),
    ('asm("mov.u32 %0, %1;" : : "r"(r), "r"(x));', "%0 is written by the instruction but is an input operand"),
    ('asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};" : '
     '"=f"(c0), "=f"(c1), "=f"(c2), "=f"(c3) : "r"(a0), "r"(a1), "r"(b0));', "output-only operand (\"=f\")"),
    ('asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};" : '
     '"+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "f"(a0), "r"(a1), "r"(b0), "f"(0.f), "f"(0.f), "f"(0.f), '
     '"f"(0.f));', "takes a 32-bit register"),
])
def test_the_rewriting_refuses_what_it_cannot_run_and_says_why(statement, words):
    with pytest.raises(hostcuda.UnknownPTX) as info:
        hostcuda.host_source(statement)
    assert words in str(info.value), str(info.value)


@_CPP
def test_the_emulated_m16n8k8_is_the_k_half_of_m16n8k16_on_the_host(rng):
    """Both instructions through the rewriting and g++, against float64: two m16n8k8 make one m16n8k16."""
    Q, K = rng.standard_normal((16, 32)), rng.standard_normal((8, 32))
    want = Q.astype(np.float16).astype(np.float64) @ K.astype(np.float16).astype(np.float64).T
    for lines in (lab07.KERNEL_SOLUTION, _K8_LINES):
        S = lab07.qk_scores(lab07.render_kernel(lines), Q, K)
        assert np.allclose(S, want, rtol=1e-5, atol=1e-4)
