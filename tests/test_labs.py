"""Labs never drift from their solutions; every solution scores full marks and every released lab scores zero."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import pathlib
import re

import nbformat
import pytest

from flashlab.grading import available_labs, batch, release, sandbox

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
LABS = sorted((ROOT / "labs").glob("lab*.ipynb"))


def _digest(paths):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_there_are_labs_and_each_has_a_grading_module():
    assert SOLUTIONS, "no solutions/lab*.ipynb"
    for p in SOLUTIONS:
        lab_id = batch.find_lab_id(json.loads(p.read_text()), p)
        assert lab_id in available_labs(), f"{p.name}: no flashlab/grading/{lab_id}.py"


def test_labs_equal_the_release_of_solutions():
    wanted = release.compute_release(ROOT / "solutions")
    have = {p.name: p.read_text() for p in LABS}
    hint = "run `python -m flashlab release`"
    assert sorted(have) == sorted(wanted), f"labs/ and solutions/ hold different notebooks: {hint}"
    stale = [name for name in wanted if have[name] != wanted[name]]
    assert not stale, f"labs/ out of date for {stale}: run `python -m flashlab release`"


def test_release_check_mode_agrees(capsys):
    assert release.main(["--check"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_solution_has_regions_and_its_lab_none(path):
    sol = path.read_text()
    lab = (ROOT / "labs" / path.name).read_text()
    assert release.BEGIN in sol and release.END in sol
    assert release.BEGIN not in lab and release.END not in lab
    assert "raise NotImplementedError" in lab
    nb = nbformat.reads(lab, as_version=4)
    assert "/blob/main/labs/" in nb.cells[0].source  # the Colab badge opens the student's copy


def test_strip_solutions_keeps_signature_and_indentation():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n\nz = 2"
    out = release.strip_solutions(src)
    assert out.splitlines()[:2] == ["def f(x):", "    y = 1"]
    assert "    raise NotImplementedError" in out and "return x + y" not in out and out.endswith("z = 2")
    ns: dict = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError):
        ns["f"](1)


@pytest.mark.parametrize(
    "src",
    [
        "### BEGIN SOLUTION\nx = 1",
        "x = 1\n### END SOLUTION",
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
    ],
)
def test_unbalanced_markers_are_an_error(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        release.strip_solutions(src)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every solution and every released lab in one batch call (kernel start-ups dominate the time)."""
    paths = SOLUTIONS + LABS
    before = _digest(paths)
    out = tmp_path_factory.mktemp("grades") / "grades.csv"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = batch.main([str(ROOT / "solutions"), str(ROOT / "labs"), "--json", "--csv", str(out), "--jobs", "2",
                         "--timeout", "240", *(["--no-sandbox"] if sandbox.sandbox_problem() else [])])
    assert rc == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]
    return {"rows": rows, "csv": out, "before": before, "after": _digest(paths)}


def _nothing_gradable_here(r: dict) -> bool:
    """A GPU lab on a machine with neither a GPU nor nvcc scores 0 of 0 and must say why (students' laptops)."""
    return r["max_score"] == 0 and all("not graded here" in q["feedback"] for q in r["questions"])


def test_every_solution_scores_full_marks(graded):
    rows = {pathlib.Path(r["path"]).resolve(): r for r in graded["rows"]}
    for p in SOLUTIONS:
        r = rows[p.resolve()]
        assert r["error"] is None, r["error"]
        if _nothing_gradable_here(r):
            continue
        assert r["max_score"] > 0 and r["score"] == r["max_score"], json.dumps(r["questions"], indent=1)


def test_every_released_lab_scores_zero_without_crashing(graded):
    rows = {pathlib.Path(r["path"]).resolve(): r for r in graded["rows"]}
    for p in LABS:
        r = rows[p.resolve()]
        assert r["error"] is None, r["error"]
        assert r["score"] == 0
        assert all("not implemented yet" in q["feedback"] for q in r["questions"]), r["questions"]


def test_grading_leaves_the_notebooks_unchanged(graded):
    assert graded["before"] == graded["after"]


def test_json_rows_have_the_documented_keys(graded):
    assert len(graded["rows"]) == len(SOLUTIONS) + len(LABS)
    for r in graded["rows"]:
        assert {"path", "score", "max_score", "questions"} <= set(r)
        for q in r["questions"]:
            assert set(q) == {"name", "score", "max_score", "feedback", "seed", "diagnoses"}
        assert r["score"] == pytest.approx(sum(q["score"] for q in r["questions"]))


def test_csv_has_one_row_per_submission_and_a_column_per_question(graded):
    with open(graded["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(SOLUTIONS) + len(LABS)
    assert {"student", "total"} <= set(rows[0])
    by_path = {pathlib.Path(r["path"]).resolve(): r for r in rows}
    question = re.compile(r"^(lab\d+\.)?q\d+$")
    for p in SOLUTIONS:
        r = by_path[p.resolve()]
        assert r["student"] == p.stem and float(r["total"]) == float(r["max_score"])
        qcols = [k for k in r if question.match(k)]
        assert qcols and sum(float(r[k]) for k in qcols if r[k]) == float(r["total"])


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_a_check_cell_for_every_question(path):
    import re

    from flashlab.grading import get_lab

    nb = json.loads(path.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    checked = set(re.findall(r"""\bcheck\(\s*["'](\w+)["']""", code))
    lab = get_lab(batch.find_lab_id(nb, path))
    assert checked == set(lab.questions), f"check cells {sorted(checked)} vs questions {sorted(lab.questions)}"
