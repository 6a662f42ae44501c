"""``python -m flashlab release --student DIR``: what a class gets, without solutions, and that it works."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

from flashlab.grading import release

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> pathlib.Path:
    dest = tmp_path_factory.mktemp("class") / "flashlab-course"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "flashlab", "release", "--student", str(dest)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no solutions/" in proc.stdout
    return dest


def _run(dest: pathlib.Path, code: str, cwd: pathlib.Path | None = None) -> dict:
    """Run ``code`` with the release's package first on the path; return the JSON its last line prints."""
    env = dict(os.environ, PYTHONPATH=str(dest))
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd or dest, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_release_holds_what_a_class_needs_and_no_solutions(student):
    names = {p.name for p in student.iterdir()}
    assert {"notebooks", "labs", "flashlab", "data", "README.md", "requirements.txt", "environment.yml", "Makefile",
            "pyproject.toml"} <= names
    assert not names & {"solutions", "tests", ".git", "tools", ".ci"}
    # every repository file a chapter or lab names (docs/kernels.md, CONTRIBUTING.md, data/...) is in the release
    import re

    for nb in [*(student / "notebooks").glob("*.ipynb"), *(student / "labs").glob("*.ipynb")]:
        cites = r"\b((?:docs|data)/[\w./-]+\.(?:md|jsonl?|txt|csv)\b|CONTRIBUTING\.md)"
        for cited in set(re.findall(cites, nb.read_text())):
            if cited == "CONTRIBUTING.md" or not re.search(r"[A-Z]{3,}", cited):  # data/NAME.json: a placeholder
                assert (student / cited).exists(), (nb.name, cited)
    assert not list(student.rglob("solutions"))
    assert not list(student.rglob("__pycache__"))
    assert sorted(p.name for p in (student / "notebooks").glob("*.ipynb")) == \
        sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    # the labs are the released ones: no solution region, nothing of the solutions' code
    assert {p.name: p.read_text() for p in (student / "labs").glob("*.ipynb")} == release.compute_release()
    for path in (ROOT / "solutions").glob("lab*.ipynb"):
        text = (student / "labs" / path.name).read_text()
        assert release.BEGIN not in text
        released = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells if c.cell_type == "code")
        inside = False
        for cell in nbformat.read(path, as_version=4).cells:
            for line in cell.source.splitlines():
                if line.strip().startswith(release.BEGIN):
                    inside = True
                elif line.strip().startswith(release.END):
                    inside = False
                elif inside and len(line.strip()) > 30 and not line.strip().startswith(("#", "//")):
                    assert line.strip() not in released, (path.name, line)


def test_the_released_package_imports_from_the_release(student):
    out = _run(student, "import json, flashlab; from flashlab import online, reference, tiled, viz; "
                        "print(json.dumps({'file': flashlab.__file__}))")
    assert out["file"] == str(student / "flashlab" / "__init__.py")


def test_a_chapter_and_a_lab_check_cell_run_in_the_release(student, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", str(student))  # the kernel imports the release's package, not the checkout's
    chapter = nbformat.read(student / "notebooks" / "01_online_softmax.ipynb", as_version=4)
    code = [c for c in chapter.cells if c.cell_type == "code"][:2]
    probe = nbformat.v4.new_code_cell("print('package at', flashlab.__file__); print(online.attend([0.0, 1.0], "
                                      "[1.0, 2.0]))")
    lab = nbformat.read(student / "labs" / "lab01_online_softmax.ipynb", as_version=4)
    lab_code = [c for c in lab.cells if c.cell_type == "code"]
    check = next(c for c in lab_code if c.source.startswith('check("q1"'))
    task = next(c for c in lab_code if c.source.startswith("def online_update"))
    cells = [nbformat.v4.new_code_cell(c.source) for c in (*code, probe, lab_code[1], task, check)]  # fresh ids
    nb = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(student / "notebooks")}}).execute()
    text = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    assert f"package at {student / 'flashlab' / '__init__.py'}" in text[2]
    assert "1.731" in text[2]  # softmax([0, 1]) . [1, 2] = 1 + e / (1 + e)
    assert text[-1].startswith("q1: 0/5") and "not implemented yet" in text[-1]


def test_chapter_9_describes_what_needs_the_solutions(student):
    out = _run(student, """
import json
from flashlab import mistakes
from flashlab.grading import known
try:
    known.solution_path("lab03")
except known.SolutionsMissing as e:
    missing = str(e)
needs = mistakes.report(mistakes.find("lab03", "read once per block of B_r"))
runs = mistakes.report(mistakes.find("lab01", "not rescaled"))
print(json.dumps({"missing": missing, "needs": needs, "runs": runs}))
""")
    assert "no solutions/" in out["missing"] and "instructor's copy" in out["missing"]
    assert "Not run here" in out["needs"] and "instructor's copy" in out["needs"]
    assert "recognised" in out["runs"] and "Not run here" not in out["runs"]


def test_the_release_refuses_a_used_folder_or_one_inside_the_course(tmp_path):
    (tmp_path / "old.txt").write_text("a previous term")
    with pytest.raises(FileExistsError):
        release.release_student(tmp_path)
    with pytest.raises(ValueError):
        release.release_student(ROOT / "labs" / "class")
    assert release.main(["--student", str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]
