"""`make html` machinery: a chapter is executed and rendered with its plot embedded; the index links it."""

import os
import pathlib
import re
import shutil

import pytest

from flashlab import site


def _tiny_course(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Two chapters (a plot, a formula) and one lab, as `make html` would find them."""
    nbformat = pytest.importorskip("nbformat")
    chapters, labs = root / "notebooks", root / "labs"
    chapters.mkdir()
    labs.mkdir()
    plot = nbformat.v4.new_notebook()
    plot.cells = [
        nbformat.v4.new_markdown_cell(
            "# 98 A chapter with a plot\n\n[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            "(https://colab.research.google.com/github/flashlab-course/flashlab/blob/main/notebooks/98_plot.ipynb)"
        ),
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()"),
        nbformat.v4.new_code_cell("print(6 / 8)"),
    ]
    nbformat.write(plot, chapters / "98_plot.ipynb")
    formula = nbformat.v4.new_notebook()
    formula.cells = [nbformat.v4.new_markdown_cell("# 99 A chapter with a formula\n\n$$e^{m - m'}$$")]
    nbformat.write(formula, chapters / "99_formula.ipynb")
    lab = nbformat.v4.new_notebook()
    lab.cells = [nbformat.v4.new_markdown_cell("# Lab 98 — plotting"), nbformat.v4.new_code_cell("raise ValueError")]
    nbformat.write(lab, labs / "lab98_plot.ipynb")
    return chapters, labs


@pytest.fixture(scope="module")
def tiny_site(tmp_path_factory):
    pytest.importorskip("nbconvert")
    root = tmp_path_factory.mktemp("course")
    chapters, labs = _tiny_course(root)
    out = root / "html"
    # An inherited MPLBACKEND=Agg once made every plt.show() draw nothing: the kernel must use its inline backend.
    saved = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"
    try:
        argv = ["--out", str(out), "--cache", str(root / "executed"), "--chapters", str(chapters), "--labs", str(labs)]
        assert site.main(argv) == 0
    finally:
        os.environ.pop("MPLBACKEND", None)
        if saved is not None:
            os.environ["MPLBACKEND"] = saved
    return out


@pytest.mark.slow
def test_site_executes_chapters_and_embeds_plots(tiny_site):
    page = (tiny_site / "98_plot.html").read_text()
    assert re.search(r'<img[^>]+src="data:image/png;base64,', page) and "0.75" in page
    # Offline: the Colab badge image becomes a text link, and no script or style sheet comes from a CDN.
    assert "colab-badge.svg" not in page and ">Open in Colab</a>" in page
    loaded = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="([^"]+)"', page)
    assert not [u for u in loaded if "://" in u], f"the page loads {[u for u in loaded if '://' in u]}"
    assert (tiny_site / "mathjax" / "MathJax.js").is_file()
    formula = (tiny_site / "99_formula.html").read_text()
    assert f'src="{site.MATHJAX_URL}"' in formula and "cdnjs.cloudflare.com/ajax/libs/mathjax" not in formula
    index = (tiny_site / "index.html").read_text()
    assert 'href="98_plot.html"' in index and 'href="labs/lab98_plot.html"' in index
    assert (tiny_site / "labs" / "lab98_plot.html").is_file()


@pytest.mark.slow
def test_site_in_headless_chromium(tiny_site):
    """Open the index offline, follow a chapter link, and check that its plot and formula render."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Chromium (Debian: apt-get install chromium); .ci/run installs it in CI")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page()
        remote = []
        page.on("request", lambda r: remote.append(r.url) if r.url.startswith("http") else None)
        page.goto((tiny_site / "index.html").as_uri())
        page.click("text=98 A chapter with a plot")
        page.wait_for_load_state("load")
        assert page.url.endswith("98_plot.html")
        sizes = page.evaluate("Array.from(document.images).filter(i => i.src.startsWith('data:image/png'))"
                              ".map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert sizes and all(ok and w > 100 and h > 100 for ok, w, h in sizes), sizes
        page.goto((tiny_site / "99_formula.html").as_uri())
        page.wait_for_function("window.MathJax && document.querySelectorAll('.MathJax, .MathJax_Display').length > 0",
                               timeout=20_000)
        browser.close()
    assert not remote, f"the course fetched from the network: {remote}"


def test_title_of_falls_back_to_file_name(tmp_path):
    p = pathlib.Path(tmp_path / "x.ipynb")
    p.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert site.title_of(p) == "x"


@pytest.mark.slow
def test_slides_keep_only_tagged_cells_and_load_nothing_from_the_network(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from flashlab import slides

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Title slide", metadata={"tags": ["slide"]}),
        nbformat.v4.new_markdown_cell("not on the slides"),
        nbformat.v4.new_code_cell("print(6 / 8)", metadata={"tags": ["slide"]}),
        nbformat.v4.new_markdown_cell("$e^{m - m'}$ rescales", metadata={"tags": ["slide-continue"]}),
    ]
    src = tmp_path / "98_deck.ipynb"
    nbformat.write(nb, src)
    executed = site.executed(src, tmp_path / "executed", timeout=120)
    out = tmp_path / "slides"
    out.mkdir()
    prefix = slides.install_reveal(out)
    assert (out / prefix / "dist" / "reveal.js").is_file()
    n = slides.render_deck(executed, out / "deck.html", reveal_prefix=prefix, mathjax_url=site.install_mathjax(out))
    assert n == 3
    page = (out / "deck.html").read_text()
    assert "Title slide" in page and "0.75" in page and "not on the slides" not in page
    assert "print(6 / 8)" not in page  # code inputs stay in the chapter
    assert page.count("<section") >= 3  # two slides, each wrapped in a vertical stack
    remote = [u for u in re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', page) if "://" in u]
    assert not remote, f"the deck loads {remote} from the network"
