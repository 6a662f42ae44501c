"""Lab 06 graded on a GPU the way a teacher grades it: ``python -m flashlab grade`` over a folder, in the sandbox
with the GPU's device files bound in. ``python3 -m pytest -q -m gpu tests/test_gpu_grading.py``."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re

import nbformat
import pytest

from flashlab.grading import batch, lab06, sandbox

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab06_cuda_online_softmax.ipynb"
RELEASED = ROOT / "labs" / "lab06_cuda_online_softmax.ipynb"

pytestmark = pytest.mark.gpu


def _variant(tmp_path: pathlib.Path, name: str, *, update: str | None = None, extra: str | None = None):
    nb = nbformat.read(SOLUTION, as_version=4)
    if update is not None:
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("KERNEL ="))
        marked = cell.source.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
        body = "\n".join(line for line in marked.split("\n")[1:-1])
        rendered = "\n".join(line if not line.strip() or re.match(r"#\s*[a-z]", line) else lab06.INDENT + line
                             for line in update.split("\n"))
        cell.source = cell.source.replace(body, rendered)
    if extra is not None:
        nb.cells.insert(3, nbformat.v4.new_code_cell(extra))
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def test_lab06_is_graded_on_the_gpu_inside_the_sandbox(tmp_path):
    if sandbox.sandbox_problem() is not None:
        pytest.skip(f"needs the sandbox: {sandbox.sandbox_problem()}")
    mutant = lab06.MUTANTS[0]
    paths = [SOLUTION, RELEASED,
             _variant(tmp_path, "wrong", update=mutant.update),
             _variant(tmp_path, "sees_gpu", extra="from flashlab.gpu import gpu_available\n"
                      "assert gpu_available(), 'no GPU inside the sandbox'"),
             _variant(tmp_path, "patches_judge", update=mutant.update,
                      extra="import flashlab.grading.lab06 as g\ng.close = g.same = lambda *a, **k: True")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert batch.main([*map(str, paths), "--json", "--jobs", "2", "--timeout", "600", "--seed", "11"]) == 0
    by_path = {pathlib.Path(r["path"]): r for r in map(json.loads, out.getvalue().splitlines())}
    rows = {("stub" if path == RELEASED else path.stem): by_path[path] for path in paths}
    full = lab06.Q1_POINTS + lab06.Q2_POINTS
    solution, stub = rows[SOLUTION.stem], rows["stub"]
    assert all(r["sandboxed"] and r["max_score"] == full for r in rows.values()), rows  # GPU points graded
    assert solution["score"] == full and solution["notebook_error"] is None, solution
    assert rows["sees_gpu"]["score"] == full and rows["sees_gpu"]["notebook_error"] is None, rows["sees_gpu"]
    assert stub["score"] == 0
    for name in ("wrong", "patches_judge"):
        q2 = {q["name"]: q for q in rows[name]["questions"]}["q2"]
        assert q2["score"] < q2["max_score"] and mutant.message in q2["feedback"], q2
