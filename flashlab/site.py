"""``python -m flashlab html``: execute every chapter headlessly and write the course as a static HTML site.

Each chapter in notebooks/ runs in a fresh kernel (cwd = notebooks/, as in CI), then nbconvert
renders it with its outputs; plots are embedded as data URIs. MathJax is copied next to the pages from the
jupyter-server-mathjax package, so formulas render offline too, and the pages load nothing else from the network:
the template drops require.js and mermaid (no chapter uses widgets or diagrams), and the Colab badge image of
every chapter's first cell becomes a text link. The index lists the chapters in study order and the labs.
"""

from __future__ import annotations

import argparse
import copy
import html
import json
import os
import pathlib
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbformat import NotebookNode

ROOT = pathlib.Path(__file__).resolve().parent.parent
MATHJAX_URL = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"
TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"
# [![Open in Colab](badge.svg)](link): an image from the network in every chapter's and lab's first cell.
BADGE = re.compile(r"\[!\[([^\]]*)\]\(https?://[^)]*\)\]\((https?://[^)]*)\)")


def install_mathjax(out_dir: pathlib.Path) -> str | None:
    """Copy MathJax 2 next to the pages; return the URL pages should load it from (None: keep nbconvert's CDN)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        return None
    target = out_dir / "mathjax"
    if not (target / "MathJax.js").exists():
        shutil.copytree(pathlib.Path(jupyter_server_mathjax.__file__).parent / "static", target, dirs_exist_ok=True)
    return MATHJAX_URL


def heading_of(nb: dict) -> str | None:
    """The first markdown heading of a notebook (a dict or notebook node), without its hashes; None if none."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        for line in "".join(cell.get("source", "")).splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return None


def title_of(path: pathlib.Path) -> str:
    """The first markdown heading of a notebook, else its file name."""
    return heading_of(json.loads(path.read_text(encoding="utf-8"))) or path.stem


def offline_links(nb: NotebookNode) -> NotebookNode:
    """A copy of NB whose badge images become text links (the notebook files keep their badges for Colab)."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type == "markdown":
            cell.source = BADGE.sub(lambda m: f"[{m.group(1)}]({m.group(2)})", cell.source)
    return out


def execute(path: pathlib.Path, *, timeout: int = 600) -> NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, as CI does (cwd = its folder).

    The kernel must keep its own inline matplotlib backend: an inherited MPLBACKEND=Agg would make every
    ``plt.show()`` draw nothing, and the pages would have no plots.
    """
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    os.environ.pop("MPLBACKEND", None)
    resources = {"metadata": {"path": str(path.parent)}}
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources).execute()
    return nb


def with_outputs(nb: NotebookNode, ran: NotebookNode) -> NotebookNode | None:
    """NB with the outputs of RAN, an executed copy, when both hold the same code cells (ids and sources); else None.

    Tags, metadata and markdown come from NB: retagging a chapter's slides or adding a markdown cell needs no new
    run, while any change to code does.
    """
    code = [(c.get("id"), c.source) for c in nb.cells if c.cell_type == "code"]
    if code != [(c.get("id"), c.source) for c in ran.cells if c.cell_type == "code"]:
        return None
    outputs = {c.get("id"): c for c in ran.cells if c.cell_type == "code"}
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs = copy.deepcopy(outputs[cell.get("id")].outputs)
            cell.execution_count = outputs[cell.get("id")].execution_count
    return out


def executed(path: pathlib.Path, cache_dir: pathlib.Path, *, timeout: int = 600, fresh: bool = False) -> NotebookNode:
    """The executed notebook: PATH with the outputs of its copy in CACHE_DIR when that copy ran the same code
    (``with_outputs``), else run now and saved there. FRESH always runs it."""
    import nbformat

    cached = cache_dir / path.name
    if not fresh and cached.exists():
        nb = with_outputs(nbformat.read(path, as_version=4), nbformat.read(cached, as_version=4))
        if nb is not None:
            return nb
    nb = execute(path, timeout=timeout)
    cache_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, cached)
    return nb


def render_chapter(nb: NotebookNode, out_path: pathlib.Path, *, mathjax_url: str | None = None) -> None:
    """Write one (executed) notebook as a self-contained HTML page."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_template_basedirs=[str(TEMPLATES)], template_name="flashlab_lab")
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(offline_links(nb))
    out_path.write_text(body, encoding="utf-8")


def lab_for(chapter: pathlib.Path, labs: list[pathlib.Path]) -> pathlib.Path | None:
    """Chapter NN_* goes with lab labNN_*."""
    number = chapter.name.split("_", 1)[0]
    return next((lab for lab in labs if lab.name.startswith(f"lab{number}_")), None)


def write_index(out_dir: pathlib.Path, chapters: list[pathlib.Path], labs: list[pathlib.Path]) -> None:
    """The course map: one row per chapter with its lab (rendered, unexecuted, under labs/)."""
    rows = []
    for chapter in chapters:
        lab = lab_for(chapter, labs)
        lab_cell = f'<a href="labs/{lab.stem}.html">{html.escape(title_of(lab))}</a>' if lab else ""
        rows.append(
            f'<tr><td><a href="{chapter.stem}.html">{html.escape(title_of(chapter))}</a></td><td>{lab_cell}</td></tr>'
        )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>FlashLab</title>
<style>
body{{font-family:system-ui,sans-serif;max-width:52rem;margin:2rem auto;line-height:1.5;padding:0 1rem}}
table{{border-collapse:collapse;width:100%}} td,th{{border-bottom:1px solid #ddd;padding:.4rem;text-align:left}}
</style></head>
<body>
<h1>FlashLab — FlashAttention from first principles</h1>
<p>Every chapter below was executed on the machine that built this site. GPU cells on a machine without a GPU
show results recorded on a GPU, with its name and date. Labs are shown as handed out (unexecuted): open them in
Jupyter (<code>make lab</code>), where each check cell grades the task above it.</p>
<table>
<tr><th>Chapter</th><th>Lab</th></tr>
{chr(10).join(rows)}
</table>
</body></html>
"""
    (out_dir / "index.html").write_text(page, encoding="utf-8")


def for_each_chapter(chapters: list[pathlib.Path], only: str, action) -> int:
    """Run ACTION(path) on each chapter whose file name contains ONLY; returns how many failed.

    A failure is printed and the next chapter runs: one broken chapter must not hide the others.
    """
    failures = 0
    for path in chapters:
        if only not in path.name:
            continue
        try:
            action(path)
        except Exception as exc:  # noqa: BLE001 - reported, counted, and turned into the exit status
            failures += 1
            print(f"{path.name}: FAILED: {type(exc).__name__}: {str(exc)[-2000:]}", file=sys.stderr)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab html", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/html", help="output folder (default: build/html)")
    parser.add_argument("--only", default="", help="render only chapters whose file name contains this text")
    parser.add_argument("--cache", default="build/executed", help="where executed notebooks are kept for `slides`")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--chapters", default=str(ROOT / "notebooks"), help="folder of chapters (default notebooks/)")
    parser.add_argument("--labs", default=str(ROOT / "labs"), help="folder of released labs (default labs/)")
    args = parser.parse_args(argv)

    import nbformat

    out_dir = pathlib.Path(args.out)
    (out_dir / "labs").mkdir(parents=True, exist_ok=True)
    chapters = sorted(pathlib.Path(args.chapters).glob("*.ipynb"))
    labs = sorted(pathlib.Path(args.labs).glob("*.ipynb"))
    mathjax_url = install_mathjax(out_dir)
    lab_mathjax = f"../{mathjax_url}" if mathjax_url else None
    for lab in labs:
        render_chapter(nbformat.read(lab, as_version=4), out_dir / "labs" / f"{lab.stem}.html", mathjax_url=lab_mathjax)

    def render(path: pathlib.Path) -> None:
        t0 = time.perf_counter()
        nb = executed(path, pathlib.Path(args.cache), timeout=args.timeout, fresh=True)
        render_chapter(nb, out_dir / f"{path.stem}.html", mathjax_url=mathjax_url)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s -> {out_dir / (path.stem + '.html')}")

    failures = for_each_chapter(chapters, args.only, render)
    write_index(out_dir, chapters, labs)
    print(f"index: {out_dir / 'index.html'}")
    return 1 if failures else 0
