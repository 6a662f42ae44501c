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
