"""``python -m flashlab slides``: reveal.js decks from the chapters, viewable offline.

A chapter cell joins the deck when it carries the cell tag ``slide`` (each such cell starts a new slide) or
``slide-continue`` (it goes on the slide of the tagged cell before it). Code cells show their outputs only.
Decks are built from executed chapters (the copies ``make html`` keeps in build/executed, or a fresh run), so
plots appear on the slides. reveal.js comes from the sphinx-revealjs package and MathJax from
jupyter-server-mathjax; both are copied next to the decks, so nothing is fetched from the network when the
slides are shown.
"""

from __future__ import annotations

import argparse
import html
import pathlib
import shutil

from . import site

TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"
SLIDE_TAGS = {"slide": "slide", "slide-continue": "-"}


def install_reveal(out_dir: pathlib.Path) -> str:
    """Copy reveal.js next to the decks; return its URL prefix relative to them."""
    try:
        import sphinx_revealjs
    except ImportError as exc:  # a clear message instead of a template error
        raise SystemExit("slides need the sphinx-revealjs package (requirements-dev.txt): run `make dev`") from exc
    source = pathlib.Path(sphinx_revealjs.__file__).parent / "_static" / "revealjs"
    shutil.copytree(source, out_dir / "reveal.js", dirs_exist_ok=True)
    return "reveal.js"


def deck(nb):
    """A copy of NB holding only its slide-tagged cells, with reveal.js slide metadata set from the tags."""
    import copy

    kept = []
    for cell in nb.cells:
        tags = set(cell.get("metadata", {}).get("tags", []))
        kind = next((SLIDE_TAGS[t] for t in SLIDE_TAGS if t in tags), None)
        if kind is None:
            continue
        cell = copy.deepcopy(cell)
        cell.metadata["slideshow"] = {"slide_type": kind}
        kept.append(cell)
    if kept:
        kept[0].metadata["slideshow"] = {"slide_type": "slide"}
    out = copy.deepcopy(nb)
    out.cells = kept
    return out


def render_deck(nb, out_path: pathlib.Path, *, reveal_prefix: str, mathjax_url: str | None) -> int:
    """Write NB's deck to OUT_PATH; returns the number of cells on it (0: nothing written)."""
    from nbconvert import SlidesExporter

    slides = deck(nb)
    if not slides.cells:
        return 0
    exporter = SlidesExporter(extra_template_basedirs=[str(TEMPLATES)], template_name="flashlab_slides")
    exporter.reveal_url_prefix = reveal_prefix
    exporter.exclude_input = True  # a projected slide shows results; the code stays in the chapter
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(slides)
    out_path.write_text(body, encoding="utf-8")
    return len(slides.cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab slides", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/slides", help="output folder (default: build/slides)")
    parser.add_argument("--cache", default="build/executed", help="executed notebooks (reused when up to date)")
    parser.add_argument("--only", default="", help="only chapters whose file name contains this text")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = parser.parse_args(argv)

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    reveal_prefix = install_reveal(out_dir)
    mathjax_url = site.install_mathjax(out_dir)
    decks = []

    def build(path: pathlib.Path) -> None:
        nb = site.executed(path, pathlib.Path(args.cache), timeout=args.timeout)
        n = render_deck(nb, out_dir / f"{path.stem}.html", reveal_prefix=reveal_prefix, mathjax_url=mathjax_url)
        print(f"{path.name}: {n} slide cells" if n else f"{path.name}: no cells tagged 'slide', no deck")
        if n:
            decks.append(path)

    failures = site.for_each_chapter(sorted((site.ROOT / "notebooks").glob("*.ipynb")), args.only, build)
    links = "\n".join(f'<li><a href="{p.stem}.html">{html.escape(site.title_of(p))}</a></li>' for p in decks)
    (out_dir / "index.html").write_text(
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>FlashLab slides</title></head>'
        f"<body><h1>FlashLab slides</h1><ol>{links}</ol></body></html>\n",
        encoding="utf-8",
    )
    print(f"index: {out_dir / 'index.html'}")
    return 1 if failures else 0
