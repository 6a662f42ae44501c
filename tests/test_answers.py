"""The course's own answers cannot be handed in (flashlab.grading.answers).

Every answer a lab module lists in ``ANSWERS``, called by a submission, scores that question 0 with feedback naming
it — through ``run_question`` and through a notebook's ``check()`` — however it was reached; the grader's own work
keeps the real functions; a solution that uses a helper the lab allows still scores full marks; and the student copy
of the package written for sandboxed grading has no answer body left.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import flashlab
from flashlab import numba_cuda, online, reference, tiled
from flashlab.grading import answers, available_labs, get_lab, lab, run_question
from flashlab.grading.known import solution_object

# lab05 needs the CUDA simulator in its process: its answers are checked in a fresh one (test_lab05_answers...).
IN_PROCESS = [lab_id for lab_id in available_labs() if lab_id != "lab05"]
CASES = [(lab_id, q, name) for lab_id in IN_PROCESS for q in get_lab(lab_id).questions
         for name in answers.answers_of(lab_id, q)]


def _cheat(answer):
    """A submission that hands the course's answer in: whatever the question passes goes straight to it."""

    def cheat(*args, **kwargs):
        return answer(*args, **kwargs)

    return cheat


def _cheats(lab_id: str, question: str, answer) -> list:
    return [_cheat(answer) for _ in get_lab(lab_id).questions[question].objects]


def test_every_lab_declares_its_answers_and_each_is_a_plain_function():
    for lab_id in available_labs():
        module = importlib.import_module(f"flashlab.grading.{lab_id}")
        assert isinstance(module.ANSWERS, dict), lab_id
        assert set(module.ANSWERS) <= set(get_lab(lab_id).questions), lab_id
        for names in module.ANSWERS.values():
            for name in names:
                assert name.startswith("flashlab."), name
                fn = answers.resolve(name)
                assert isinstance(fn, types.FunctionType) and not fn.__closure__, name
    assert len(CASES) > 40  # every lab but lab06 (a CUDA C string) lists answers


@pytest.mark.parametrize(("lab_id", "question", "name"), CASES, ids=[f"{a}-{b}-{c}" for a, b, c in CASES])
def test_calling_an_answer_scores_zero_and_names_it(lab_id, question, name):
    answer = answers.resolve(name)  # a reference kept from before the check, like `from m import f as g`
    result = run_question(lab_id, question, _cheats(lab_id, question, answer), seed=5)
    assert result.score == 0, result.feedback
    assert f"calls {name} " in result.feedback


@pytest.mark.parametrize(("lab_id", "question", "name"), CASES, ids=[f"{a}-{b}-{c}" for a, b, c in CASES])
def test_the_interactive_check_says_the_same(lab_id, question, name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        lab(lab_id)(question, *_cheats(lab_id, question, answers.resolve(name)), seed=5)
    text = out.getvalue()
    assert text.startswith(f"{question}: 0/"), text
    assert f"calls {name} " in text


def test_the_answers_are_restored_and_the_grader_keeps_using_them():
    originals = {name: answers.resolve(name).__code__ for name in answers.answers_of("lab02")}
    run_question("lab02", "q2", [_cheat(tiled.forward)], seed=1)
    assert {name: answers.resolve(name).__code__ for name in originals} == originals
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((5, 3)), rng.standard_normal((7, 3)), rng.standard_normal((7, 2))
    assert np.allclose(tiled.forward(Q, K, V, block_q=2, block_k=3)[0], reference.attention(Q, K, V)[0])


def test_any_route_to_an_answer_trips_it():
    def through_the_module(Q, K, V, block_q, block_k):
        return flashlab.tiled.forward(Q, K, V, block_q=block_q, block_k=block_k)

    def through_another_package_function(m, l, u, scores, values):  # viz.trace_states folds with online.update
        from flashlab.viz import trace_states

        state = trace_states([scores], [values])[-1]
        return state.m, state.l, state.u

    r = run_question("lab02", "q2", [through_the_module], seed=2)
    assert r.score == 0 and "calls flashlab.tiled.forward " in r.feedback
    r = run_question("lab01", "q1", [through_another_package_function], seed=2)
    assert r.score == 0 and "calls flashlab.online.update " in r.feedback


def test_catching_the_tripwire_does_not_help():
    solution = solution_object("lab02", "flash_forward")

    def sly(Q, K, V, block_q, block_k):
        try:
            return tiled.forward(Q, K, V, block_q=block_q, block_k=block_k)
        except BaseException:  # noqa: BLE001 - the point of the test
            return solution(Q, K, V, block_q, block_k)

    r = run_question("lab02", "q2", [sly], seed=3)
    assert r.score == 0 and "calls flashlab.tiled.forward " in r.feedback


def test_student_code_cannot_disarm_its_own_check():
    def disarm(m, l, u, scores, values):
        with answers.trusted():
            state = online.update(online.State(np.float64(m), np.float64(l), np.asarray(u, float)), scores, values)
        return state.m, state.l, state.u

    r = run_question("lab01", "q1", [disarm], seed=4)
    assert r.score == 0 and "calls flashlab.grading.answers.trusted " in r.feedback


def test_the_course_s_own_code_is_graded_inside_trusted():
    # Chapter 9's wrong implementations may reuse the package: inside trusted() the answers are left alone.
    with answers.trusted():
        r = run_question("lab02", "q2", [_cheat(lambda Q, K, V, bq, bk: tiled.forward(Q, K, V, block_q=bq,
                                                                                      block_k=bk))], seed=6)
    assert r.score == r.max_score, r.feedback


def test_solutions_score_full_marks_and_an_allowed_helper_stays_usable():
    for lab_id in IN_PROCESS:
        for q, question in get_lab(lab_id).questions.items():
            if lab_id == "lab06":
                continue  # graded by nvcc or on a GPU (tests/test_labs.py runs it)
            objects = [solution_object(lab_id, name) for name in question.objects]
            r = run_question(lab_id, q, objects, seed=7)
            assert r.score == r.max_score, (lab_id, q, r.feedback)

    def flash_backward(Q, K, V, O, L, dO, block_q, block_k):
        """The solution, with each tile of scores from flashlab.reference.scores (a helper, not the answer)."""
        n, d = Q.shape
        scale = 1.0 / np.sqrt(d)
        dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
        D = np.sum(dO * O, axis=1)
        for k0 in range(0, K.shape[0], block_k):
            Kj, Vj = K[k0:k0 + block_k], V[k0:k0 + block_k]
            for q0 in range(0, n, block_q):
                Qi, dOi = Q[q0:q0 + block_q], dO[q0:q0 + block_q]
                P = np.exp(reference.scores(Qi, Kj, scale=scale) - L[q0:q0 + block_q, None])
                dV[k0:k0 + block_k] += P.T @ dOi
                dS = P * (dOi @ Vj.T - D[q0:q0 + block_q, None])
                dQ[q0:q0 + block_q] += scale * dS @ Kj
                dK[k0:k0 + block_k] += scale * dS.T @ Qi
        return dQ, dK, dV

    r = run_question("lab04", "q1", [flash_backward], seed=8)
    assert r.score == r.max_score, r.feedback


def test_lab05_answers_trip_in_the_simulator():
    code = """
    import json
    from flashlab.grading import answers, run_question
    from flashlab.grading.known import solution_object
    out = {}
    for q, obj in (("q1", "make_kernel"), ("q2", "run_kernel")):
        out[q + " solution"] = run_question("lab05", q, [solution_object("lab05", obj)], seed=1).score
        for name in answers.answers_of("lab05", q):
            fn = answers.resolve(name)
            r = run_question("lab05", q, [lambda *a, fn=fn: fn(*a)], seed=1)
            out[q + " " + name] = [r.score, r.feedback]
    print(json.dumps(out))
    """
    out = numba_cuda.run_in_simulator(code, timeout=600)
    assert out.pop("q1 solution") == 6 and out.pop("q2 solution") == 2
    assert len(out) == len(answers.answers_of("lab05", "q1")) + len(answers.answers_of("lab05", "q2"))
    for key, (score, feedback) in out.items():
        name = key.split(" ", 1)[1]
        assert score == 0 and f"calls {name} " in feedback, (key, feedback)


# ------------------------------------------------------------------------------------ the student's package copy
_COPY_CHECK = """
import ast, inspect, json, sys, textwrap
import flashlab
from flashlab.grading import answers
lab_id, originals = sys.argv[1], json.loads(sys.argv[2])
out = {"file": flashlab.__file__, "raised": {}, "bodies_left": []}
for name in answers.sandbox_answers(lab_id):
    fn = answers.resolve(name)
    params = inspect.signature(fn).parameters.values()
    args = [None for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in params if p.default is p.empty and p.kind is p.KEYWORD_ONLY}
    try:
        fn(*args, **kwargs)
    except answers.AnswerCalled as e:
        out["raised"][name] = e.name
    source = inspect.getsource(fn)
    out["bodies_left"] += [name for line in originals[name] if line in source]
import numpy as np
from flashlab import online, reference
from flashlab.measure import peak_memory
s = online.init((), None)
out["helpers"] = [float(reference.scores(np.eye(2), np.eye(2), scale=1.0).sum()), float(s.l),
                  int(peak_memory(sum, [1, 2])[1])]
print(json.dumps(out))
"""


def _body_lines(name: str) -> list[str]:
    """Distinctive lines of an answer's body in the real package (its statements, not its docstring)."""
    source = textwrap.dedent(inspect.getsource(answers.resolve(name)))
    node = ast.parse(source).body[0]
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body
    lines = [line.strip() for stmt in body for line in ast.get_source_segment(source, stmt).splitlines()]
    return [line for line in lines if len(line) > 20 and not line.startswith("#")]


@pytest.mark.parametrize("lab_id", ["lab01", "lab02", "lab03", "lab04", "lab05", "lab07", "lab08", "lab10", "lab11"])
def test_the_student_copy_has_no_answer_body(tmp_path, lab_id):
    package = answers.student_package(tmp_path, lab_id)
    assert package == tmp_path / "flashlab" and (package / "__init__.py").is_file()
    originals = {name: _body_lines(name) for name in answers.sandbox_answers(lab_id)}
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _COPY_CHECK, lab_id, json.dumps(originals)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"] == str(package / "__init__.py")
    assert out["raised"] == {name: name for name in answers.sandbox_answers(lab_id)}
    assert out["bodies_left"] == []
    assert out["helpers"] == [2.0, 0.0, 3]
    assert all(originals.values())  # each answer had body lines to look for


def test_the_student_copy_refuses_an_existing_folder(tmp_path):
    answers.student_package(tmp_path, "lab01")
    with pytest.raises(FileExistsError):
        answers.student_package(tmp_path, "lab01")


def test_the_course_s_own_mutants_are_graded_but_its_answers_handed_in_are_not():
    from flashlab.grading import lab01, lab02, lab04

    r = run_question("lab01", "q3", [lab01._attend_drop_ragged], seed=9)  # calls online.attend: a course mistake
    assert 0 < r.score < r.max_score or "last ragged block is dropped" in r.feedback, r.feedback
    assert "calls " not in r.feedback
    assert run_question("lab02", "q2", [lab02._switch()], seed=9).score == 7  # the switchable forward, all off
    r = run_question("lab04", "q1", [lab04._mutant_backward], seed=9)  # listed: handed in as it is, still an answer
    assert r.score == 0 and "calls flashlab.grading.lab04._mutant_backward " in r.feedback
    r = run_question("lab02", "q2", [tiled.forward], seed=9)
    assert r.score == 0 and "calls flashlab.tiled.forward " in r.feedback


def test_the_student_copy_strips_every_labs_answers_not_only_the_graded_ones():
    """Another lab's answer (its grader's correct helper, or the package function it implements) is a way around
    this lab's work: lab 10's fold grades lab 01's update, lab 01's online.update computes lab 08's partials."""
    assert "flashlab.grading.lab10._fold_scores" in answers.sandbox_answers("lab01")
    assert "flashlab.grading.lab08._merge" in answers.sandbox_answers("lab01")
    assert "flashlab.online.update" in answers.sandbox_answers("lab08")
    assert "flashlab.blocksparse._edges" in answers.sandbox_answers("lab02")
    # what a lab keeps for its own given cells stays, and only for that lab
    assert "flashlab.reference.attention" not in answers.sandbox_answers("lab05")
    assert "flashlab.reference.attention" in answers.sandbox_answers("lab01")
