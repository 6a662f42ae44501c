"""The gradebook: a CSV per lab with a row per student, a feedback file per student, and the class summary.

Most tests build grader rows by hand (the shape :func:`flashlab.grading.batch.grade_one` returns); the last ones
grade real notebooks (the solved lab 01, its released copy, and a copy with a known mistake) under student names.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import pathlib
import re
import shutil
import types

import nbformat
import pytest

import flashlab
from flashlab.grading import batch, get_lab, lab01, report, run_question, sandbox
from flashlab.grading.core import mistake_title

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_RESCALE = mistake_title(lab01.UPDATE_MUTANTS[0].message)


def _row(path: str, scores: dict[str, float] | None, *, error: str | None = None, seed: int | None = 7,
         sandboxed: bool | None = True, diagnoses: dict[str, list[str]] | None = None, lab: str | None = "lab01"):
    """A grader row of lab 01 with the given points per question (None: an error row)."""
    questions = []
    if lab is not None:
        for name, q in get_lab(lab).questions.items():
            got = 0.0 if scores is None else scores.get(name, q.points)
            feedback = error or ("" if got == q.points else f"[FAIL] {name} lost points")
            questions.append({"name": name, "score": got, "max_score": q.points, "feedback": feedback, "seed": seed,
                              "diagnoses": (diagnoses or {}).get(name, [])})
    row = {"path": path, "lab": lab, "score": sum(q["score"] for q in questions),
           "max_score": sum(q["max_score"] for q in questions), "questions": questions, "error": error}
    if sandboxed is not None:
        row["sandboxed"] = sandboxed
    return row


def _read_csv(path: pathlib.Path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["id"]: r for r in csv.DictReader(f)}


def _args(out, **kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"json": False, "csv": None, "feedback": False, "out": str(out), **kw})


# ------------------------------------------------------------------------------------------- ids and rosters
def test_ids_come_from_the_named_group_the_first_group_or_the_path():
    assert report.id_from_path("subs/lab01_alice.ipynb", report.compile_id_pattern(r"lab01_(\w+)\.ipynb")) == "alice"
    named = report.compile_id_pattern(r"(?P<lab>lab\d+)_(?P<id>[a-z]+)")
    assert report.id_from_path("lab01_bob.ipynb", named) == "bob"
    by_folder = report.compile_id_pattern(r"subs/([^/]+)/")
    assert report.id_from_path("subs/carol/lab01.ipynb", by_folder) == "carol"
    assert report.id_from_path("subs/x/lab01_dave.ipynb", None) == "lab01_dave"
    assert report.id_from_path("notes.ipynb", named) is None
    with pytest.raises(ValueError, match="name the id"):
        report.compile_id_pattern(r"(a)(b)")
    with pytest.raises(ValueError, match="not a regular expression"):
        report.compile_id_pattern("(")


def test_roster_matches_by_file_pattern_or_id(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("ID,file,pattern,name\nalice,alice/lab01.ipynb,,Alice\nbob,,^b0b,Bob\ncarol,,,Carol\n\n")
    entries = report.read_roster(roster)
    assert [e.id for e in entries] == ["alice", "bob", "carol"]
    pattern = report.compile_id_pattern(r"_(\w+)\.ipynb$")
    assert report.identify("subs/alice/lab01.ipynb", roster=entries) == ("alice", "")
    assert report.identify("subs/b0b-final.ipynb", roster=entries) == ("bob", "")
    assert report.identify("subs/lab01_carol.ipynb", id_pattern=pattern, roster=entries) == ("carol", "")
    sid, why = report.identify("subs/lab01_eve.ipynb", id_pattern=pattern, roster=entries)
    assert sid is None and "not in the roster" in why and "'eve'" in why
    assert report.identify("notes.ipynb", id_pattern=pattern) == (None, "its file name does not match --id-pattern")


@pytest.mark.parametrize("text, reason", [
    ("name,file\nalice,a.ipynb\n", "no column 'id'"),
    ("id,file\nalice,a.ipynb\nalice,b.ipynb\n", "appears twice"),
    ("id,pattern\nalice,(\n", "line 2: pattern"),
    ("id,file\n,a.ipynb\n", "empty id"),
])
def test_a_bad_roster_is_refused_before_any_grading(tmp_path, capsys, text, reason):
    roster = tmp_path / "roster.csv"
    roster.write_text(text)
    with pytest.raises(ValueError, match=re.escape(reason)):
        report.read_roster(roster)
    # main checks the roster before it collects anything: the submission below does not exist
    with pytest.raises(SystemExit) as stop:
        batch.main([str(tmp_path / "missing.ipynb"), "--out", str(tmp_path / "book"), "--roster", str(roster)])
    assert stop.value.code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "book").exists()


def test_id_flags_need_a_gradebook(tmp_path, capsys):
    with pytest.raises(SystemExit):
        batch.main([str(tmp_path), "--id-pattern", "(.*)"])
    assert "add --out DIR" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- the CSV
def test_one_csv_per_lab_with_a_row_per_student(tmp_path):
    rows = [
        _row("subs/lab01_alice.ipynb", {"q1": 5, "q2": 1.5}, seed=11),
        _row("subs/lab01_bob.ipynb", None, error="timed out after 300 s", seed=12, sandboxed=False),
        _row("subs/lab01_carol.ipynb", None, error="not a readable notebook", lab=None, sandboxed=None),
    ]
    book = report.build(rows, id_pattern=report.compile_id_pattern(r"lab01_(\w+)"), graded_at="2026-01-02T03:04:05Z")
    report.write_gradebook(book, tmp_path)
    with open(tmp_path / "lab01.csv", newline="") as f:
        head = next(csv.reader(f))
    assert head == ["id", "q1", "q2", "q3", "total", "max_score", "seed", "sandboxed", "grader_version", "graded_at",
                    "error", "submission"]
    table = _read_csv(tmp_path / "lab01.csv")
    assert list(table) == ["alice", "bob", "carol"]
    alice, bob, carol = table["alice"], table["bob"], table["carol"]
    assert (alice["q1"], alice["q2"], alice["q3"], alice["total"]) == ("5", "1.5", "2.0", "8.5")
    assert alice["seed"] == "11" and alice["sandboxed"] == "yes" and alice["error"] == ""
    assert alice["graded_at"] == "2026-01-02T03:04:05Z"
    assert alice["grader_version"] == report.grader_version("lab01")
    assert alice["grader_version"].startswith(flashlab.__version__ + "+")
    # error rows keep their lab and maximum; an unreadable notebook is placed by its file name
    assert bob["error"] == "timed out after 300 s" and bob["total"] == "0.0" and bob["max_score"] == "10.0"
    assert bob["sandboxed"] == "no"
    assert carol["error"] == "not a readable notebook" and carol["max_score"] == "10.0" and carol["sandboxed"] == ""


def test_a_notebook_without_a_lab_goes_to_the_only_lab_of_the_run_else_is_reported():
    garbage = _row("garbage.ipynb", None, error="not a readable notebook", lab=None)
    book = report.build([_row("a.ipynb", {}), garbage])
    assert [s.id for s in book.students["lab01"]] == ["a", "garbage"] and not book.unmatched
    assert book.students["lab01"][1].row["max_score"] == get_lab("lab01").max_score
    book = report.build([_row("a.ipynb", {}), _row("b.ipynb", {}, lab="lab02"), garbage])
    assert [r["path"] for r, _ in book.unmatched] == ["garbage.ipynb"]
    assert "cannot tell which lab" in book.problems[0]


def test_rows_without_a_run_seed_show_the_questions_seeds():
    row = _row("a.ipynb", {}, seed=None)
    for q, seed in zip(row["questions"], (3, 4, 5), strict=True):
        q["seed"] = seed
    assert report.seed_text(row) == "q1=3 q2=4 q3=5"
    row["seed"] = 9
    assert report.seed_text(row) == "9"


def test_the_grader_version_changes_with_the_graders_source(tmp_path, monkeypatch):
    before = report.grader_version("lab01")
    assert report.grader_version("lab02") != before
    copy = tmp_path / "lab01.py"
    copy.write_text(pathlib.Path(lab01.__file__).read_text() + "\n# points changed\n")
    real = importlib.util.find_spec

    def find_spec(name, *args):
        spec = real(name, *args)
        return types.SimpleNamespace(origin=str(copy)) if name == "flashlab.grading.lab01" else spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    report.grader_version.cache_clear()
    try:
        changed = report.grader_version("lab01")
    finally:
        monkeypatch.undo()
        report.grader_version.cache_clear()
    assert changed != before and changed.split("+")[0] == before.split("+")[0]
    assert report.grader_version("lab01") == before


def test_roster_students_without_a_submission_and_strangers_are_reported(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("id\nalice\nbob\n")
    rows = [_row("lab01_alice.ipynb", {}), _row("lab01_zoe.ipynb", {"q1": 0})]
    options = report.Options(report.compile_id_pattern(r"_(\w+)\."), report.read_roster(roster))
    book = report.build(rows, id_pattern=options.id_pattern, roster=options.roster)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        rc = report.emit(rows, _args(tmp_path / "book", json=True), options, err=err)
    printed = [json.loads(line)["path"] for line in stdout.getvalue().splitlines()]
    assert rc == 0 and printed == [r["path"] for r in rows]
    table = _read_csv(tmp_path / "book" / "lab01.csv")
    assert list(table) == ["alice", "bob"]
    assert table["bob"]["error"] == report.NO_SUBMISSION and table["bob"]["total"] == "0"
    assert table["bob"]["max_score"] == "10.0"
    assert [r["path"] for r, _ in book.unmatched] == ["lab01_zoe.ipynb"]
    assert "lab01_zoe.ipynb is in no lab file: not in the roster (id 'zoe')" in err.getvalue()
    summary = (tmp_path / "book" / "summary.md").read_text()
    assert "lab01_zoe.ipynb" in summary and "not in the roster" in summary
    assert "No submission was received" in (tmp_path / "book" / "feedback" / "bob.md").read_text()


def test_two_submissions_with_one_id_are_an_error_not_an_overwrite(tmp_path):
    rows = [_row("early/lab01_alice.ipynb", {"q1": 0}), _row("late/lab01_alice.ipynb", {}),
            _row("lab01_bob.ipynb", {})]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = report.emit(rows, _args(tmp_path), report.Options(re.compile(r"lab01_(\w+)")), err=err)
    assert rc == 1
    assert "error: lab01 alice: 2 submissions carry this id" in err.getvalue()
    table = _read_csv(tmp_path / "lab01.csv")
    alice = table["alice"]
    assert alice["total"] == "" and alice["q1"] == "" and alice["max_score"] == "10.0"
    assert "early/lab01_alice.ipynb" in alice["error"] and "late/lab01_alice.ipynb" in alice["error"]
    assert table["bob"]["total"] == "10.0"
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["labs"]["lab01"]["duplicates"] == 1 and data["labs"]["lab01"]["graded"] == 1
    assert any("alice" in p for p in data["problems"])


def test_several_labs_give_a_csv_each_and_one_feedback_file_per_student(tmp_path):
    rows = [_row("lab01_alice.ipynb", {}), _row("lab02_alice.ipynb", {}, lab="lab02"),
            _row("lab02_bob.ipynb", {"q1": 0}, lab="lab02")]
    roster = [report.RosterEntry("alice"), report.RosterEntry("bob")]
    report.write_gradebook(report.build(rows, id_pattern=re.compile(r"_(\w+)"), roster=roster), tmp_path)
    lab1, lab2 = _read_csv(tmp_path / "lab01.csv"), _read_csv(tmp_path / "lab02.csv")
    assert lab1["bob"]["error"] == report.NO_SUBMISSION and lab1["alice"]["error"] == ""
    assert list(lab2) == ["alice", "bob"] and lab2["bob"]["q1"] == "0"
    assert lab2["alice"]["max_score"] == str(get_lab("lab02").max_score)
    assert lab2["alice"]["grader_version"] == report.grader_version("lab02") != lab1["alice"]["grader_version"]
    alice = (tmp_path / "feedback" / "alice.md").read_text()
    assert "## lab01" in alice and "## lab02" in alice
    bob = (tmp_path / "feedback" / "bob.md").read_text()
    assert "No submission was received for lab01" in bob and "## lab02" in bob


# --------------------------------------------------------------------------------------- feedback and summary
def test_feedback_shows_points_feedback_seed_replay_and_error(tmp_path):
    rows = [_row("lab01_alice.ipynb", {"q2": 0}, seed=1234), _row("lab01_bob.ipynb", None, error="ModuleNotFoundError:"
                                                                    " No module named 'torch' (cell 2)")]
    report.write_gradebook(report.build(rows, id_pattern=re.compile(r"_(\w+)")), tmp_path)
    alice = (tmp_path / "feedback" / "alice.md").read_text()
    assert "# Feedback for alice" in alice and "Score: 7 / 10 points" in alice
    assert "### q2: 0 / 3 points" in alice and "[FAIL] q2 lost points" in alice
    assert 'check("q2", online_merge, seed=1234)' in alice and "seed 1234" in alice
    assert 'check("q1", online_update' not in alice  # full marks: nothing to replay
    bob = (tmp_path / "feedback" / "bob.md").read_text()
    assert "could not be graded" in bob and "No module named 'torch' (cell 2)" in bob
    assert bob.count("No module named 'torch'") == 1  # once, not repeated under every question


def test_feedback_names_a_failed_cell_even_at_full_marks(tmp_path):
    """A submission whose functions earn every point but whose cell failed (an attack, say) hears of that cell."""
    row = _row("lab01_carol.ipynb", {})
    row["notebook_error"] = "cell 5 raised PermissionError: [Errno 13] Permission denied: '/srv/gradebook'"
    report.write_gradebook(report.build([row], id_pattern=re.compile(r"_(\w+)")), tmp_path)
    carol = (tmp_path / "feedback" / "carol.md").read_text()
    assert "Score: 10 / 10 points" in carol and "A cell of your notebook failed" in carol
    assert "cell 5 raised PermissionError" in carol


def test_feedback_file_names_stay_inside_the_folder(tmp_path):
    rows = [_row("x.ipynb", {})]
    roster = [report.RosterEntry("../../etc/passwd", file="x.ipynb"), report.RosterEntry(".hidden")]
    report.write_gradebook(report.build(rows, roster=roster), tmp_path / "book")
    names = sorted(p.name for p in (tmp_path / "book" / "feedback").iterdir())
    assert names == ["_.._etc_passwd.md", "hidden.md"]
    assert not (tmp_path / "etc").exists()


def test_summary_means_histograms_and_mistakes(tmp_path):
    rows = [
        _row("lab01_a.ipynb", {"q1": 0}, diagnoses={"q1": [NO_RESCALE]}),
        _row("lab01_b.ipynb", {"q1": 0, "q2": 0}, diagnoses={"q1": [NO_RESCALE], "q2": ["averaging the two results"]}),
        _row("lab01_c.ipynb", {}),
        _row("lab01_d.ipynb", None, error="timed out"),
    ]
    report.write_gradebook(report.build(rows, id_pattern=re.compile(r"_(\w+)")), tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    lab = data["labs"]["lab01"]
    assert (lab["students"], lab["graded"], lab["errors"], lab["no_submission"]) == (4, 4, 1, 0)
    q1, q2 = lab["questions"]["q1"], lab["questions"]["q2"]
    assert q1["mean"] == pytest.approx(5 / 4) and q2["mean"] == pytest.approx(2 * 3 / 4)
    assert q1["histogram"] == [{"from": 0.0, "to": 0.0, "count": 3}, {"from": 5.0, "to": 5.0, "count": 1}]
    assert q1["mistakes"] == {NO_RESCALE: 2} and q2["mistakes"] == {"averaging the two results": 1}
    assert lab["mean_total"] == pytest.approx((5 + 2 + 10 + 0) / 4)
    md = (tmp_path / "summary.md").read_text()
    assert f"- 2 × {NO_RESCALE}" in md and "### q1: mean 1.25 / 5" in md
    bars = re.findall(r"^\s+(\S+) \| (#+) (\d+)$", md.split("### q1")[1].split("\n### ")[0], re.M)
    assert [(v, len(b), int(n)) for v, b, n in bars] == [("0", 40, 3), ("5", 13, 1)]


def test_a_wide_spread_of_points_is_binned():
    hist = report.histogram([i / 10 for i in range(101)], 10.0)
    assert len(hist) == 10 and sum(h["count"] for h in hist) == 101 and hist[-1]["count"] == 11


def test_an_unsandboxed_row_is_marked_in_the_summary(tmp_path):
    report.write_gradebook(report.build([_row("lab01_a.ipynb", {}, sandboxed=False)]), tmp_path)
    assert "1 submission(s) were graded without the sandbox" in (tmp_path / "summary.md").read_text()


def test_the_diagnosed_mistake_is_named_in_the_result():
    wrong = run_question("lab01", "q1", [lab01._update_no_rescale], seed=3)
    assert wrong.score < wrong.max_score and wrong.diagnoses == [NO_RESCALE]
    assert wrong.as_dict()["diagnoses"] == [NO_RESCALE] and wrong.as_dict()["seed"] == 3
    assert run_question("lab01", "q1", [flashlab.online.update], seed=3).diagnoses == []


# ----------------------------------------------------------------------------------------- a real grading run
def _solution_with(edit: tuple[str, str] | None) -> nbformat.NotebookNode:
    nb = nbformat.read(ROOT / "solutions" / "lab01_online_softmax.ipynb", as_version=4)
    if edit:
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def online_update"))
        assert edit[0] in cell.source
        cell.source = cell.source.replace(*edit)
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    subs = tmp_path_factory.mktemp("submissions")
    nbformat.write(_solution_with(None), subs / "lab01_alice.ipynb")
    shutil.copy(ROOT / "labs" / "lab01_online_softmax.ipynb", subs / "lab01_bob.ipynb")
    # carol forgets to rescale what was summed against the old max
    nbformat.write(_solution_with(("alpha * l + p.sum(), alpha * u", "l + p.sum(), u")), subs / "lab01_carol.ipynb")
    (subs / "lab01_dan.ipynb").write_text("{ not a notebook")
    roster = subs.parent / "roster.csv"
    roster.write_text("id\nalice\nbob\ncarol\ndan\nerin\n")
    out = subs.parent / "gradebook"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = batch.main([str(subs), "--out", str(out), "--id-pattern", r"lab01_(\w+)", "--roster", str(roster),
                         "--timeout", "120", "--jobs", "2", *(["--no-sandbox"] if sandbox.sandbox_problem() else [])])
    return {"rc": rc, "out": out, "table": _read_csv(out / "lab01.csv"), "stdout": stdout.getvalue()}


def test_real_run_fills_the_gradebook(graded):
    assert graded["rc"] == 0
    t = graded["table"]
    assert list(t) == ["alice", "bob", "carol", "dan", "erin"]
    assert t["alice"]["total"] == "10.0" and t["alice"]["error"] == ""
    assert t["bob"]["total"] == "0.0" and t["bob"]["max_score"] == "10.0"
    assert float(t["carol"]["q1"]) < 5 and t["carol"]["q2"] == "3.0"
    assert "not a readable notebook" in t["dan"]["error"] and t["dan"]["max_score"] == "10.0"
    assert t["erin"]["error"] == report.NO_SUBMISSION
    assert all(t[s]["grader_version"] == report.grader_version("lab01") for s in t)
    assert "lab01_alice.ipynb" in graded["stdout"]  # the table is still printed


def test_real_run_summary_counts_the_diagnosed_mistake(graded):
    data = json.loads((graded["out"] / "summary.json").read_text())
    lab = data["labs"]["lab01"]
    assert lab["questions"]["q1"]["mistakes"] == {NO_RESCALE: 1}
    assert (lab["students"], lab["graded"], lab["errors"], lab["no_submission"]) == (5, 4, 1, 1)
    assert f"- 1 × {NO_RESCALE}" in (graded["out"] / "summary.md").read_text()


def test_real_run_feedback_replays_to_the_same_score(graded):
    carol = (graded["out"] / "feedback" / "carol.md").read_text()
    assert NO_RESCALE in carol
    seed = int(re.search(r'check\("q1", online_update, seed=(\d+)\)', carol).group(1))
    ns: dict = {}
    source = next(c.source for c in _solution_with(("alpha * l + p.sum(), alpha * u", "l + p.sum(), u")).cells
                  if c.source.startswith("def online_update"))
    exec("import numpy as np\n" + source, ns)  # noqa: S102 - the test's own notebook cell
    again = run_question("lab01", "q1", [ns["online_update"]], seed=seed)
    assert again.score == float(graded["table"]["carol"]["q1"])
    assert sorted(p.name for p in (graded["out"] / "feedback").iterdir()) == [
        f"{s}.md" for s in ("alice", "bob", "carol", "dan", "erin")]


def test_the_summary_counts_lost_points_with_no_mistake_named_and_speaks_of_one_student(tmp_path):
    rows = [_row("lab01_a.ipynb", {"q2": 0}), _row("lab01_b.ipynb", {"q2": 0}, diagnoses={"q2": ["averaging"]})]
    report.write_gradebook(report.build(rows, id_pattern=re.compile(r"_(\w+)")), tmp_path)
    q2 = json.loads((tmp_path / "summary.json").read_text())["labs"]["lab01"]["questions"]["q2"]
    assert q2["undiagnosed"] == 1 and q2["mistakes"] == {"averaging": 1}
    assert "- 1 × lost points with no mistake named" in (tmp_path / "summary.md").read_text()
    report.write_gradebook(report.build(rows[:1], id_pattern=re.compile(r"_(\w+)")), tmp_path / "one")
    assert "1 student, 1 graded" in (tmp_path / "one" / "summary.md").read_text()
