"""Lab 02's memory part graded the way a teacher grades it: a folder of honest and cheating notebooks in one run
of the batch grader, memory measured from outside each notebook's process (flashlab.grading.memprobe)."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import nbformat
import pytest

from flashlab.grading import batch, sandbox

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab02_tiled_forward.ipynb"
STUB = ROOT / "labs" / "lab02_tiled_forward.ipynb"

NAIVE = """
import numpy as np
def flash_forward(Q, K, V, block_q, block_k):
    S = Q @ K.T / np.sqrt(Q.shape[1])
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    {hide}
    return P @ V / l, (m + np.log(l))[:, 0]
"""
CHEATS = {
    # builds the whole matrix, honestly
    "naive": ("", NAIVE.format(hide="")),
    # holds 308 MB before the call and frees it inside, so that S and P fit in memory already counted
    "holds_then_frees": ("_hold = np.ones((6200, 6200))", NAIVE.format(hide="").replace(
        "    S = Q @ K.T", "    global _hold\n    _hold = None\n    S = Q @ K.T")),
    # lowers its own high-water mark once the matrix is gone
    "resets_the_mark": ("", NAIVE.format(hide="del S, P\n    open('/proc/self/clear_refs', 'w').write('5')")),
}


def _with_cells(tmp_path: pathlib.Path, name: str, before: str, after: str) -> pathlib.Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if before:
        nb.cells.insert(3, nbformat.v4.new_code_cell("import numpy as np\n" + before))
    nb.cells.append(nbformat.v4.new_code_cell(after))  # the last definition of flash_forward is the one graded
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_lab02_memory_is_measured_from_outside_for_a_class_in_one_run(tmp_path):
    if sandbox.sandbox_problem() is not None:
        pytest.skip(f"needs the sandbox: {sandbox.sandbox_problem()}")
    # the released lab with every `raise NotImplementedError` line deleted: the template's arrays, unfilled
    stub = nbformat.read(STUB, as_version=4)
    for cell in stub.cells:
        cell.source = "\n".join(x for x in cell.source.splitlines() if "raise NotImplementedError" not in x)
    nbformat.write(stub, tmp_path / "raise_deleted.ipynb")
    paths = [SOLUTION, *(_with_cells(tmp_path, name, *cells) for name, cells in CHEATS.items()),
             tmp_path / "raise_deleted.ipynb"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert batch.main([*map(str, paths), "--json", "--jobs", "2", "--timeout", "900", "--seed", "4"]) == 0
    rows = {pathlib.Path(r["path"]).stem: r for r in map(json.loads, out.getvalue().splitlines())}
    q2 = {name: {q["name"]: q for q in row["questions"]}["q2"] for name, row in rows.items()}
    honest = q2[SOLUTION.stem]
    assert honest["score"] == honest["max_score"], honest["feedback"]
    for name in CHEATS:
        feedback = q2[name]["feedback"]
        assert "[FAIL] memory" in feedback, (name, feedback)
        assert q2[name]["score"] < honest["max_score"] - 3, (name, q2[name]["score"])  # memory is 4 of 7 points
    assert "MB in memory before the call" in q2["holds_then_frees"]["feedback"]
    for q in ("q2", "q3"):  # the template's arrays earn nothing, memory included
        part = {x["name"]: x for x in rows["raise_deleted"]["questions"]}[q]
        assert part["score"] == 0 and "template" in part["feedback"], part["feedback"]
