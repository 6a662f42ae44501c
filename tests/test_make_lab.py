"""`make lab` as a student meets it: the server it starts reaches every chapter, every lab and every link between
them, opens on chapter 1, and in a browser chapter 1's "Lab:" link opens the lab, whose first check cell grades.

The server is started by make itself, from the Makefile's own `lab` recipe (only its `setup` prerequisite is
skipped and BIN points at the venv running the tests), so the test cannot drift from what `make lab` does.
"""

from __future__ import annotations

import json
import os
import pathlib
import posixpath
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "notebooks").glob("*.ipynb"))
LABS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "labs").glob("*.ipynb"))
START_TIMEOUT = 180  # seconds: JupyterLab starts in a few on an idle laptop, far slower on a busy shared machine


@dataclass
class LabServer:
    """A `make lab` server: where it answers, its token, what it printed, the runtime files it wrote."""

    url: str
    token: str
    log: pathlib.Path
    runtime: pathlib.Path

    def get(self, path: str, timeout: float = 60) -> tuple[int, bytes]:
        """GET ``path`` (below the server's root URL) with the token; the HTTP status and the body."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def contents(self, path: str, content: bool = True) -> tuple[int, dict]:
        """The contents API's answer for ``path`` relative to the server's root (what the file browser sees)."""
        status, body = self.get(f"api/contents/{urllib.parse.quote(path)}?content={int(content)}")
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {"raw": body[:300].decode(errors="replace")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, server: LabServer | None) -> None:
    """Shut the kernels down through the server (they run in sessions of their own), then end make's group."""
    if server is not None and proc.poll() is None:
        try:
            status, body = server.get("api/kernels", timeout=10)
            for kernel in json.loads(body) if status == 200 else []:
                req = urllib.request.Request(f"{server.url}api/kernels/{kernel['id']}", method="DELETE",
                                             headers={"Authorization": f"token {server.token}"})
                urllib.request.urlopen(req, timeout=30).close()
        except (OSError, ValueError):
            pass  # the group is ended below either way
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """`make lab` with BIN at this venv and LAB_ARGS for a headless run on a free port; ended at the module's end."""
    if shutil.which("make") is None:
        pytest.skip("needs make, the command the README gives students")
    if not (pathlib.Path(sys.executable).parent / "jupyter").exists():
        pytest.skip("needs JupyterLab in the venv running the tests (requirements.txt)")
    tmp = tmp_path_factory.mktemp("make_lab")
    port, token = _free_port(), secrets.token_hex(16)
    # As typed at a shell: no flags or job server inherited from a `make test` this may run under.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    # A fresh student's Jupyter state: runtime files (the URL it opens), workspaces and settings of our own.
    env.update(JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"))
    # Kernels inherit the server's environment: they must import this checkout's package, as the grader here does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    lab_args = f"--no-browser --port={port} --ServerApp.port_retries=0 --IdentityProvider.token={token}"
    # -o setup: the venv already exists; `make lab` on a fresh clone would build it first.
    cmd = ["make", "--no-print-directory", "-o", "setup", "lab", f"BIN={pathlib.Path(sys.executable).parent}",
           f"LAB_ARGS={lab_args}"]
    log = tmp / "make_lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group, ended as one
    server = LabServer(f"http://127.0.0.1:{port}/", token, log, tmp / "runtime")
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`make lab` exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if server.get("api/status", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"`make lab` did not answer within {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        _stop(proc, server)


def _opened_path(server: LabServer) -> tuple[str, str]:
    """The path (below the server's root URL) of the page `make lab` opens in the browser, and of the one it prints."""
    opened = sorted(server.runtime.glob("jpserver-*-open.html"))
    assert opened, f"the server wrote no page to open in the browser into {server.runtime}"
    refresh = re.search(r'http-equiv="refresh" content="\d+;url=([^"]+)"', opened[-1].read_text())
    assert refresh, opened[-1].read_text()
    printed = re.search(r"(http://127\.0\.0\.1:\d+/\S*)", server.log.read_text())
    assert printed, server.log.read_text()[-3000:]
    return urllib.parse.urlsplit(refresh.group(1)).path, urllib.parse.urlsplit(printed.group(1)).path


def markdown_links(nb: dict) -> list[str]:
    """Every link and image target of the notebook's markdown cells, as JupyterLab's renderer sees them."""
    mistune = pytest.importorskip("mistune")
    links = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        # Rendering first keeps code spans such as `kernel[grid, threads](...)` from passing for links.
        html = mistune.html(source)
        links += [urllib.parse.unquote(t) for t in re.findall(r'<(?:a|img)\b[^>]*?\b(?:href|src)="([^"]*)"', html)]
    return links


def relative_target(notebook: str, link: str) -> str | None:
    """The root-relative path a relative link of ``notebook`` names (None for web links and in-page anchors)."""
    parts = urllib.parse.urlsplit(link)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(notebook), parts.path))


def test_make_lab_serves_every_chapter_lab_and_link_between_them(lab_server):
    assert CHAPTERS and LABS
    assert _opened_path(lab_server) == (f"/lab/tree/{CHAPTERS[0]}",) * 2, "`make lab` must open on chapter 1"
    status, _ = lab_server.get(f"lab/tree/{CHAPTERS[0]}?token={lab_server.token}")
    assert status == 200

    links: dict[str, set[str]] = {}
    for path in CHAPTERS + LABS:
        status, model = lab_server.contents(path)
        assert status == 200 and model.get("type") == "notebook", (path, status, model)
        local = json.loads((REPO / path).read_text())
        assert [c["source"] for c in model["content"]["cells"]] == [
            c["source"] if isinstance(c["source"], str) else "".join(c["source"]) for c in local["cells"]
        ], f"the server's {path} is not the course's"
        for link in markdown_links(model["content"]):
            target = relative_target(path, link)
            if target is not None:
                links.setdefault(target, set()).add(f"{path} -> {link}")

    # Chapters link their labs (chapter 1's "Lab:" link among them): the links that failed outside the old root.
    assert any(t in LABS for t in links), f"no chapter links a lab: {sorted(links)}"
    broken = {}
    for target, sources in sorted(links.items()):
        status, model = lab_server.contents(target, content=False)
        if target.startswith("../") or status != 200:
            broken[target] = (status, model.get("message") or model.get("raw"), sorted(sources))
    assert not broken, f"links the server of `make lab` cannot open: {broken}"


def _lab_link(chapter: dict) -> tuple[str, str]:
    """The target and the text of the chapter's "Lab:" link (the first link after "Lab:" in its markdown)."""
    mistune = pytest.importorskip("mistune")
    for cell in chapter["cells"]:
        if cell["cell_type"] == "markdown":
            html = mistune.html("".join(cell["source"]))
            found = re.search(r'Lab:.*?<a\b[^>]*\bhref="([^"]+)"[^>]*>(.*?)</a>', html, re.S)
            if found:
                return urllib.parse.unquote(found.group(1)), re.sub(r"<[^>]+>", "", found.group(2))
    pytest.fail('chapter 1 has no "Lab:" link')


def _first_check(lab_nb: dict) -> tuple[int, str, str]:
    """The index of the lab's first check cell, the lab id its `check` grades for, and the question it checks."""
    lab_id = None
    for i, cell in enumerate(lab_nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        lab_id = lab_id or next(iter(re.findall(r"""\blab\(\s*["'](\w+)["']\s*\)""", source)), None)
        question = re.search(r"""^\s*check\(\s*["'](\w+)["']""", source, re.M)
        if question:
            assert lab_id, "the check cell comes before `check = lab(...)`"
            return i, lab_id, question.group(1)
    pytest.fail("the lab has no check cell")


def _stub_feedback(lab_id: str, question: str, seed: int) -> str:
    """What `check` prints for the released stubs at ``seed``: the grader's own words, computed here."""
    from flashlab.grading import core

    def stub(*args, **kwargs):
        raise NotImplementedError("write your solution here")

    objects = [stub] * len(core.get_lab(lab_id).questions[question].objects)
    result = core.run_question(lab_id, question, objects, seed=seed)
    assert result.score == 0 and "NotImplementedError" in result.feedback, result
    return core.format_result(result, lab_id)


def _run_menu(page, item: str) -> None:
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-hidden)", has_text=item).first.click()


@pytest.mark.slow
def test_chapter_1_lab_link_opens_the_lab_and_its_first_check_grades_in_chromium(lab_server):
    """In JupyterLab: open chapter 1, click its "Lab:" link, run the lab down to its first check cell."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Chromium (Debian: apt-get install chromium); .ci/run installs it in CI")
    chapter = json.loads((REPO / CHAPTERS[0]).read_text())
    target, text = _lab_link(chapter)
    lab_path = relative_target(CHAPTERS[0], target)
    assert lab_path in LABS, f"chapter 1's Lab: link {target} is not a lab"
    index, lab_id, question = _first_check(json.loads((REPO / lab_path).read_text()))
    opened, _ = _opened_path(lab_server)

    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(180_000)
            page.goto(f"{lab_server.url.rstrip('/')}{opened}?token={lab_server.token}")
            link = page.locator(".jp-NotebookPanel .jp-RenderedMarkdown a", has_text=text)
            link.first.click()

            # The lab opens in a tab of its own, and JupyterLab's address names its path below the server's root.
            page.wait_for_url(f"**/lab/tree/{lab_path}*")
            tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=posixpath.basename(lab_path)).first
            panel_id = tab.get_attribute("data-id")
            assert panel_id, tab.evaluate("t => t.outerHTML")
            panel = page.locator(f'[id="{panel_id}"]')
            cell = panel.locator(".jp-Notebook .jp-Cell").nth(index)
            cell.locator(".jp-InputArea-editor").click()
            _run_menu(page, "Run All Above Selected Cell")
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")

            output = cell.locator(".jp-OutputArea-output", has_text=re.compile(rf"^{question}: ", re.M))
            output.first.wait_for(timeout=300_000)
            shown = output.first.inner_text()
        finally:
            browser.close()
    seed = re.search(r"\(seed (\d+);", shown)
    assert seed, shown
    assert shown.strip() == _stub_feedback(lab_id, question, int(seed.group(1))).strip()
