"""One lock around every parse into Python AST objects while the batch grader runs submissions in threads.

CPython 3.11 keeps the AST constructor's recursion count in interpreter-wide state. Two threads that build AST
objects at once can corrupt it, and one of them then fails with "SystemError: AST constructor recursion depth
mismatch" (CPython's gh-106905). The grader parses notebooks, package sources and kernels in several threads, and
the standard library parses too where nobody asks it to: ``traceback`` parses a line to draw its carets, and
``inspect.signature`` parses text signatures. So the grader's own parsing takes :data:`LOCK`, and :func:`install`
wraps ``ast.parse`` so that every other caller in the process takes it as well.
"""
from __future__ import annotations

import ast
import functools
import threading

#: Reentrant: the grader's code holds it around whole passes over a tree, which call ``ast.parse`` again.
LOCK = threading.RLock()

_original = ast.parse


@functools.wraps(_original)
def _locked_parse(*args, **kwargs):
    with LOCK:
        return _original(*args, **kwargs)


def install() -> None:
    """Make ``ast.parse`` take :data:`LOCK` for every caller in this process (idempotent)."""
    ast.parse = _locked_parse


def installed() -> bool:
    return ast.parse is _locked_parse
