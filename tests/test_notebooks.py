"""Every chapter executes top to bottom on a CPU, and no notebook is committed with outputs."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ALL_NOTEBOOKS = sorted(p for d in ("notebooks", "labs", "solutions") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs or execution counts; strip them before committing"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_valid_nbformat(path):
    """Valid against its nbformat schema, with unique cell ids (nbformat 4.5+ requires them; a missing one is a
    warning today and an error in future nbformat versions)."""
    nbformat = pytest.importorskip("nbformat")
    nb = json.loads(path.read_text())
    nbformat.validate(nbformat.from_dict(nb))
    if (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5):
        ids = [c.get("id") for c in nb["cells"]]
        assert None not in ids, f"{path.name}: cells {[i for i, x in enumerate(ids) if x is None]} have no id"
        assert len(set(ids)) == len(ids), f"{path.name}: duplicate cell ids"


@pytest.mark.slow
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_executes_on_cpu(path):
    pytest.importorskip("nbclient")
    from flashlab import site

    t0 = time.perf_counter()
    nb = site.execute(path)
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
