"""The grader: mutants are diagnosed by name, stubs score zero, and the batch grader survives bad submissions."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
import time

import nbformat
import numpy as np
import pytest

from flashlab.grading import available_labs, batch, core, get_lab, lab, lab01, lab02, run_question, sandbox
from flashlab.grading.known import solution_object

ROOT = pathlib.Path(__file__).resolve().parent.parent
# CI installs bubblewrap, so there the batch tests grade in the sandbox; elsewhere they say why they could not.
NO_SANDBOX = sandbox.sandbox_problem()
SANDBOX_FLAGS = ["--no-sandbox"] if NO_SANDBOX else []


# ----------------------------------------------------------------------------------- diagnoses, called directly
def _cases():
    for q, mutants in (("q1", lab01.UPDATE_MUTANTS), ("q2", lab01.MERGE_MUTANTS), ("q3", lab01.ATTEND_MUTANTS)):
        for m in mutants:
            yield pytest.param("lab01", q, m, id=f"lab01-{q}-{m.message[:40]}")
    for m in lab02.TILES_MUTANTS:
        yield pytest.param("lab02", "q1", m, id=f"lab02-q1-{m.message[:40]}")
    for q, mutants in (("q2", lab02.FORWARD_MUTANTS), ("q3", lab02.KV_OUTER_MUTANTS)):
        for m in mutants:
            if m.fn is not None:
                yield pytest.param("lab02", q, m, id=f"lab02-{q}-{m.message[:40]}")


@pytest.mark.parametrize("lab_id,question,mutant", list(_cases()))
def test_each_mutant_is_diagnosed_by_name(lab_id, question, mutant):
    r = run_question(lab_id, question, [mutant.fn])
    assert r.score < r.max_score, r.feedback
    assert mutant.message in r.feedback, f"seed {r.seed}:\n{r.feedback}"


# The mistakes the course promises to recognise, each as a student would write it (calling flashlab.reference
# would be handing in the course's answer: see tests/test_answers.py).
def _attention(Q, K, V):
    S = Q @ K.T / np.sqrt(Q.shape[1])  # the whole n x m matrix
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)  # noqa: E741
    return (P @ V) / l, (m + np.log(l))[:, 0]


def _drop_last_query_tile(Q, K, V, block_q, block_k):
    n = Q.shape[0]
    O, L = np.zeros((n, V.shape[1])), np.zeros(n)
    for q0 in range(0, n - n % block_q, block_q):
        O[q0 : q0 + block_q], L[q0 : q0 + block_q] = _attention(Q[q0 : q0 + block_q], K, V)
    return O, L


def _naive_but_right(Q, K, V, block_q, block_k):
    return _attention(Q, K, V)


@pytest.mark.parametrize(
    "lab_id,question,fn,phrase",
    [
        ("lab01", "q3", lab01._attend_average, "averaging block results"),
        ("lab01", "q1", lab01._update_no_rescale, "not rescaled"),
        ("lab01", "q1", lab01._update_no_max, "no max subtraction"),
        ("lab01", "q1", lab01._update_unguarded, "fully masked block"),
        ("lab01", "q3", lab01._attend_drop_ragged, "last ragged block is dropped"),
        ("lab02", "q2", lab02._switch(drop_ragged_k=True), "last ragged K/V tile is dropped"),
        ("lab02", "q2", _drop_last_query_tile, "last ragged query tile is dropped"),
        ("lab02", "q2", lab02._switch(normalise_in_loop=True), "normalising inside the loop"),
        ("lab02", "q2", lab02._switch(scale=False), "missing the 1/sqrt(d) scale"),
        ("lab02", "q2", lab02._switch(lse=False), "L is the running max"),
        ("lab02", "q2", lab02._switch(rescale=False), "no rescale when the max grows"),
        ("lab02", "q2", lab02._switch(subtract_max=False), "no max subtraction"),
        ("lab02", "q2", lab02._switch(rescale_acc=False), "l is rescaled but the accumulated output is not"),
        ("lab02", "q2", lab02._switch(rescale_l=False), "the accumulated output is rescaled but l is not"),
        ("lab02", "q3", lab02._switch(rescale_acc=False), "l is rescaled but the accumulated output is not"),
        ("lab02", "q3", lab02._switch(reset_per_tile=True), "reset for every K/V tile"),
        ("lab02", "q3", _drop_last_query_tile, "skips the last ragged query tile"),
    ],
)
def test_promised_diagnoses(lab_id, question, fn, phrase):
    r = run_question(lab_id, question, [fn])
    assert r.score < r.max_score and phrase in r.feedback, f"seed {r.seed}:\n{r.feedback}"


def test_correct_reference_implementation_scores_full():
    for q in ("q2", "q3"):
        r = run_question("lab02", q, [lab02._switch()])
        assert r.score == r.max_score == 7, r.feedback


def test_materialising_the_score_matrix_fails_only_the_memory_part():
    for q in ("q2", "q3"):
        r = run_question("lab02", q, [_naive_but_right])
        assert r.score == 3 and "peak memory" in r.feedback and "MB" in r.feedback, r.feedback


def test_memory_carries_half_of_lab02_and_is_scored_on_its_own():
    """A tiled forward with a wrong answer keeps the memory points; the memory parts carry over half the lab."""
    questions = get_lab("lab02").questions
    memory = sum(lab02.MEMORY_POINTS for q in questions.values() if q.name in ("q2", "q3"))
    assert memory >= get_lab("lab02").max_score / 2
    r = run_question("lab02", "q2", [lab02._switch(rescale_l=False)])
    assert r.score == lab02.MEMORY_POINTS and "[ok  ] memory" in r.feedback, r.feedback
    r = run_question("lab02", "q2", [lambda Q, K, V, bq, bk: (np.zeros((len(Q), V.shape[1] + 1)), np.zeros(len(Q)))])
    assert r.score == 0 and "memory not measured" in r.feedback, r.feedback


def _template_unfilled(Q, K, V, block_q, block_k):
    """Lab 02's template with its `raise` line deleted: the arrays it allocates, returned unfilled."""
    return np.empty((len(Q), V.shape[1])), np.empty(len(Q))


def _template_zeros(Q, K, V, block_q, block_k):
    return np.zeros((len(Q), V.shape[1])), np.empty(len(Q))


def _backward_template(Q, K, V, O, L, dO, block_q, block_k):
    """Lab 04's template with its `raise` line deleted."""
    return np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)


def test_the_templates_arrays_returned_unfilled_earn_no_memory_points():
    """Deleting a stub's `raise` line returns the template's arrays: of the right shapes, allocated tile-free,
    so they used to earn the memory points that a wrong but tiled attempt keeps. Memory is now scored only for
    arrays computed from the inputs; a wrong tiled attempt still earns it (above)."""
    for q in ("q2", "q3"):
        for fn in (_template_unfilled, _template_zeros):
            r = run_question("lab02", q, [fn])
            assert r.score == 0, r.feedback
            assert "memory not measured" in r.feedback and ("template" in r.feedback), r.feedback
    r = run_question("lab04", "q1", [_backward_template])
    assert r.score == 0 and "memory not measured" in r.feedback and "template" in r.feedback, r.feedback
    # the solution still earns everything; a backward with a wrong answer (dV from the wrong P) keeps memory
    r = run_question("lab04", "q1", [solution_object("lab04", "flash_backward")])
    assert r.score == r.max_score, r.feedback
    right = solution_object("lab04", "flash_backward")

    def wrong_dv(Q, K, V, O, L, dO, block_q, block_k):
        dQ, dK, dV = right(Q, K, V, O, L, dO, block_q, block_k)
        return dQ, dK, 1.5 * dV

    r = run_question("lab04", "q1", [wrong_dv])
    assert "[ok  ] memory" in r.feedback and r.score < r.max_score, r.feedback


def test_a_forward_that_raises_at_the_memory_size_is_not_measured():
    forward = solution_object("lab02", "flash_forward")

    def fails_when_large(Q, K, V, block_q, block_k):
        if len(Q) > 1000:
            raise MemoryError("Unable to allocate 134 MB")
        return forward(Q, K, V, block_q, block_k)

    r = run_question("lab02", "q2", [fails_when_large])
    memory = [line for line in r.feedback.splitlines() if line.startswith("[FAIL] memory")]
    assert memory and "(not measured: your code raised MemoryError)" in memory[0], r.feedback
    assert "peak" not in r.feedback and "memory not measured: your code raised MemoryError" in r.feedback, r.feedback
    assert r.score == lab02.CORRECTNESS_POINTS, r.feedback


def test_stub_scores_zero_with_not_implemented():
    def stub(*args):
        raise NotImplementedError("write your solution here")

    for lab_id in ("lab01", "lab02"):
        for q in get_lab(lab_id).questions.values():
            r = run_question(lab_id, q.name, [stub] * len(q.objects))
            assert r.score == 0 and "not implemented yet" in r.feedback


@pytest.mark.parametrize("ret", [None, "text", (1, 2, 3), [[1, 2], [3]], np.zeros((2, 2))])
def test_wrong_return_values_give_feedback_not_a_crash(ret):
    r = run_question("lab02", "q2", [lambda *a: ret])
    assert r.score == 0 and r.feedback


def test_exceptions_are_reported_with_the_smallest_input():
    def broken(Q, K, V, block_q, block_k):
        raise IndexError("index 7 is out of bounds")

    r = run_question("lab02", "q2", [broken])
    assert r.score == 0 and "IndexError: index 7 is out of bounds" in r.feedback
    assert "Smallest failing input" in r.feedback


def test_an_endless_loop_is_stopped_by_the_time_limit():
    def forever(n, block):
        while True:
            pass

    t0 = time.perf_counter()
    r = run_question("lab02", "q1", [forever], time_limit=1.0)
    assert r.score == 0 and "took longer" in r.feedback and time.perf_counter() - t0 < 10


def test_a_seed_replays_the_same_inputs():
    a = run_question("lab01", "q1", [lab01._update_no_rescale], seed=1234)
    b = run_question("lab01", "q1", [lab01._update_no_rescale], seed=1234)
    assert a.seed == b.seed == 1234 and a.feedback == b.feedback and a.score == b.score


def test_fresh_inputs_every_run():
    seen = {run_question("lab01", "q1", [lab01._update_no_rescale]).feedback for _ in range(3)}
    assert len(seen) > 1


def test_check_prints_points_and_defers_in_batch_mode(capsys, monkeypatch):
    check = lab("lab01")
    check("q3", lab01._attend_average)
    out = capsys.readouterr().out
    assert out.startswith("q3: 0/2 points") and "seed" in out and "averaging block results" in out
    check("q9", lab01._attend_average)
    assert "has no question 'q9'" in capsys.readouterr().out
    monkeypatch.setenv(core.BATCH_ENV, "1")
    check("q3", lab01._attend_average)
    assert "deferred" in capsys.readouterr().out


def test_registry():
    assert {"lab01", "lab02"} <= set(available_labs())
    with pytest.raises(ValueError, match="unknown lab"):
        get_lab("lab99")
    with pytest.raises(ValueError, match="lab id"):
        get_lab("../etc")


def test_lab_is_found_from_metadata_call_or_name():
    p = pathlib.Path("alice.ipynb")
    assert batch.find_lab_id({"metadata": {"flashlab": {"lab": "lab02"}}, "cells": []}, p) == "lab02"
    cell = {"cell_type": "code", "source": 'from flashlab.grading import lab; check = lab("lab01")'}
    assert batch.find_lab_id({"cells": [cell]}, p) == "lab01"
    assert batch.find_lab_id({"cells": []}, pathlib.Path("lab02_mine.ipynb")) == "lab02"
    assert batch.find_lab_id({"cells": []}, p) is None


# ----------------------------------------------------------------------------------------- the batch grader
def _solution_code_cells() -> list:
    nb = nbformat.read(ROOT / "solutions" / "lab01_online_softmax.ipynb", as_version=4)
    return [nbformat.v4.new_code_cell(c.source) for c in nb.cells if c.cell_type == "code" and "def " in c.source]


# Seconds per submission in the hostile batch: a cell is interrupted at half of it and each question gets a
# quarter (flashlab.grading.batch). At 25 s a question of an honest submission could run out of its 6 s on a
# loaded two-core machine; 40 s leaves each 10 s while the endless cells still end the batch in about a minute.
BATCH_TIMEOUT = 40

SURVIVOR = "987654321"  # argument of a sleep a submission leaves behind; no process with it may outlive grading

# A wrong online_update whose mistakes depend on the inputs drawn: its partial credit varies with the seed.
FLAKY_SOURCE = """
_right_update = online_update
def online_update(*args, **kwargs):
    out = _right_update(*args, **kwargs)
    total = 0.0
    for a in args:
        try:
            total += float(np.sum(np.nan_to_num(np.asarray(a, dtype=float), posinf=0.0, neginf=0.0)))
        except (TypeError, ValueError):
            pass
    return out if total > 0 else tuple(np.asarray(x, dtype=float) + 1.0 for x in out)
"""

# Cheats that worked while the questions ran in the notebook's own kernel, each with a wrong online_update.
WRONG_SOURCE = """
def online_update(m, l, u, scores, values):
    return (0.0, 0.0, 0.0)
"""
PATCH_GRADER_SOURCE = """
import flashlab.grading.core as _core
_core.run_question = lambda lab_id, name, objects, **kw: _core.Result(name, 99.0, 5.0, "patched", 0)
_core.allclose = lambda *a, **k: True
""" + WRONG_SOURCE
# Returns the expected value it finds in a caller's frame, which holds it when the check runs in this process.
STACK_WALK_SOURCE = """
import inspect
def online_update(m, l, u, scores, values):
    for info in inspect.stack():
        expected = info.frame.f_locals.get("expected")
        if isinstance(expected, tuple) and len(expected) == 3:
            return expected
    return (0.0, 0.0, 0.0)
"""
# Hands in the course's own answer; in the sandbox the package copy has no body for it, only a raise naming it.
COURSE_ANSWER_SOURCE = """
from flashlab import online as _online
def online_update(m, l, u, scores, values):
    state = _online.State(np.float64(m), np.float64(l), np.asarray(u, dtype=float))
    return tuple(_online.update(state, np.asarray(scores, float), np.asarray(values, float)))
"""


def _submission(path: pathlib.Path, bad_source: str | None, lab_line: bool = True, after: str | None = None
                ) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    head = "import numpy as np\n" + ('from flashlab.grading import lab; check = lab("lab01")' if lab_line else "")
    cells = [nbformat.v4.new_code_cell(head)]
    if bad_source:
        cells.append(nbformat.v4.new_code_cell(bad_source))
    cells += _solution_code_cells()
    if after:
        cells.append(nbformat.v4.new_code_cell(after))
    nb.cells = cells + [nbformat.v4.new_code_cell('check("q1", online_update)')]
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def bad_batch(tmp_path_factory):
    d = tmp_path_factory.mktemp("submissions")
    subs = {
        "raises": _submission(d / "raises.ipynb", 'raise RuntimeError("boom")'),
        "hangs": _submission(d / "hangs.ipynb", "while True:\n    pass"),
        # two endless cells: they share the cells' budget, and the questions still have their time
        "hangs_twice": _submission(d / "hangs_twice.ipynb", "while True:\n    pass", after="while True:\n    pass"),
        "hangs_hard": _submission(
            d / "hangs_hard.ipynb",
            f"import signal, subprocess\nsubprocess.Popen(['sleep', {SURVIVOR!r}])\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignores the interrupt: only a kill stops it\n"
            "while True:\n    pass",
        ),
        "prints": _submission(d / "prints.ipynb", 'import sys\nfor _ in range(40):\n    sys.stdout.write("x" * 10**6)'),
        "deletes": _submission(d / "deletes.ipynb", 'import os\nfor f in os.listdir("."):\n    os.remove(f)'),
        "nolab": _submission(d / "nolab.ipynb", None, lab_line=False),
        "exits": _submission(d / "exits.ipynb", "import os\nos._exit(3)  # kills its own kernel"),
        # The import fails; a later cell then fails with a NameError that is only its consequence.
        "noimport": _submission(d / "noimport.ipynb", "import flashlab_no_such_module",
                                after="del online_update\nonline_update = flashlab_no_such_module.update"),
        "wrong": _submission(d / "wrong.ipynb", None, after=WRONG_SOURCE),
        "patches_grader": _submission(d / "patches_grader.ipynb", None, after=PATCH_GRADER_SOURCE),
        "walks_stack": _submission(d / "walks_stack.ipynb", None, after=STACK_WALK_SOURCE),
        "course_answer": _submission(d / "course_answer.ipynb", None, after=COURSE_ANSWER_SOURCE),
    }
    (d / "garbage.ipynb").write_text("this is not a notebook {")
    subs["garbage"] = d / "garbage.ipynb"
    (d / "sentinel.txt").write_text("must survive")
    before = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in subs.items()}
    csv_path = d.parent / f"{d.name}.csv"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = batch.main([str(d), str(d / "missing.ipynb"), "--json", "--csv", str(csv_path),
                         "--timeout", str(BATCH_TIMEOUT), "--jobs", "2", "--seed", "11", *SANDBOX_FLAGS])
    rows = {pathlib.Path(r["path"]).stem: r for r in map(json.loads, buf.getvalue().splitlines())}
    after = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in subs.items()}
    return {"rc": rc, "rows": rows, "before": before, "after": after, "dir": d, "csv": csv_path}


def test_batch_survives_a_raising_cell(bad_batch):
    r = bad_batch["rows"]["raises"]
    assert bad_batch["rc"] == 0 and r["error"] is None and r["score"] == r["max_score"] == 10, r


def test_batch_interrupts_an_endless_cell_and_still_grades(bad_batch):
    r = bad_batch["rows"]["hangs"]
    assert r["error"] is None and r["score"] == r["max_score"], r
    twice = bad_batch["rows"]["hangs_twice"]
    assert twice["error"] is None and twice["score"] == twice["max_score"], twice
    assert (twice["notebook_error"] or "").startswith("cell 2 was interrupted"), twice


def _survivors() -> list[int]:
    found = []
    for status in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = status.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", SURVIVOR.encode()]:
            found.append(int(status.parent.name))
    return found


def test_batch_kills_a_submission_that_ignores_interrupts(bad_batch):
    r = bad_batch["rows"]["hangs_hard"]
    assert r["score"] == 0 and f"timed out after {BATCH_TIMEOUT} s" in r["error"], r
    if NO_SANDBOX:
        pytest.skip(f"unsandboxed, processes a submission starts may outlive it: {NO_SANDBOX}")
    assert _survivors() == [], "a process the submission started outlived grading"


def test_rows_say_sandboxed_and_carry_the_seed(bad_batch):
    for name, r in bad_batch["rows"].items():
        assert r["seed"] == 11, name
        assert r["sandboxed"] is (NO_SANDBOX is None), name


def test_patching_the_grader_inside_the_notebook_changes_nothing(bad_batch):
    r, honest = bad_batch["rows"]["patches_grader"], bad_batch["rows"]["wrong"]
    assert r["error"] is None and r["questions"][0]["score"] == 0 and "patched" not in r["questions"][0]["feedback"]
    assert [q["score"] for q in r["questions"]] == [q["score"] for q in honest["questions"]]
    assert honest["score"] < honest["max_score"]


def test_the_notebook_cannot_see_expected_values(bad_batch):
    namespace: dict = {"np": np}
    exec(STACK_WALK_SOURCE, namespace)
    assert run_question("lab01", "q1", [namespace["online_update"]]).score > 0  # in one process, the cheat works
    r = bad_batch["rows"]["walks_stack"]
    assert r["error"] is None and r["questions"][0]["score"] == 0


def test_the_course_answer_scores_zero_and_is_named(bad_batch):
    r = bad_batch["rows"]["course_answer"]
    q1 = r["questions"][0]
    assert r["error"] is None and q1["name"] == "q1" and q1["score"] == 0, r
    assert "calls flashlab.online.update" in q1["feedback"], r
    assert r["questions"][1]["score"] == r["questions"][1]["max_score"], r  # its other answers are its own


def test_feedback_shows_the_notebooks_first_error(bad_batch):
    r = bad_batch["rows"]["noimport"]
    assert r["error"] is None and r["score"] < r["max_score"], r
    assert r["notebook_error"] == "cell 2 raised ModuleNotFoundError: No module named 'flashlab_no_such_module'", r
    q1 = r["questions"][0]
    assert q1["score"] == 0 and "cell 2 raised ModuleNotFoundError" in q1["feedback"], r
    assert "NameError" not in q1["feedback"], r
    raises = bad_batch["rows"]["raises"]
    assert raises["notebook_error"] == "cell 2 raised RuntimeError: boom", raises


def test_batch_survives_megabytes_of_output(bad_batch):
    r = bad_batch["rows"]["prints"]
    assert r["error"] is None and r["score"] == r["max_score"], r


def test_batch_survives_a_submission_that_deletes_files(bad_batch):
    r = bad_batch["rows"]["deletes"]
    assert r["error"] is None and r["score"] == r["max_score"], r
    assert (bad_batch["dir"] / "sentinel.txt").read_text() == "must survive"


def test_batch_survives_a_kernel_that_dies(bad_batch):
    r = bad_batch["rows"]["exits"]
    assert r["score"] == 0 and "kernel died" in r["error"]


def test_submissions_bytes_unchanged(bad_batch):
    assert bad_batch["before"] == bad_batch["after"]


def test_error_rows_for_unknown_lab_unreadable_and_missing(bad_batch):
    rows = bad_batch["rows"]
    assert "cannot tell which lab" in rows["nolab"]["error"]
    assert "not a readable notebook" in rows["garbage"]["error"]
    assert "cannot read" in rows["missing"]["error"]
    for k in ("nolab", "garbage", "missing"):
        assert rows[k]["score"] == 0 and rows[k]["max_score"] == 0


def test_batch_csv_and_json_formats(bad_batch):
    rows = bad_batch["rows"]
    assert len(rows) == len(list(bad_batch["dir"].glob("*.ipynb"))) + 1  # every notebook, and the missing one
    for r in rows.values():
        assert {"path", "score", "max_score", "questions"} <= set(r)
    graded = rows["raises"]
    assert [q["name"] for q in graded["questions"]] == ["q1", "q2", "q3"]
    with open(bad_batch["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert [c for c in table[0]] == ["student", "path", "lab", "q1", "q2", "q3", "total", "max_score", "error"]
    by_student = {r["student"]: r for r in table}
    assert set(by_student) == set(rows)
    assert float(by_student["raises"]["total"]) == 10 and by_student["hangs_hard"]["error"].startswith("timed out")


def test_cli_entry_points(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "flashlab", "grade", str(tmp_path / "nope.ipynb")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "cannot read" in out.stdout and "nope.ipynb" in out.stdout
    out = subprocess.run([sys.executable, "-m", "flashlab", "release", "--check"], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "flashlab", "grade", "--timeout", "0", "x.ipynb"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "--timeout" in out.stderr


def test_a_seed_reproduces_scores_and_feedback_tells_how_to_replay(tmp_path):
    sub = _submission(tmp_path / "lab01_flaky.ipynb", None, after=FLAKY_SOURCE)
    # Seed 18 draws inputs on which this submission earns part of q1's points (most seeds give 1 or 2 of 5).
    first, again, other = (batch.grade_one(sub, timeout=120, seed=s, sandboxed=NO_SANDBOX is None)
                           for s in (18, 18, 8))
    assert first["error"] is None and first["questions"] == again["questions"]
    assert first["questions"] != other["questions"]  # other inputs: other failing cases shown
    q1 = first["questions"][0]
    assert 0 < q1["score"] < q1["max_score"], q1
    q_seed = batch.question_seed(18, "q1")
    assert f"replay: check('q1', ..., seed={q_seed})" in q1["feedback"]
    # The replay, in the student's own process, gives the same score.
    namespace = {"np": np}
    for cell in _solution_code_cells():
        exec(cell.source, namespace)
    exec(FLAKY_SOURCE, namespace)
    replayed = run_question("lab01", "q1", [namespace["online_update"]], seed=q_seed)
    assert replayed.score == q1["score"] and replayed.feedback in q1["feedback"]


def test_grading_refuses_without_a_sandbox_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda bwrap=None: "bwrap not found (test)")
    assert batch.main([str(tmp_path / "x.ipynb")]) == 2
    err = capsys.readouterr().err
    assert "bwrap not found (test)" in err and "apt-get install bubblewrap" in err and "--no-sandbox" in err


# A lab's given quick-look cells compare the learner's code with the package's (lab 03: iocount.count). In the
# sandbox that function is a stub raising AnswerCalled, so the given cell raises whatever the learner wrote.
LAB03_CHEAT = '''
def standard_counts(n, d, sram, block_q, block_k):
    from flashlab import iocount
    c = iocount.count("standard", n, d, sram=sram, block_q=block_q, block_k=block_k)
    return c.reads, c.writes
'''
LAB03_OWN_CELL = '''
def standard_counts(n, d, sram, block_q, block_k):
    return counted.reads, counted.writes


from flashlab import iocount
counted = iocount.count("standard", 301, 16, sram=2000, block_q=24, block_k=20)
'''


@pytest.fixture(scope="module")
def lab03_batch(tmp_path_factory):
    d = tmp_path_factory.mktemp("lab03")
    solution = next((ROOT / "solutions").glob("lab03_*.ipynb"))
    for name, extra in (("answer_in_function", LAB03_CHEAT), ("answer_in_own_cell", LAB03_OWN_CELL)):
        nb = nbformat.read(solution, as_version=4)
        at = next(i for i, c in enumerate(nb.cells) if "def standard_counts(" in c.source)
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(extra))
        nbformat.write(nb, d / f"{name}.ipynb")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        batch.main([str(d), "--json", "--timeout", "120", "--seed", "5", *SANDBOX_FLAGS])
    return {pathlib.Path(r["path"]).stem: r for r in map(json.loads, buf.getvalue().splitlines())}


def test_a_given_cell_that_reaches_an_answer_is_not_named_as_the_learners_error(lab03_batch):
    r = lab03_batch["answer_in_function"]
    q1 = next(q for q in r["questions"] if q["name"] == "q1")
    assert q1["score"] == 0 and "the course's own answer to this question" in q1["feedback"]
    assert r["notebook_error"] is None and "first error" not in q1["feedback"]


def test_a_learners_own_cell_that_reaches_an_answer_is_named(lab03_batch):
    r = lab03_batch["answer_in_own_cell"]
    assert r["notebook_error"] and "raised AnswerCalled" in r["notebook_error"], r["notebook_error"]
    q1 = next(q for q in r["questions"] if q["name"] == "q1")
    assert q1["score"] < q1["max_score"]
    assert q1["feedback"].startswith(f"Your notebook's first error: {r['notebook_error']}")


# A CUDA lab's answer is a string built from lines the lab's grading module holds; in the sandbox's copy of the
# package those constants are poisoned, so a kernel assembled from them fails to compile and names them.
CUDA_CHEATS = {
    "lab06_solution": ("lab06", "from flashlab.grading import lab06 as _l\nKERNEL = _l.render(_l.SOLUTION)\n",
                       ("q1", "q2"), "flashlab.grading.lab06.SOLUTION"),
    "lab06_mutant_parts": ("lab06", "from flashlab.grading import lab06 as _l\nKERNEL = _l.render(_l._update())\n",
                           ("q1", "q2"), "flashlab.grading.lab06._"),
    "lab07_solution": ("lab07", "from flashlab.grading import lab07 as _l\n"
                                "KERNEL = _l.render_kernel(_l.KERNEL_SOLUTION)\n", ("q5",),
                       "flashlab.grading.lab07.KERNEL_SOLUTION"),
}


@pytest.fixture(scope="module")
def cuda_batch(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda_labs")
    for lab_id in ("lab06", "lab07"):
        solution = next((ROOT / "solutions").glob(f"{lab_id}_*.ipynb"))
        nbformat.write(nbformat.read(solution, as_version=4), d / f"{lab_id}_honest.ipynb")
    for name, (lab_id, cheat, _, _) in CUDA_CHEATS.items():
        nb = nbformat.read(next((ROOT / "solutions").glob(f"{lab_id}_*.ipynb")), as_version=4)
        at = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "KERNEL = " in c.source)
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(cheat))
        nbformat.write(nb, d / f"{name}.ipynb")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        batch.main([str(d), "--json", "--timeout", "300", "--seed", "3", *SANDBOX_FLAGS])
    return {pathlib.Path(r["path"]).stem: r for r in map(json.loads, buf.getvalue().splitlines())}


@pytest.mark.skipif(NO_SANDBOX, reason="the poisoned copy of the package is what the sandbox runs")
def test_a_kernel_built_from_the_courses_lines_scores_zero_and_is_named(cuda_batch):
    for lab_id in ("lab06", "lab07"):
        honest = cuda_batch[f"{lab_id}_honest"]
        assert honest["error"] is None and honest["score"] == honest["max_score"], honest
    for name, (_, _, questions, named) in CUDA_CHEATS.items():
        row = cuda_batch[name]
        scores = {q["name"]: q for q in row["questions"]}
        for question in questions:
            assert scores[question]["score"] == 0, (name, scores[question])
        assert named in scores[questions[0]]["feedback"] and "course's own answer" in scores[questions[0]]["feedback"]
