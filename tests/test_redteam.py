"""The red-team suite: a class of hostile lab 01 submissions (tests/redteam/attacks.py, one per attack) graded
beside honest, wrong and broken ones in ONE run of ``python -m flashlab grade --json``, as an instructor runs it.

Cheats score 0 on what they cheat; honest, wrong and broken submissions score exactly what they score when graded
without the others (same ``--seed``); no submission's bytes change, nor any file outside the sandbox (sentinels,
the repository's flashlab/, solutions/ and labs/); a decoy process survives; nothing started by the run outlives
it; nothing reaches the host's network; no submission sees another's notebook. See CONTRIBUTING.md, "Labs and
grading". Skipped, with the reason, where bubblewrap cannot sandbox (CI installs it).
"""

from __future__ import annotations

import json
import os
import re

import pytest
from redteam import attacks as A
from redteam import harness as H

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name != "posix", reason="the sandbox needs Linux")]

SEED = 4242
OPTIONS = ["--lab", A.LAB, "--jobs", "2", "--timeout", "120", "--seed", str(SEED)]


def _sandbox_problem() -> str | None:
    try:
        from flashlab.grading import sandbox
    except ImportError as e:
        return f"no sandbox module: {e}"
    return sandbox.sandbox_problem()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> H.ClassRun:
    problem = _sandbox_problem()
    if problem is not None:
        pytest.skip(f"no usable sandbox here: {problem}")
    return H.run_class(tmp_path_factory.mktemp("redteam"), OPTIONS)


def _graded(run: H.ClassRun) -> H.Graded:
    """The class run, which must have graded something: a grader that refused to start proves nothing."""
    assert run.graded is not None, run.error
    assert run.graded.returncode == 0 and run.graded.rows, f"the grader did not grade: {run.graded.stderr[-2000:]}"
    return run.graded


def test_the_run_completes_with_a_row_for_every_submission(run):
    graded = _graded(run)
    assert graded.returncode == 0, graded.stderr
    missing = sorted(set(run.files.values()) - set(graded.rows))
    assert not missing, f"no row for {missing}; stderr: {graded.stderr[-2000:]}"
    huge = [name for name, row in graded.rows.items() if len(json.dumps(row)) > 1 << 20]
    assert not huge, f"rows over 1 MB (printed output must be capped): {huge}"
    for name, row in graded.rows.items():
        assert row["lab"] == A.LAB and row["max_score"] > 0, (f"{name}: an error row keeps its lab and maximum "
                                                              f"(error: {row.get('error')}; stderr: "
                                                              f"{graded.stderr[-3000:]})")


def test_no_submission_is_changed(run):
    _graded(run)
    assert not run.changed_submissions, f"changed in the class folder: {run.changed_submissions}"


def test_nothing_outside_the_sandbox_changes(run):
    _graded(run)
    assert not run.changed_outside, f"changed outside the sandbox: {run.changed_outside}"


def test_the_decoy_process_survives(run):
    _graded(run)
    assert run.decoy_alive, "the instructor's decoy process was killed during grading"


def test_nothing_the_run_started_outlives_it(run):
    _graded(run)
    assert not run.leftovers, f"still running after the grader finished: {run.leftovers}"


def test_no_submission_reaches_the_host_network(run):
    _graded(run)
    assert run.connections == 0, f"{run.connections} connection(s) reached a listener on the host's 127.0.0.1"


def test_no_submission_sees_another(run):
    graded = _graded(run)
    leaks = []
    for attack, file in run.files.items():
        row = json.dumps(graded.rows.get(file, {}))
        stolen = set(re.findall(rf"secret-{run.ctx.marker}-(\w+)", row)) - {attack}
        if stolen:
            leaks.append(f"{attack} shows {sorted(stolen)}")
    assert not leaks, "; ".join(leaks)


def test_honest_wrong_and_broken_score_as_when_graded_alone(run):
    graded = _graded(run)
    differ = []
    for attack in (a for a in A.ATTACKS if a.kind in ("honest", "wrong", "broken")):
        file = run.files[attack.name]
        alone, together = run.alone.rows.get(file), graded.rows.get(file)
        assert alone is not None, f"{file} got no row when graded alone: {run.alone.stderr[-2000:]}"
        if together is None or H.scores(together) != H.scores(alone) or together["score"] != alone["score"]:
            differ.append(f"{attack.name}: alone {H.scores(alone)}, in the class "
                          f"{together and H.scores(together)}")
    assert not differ, "; ".join(differ)
    honest = run.alone.rows[run.files["honest"]]
    assert honest["score"] == honest["max_score"] > 0, honest
    assert run.alone.rows[run.files["stub"]]["score"] == 0


def test_each_cheat_scores_zero_on_what_it_cheats(run):
    graded = _graded(run)
    cheated = []
    for attack in (a for a in A.ATTACKS if a.targets):
        row = graded.rows.get(run.files[attack.name])
        got = {} if row is None else H.scores(row)
        won = {q: got[q] for q in attack.targets if got.get(q, 0) > 0}
        if row is None or won:
            cheated.append(f"{attack.name} ({attack.what}): {won or 'no row'}")
    assert not cheated, "cheats that scored: " + "; ".join(cheated)


def test_the_course_answer_is_named_in_the_feedback(run):
    row = _graded(run).rows.get(run.files["course_answer"])
    assert row is not None
    unnamed = [q["name"] for q in row["questions"] if not re.search(r"flashlab\.online", q["feedback"])]
    assert not unnamed, f"feedback does not name the course's function for {unnamed}: {row['questions']}"


def test_a_broken_notebook_shows_its_own_first_error(run):
    row = _graded(run).rows.get(run.files["broken"])
    assert row is not None
    assert re.search(r"ModuleNotFoundError.*torch|No module named .torch.", json.dumps(row)), row
