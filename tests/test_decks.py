"""Every chapter's deck tells its story: tagged as CONTRIBUTING.md ("Notebooks") says, built as `make slides` builds
it, and opened in headless Chromium as an instructor would open it, offline.

The tag checks read the chapters as committed (fast); the deck checks execute every chapter (slow) and keep a
screenshot of one slide per chapter in build/deck-screenshots/ for review.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from flashlab import site, slides

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SCREENSHOTS = ROOT / "build" / "deck-screenshots"
# The catalogue of mistakes (chapter 9) shows one slide per lab and a few of its mistakes: it may run longer.
LONG_DECKS = {"09_common_mistakes": 30}
# The closing chapter is itself the course's check-yourself: its seven questions open it, its measured limits follow.
QUESTIONS_FIRST = {"12_closing"}
EVIDENCE_MD = re.compile(r"\$|^\s*\|.*\|\s*$|```|<img|!\[|<table", re.M)


def _read(path: pathlib.Path):
    nbformat = pytest.importorskip("nbformat")
    return nbformat.read(path, as_version=4)


def _slides_of(nb) -> list[list]:
    """The deck's cells grouped by slide (the generated title slide first)."""
    groups: list[list] = []
    for cell in slides.deck(nb).cells:
        if cell.metadata["slideshow"]["slide_type"] == "slide" or not groups:
            groups.append([])
        groups[-1].append(cell)
    return groups


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_is_tagged_for_its_deck(path):
    """Title slide, 10-20 slides of evidence, the check-yourself questions last; no colon announcing nothing."""
    nb = _read(path)
    meta = slides.deck_metadata(nb)
    assert meta.get("claim") and meta.get("shows"), f"{path.name}: metadata flashlab.deck needs 'claim' and 'shows'"
    groups = _slides_of(nb)
    low, high = 10, LONG_DECKS.get(path.stem, 20)
    assert low <= len(groups) <= high, f"{path.name}: {len(groups)} slides, expected {low}-{high}"
    if path.stem not in QUESTIONS_FIRST:
        closing = groups[-1][0].source
        assert "Check yourself" in closing, f"{path.name}: the last slide is not the check-yourself questions"
    for group in groups[1:-1]:
        heading = group[0].source.strip().splitlines()[0] if group[0].cell_type == "markdown" else "(a code cell)"
        evidence = [c for c in group if c.cell_type == "code" or EVIDENCE_MD.search(c.source)]
        assert evidence, f"{path.name}: the slide {heading!r} is prose only (no output, figure, formula or table)"
    kinds = slides.slide_types(nb)
    for i, cell in enumerate(nb.cells):
        if kinds[i] and slides.announces_next(cell):
            following = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
            carried = following is not None and kinds[i + 1] == "-" and following.cell_type == "code"
            assert carried, f"{path.name}: cell {cell.get('id')} ends with a colon, and no code cell follows it"


def test_deck_rules_on_a_small_chapter():
    """The builder's rules, on a chapter made for them: title slide, colon carry, code only where asked."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.metadata["flashlab"] = {"deck": {"claim": "Blocks carry a mass.", "shows": ["the number 0.75"]}}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 97 A small chapter\n\n[![Open in Colab](https://x.test/b.svg)](https://x.test/nb)"),
        nbformat.v4.new_markdown_cell("## The answer\n\nIt is:", metadata={"tags": ["slide"]}),
        nbformat.v4.new_code_cell("print(6 / 8)", outputs=[nbformat.v4.new_output("stream", text="0.75\n")]),
        nbformat.v4.new_markdown_cell("## The update\n\nHere it is:", metadata={"tags": ["slide"]}),
        nbformat.v4.new_code_cell("def f(): pass"),
        nbformat.v4.new_code_cell("print(1)", metadata={"tags": ["slide-continue", "slide-code"]}),
        nbformat.v4.new_code_cell("print(2)"),
    ]
    d = slides.deck(nb)
    assert [c.metadata["slideshow"]["slide_type"] for c in d.cells] == ["slide", "slide", "-", "slide", "-", "-"]
    assert "Blocks carry a mass." in d.cells[0].source and d.cells[0].source.startswith("# 97 A small chapter")
    hidden = [slides.HIDE_INPUT_TAG in c.metadata.get("tags", []) for c in d.cells if c.cell_type == "code"]
    assert hidden == [True, False, False]  # printed output only; code with no output; code asked for
    live = slides.present_notebook(nb)
    assert [c.metadata["slideshow"]["slide_type"] for c in live.cells] == [
        "slide", "skip", "slide", "-", "slide", "-", "-", "skip"]
    assert "x.test/b.svg" not in live.cells[1].source and "[Open in Colab](https://x.test/nb)" in live.cells[1].source


@pytest.fixture(scope="module")
def decks(tmp_path_factory):
    """Every chapter's deck, built as `make slides` builds it (executed chapters are reused from build/executed)."""
    pytest.importorskip("nbconvert")
    pytest.importorskip("sphinx_revealjs")
    out = tmp_path_factory.mktemp("slides")
    assert slides.main(["--out", str(out), "--cache", str(ROOT / "build" / "executed")]) == 0
    return out


@pytest.mark.slow
def test_every_chapter_has_a_deck_and_gpu_results_say_where_they_come_from(decks):
    """Built without a GPU, every slide that shows a recorded GPU result names the GPU and the date."""
    from flashlab import records

    checked = 0
    for path in CHAPTERS:
        assert (decks / f"{path.stem}.html").is_file(), f"no deck for {path.name}"
        for group in _slides_of(site.executed(path, ROOT / "build" / "executed")):
            shown = "".join(slides.printed_text(c) if c.cell_type == "code" else c.source for c in group)
            for cell in group:
                for name in slides.READS_RECORD.findall(cell.source) if cell.cell_type == "code" else []:
                    prov = records.read_record(name).get("provenance", {})
                    if prov.get("gpu"):
                        checked += 1
                        assert prov["gpu"] in shown and str(prov["date_utc"])[:10] in shown, (
                            f"{path.name}, cell {cell.get('id')}: {name} shown without its GPU and date")
    assert checked, "no slide shows a recorded GPU result: the GPU chapters' decks lost their fallbacks"


SLIDE_REPORT = """() => Reveal.getSlides().map((s, i) => {
  const heading = s.querySelector('h1, h2, h3');
  const text = s.innerText.trim();
  const imgs = Array.from(s.querySelectorAll('img'));
  return {
    index: i,
    indices: Reveal.getIndices(s),
    title: heading ? heading.innerText.trim() : '',
    text: text,
    // The slide's last cell with something in it ends in a colon, and no figure follows: it announces nothing.
    dangling: (() => {
      const cells = Array.from(s.querySelectorAll('.jp-Cell'))
        .filter(c => c.innerText.trim() || c.querySelector('img'));
      const last = cells[cells.length - 1];
      return !!last && !last.querySelector('img') && last.innerText.trim().endsWith(':');
    })(),
    beyond: text.replace(heading ? heading.innerText.trim() : '', '').trim().length + imgs.length,
    images: imgs.map(im => [im.complete, im.naturalWidth]),
    tex: s.querySelectorAll('script[type^="math/tex"]').length,
    rendered: s.querySelectorAll('.MathJax, .MathJax_Display, .MathJax_SVG, mjx-container').length,
  };
})"""


@pytest.mark.slow
def test_decks_in_headless_chromium(decks):
    """Every slide of every deck shows content, renders its math and images, and nothing is fetched remotely."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Chromium (Debian: apt-get install chromium); .ci/run installs it in CI")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        for path in CHAPTERS:
            page.goto((decks / f"{path.stem}.html").as_uri())
            page.wait_for_function("window.Reveal && Reveal.isReady()", timeout=30_000)
            page.wait_for_function("window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0", timeout=60_000)
            # MathJax typesets the whole page once; wait until every formula of every slide has its output.
            page.wait_for_function(
                "document.querySelectorAll('script[type^=\"math/tex\"]').length <= "
                "document.querySelectorAll('.MathJax, .MathJax_Display').length", timeout=60_000)
            report = page.evaluate(SLIDE_REPORT)
            for s in report:
                where = f"{path.stem} slide {s['index'] + 1} ({s['title'][:50]!r})"
                if s["beyond"] == 0:
                    problems.append(f"{where}: nothing beyond its title")
                if s["dangling"]:
                    problems.append(f"{where}: ends with a colon: ...{s['text'][-80:]!r}")
                if "$$" in s["text"] or "\\begin{" in s["text"]:
                    problems.append(f"{where}: raw TeX on the slide")
                if s["tex"] and not s["rendered"]:
                    problems.append(f"{where}: {s['tex']} formulas, none rendered by MathJax")
                if not all(ok and width > 0 for ok, width in s["images"]):
                    problems.append(f"{where}: an image does not decode {s['images']}")
            shot = next((s for s in report if s["images"]), report[min(1, len(report) - 1)])
            page.evaluate(f"Reveal.slide({shot['indices']['h']}, {shot['indices']['v']})")
            page.wait_for_timeout(600)  # the slide transition, and the fit of a tall slide
            page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.png"))
            if len(report) < 10:
                problems.append(f"{path.stem}: {len(report)} slides in the browser")
        browser.close()
    remote = [u for u in requests if not re.match(r"(file|data|blob|about):|https?://(localhost|127\.0\.0\.1)[:/]", u)]
    assert not remote, f"the decks fetched from the network: {sorted(set(remote))[:10]}"
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_present_opens_as_live_slides_in_jupyterlab(tmp_path):
    """`make present`: the chapter written for RISE opens in JupyterLab as live slides, its title slide first."""
    pytest.importorskip("jupyterlab_rise", reason="make present installs it (requirements-instructor.txt)")
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Chromium (Debian: apt-get install chromium)")
    written = slides.write_present("1", tmp_path / "build" / "present")
    claim = slides.deck_metadata(_read(written))["claim"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "deck-test"
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api?token={token}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "JupyterLab did not start"
                time.sleep(0.5)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/rise/build/present/{written.name}?token={token}")
            page.wait_for_function("document.querySelectorAll('.reveal .slides > section').length >= 10",
                                   timeout=90_000)
            assert claim in page.inner_text(".reveal .slides > section.present")
            count = page.evaluate("document.querySelectorAll('.reveal .slides > section').length")
            assert count == len(_slides_of(_read(slides.chapter_path("1")))), "the live deck and the static one differ"
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
