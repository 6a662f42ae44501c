"""The batch grader parses Python in several threads at once; CPython 3.11 needs those parses one at a time."""
import ast
import sys
import threading
import traceback

import pytest

from flashlab.grading import astguard, batch


@pytest.fixture
def unguarded(monkeypatch):
    monkeypatch.setattr(ast, "parse", astguard._original)
    yield
    # monkeypatch puts back whatever ast.parse was before the test


def _parse_in_thread(source: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def work():
        ast.parse(source)
        done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, done


def test_batch_grading_installs_the_guard(unguarded, tmp_path):
    assert not astguard.installed()
    assert batch.main([str(tmp_path), "--no-sandbox"]) == 2  # an empty folder: nothing to grade
    assert astguard.installed()


def test_a_parse_waits_while_another_thread_holds_the_lock(unguarded):
    astguard.install()
    with astguard.LOCK:
        thread, done = _parse_in_thread("x = 1 + 2")
        assert not done.wait(0.3), "ast.parse ran while another thread held the AST lock"
    assert done.wait(10)
    thread.join()


def test_without_the_guard_nothing_waits(unguarded):
    # The control of the test above: the same parse does not wait when the guard is not installed.
    with astguard.LOCK:
        thread, done = _parse_in_thread("x = 1 + 2")
        assert done.wait(10)
    thread.join()


def test_traceback_carets_go_through_the_guard(unguarded, monkeypatch):
    # Python 3.11's traceback parses the failing line to place its carets: a parse nobody in the grader calls.
    calls = []
    original = astguard._original

    def counting(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("source"))
        return original(*args, **kwargs)

    monkeypatch.setattr(astguard, "_original", counting)
    astguard.install()
    try:
        values = {"a": 1}
        values["a"] + values["b"]
    except KeyError as e:
        text = "".join(traceback.format_exception(e))
    assert "KeyError" in text
    if sys.version_info >= (3, 11):
        assert calls, "traceback formatting did not parse through the guarded ast.parse"
