"""``python -m flashlab html``: execute every chapter headlessly and write the course as a static HTML site.

Each chapter in notebooks/ runs in a fresh kernel (cwd = notebooks/, MPLBACKEND=Agg, as in CI), then nbconvert
renders it with its outputs; plots are embedded as data URIs. MathJax is copied next to the pages from the
jupyter-server-mathjax package, so formulas render offline too. The index lists the chapters in study order and
the labs.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MATHJAX_URL = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"


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


def title_of(path: pathlib.Path) -> str:
    """The first markdown heading of a notebook, else its file name."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        for line in "".join(cell.get("source", "")).splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return path.stem


def execute(path: pathlib.Path, *, timeout: int = 600):
    """Run a notebook top to bottom in a fresh kernel, as CI does (cwd = its folder, MPLBACKEND=Agg)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MPLBACKEND", "Agg")
    resources = {"metadata": {"path": str(path.parent)}}
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources).execute()
    return nb


def executed(path: pathlib.Path, cache_dir: pathlib.Path, *, timeout: int = 600, fresh: bool = False):
    """The executed notebook, from CACHE_DIR when a copy newer than the source is there; saved there otherwise."""
    import nbformat

    cached = cache_dir / path.name
    if not fresh and cached.exists() and cached.stat().st_mtime >= path.stat().st_mtime:
        return nbformat.read(cached, as_version=4)
    nb = execute(path, timeout=timeout)
    cache_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, cached)
    return nb


def render_chapter(nb, out_path: pathlib.Path, *, mathjax_url: str | None = None) -> None:
    """Write one (executed) notebook as a self-contained HTML page."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(nb)
    out_path.write_text(body, encoding="utf-8")


def write_index(out_dir: pathlib.Path, chapters: list[pathlib.Path], labs: list[pathlib.Path]) -> None:
    def items(paths, href):
        return "\n".join(f'<li><a href="{href(p)}">{html.escape(title_of(p))}</a></li>' for p in paths)

    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>FlashLab</title>
<style>body{{font-family:system-ui,sans-serif;max-width:46rem;margin:2rem auto;line-height:1.5}}</style></head>
<body>
<h1>FlashLab — FlashAttention from first principles</h1>
<p>Every chapter below was executed on the machine that built this site; GPU cells on a machine without a GPU
show results recorded on a GPU, with its name and date.</p>
<h2>Chapters</h2>
<ol>
{items(chapters, lambda p: f"{p.stem}.html")}
</ol>
<h2>Labs</h2>
<p>Open them in Jupyter (<code>make lab</code>); each check cell grades the task above it.</p>
<ul>
{items(labs, lambda p: f"../../labs/{p.name}")}
</ul>
</body></html>
"""
    (out_dir / "index.html").write_text(page, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab html", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/html", help="output folder (default: build/html)")
    parser.add_argument("--only", default="", help="render only chapters whose file name contains this text")
    parser.add_argument("--cache", default="build/executed", help="where executed notebooks are kept for `slides`")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = parser.parse_args(argv)

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    chapters = sorted((ROOT / "notebooks").glob("*.ipynb"))
    labs = sorted((ROOT / "labs").glob("*.ipynb"))
    mathjax_url = install_mathjax(out_dir)
    failures = 0
    for path in chapters:
        if args.only not in path.name:
            continue
        try:
            t0 = time.perf_counter()
            nb = executed(path, pathlib.Path(args.cache), timeout=args.timeout, fresh=True)
            render_chapter(nb, out_dir / f"{path.stem}.html", mathjax_url=mathjax_url)
            print(f"{path.name}: {time.perf_counter() - t0:.1f} s -> {out_dir / (path.stem + '.html')}")
        except Exception as exc:  # one broken chapter must not hide the others
            failures += 1
            print(f"{path.name}: FAILED: {type(exc).__name__}: {str(exc)[-2000:]}", file=sys.stderr)
    write_index(out_dir, chapters, labs)
    print(f"index: {out_dir / 'index.html'}")
    return 1 if failures else 0
