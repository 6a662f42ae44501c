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
    site.render_chapter(src, out, execute=True, timeout=120, mathjax_url=mathjax_url)
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
