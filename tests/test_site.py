"""`make html` machinery: a chapter is executed and rendered with its plot embedded; the index links it."""

import pathlib

import pytest

from flashlab import site


@pytest.mark.slow
def test_render_executes_and_embeds_plots(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbconvert")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 99 A tiny chapter"),
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()"),
        nbformat.v4.new_code_cell("print(6 / 8)"),
    ]
    src = tmp_path / "99_tiny.ipynb"
    nbformat.write(nb, src)
    out = tmp_path / "html"
    out.mkdir()
    mathjax_url = site.install_mathjax(out)
    assert mathjax_url and (out / "mathjax" / "MathJax.js").is_file()
    nb = site.executed(src, tmp_path / "executed", timeout=120)
    assert (tmp_path / "executed" / "99_tiny.ipynb").exists()
    site.render_chapter(nb, out / "99_tiny.html", mathjax_url=mathjax_url)
    page = (out / "99_tiny.html").read_text()
    assert "data:image/png;base64," in page
    assert f'src="{mathjax_url}"' in page and "cdnjs.cloudflare.com/ajax/libs/mathjax" not in page
    assert "0.75" in page
    site.write_index(out, [src], [])
    index = (out / "index.html").read_text()
    assert 'href="99_tiny.html"' in index and "99 A tiny chapter" in index


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
    assert page.count("<section") >= 3  # two slides, each wrapped in a vertical stack
    import re

    remote = [u for u in re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', page) if "://" in u]
    assert not remote, f"the deck loads {remote} from the network"
