"""The course's own answers cannot be handed in: a question that reaches them scores 0 and says so.

The package implements every lab's task (``flashlab.online.update`` is lab 01's ``online_update``,
``flashlab.tiled.forward`` lab 02's ``flash_forward``, ...), and chapters need those implementations. A lab
module declares, per question, the package functions that *are* that question's answer::

    ANSWERS = {"q1": ("flashlab.online.update",), "q2": ("flashlab.online.merge", ...), ...}

(dotted names of module-level functions). Helpers a lab is meant to use (``flashlab.measure.peak_memory``,
``flashlab.numba_cuda.launch`` in lab 05's kernel question, ...) are simply not listed.

Two defences use that mapping:

* In process (interactive ``check()`` and the grader's in-process runs), :class:`Guard` arms the question's answer
  functions while the student's code runs (:meth:`flashlab.grading.core.Trial.call`): each function's ``__code__``
  is swapped for a tripwire that records the call and raises :class:`AnswerCalled`, and is restored on the way out.
  Every reference to the function object trips, however it was imported (``from flashlab.tiled import forward as
  f``, a reference kept in a list, a call from another package function). The grader's own work (drawing inputs,
  computing expected values, diagnosing) runs outside that window, so it keeps the real functions. The question
  then scores 0 with feedback naming the function, even if the student's code caught the exception.
  Out of scope in process: code that copied an answer before the check ran (``inspect.getsource`` + ``exec``, a
  new function built from the saved ``__code__``) — an interactive check cannot stop a student fooling themselves.
* For sandboxed batch grading, :func:`student_package` writes a copy of the package in which the bodies of the
  answer functions of every lab (another lab's answer is as much a way around this one's work) are replaced by a
  ``raise AnswerCalled(...)``: there is no answer code left to call or copy. The grader's own judging, outside
  the sandbox, keeps the real package.

The course's own implementations may reuse package code: the lab module's mutants and helpers, handed in as they
are (tests do), are graded without the tripwire (:func:`is_course_code`; a listed answer handed in is still caught),
and chapter 9 grades its hand-written mistakes inside :func:`trusted`. Not caught in process: handing in one of the
grading module's own unlisted right implementations as it is (the student copy of the package is the defence there).

Lab 06 lists nothing: its answer is a CUDA C string, built before any check runs. A sandboxed run that reaches a
stub sees :class:`AnswerCalled`, whose message is the feedback: the judge outside should give that question 0.
A CUDA lab's module holds the lines its answer is made of (the solution, the statements its mutants are built
from): it names those constants in ``SANDBOX_POISON``, and the student copy replaces their values by :func:`poison`,
preprocessor errors that name them, so that a kernel assembled from them fails to compile and says why.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import pathlib
import shutil
import threading
import types
from typing import Any, Iterator, Sequence

from . import astguard

PACKAGE = "flashlab"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]

_LOCK = threading.Lock()
_ARMED: list["Guard"] = []  # guards whose window is open, innermost last
_TRUSTED = threading.local()


class AnswerCalled(BaseException):
    """Raised by an armed answer function. A BaseException, so that ``except Exception:`` does not hide it."""

    def __init__(self, name: str) -> None:
        super().__init__(feedback(name))
        self.name = name


def feedback(name: str) -> str:
    """What the student reads when their code called the course's answer ``name``."""
    return f"calls {name} — the course's own answer to this question; write it yourself"


def answers_of(lab_id: str, question: str | None = None) -> tuple[str, ...]:
    """Dotted names of the answer functions of one question of ``lab_id`` (of all its questions if None)."""
    module = importlib.import_module(f"{PACKAGE}.grading.{lab_id}")
    table: dict[str, tuple[str, ...]] = getattr(module, "ANSWERS", {})
    if question is not None:
        return tuple(table.get(question, ()))
    return tuple(dict.fromkeys(name for names in table.values() for name in names))


def sandbox_answers(lab_id: str) -> tuple[str, ...]:
    """The answers :func:`student_package` removes when ``lab_id`` is graded: every lab's (another lab's answer, a
    correct helper of its grader, is just as much a way around this lab's work), but those the graded lab's module
    lists in ``SANDBOX_KEEP`` (an answer of one question that another question's task or its grading needs)."""
    from .core import available_labs

    keep = set(getattr(importlib.import_module(f"{PACKAGE}.grading.{lab_id}"), "SANDBOX_KEEP", ()))
    own = answers_of(lab_id)
    others = [name for other in available_labs() if other != lab_id for name in answers_of(other)]
    return tuple(name for name in dict.fromkeys([*own, *others]) if name not in keep)


def sandbox_methods() -> dict[str, tuple[str, ...]]:
    """Methods that hold a lab's answer (``SANDBOX_METHODS`` of every lab: ``{module: ("Class.method", ...)}``),
    stubbed in the student copy of the package like the functions of :func:`sandbox_answers`. The in-process guard
    does not arm them: an interactive check does not stop a student who copies the course's code."""
    from .core import available_labs

    out: dict[str, tuple[str, ...]] = {}
    for lab in available_labs():
        for module_name, methods in getattr(importlib.import_module(f"{PACKAGE}.grading.{lab}"),
                                            "SANDBOX_METHODS", {}).items():
            out[module_name] = tuple(dict.fromkeys([*out.get(module_name, ()), *methods]))
    return out


def resolve(name: str) -> types.FunctionType | None:
    """The Python function behind a dotted name (under a cache decorator, the cached function itself).

    None when its module cannot be imported here (e.g. a GPU module without CuPy): nothing can call it then.
    """
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    fn = getattr(module, attr)
    fn = getattr(fn, "__wrapped__", fn)
    if not isinstance(fn, types.FunctionType) or fn.__closure__:
        raise TypeError(f"{name} is not a module-level Python function; ANSWERS lists those only")
    return fn


def _clear_cache(name: str) -> None:
    # A cached answer (functools.lru_cache) could hand back a result computed before the guard was armed.
    module_name, _, attr = name.rpartition(".")
    clear = getattr(getattr(importlib.import_module(module_name), attr), "cache_clear", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Grade the course's own code (chapter 9's wrong implementations) with the answer functions left alone.

    Refused while a guard is armed: student code cannot use it to disarm its own check.
    """
    if _ARMED:
        raise _tripped(f"{__name__}.trusted")
    previous = getattr(_TRUSTED, "on", False)
    _TRUSTED.on = True
    try:
        yield
    finally:
        _TRUSTED.on = previous


@functools.lru_cache(maxsize=None)
def _module_code(lab_id: str) -> frozenset[types.CodeType]:
    """Every code object defined in ``flashlab.grading.<lab_id>``: its functions, their nested functions and
    lambdas, and the functions held in its module-level lists (mutants)."""
    module = importlib.import_module(f"{PACKAGE}.grading.{lab_id}")
    codes: set[types.CodeType] = set()

    def add_code(code: types.CodeType) -> None:
        if code not in codes:
            codes.add(code)
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    add_code(const)

    def add(value: Any, depth: int = 0) -> None:
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            add_code(value.__code__)
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                add(item, depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 2:
            for f in dataclasses.fields(value):
                add(getattr(value, f.name), depth + 1)

    for value in vars(module).values():
        add(value)
    return frozenset(codes)


def is_course_code(obj: Any, lab_id: str) -> bool:
    """Whether ``obj`` is a function the lab's grading module itself defines (by its code object, not its name).

    Tests and chapter 9 submit these (mutants, a switchable right implementation): they are graded like a
    student's, without the tripwire. A student's own function, even one that calls them, is not course code.
    """
    code = getattr(obj, "__code__", None)
    if not isinstance(code, types.CodeType) or code not in _module_code(lab_id):
        return False
    # ... unless it is one of the lab's answers itself (``flash_backward = lab04._mutant_backward``)
    return all(fn is None or fn.__code__ is not code for fn in map(resolve, answers_of(lab_id)))


@functools.lru_cache(maxsize=None)
def _tripwire_code(name: str, original: types.CodeType) -> types.CodeType:
    # The tripwire runs with the answer function's own globals, so it reaches this module through the builtin
    # __import__ rather than through a name that those globals might not have.
    source = (f"def {original.co_name}(*args, **kwargs):\n"
              f"    raise __import__({__name__!r}, fromlist=['_tripped'])._tripped({name!r})\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, original.co_filename, "exec"), namespace)  # noqa: S102 - a fixed two-line template
    return namespace[original.co_name].__code__


def _tripped(name: str) -> AnswerCalled:
    with _LOCK:
        for guard in _ARMED:
            if name in guard.names or name == f"{__name__}.trusted":
                guard.calls.append(name)
    return AnswerCalled(name)


class Guard:
    """The answer functions of one question, armed while the student's code runs (a reentrant context manager).

    ``calls`` lists every answer function the student's code reached; :func:`verdict` turns a non-empty list
    into a score of 0.
    """

    def __init__(self, lab_id: str, question: str, objects: Sequence[Any] = ()) -> None:
        self.lab_id = lab_id
        self.question = question
        # The course's own implementations (the lab module's mistakes, right or wrong) are not a student's code.
        course = bool(objects) and all(is_course_code(obj, lab_id) for obj in objects)
        # A proxy of a sandboxed notebook runs the student's code in the sandbox, whose package copy has no answer
        # bodies (student_package). Arming here would trip the grader's own threads, which compute the expected
        # values with these very functions while another submission's call is under way.
        sandboxed = any(getattr(obj, "runs_in_sandbox", False) for obj in objects)
        self.names = () if course or sandboxed else answers_of(lab_id, question)
        self.calls: list[str] = []
        self._depth = 0
        self._saved: list[tuple[types.FunctionType, types.CodeType]] = []

    def __enter__(self) -> "Guard":
        if getattr(_TRUSTED, "on", False) or not self.names:
            return self
        with _LOCK:
            self._depth += 1
            if self._depth == 1:
                for name in self.names:
                    fn = resolve(name)
                    if fn is None:
                        continue
                    _clear_cache(name)
                    self._saved.append((fn, fn.__code__))
                    fn.__code__ = _tripwire_code(name, fn.__code__)
                _ARMED.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if getattr(_TRUSTED, "on", False) or not self.names:
            return
        with _LOCK:
            self._depth -= 1
            if self._depth == 0:
                for fn, code in reversed(self._saved):
                    fn.__code__ = code
                self._saved.clear()
                _ARMED.remove(self)

    def __repr__(self) -> str:
        return f"Guard({self.lab_id!r}, {self.question!r}, names={list(self.names)})"


def verdict(guard: Guard | Any, result: Any) -> Any:
    """``result`` unchanged, or with score 0 and feedback naming the answer functions the student's code called."""
    calls = list(dict.fromkeys(getattr(guard, "calls", ())))
    if not calls:
        return result
    return dataclasses.replace(result, score=0.0, feedback="\n".join(feedback(name) for name in calls))


# ------------------------------------------------------------------------------------ the student's package copy
def _stub(name: str, indent: str) -> list[str]:
    return [f"{indent}from flashlab.grading.answers import AnswerCalled\n",
            f"{indent}raise AnswerCalled({name!r})  # the course's answer is not part of this copy\n"]


#: Held around ``ast`` work in the grader's threads: see :mod:`flashlab.grading.astguard`.
AST_LOCK = astguard.LOCK


def _strip_functions(source: str, targets: dict[str, str], where: str) -> str:
    """``source`` with the bodies (docstrings included) of the module-level functions in ``targets`` replaced, and of
    the methods named ``"Class.method"`` there."""
    with AST_LOCK:
        return _strip_functions_locked(source, targets, where)


def _strip_functions_locked(source: str, targets: dict[str, str], where: str) -> str:
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and node.name in targets:
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update((f"{node.name}.{f.name}", f) for f in node.body
                         if isinstance(f, functions) and f"{node.name}.{f.name}" in targets)
    missing = set(targets) - set(found)
    if missing:
        raise LookupError(f"{where} defines no module-level function or method {', '.join(sorted(missing))}")
    for key, node in sorted(found.items(), key=lambda item: item[1].lineno, reverse=True):
        first = node.body[0]
        if first.lineno == node.lineno:  # "def f(x): return x" on one line: rewrite the whole definition
            node.body = ast.parse("".join(_stub(targets[key], ""))).body
            text = ast.unparse(node)
            lines[node.lineno - 1: node.end_lineno] = [" " * node.col_offset + s + "\n" for s in text.splitlines()]
            continue
        indent = " " * first.col_offset
        lines[first.lineno - 1: node.end_lineno] = _stub(targets[key], indent)
    return "".join(lines)


#: How many lines a poisoned constant has: code that indexes the lines of an answer string (lab 07 takes lines of
#: its kernel's solution apart at import) still finds lines to take.
POISON_LINES = 16


def poison(name: str) -> str:
    """What a constant that holds (part of) a CUDA lab's answer becomes in the student's copy: preprocessor errors
    naming it, so that any kernel assembled from it fails to compile with that message, whatever else it holds."""
    line = f'#error "{name} is the course\'s own answer: write these lines yourself"'
    return "\n".join([line] * POISON_LINES)


def _poison_constants(source: str, names: Sequence[str], module: str, where: str) -> str:
    """``source`` with the value of each module-level assignment to ``names`` replaced by :func:`poison`."""
    with AST_LOCK:
        tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        found.update((t.id, node) for t in targets if isinstance(t, ast.Name) and t.id in names)
    missing = set(names) - set(found)
    if missing:
        raise LookupError(f"{where} assigns no module-level constant {', '.join(sorted(missing))}")
    for name, node in sorted(found.items(), key=lambda item: item[1].lineno, reverse=True):
        lines[node.lineno - 1: node.end_lineno] = [f"{name} = {poison(f'{module}.{name}')!r}\n"]
    return "".join(lines)


def student_package(dest: pathlib.Path | str, lab_id: str) -> pathlib.Path:
    """Write ``dest/flashlab``: the package with the bodies of ``lab_id``'s answer functions replaced by a raise.

    Returns the written package folder. A sandboxed run that exposes this copy (and hides the checkout) has no
    answer code to call, import or read with ``inspect.getsource``; everything else works as in the real package.
    """
    dest = pathlib.Path(dest)
    out = dest / PACKAGE
    if out.exists():
        raise FileExistsError(f"{out} exists; student_package writes a fresh copy")
    shutil.copytree(PACKAGE_DIR, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    by_module: dict[str, dict[str, str]] = {}
    for name in sandbox_answers(lab_id):
        module_name, _, attr = name.rpartition(".")
        by_module.setdefault(module_name, {})[attr] = name
    for module_name, methods in sandbox_methods().items():
        by_module.setdefault(module_name, {}).update((m, f"{module_name}.{m}") for m in methods)
    for module_name, targets in by_module.items():
        parts = module_name.split(".")
        if parts[0] != PACKAGE:
            raise ValueError(f"{lab_id}'s ANSWERS names {module_name}, outside the {PACKAGE} package")
        path = out.joinpath(*parts[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        path.write_text(_strip_functions(path.read_text(), targets, str(path.relative_to(dest))))
    # A CUDA lab's answer is a string (lines of a kernel), not a function: the constants it is built from are
    # poisoned in the lab's own module (its SANDBOX_POISON), which the notebook imports to check itself
    module_name = f"{PACKAGE}.grading.{lab_id}"
    poisoned = tuple(getattr(importlib.import_module(module_name), "SANDBOX_POISON", ()))
    if poisoned:
        path = out / "grading" / f"{lab_id}.py"
        path.write_text(_poison_constants(path.read_text(), poisoned, module_name, str(path.relative_to(dest))))
    return out
