"""What a lab's grader tells chapter 9 about its known mistakes, beyond the mutants its questions use.

A lab module (``flashlab/grading/labNN.py``) names its mistakes with :class:`~flashlab.grading.core.Mutant`
objects; :mod:`flashlab.mistakes` finds those by itself. What it cannot find, the module declares in one
module-level object, ``KNOWN_MISTAKES = KnownMistakes(...)`` (every field optional, and the whole object too):

* ``demos`` — small, telling inputs (a :class:`Demo` builder) per module-level mutant list, or per question for
  the mutants written inside its function;
* ``hand_written`` — wrong implementations for mutants that have no ``fn`` (recognised by a predicate), keyed by
  (question, the start of the mutant's message); :func:`solution_variant` writes them as edits of the solution;
* ``other_diagnoses`` — diagnoses that are not mutants (a memory limit, a tile shape), each with an
  implementation that earns it;
* ``expect``, ``question_of``, ``object_of`` — where the grader's words, a list's question or a list's graded
  object cannot be guessed;
* ``submission`` and ``sources`` — for mutants that are not Python functions (lab 06's CUDA loop bodies).

This module also reads the solved labs (``solutions/labNN_*.ipynb``): chapter 9 submits a mistake with the
solution's other objects beside it. A student release has no ``solutions/``: what needs them raises
:class:`SolutionsMissing`, which says so (chapter 9 then shows those mistakes without running them).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


class SolutionsMissing(FileNotFoundError):
    """The solved labs (``solutions/``) are not here: a student release leaves them out."""


def call_with(fn: Callable, args: tuple) -> Any:
    """``fn(*args)``: how a demo applies an implementation to its inputs unless it says otherwise."""
    return fn(*args)


@dataclass
class Demo:
    """Small telling inputs for one group: ``examples`` are (label, args); ``right(args)`` and ``run(fn, args)``
    (the right outputs, and an implementation's) give outputs named ``names``."""

    examples: list[tuple[str, tuple]]
    right: Callable[[tuple], Any]
    names: tuple[str, ...]
    run: Callable[[Callable, tuple], Any] = call_with
    rtol: float = 1e-9  # what counts as "the same" (the graders' float64 tolerance; fp32 kernels need more)
    atol: float = 1e-12


@dataclass(frozen=True)
class HandWritten:
    """A wrong implementation written by hand: ``build()`` returns it; ``expect`` is the phrase its grader shows."""

    variant: str
    build: Callable[[], Callable]
    expect: str = ""


@dataclass(frozen=True)
class OtherDiagnosis:
    """A diagnosis that is not a mutant (a memory limit, a tile shape), with an implementation that earns it.

    ``obj`` is the graded object of ``question`` that ``impl`` replaces.
    """

    question: str
    obj: str
    message: str
    impl: HandWritten


@dataclass(frozen=True)
class KnownMistakes:
    """A lab module's ``KNOWN_MISTAKES``: what chapter 9 needs about its mistakes besides the mutants themselves.

    ``demos``: group (a module-level mutant list's name) or question -> a :class:`Demo` builder.
    ``hand_written``: (question, start of a mutant's message) -> implementations for a mutant without ``fn``.
    ``expect``: (question, start of a mutant's message) -> the phrase the grader shows instead of the message.
    ``other_diagnoses``: diagnoses that are not mutants.
    ``question_of``: group -> question, where the question functions' names cannot tell.
    ``object_of``: group -> the graded object its mutants replace, where the names cannot tell.
    ``submission(mutant)``: the object a student would hand in with the mistake, for mutants that are not
    functions; ``sources(mutant)``: (right code, wrong code), shown as a diff.
    """

    demos: dict[str, Callable[[], Demo]] = field(default_factory=dict)
    hand_written: dict[tuple[str, str], list[HandWritten]] = field(default_factory=dict)
    expect: dict[tuple[str, str], str] = field(default_factory=dict)
    other_diagnoses: list[OtherDiagnosis] = field(default_factory=list)
    question_of: dict[str, str] = field(default_factory=dict)
    object_of: dict[str, str] = field(default_factory=dict)
    submission: Callable[[Any], Any] | None = None
    sources: Callable[[Any], tuple[str, str]] | None = None


def demo_qkv(n: int, m: int, d: int, dv: int, seed: int, *, batch: int | None = None,
             top: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q (n, d), K (m, d), V (m, dv) of standard normals from ``seed`` (with a leading ``batch`` axis if given).

    ``top`` rescales Q so that the largest scaled score ``Q K^T / sqrt(d)`` is exactly ``top``.
    """
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    Q, K = rng.standard_normal((*lead, n, d)), rng.standard_normal((*lead, m, d))
    V = rng.standard_normal((*lead, m, dv))
    if top is not None:
        Q = Q * (top / (Q @ np.swapaxes(K, -1, -2) / np.sqrt(d)).max())
    return Q, K, V


# ------------------------------------------------------------------------------------------ the solution labs
def solution_path(lab_id: str) -> pathlib.Path:
    """``solutions/<lab_id>_*.ipynb``, the solved lab."""
    if not (ROOT / "solutions").is_dir():
        raise SolutionsMissing(f"{lab_id}'s solved lab is needed here, and this copy of the course has no solutions/ "
                               "(a student release leaves them out): run this in the instructor's copy")
    paths = sorted((ROOT / "solutions").glob(f"{lab_id}_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no solutions/{lab_id}_*.ipynb next to the flashlab package ({ROOT})")
    return paths[0]


def _definitions(source: str) -> str:
    """The statements of a cell that only define things: imports, functions, classes, call-free assignments."""
    source = "\n".join(line for line in source.splitlines() if "### BEGIN SOLUTION" not in line
                       and "### END SOLUTION" not in line)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    keep = []
    for node in tree.body:
        plain = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
        constant = isinstance(node, ast.Assign) and not any(isinstance(n, ast.Call) for n in ast.walk(node.value))
        if plain or constant:
            keep.append(ast.get_source_segment(source, node))
    return "\n".join(keep)


@functools.lru_cache(maxsize=None)
def _solution_sources(lab_id: str) -> tuple[str, ...]:
    import nbformat

    nb = nbformat.read(solution_path(lab_id), as_version=4)
    return tuple(_definitions(c.source) for c in nb.cells if c.cell_type == "code")


@functools.lru_cache(maxsize=None)
def _solution_namespace(lab_id: str) -> dict:
    ns: dict[str, Any] = {"__name__": f"solution_{lab_id}"}
    for source in _solution_sources(lab_id):
        exec(compile(source, f"<solutions/{lab_id}>", "exec"), ns)  # noqa: S102 - the course's own notebook
    return ns


def solution_object(lab_id: str, name: str) -> Any:
    """The object ``name`` as the solution notebook defines it (its imports, functions and constants only)."""
    ns = _solution_namespace(lab_id)
    if name not in ns:
        raise LookupError(f"{solution_path(lab_id).name} defines no {name!r}")
    return ns[name]


def solution_variant(lab_id: str, name: str, edits: Sequence[tuple[str, str]], extra: dict | None = None) -> Any:
    """``name`` from the solution with text edits applied to its cell (every occurrence of each ``old``)."""
    cell = next((s for s in _solution_sources(lab_id) if re.search(rf"^def {name}\(", s, re.M)), None)
    if cell is None:
        raise LookupError(f"{solution_path(lab_id).name} has no cell defining {name}()")
    for old, new in edits:
        if old not in cell:
            raise LookupError(f"{name}() in {solution_path(lab_id).name} no longer contains {old!r}: update "
                              f"KNOWN_MISTAKES in flashlab/grading/{lab_id}.py to the solution's new text")
        cell = cell.replace(old, new)
    ns = dict(_solution_namespace(lab_id), **(extra or {}))
    exec(compile(cell, f"<{lab_id} {name}, edited>", "exec"), ns)  # noqa: S102
    return ns[name]
