"""``python -m flashlab slides``: reveal.js decks from the chapters, viewable offline, and live decks for RISE.

How a chapter is tagged for its deck (CONTRIBUTING.md, "Notebooks"):

* the chapter's notebook metadata ``flashlab.deck`` holds the title slide: ``claim`` (one line) and ``shows``
  (what the audience will see, a list of short lines); the slide's title is the chapter's first heading;
* a cell tagged ``slide`` starts a new slide, ``slide-continue`` goes on the slide of the tagged cell before it;
* a tagged markdown cell whose text ends with a colon carries the code cell right after it onto its slide (the
  printed number, table or figure the colon announces), tagged or not;
* code cells show their outputs only, the code staying in the chapter, except a cell also tagged ``slide-code``
  (the ten lines that matter), and a cell carried by a colon that prints nothing (the colon announces its code);
* a code cell that shows a GPU result read from data/ without printing its GPU and date gets a caption naming them.

Decks are built from executed chapters (the copies ``make html`` keeps in build/executed, or a fresh run), so
plots and printed results appear on the slides; GPU cells run on a machine without a GPU show the results
recorded on one, with the GPU and date they print. reveal.js comes from the sphinx-revealjs package and MathJax
from jupyter-server-mathjax; both are copied next to the decks, so nothing is fetched from the network when the
slides are shown.

``--present NN`` writes chapter NN as a notebook for live slides instead (``make present``): the same cells, with
the ``slideshow`` metadata that RISE (the jupyterlab-rise extension) reads, every other cell skipped.
"""

from __future__ import annotations

import argparse
import copy
import html
import pathlib
import re
import shutil
from typing import TYPE_CHECKING

from . import site

if TYPE_CHECKING:
    from nbformat import NotebookNode

TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"
SLIDE_TAGS = {"slide": "slide", "slide-continue": "-"}
CODE_TAG = "slide-code"
HIDE_INPUT_TAG = "deck-hide-input"  # set by the builder on the deck's copy, never in a chapter
TITLE_CELL_ID = "deck-title"
# A slide's text ends with a colon when the next cell's output is what it announces.
ANNOUNCES = re.compile(r":\s*(\*\*|\*|_)?\s*$")
READS_RECORD = re.compile(r"read_record\(\s*[\"']([^\"']+)[\"']")


def install_reveal(out_dir: pathlib.Path) -> str:
    """Copy reveal.js next to the decks; return its URL prefix relative to them."""
    try:
        import sphinx_revealjs
    except ImportError as exc:  # a clear message instead of a template error
        raise SystemExit("slides need the sphinx-revealjs package (requirements-dev.txt): run `make dev`") from exc
    source = pathlib.Path(sphinx_revealjs.__file__).parent / "_static" / "revealjs"
    shutil.copytree(source, out_dir / "reveal.js", dirs_exist_ok=True)
    return "reveal.js"


def deck_metadata(nb: NotebookNode) -> dict:
    """The chapter's title-slide text: ``{"claim": str, "shows": [str, ...]}`` (empty when not tagged)."""
    return dict(nb.metadata.get("flashlab", {}).get("deck", {}))


def title_cell(nb: NotebookNode) -> NotebookNode:
    """The generated title slide: the chapter's first heading, its one-line claim and what the slides show."""
    import nbformat

    meta = deck_metadata(nb)
    lines = [f"# {site.heading_of(nb) or 'FlashLab'}", ""]
    if meta.get("claim"):
        lines += [f"<p class='deck-claim'>{html.escape(meta['claim'])}</p>", ""]
    if meta.get("shows"):
        lines += ["**On these slides**", ""] + [f"- {item}" for item in meta["shows"]]
    cell = nbformat.v4.new_markdown_cell("\n".join(lines), id=TITLE_CELL_ID)
    cell.metadata["slideshow"] = {"slide_type": "slide"}
    return cell


def announces_next(cell: NotebookNode) -> bool:
    """True for a markdown cell whose text ends with a colon: it introduces the output of the cell after it."""
    return cell.cell_type == "markdown" and bool(ANNOUNCES.search(cell.source.rstrip()))


def slide_types(nb: NotebookNode) -> list[str | None]:
    """Per cell of NB: its reveal.js slide type ("slide" or "-") when it goes on the deck, else None."""
    kinds: list[str | None] = []
    for i, cell in enumerate(nb.cells):
        tags = set(cell.get("metadata", {}).get("tags", []))
        kind = next((SLIDE_TAGS[t] for t in SLIDE_TAGS if t in tags), None)
        if kind is None and i > 0 and cell.cell_type == "code" and kinds[i - 1] and announces_next(nb.cells[i - 1]):
            kind = "-"
        kinds.append(kind)
    return kinds


def shows_code(nb: NotebookNode, i: int) -> bool:
    """Whether code cell I of NB shows its code on the slide (see the module docstring)."""
    cell = nb.cells[i]
    if CODE_TAG in cell.metadata.get("tags", []):
        return True
    carried = SLIDE_TAGS.keys().isdisjoint(cell.metadata.get("tags", [])) and i > 0 and announces_next(nb.cells[i - 1])
    return carried and not cell.get("outputs")


def printed_text(cell: NotebookNode) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        data = out.get("data", {})
        parts += [str(data.get(kind, "")) for kind in ("text/plain", "text/markdown", "text/html")]
    return "".join(parts)


def recorded_caption(cell: NotebookNode) -> str | None:
    """A caption for a code cell that shows GPU results recorded in data/ without saying which GPU and when.

    A chapter built without a GPU shows recorded results; most cells print their provenance, and this covers the
    ones that do not (a table or figure drawn straight from a record), so every recorded GPU result on a slide is
    labelled with its GPU and date.
    """
    from . import records

    printed, labels = printed_text(cell), []
    for name in dict.fromkeys(READS_RECORD.findall(cell.source)):
        try:
            prov = records.read_record(name).get("provenance", {})
        except (OSError, ValueError):
            continue
        gpu, date = prov.get("gpu"), str(prov.get("date_utc", ""))[:10]
        if gpu and date and not (gpu in printed and date in printed):
            labels.append(f"recorded on {html.escape(gpu)}, {date} (<code>data/{html.escape(name)}.json</code>)")
    return f"<p class='deck-recorded'>{'; '.join(labels)}</p>" if labels else None


def deck(nb: NotebookNode) -> NotebookNode:
    """A copy of NB holding its title slide and its slide cells, with reveal.js slide metadata set from the tags."""
    import nbformat

    kept = []
    for i, (cell, kind) in enumerate(zip(nb.cells, slide_types(nb), strict=True)):
        if kind is None:
            continue
        cell = copy.deepcopy(cell)
        cell.metadata["slideshow"] = {"slide_type": kind}
        if cell.cell_type == "code" and not shows_code(nb, i):
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), HIDE_INPUT_TAG]
        kept.append(cell)
        caption = recorded_caption(cell) if cell.cell_type == "code" else None
        if caption:
            kept.append(nbformat.v4.new_markdown_cell(caption, id=f"{cell.get('id', i)}-recorded"))
            kept[-1].metadata["slideshow"] = {"slide_type": "-"}
    if kept:
        kept[0].metadata["slideshow"] = {"slide_type": "slide"}
        if deck_metadata(nb):
            kept.insert(0, title_cell(nb))
    out = copy.deepcopy(nb)
    out.cells = kept
    return site.offline_links(out)


def present_notebook(nb: NotebookNode) -> NotebookNode:
    """A copy of NB for live slides in JupyterLab (RISE): every cell kept, in order, the untagged ones skipped.

    The chapter runs as it is (Run All, then present), so the slides show what its cells compute live, on a GPU
    where there is one.
    """
    out = copy.deepcopy(nb)
    for cell, kind in zip(out.cells, slide_types(nb), strict=True):
        cell.metadata["slideshow"] = {"slide_type": kind or "skip"}
    if deck_metadata(nb):
        out.cells.insert(0, title_cell(nb))
    return site.offline_links(out)


def render_deck(nb: NotebookNode, out_path: pathlib.Path, *, reveal_prefix: str, mathjax_url: str | None) -> int:
    """Write NB's deck to OUT_PATH; returns the number of cells on it (0: nothing written)."""
    from nbconvert import SlidesExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    slides = deck(nb)
    if not slides.cells:
        return 0
    exporter = SlidesExporter(extra_template_basedirs=[str(TEMPLATES)], template_name="flashlab_slides")
    exporter.reveal_url_prefix = reveal_prefix
    exporter.reveal_theme = "white"  # its fonts ship with reveal.js; nbconvert's default theme loads Google Fonts
    # A projected slide shows results; the code stays in the chapter unless the deck asks for it.
    exporter.register_preprocessor(TagRemovePreprocessor(remove_input_tags={HIDE_INPUT_TAG}), enabled=True)
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(slides)
    out_path.write_text(body, encoding="utf-8")
    return len(slides.cells)


def chapter_path(number: str) -> pathlib.Path:
    """The chapter whose file name starts with NUMBER (``7`` or ``07``)."""
    prefix = number.zfill(2) if number.isdigit() else number
    found = sorted((site.ROOT / "notebooks").glob(f"{prefix}*.ipynb"))
    if len(found) != 1:
        raise SystemExit(f"no single chapter starts with {prefix!r}: {[p.name for p in found]}")
    return found[0]


def write_present(number: str, out_dir: pathlib.Path) -> pathlib.Path:
    """Write chapter NUMBER as a RISE notebook into OUT_DIR; return its path."""
    import nbformat

    source = chapter_path(number)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    nbformat.write(present_notebook(nbformat.read(source, as_version=4)), target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab slides", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/slides", help="output folder (default: build/slides)")
    parser.add_argument("--cache", default="build/executed", help="executed notebooks (reused when up to date)")
    parser.add_argument("--only", default="", help="only chapters whose file name contains this text")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--chapters", default=str(site.ROOT / "notebooks"), help="folder of chapters")
    parser.add_argument("--present", metavar="NN", help="write chapter NN for live slides (RISE) into --out instead")
    args = parser.parse_args(argv)

    out_dir = pathlib.Path(args.out)
    if args.present:
        print(write_present(args.present, out_dir))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    reveal_prefix = install_reveal(out_dir)
    mathjax_url = site.install_mathjax(out_dir)
    decks: list[tuple[pathlib.Path, str]] = []

    def build(path: pathlib.Path) -> None:
        nb = site.executed(path, pathlib.Path(args.cache), timeout=args.timeout)
        n = render_deck(nb, out_dir / f"{path.stem}.html", reveal_prefix=reveal_prefix, mathjax_url=mathjax_url)
        print(f"{path.name}: {n} slide cells" if n else f"{path.name}: no cells tagged 'slide', no deck")
        if n:
            decks.append((path, deck_metadata(nb).get("claim", "")))

    failures = site.for_each_chapter(sorted(pathlib.Path(args.chapters).glob("*.ipynb")), args.only, build)
    links = "\n".join(
        f'<li><a href="{p.stem}.html">{html.escape(site.title_of(p))}</a><br>{html.escape(claim)}</li>'
        for p, claim in decks
    )
    (out_dir / "index.html").write_text(
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>FlashLab slides</title>'
        f"<style>body{{font-family:system-ui,sans-serif;font-size:1.3rem;max-width:56rem;margin:2rem auto}}"
        f"li{{margin-bottom:.8rem}}</style></head><body><h1>FlashLab slides</h1>"
        f"<p>Arrow keys move, S opens the speaker view, F goes full screen, Alt+click zooms.</p>"
        f"<ol>{links}</ol></body></html>\n",
        encoding="utf-8",
    )
    print(f"index: {out_dir / 'index.html'}")
    return 1 if failures else 0
