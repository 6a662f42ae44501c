"""The graders' known mistakes, listed, run and graded: the code behind chapter 9 ("common mistakes").

Every lab module ``flashlab/grading/labNN.py`` describes the mistakes its questions recognise as
:class:`~flashlab.grading.core.Mutant` objects: a message and, usually, a wrong implementation ``fn``; what
else chapter 9 needs about them it declares in ``KNOWN_MISTAKES``, a :class:`~flashlab.grading.known.KnownMistakes`
(demos, hand-written implementations, other diagnoses). This module holds nothing of any one lab:

* :func:`catalogue` walks every lab module. A module-level list of mutants (``UPDATE_MUTANTS``, ...) belongs to
  the question whose function refers to it, directly or through the module's helper functions (found from the
  functions' bytecode names). ``Mutant(...)`` calls written inside a question function (mistakes recognised from
  a trace rather than by running a wrong function) are found in the module's source. A mutant without ``fn`` is
  run through the module's hand-written wrong implementations (``KNOWN_MISTAKES.hand_written``); its
  ``other_diagnoses`` add diagnoses that are not mutants (memory limits, tile shapes).
* :func:`grade` submits a mistake to its question exactly as a student's function would be submitted
  (:func:`flashlab.grading.run_question`, with a fixed seed), the other objects of the question taken from the
  lab's solution notebook.
* :func:`demo` runs the mistake on small, telling inputs (``KNOWN_MISTAKES.demos``) beside the right answer;
  :func:`report` puts the demo and the grader's message together, and :class:`Showcase` is what the chapter calls.
  The labs slow to grade on a CPU (:func:`slow_to_grade`: a kernel compiled per mistake) have their reports
  recorded (:func:`record_lines`, ``python -m flashlab mistakes --record``, into :data:`RECORD`); the chapter grades
  one of them live and prints the others from the record, marked as recorded.
* :func:`sweep` (``python -m flashlab.mistakes --seeds 40``) grades every mistake with many seeds and :func:`rates`
  sums it up per lab: how often each mistake is named (target: at least 95 % of the seeds) and how often another
  mistake is printed as the likely one (target: never); the command exits non-zero when a lab misses either.
  :func:`seed_sweep` lists the gradings that miss.

``tests/test_mistakes.py`` checks that every mutant of every lab is in the catalogue, runnable, and named by
its own grader; it says what to add to the lab's module when a new mistake is not.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import pathlib
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .grading import answers
from .grading.core import (
    QUESTION_TIME_LIMIT,
    Mutant,
    Result,
    allclose,
    as_outputs,
    available_labs,
    fmt,
    get_lab,
    mistake_title,
    run_question,
)
from .grading.known import ROOT, Demo, HandWritten, KnownMistakes, SolutionsMissing, solution_object

#: The seed every grading in the chapter uses, so that its messages are the same on every run.
SEED = 0


@dataclass(eq=False)
class Mistake:
    """One mistake a grader diagnoses, with a wrong implementation that makes it (when one is known).

    ``group`` is the module-level list the mutant sits in (``"UPDATE_MUTANTS"``), ``"inside <question>"`` for a
    mutant built inside the question function, or ``"other diagnoses"``. ``obj`` is the name of the graded
    object the wrong implementation replaces; ``expect`` a phrase the grader's feedback shows when it
    recognises the mistake; ``variant`` says what the hand-written implementation does wrong.
    """

    lab_id: str
    question: str
    group: str
    message: str
    fn: Callable | None
    obj: str
    expect: str
    mutant: Mutant | None = None
    variant: str = ""

    @property
    def title(self) -> str:
        """The message's first clause, e.g. "averaging block results"."""
        return mistake_title(self.message)

    def __repr__(self) -> str:
        extra = f", variant={self.variant!r}" if self.variant else ""
        return f"Mistake({self.lab_id} {self.question} {self.group}: {self.title!r}{extra})"


# ------------------------------------------------------------------------------------------------ lab modules
def lab_module(lab_id: str) -> types.ModuleType:
    """The module ``flashlab.grading.<lab_id>`` (imported, so that its questions are registered)."""
    get_lab(lab_id)
    return sys.modules[f"flashlab.grading.{lab_id}"]


def known(lab_id: str) -> KnownMistakes:
    """The lab module's ``KNOWN_MISTAKES`` (an empty one when it declares none)."""
    return getattr(lab_module(lab_id), "KNOWN_MISTAKES", None) or KnownMistakes()


def is_mutant(x: Any) -> bool:
    """A :class:`Mutant`, or a lab's own kind of mutant: a class named ``...Mutant`` with a ``message`` (e.g. one
    whose wrong code is CUDA source rather than a Python function)."""
    if isinstance(x, Mutant):
        return True
    return type(x).__name__.endswith("Mutant") and isinstance(getattr(x, "message", None), str)


def mutant_groups(lab_id: str) -> dict[str, list[Any]]:
    """Module-level mutants of a lab: every list or tuple of mutants, and every lone mutant, by name."""
    groups: dict[str, list[Any]] = {}
    for name, value in vars(lab_module(lab_id)).items():
        if is_mutant(value):
            groups[name] = [value]
        elif isinstance(value, (list, tuple)) and value and all(is_mutant(v) for v in value):
            groups[name] = list(value)
    return groups


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _reachable_names(fn: Callable, module: types.ModuleType) -> set[str]:
    """Global names a function uses, following the module's own functions it calls (question -> helper -> list)."""
    seen: set[str] = set()
    todo = [fn]
    while todo:
        f = inspect.unwrap(todo.pop())
        code = getattr(f, "__code__", None)
        if code is None:
            continue
        for name in _code_names(code) - seen:
            seen.add(name)
            value = getattr(module, name, None)
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                todo.append(value)
    return seen


def group_questions(lab_id: str) -> dict[str, list[str]]:
    """For each module-level group of a lab, the questions that use it (one, unless ``question_of`` decides)."""
    module = lab_module(lab_id)
    questions = get_lab(lab_id).questions
    question_of = known(lab_id).question_of
    out: dict[str, list[str]] = {}
    for group in mutant_groups(lab_id):
        if group in question_of:
            out[group] = [question_of[group]]
            continue
        out[group] = [name for name, q in questions.items() if group in _reachable_names(q.run, module)]
    return out


def _tokens(name: str) -> set[str]:
    return {t for t in name.lower().split("_") if t and t != "mutants"}


def _object_for(lab_id: str, question: str, group: str) -> str:
    """The graded object a group's mutants replace: the only one, the declared one, or the one its name shares most
    with."""
    objects = get_lab(lab_id).questions[question].objects
    if len(objects) == 1:
        return objects[0]
    if group in known(lab_id).object_of:
        return known(lab_id).object_of[group]
    overlap = [len(_tokens(group) & _tokens(o)) for o in objects]
    best = max(overlap)
    if best > 0 and overlap.count(best) == 1:
        return objects[overlap.index(best)]
    raise LookupError(
        f"{lab_id}.{group}: cannot tell which of {', '.join(objects)} (question {question}) its mutants replace; "
        f"add object_of={{{group!r}: '<object name>'}} to KNOWN_MISTAKES in flashlab/grading/{lab_id}.py"
    )


def _literal(node: ast.AST, module: types.ModuleType) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return getattr(module, node.id)
    return None


def _message_position(cls: Any) -> int:
    """Where ``message`` sits among a mutant class's positional arguments (0 for Mutant)."""
    try:
        names = list(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return 0
    return names.index("message") if "message" in names else 0


def declared_mutants(lab_id: str) -> list[tuple[str | None, str | None]]:
    """Every ``Mutant(...)`` (or ``...Mutant(...)``) call in a lab module's source: (enclosing top-level function
    or None, message).

    The message is None when it is not a string literal (or a module constant), so it cannot be read here.
    """
    module = lab_module(lab_id)
    tree = ast.parse(inspect.getsource(module))
    found = []
    for top in tree.body:
        owner = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        for node in ast.walk(top):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", getattr(node.func, "attr", None))
            if isinstance(called, str) and called.endswith("Mutant"):
                arg = next((k.value for k in node.keywords if k.arg == "message"), None)
                position = _message_position(getattr(module, called, Mutant))
                if arg is None and len(node.args) > position:
                    arg = node.args[position]
                found.append((owner, _literal(arg, module) if arg is not None else None))
    return found


def local_mutants(lab_id: str) -> list[tuple[str, str]]:
    """(question, message) of mutants built inside a question function rather than at module level."""
    lab = get_lab(lab_id)
    by_function = {q.run.__name__: name for name, q in lab.questions.items()}
    module_level = {m.message for ms in mutant_groups(lab_id).values() for m in ms}
    out = []
    for owner, message in declared_mutants(lab_id):
        if owner in by_function and message is not None and message not in module_level:
            out.append((by_function[owner], message))
    return out


# ---------------------------------------------------------------------------------------------- the catalogue
def _hand_written(lab_id: str, question: str, message: str) -> list[HandWritten]:
    return [h for (q, start), hs in known(lab_id).hand_written.items() if q == question and message.startswith(start)
            for h in hs]


def _entries(lab_id, question, group, message, obj, mutant=None) -> list[Mistake]:
    book = known(lab_id)
    expect = next((e for (q, start), e in book.expect.items() if q == question and message.startswith(start)),
                  message)
    if mutant is not None and getattr(mutant, "fn", None) is not None:
        return [Mistake(lab_id, question, group, message, mutant.fn, obj, expect, mutant)]
    if mutant is not None and book.submission is not None:
        make = book.submission
        return [Mistake(lab_id, question, group, message, lambda: make(mutant), obj, expect, mutant,
                        getattr(mutant, "tag", ""))]
    hand = _hand_written(lab_id, question, message)
    if not hand:  # listed, but nothing to run: tests/test_mistakes.py asks for a hand_written entry
        return [Mistake(lab_id, question, group, message, None, obj, message, mutant)]
    return [Mistake(lab_id, question, group, message, h.build, obj, h.expect or message.split(":")[0], mutant,
                    h.variant) for h in hand]


@functools.lru_cache(maxsize=None)
def _catalogue(lab_id: str) -> tuple[Mistake, ...]:
    lab = get_lab(lab_id)
    out: list[Mistake] = []
    owners = group_questions(lab_id)
    by_question: dict[str, list[Mistake]] = {q: [] for q in lab.questions}
    for group, mutants in mutant_groups(lab_id).items():
        if len(owners[group]) != 1:
            continue  # unowned or shared: unmapped_groups() reports it
        question = owners[group][0]
        obj = _object_for(lab_id, question, group)
        for mutant in mutants:
            by_question[question] += _entries(lab_id, question, group, mutant.message, obj, mutant)
    for question, message in local_mutants(lab_id):
        obj = lab.questions[question].objects[0]
        by_question[question] += _entries(lab_id, question, f"inside {question}", message, obj)
    for other in known(lab_id).other_diagnoses:
        if other.question in by_question:
            h = other.impl
            by_question[other.question].append(Mistake(lab_id, other.question, "other diagnoses", other.message,
                                                       h.build, other.obj, h.expect or other.message,
                                                       variant=h.variant))
    for question in lab.questions:
        out += by_question[question]
    return tuple(out)


def labs() -> list[str]:
    """Every lab with a grading module (flashlab/grading/labNN.py)."""
    return available_labs()


def catalogue(lab_ids: Sequence[str] | None = None) -> list[Mistake]:
    """Every mistake the graders of ``lab_ids`` (default: all labs) diagnose, in lab and question order."""
    return [m for lab_id in (lab_ids or labs()) for m in _catalogue(lab_id)]


def unmapped_groups(lab_id: str) -> dict[str, list[str]]:
    """Module-level groups that belong to no question, or to several: they are left out of the catalogue."""
    return {g: qs for g, qs in group_questions(lab_id).items() if len(qs) != 1}


def find(lab_id: str, phrase: str, question: str | None = None, variant: str | None = None,
         group: str | None = None) -> Mistake:
    """The one mistake of ``lab_id`` whose message contains ``phrase`` (case-insensitive), narrowed by question,
    variant (a phrase of it) and group (its module-level list) when given. Raises LookupError otherwise."""
    found = [m for m in catalogue([lab_id]) if phrase.lower() in m.message.lower()
             and (question is None or m.question == question)
             and (variant is None or variant.lower() in m.variant.lower())
             and (group is None or m.group == group)]
    if len(found) != 1:
        titles = "\n  ".join(f"{m.question} {m.title!r} {m.variant}" for m in catalogue([lab_id]))
        what = "no" if not found else f"{len(found)}"
        raise LookupError(f"{what} mistakes of {lab_id} match {phrase!r} (question={question}, variant={variant}, "
                          f"group={group}); its mistakes are:\n  {titles}")
    return found[0]


# ---------------------------------------------------------------------------------------------- environments
def needs_gpu(lab_id: str) -> bool:
    """True when a lab's questions run CUDA code on a real GPU (its module sets NEEDS_GPU, or uses CuPy)."""
    module = lab_module(lab_id)
    if hasattr(module, "NEEDS_GPU"):
        return bool(module.NEEDS_GPU)
    source = inspect.getsource(module)
    for name in answers.answers_of(lab_id):  # the answers it lists are names, not code that runs
        source = source.replace(f'"{name}"', "")
    return bool(re.search(r"\bcupy\b|flashlab\.gpu\b|from \.\.gpu\b|from \.\. import gpu\b", source))


def needs_simulator(lab_id: str) -> bool:
    """True when a lab's questions run numba.cuda kernels in the CUDA simulator."""
    return "simulator_active" in inspect.getsource(lab_module(lab_id))


@functools.lru_cache(maxsize=1)
def gpu_here() -> bool:
    """Whether CuPy sees a CUDA GPU on this machine."""
    from .gpu import gpu_available

    return gpu_available()


def runnable_here(mistake: Mistake) -> bool:
    """Whether the mistake can be run and diagnosed here: not for GPU labs without a GPU, nor without an
    implementation."""
    return mistake.fn is not None and (gpu_here() or not needs_gpu(mistake.lab_id))


# ------------------------------------------------------------------------------------------------- grading
def implementation(mistake: Mistake) -> Callable:
    """The wrong function itself (hand-written ones are built on first use)."""
    if mistake.fn is None:
        raise LookupError(f"{mistake!r} has no implementation: add one to KNOWN_MISTAKES.hand_written in "
                          f"flashlab/grading/{mistake.lab_id}.py")
    if mistake.mutant is not None and getattr(mistake.mutant, "fn", None) is mistake.fn:
        return mistake.fn
    return mistake.fn()  # a builder


def _submission(mistake: Mistake) -> list:
    question = get_lab(mistake.lab_id).questions[mistake.question]
    wrong = implementation(mistake)
    return [wrong if name == mistake.obj else solution_object(mistake.lab_id, name) for name in question.objects]


def grade(mistake: Mistake, seed: int = SEED, time_limit: float | None = QUESTION_TIME_LIMIT) -> Result:
    """Grade the mistake as a student's submission: the wrong object in its place, the solution's elsewhere.

    The course's wrong implementations may reuse the package's own answers (a forward that skips the last query
    tile by calling ``flashlab.tiled.forward``): they are graded with those answers left alone.
    """
    with answers.trusted():
        return run_question(mistake.lab_id, mistake.question, _submission(mistake), seed=seed, time_limit=time_limit)


def grader_message(mistake: Mistake, seed: int = SEED) -> str:
    """What the check cell prints for this mistake: points, then the feedback."""
    r = grade(mistake, seed)
    return f"{r.name}: {r.score:g}/{r.max_score:g} points (seed {r.seed})\n{r.feedback}"


def diagnosed(mistake: Mistake, result: Result) -> bool:
    """Whether the grader lost points and named this mistake."""
    return result.score < result.max_score and mistake.expect.lower() in result.feedback.lower()


# ------------------------------------------------------------------------------------------------ the demos
def demo_for(mistake: Mistake) -> Demo | None:
    """The demo of a mistake's group (or, for the other diagnoses and in-question mutants, of its question)."""
    if mistake.group == "other diagnoses":
        return None  # memory limits, block choices, tile shapes: the grader's message holds the measurement
    demos = known(mistake.lab_id).demos
    make = demos.get(mistake.group)
    if make is None and mistake.group.startswith("inside "):
        make = demos.get(mistake.question)
    return make() if make else None


@dataclass
class Row:
    """One input of a demo: the right outputs, the mistake's outputs (or the exception it raised)."""

    label: str
    right: tuple
    wrong: tuple | BaseException
    rtol: float = 1e-9
    atol: float = 1e-12
    differs: bool = field(init=False)

    def __post_init__(self):
        self.differs = isinstance(self.wrong, BaseException) or not self.same(self.wrong, self.right)

    def same(self, a: Sequence, b: Sequence) -> bool:
        return allclose(a, b, self.rtol, self.atol)

    def differs_in(self, *indices: int) -> bool:
        """Whether the outputs at ``indices`` (e.g. 0: the first output alone) differ, or the mistake raised."""
        if isinstance(self.wrong, BaseException):
            return True
        if len(self.wrong) != len(self.right):
            return True
        return not self.same([self.wrong[i] for i in indices], [self.right[i] for i in indices])


def demo(mistake: Mistake) -> list[Row] | None:
    """Run the mistake on its group's telling inputs beside the right answer (None if the group has no demo)."""
    spec = demo_for(mistake)
    if spec is None:
        return None
    wrong_fn = implementation(mistake)
    rows = []
    for label, args in spec.examples:
        right = as_outputs(spec.right(args))
        try:
            with np.errstate(all="ignore"):
                wrong: tuple | BaseException = as_outputs(spec.run(wrong_fn, args))
        except Exception as e:  # the mistake crashes on this input: that is what the reader should see
            wrong = e
        rows.append(Row(label, right, wrong, spec.rtol, spec.atol))
    return rows


def _diff(right: np.ndarray, wrong: np.ndarray) -> str:
    if right.shape != wrong.shape:
        return f"shape {wrong.shape} instead of {right.shape}"
    if (np.isnan(wrong) & ~np.isnan(right)).any():
        return "nan where the answer is a number"
    if not np.array_equal(np.isinf(wrong) & (wrong > 0), np.isinf(right) & (right > 0)) or not np.array_equal(
            np.isinf(wrong) & (wrong < 0), np.isinf(right) & (right < 0)):
        return "inf where the answer is finite, or the other way round"
    finite = np.isfinite(right) & np.isfinite(wrong)
    gap = np.abs(wrong[finite] - right[finite])
    return f"max |wrong - right| = {gap.max(initial=0.0):.3g}"


def format_rows(rows: list[Row], names: Sequence[str]) -> str:
    """The demo as text: per input, the right outputs and, where they differ, the mistake's."""
    lines = []
    for row in rows:
        lines.append(f"input: {row.label}")
        if isinstance(row.wrong, BaseException):
            lines.append("  right:  " + ", ".join(f"{n} = {fmt(v)}" for n, v in zip(names, row.right, strict=False)))
            lines.append(f"  wrong:  raises {type(row.wrong).__name__}: {str(row.wrong)[:200]}")
            continue
        if not row.differs:
            lines.append("  right:  " + ", ".join(f"{n} = {fmt(v)}" for n, v in zip(names, row.right, strict=False)))
            lines.append("  wrong:  the same on this input (the mistake does not show here)")
            continue
        for name, r, w in zip(names, row.right, row.wrong, strict=False):
            if row.same((w,), (r,)):
                lines.append(f"  {name}: right {fmt(r)} (the mistake gets this one right)")
            else:
                lines.append(f"  {name}: right {fmt(r)}")
                lines.append(f"  {' ' * len(name)}  wrong {fmt(w)}   <- {_diff(r, w)}")
    return "\n".join(lines)


def source_diff(mistake: Mistake) -> str | None:
    """For a mutant that is source code (e.g. a CUDA loop body): a diff of the right code and the wrong one."""
    import difflib

    sources = known(mistake.lab_id).sources
    if sources is None or mistake.mutant is None:
        return None
    right, wrong = sources(mistake.mutant)

    def code(text: str) -> list[str]:  # comments differ between the two; the code is what matters
        lines = (re.sub(r"\s*//.*$", "", line).rstrip() for line in text.splitlines())
        return [line for line in lines if line.strip()]

    lines = difflib.unified_diff(code(right), code(wrong), "right", "wrong", lineterm="", n=9)
    return "\n".join(line for line in list(lines)[2:] if not line.startswith("@@"))


def report(mistake: Mistake, seed: int = SEED, width: int = 240) -> str:
    """The chapter's view of one mistake: what it is, its demo, and the grader's message when it is submitted
    (lines longer than ``width`` cut short).

    Without the solved labs (a student release) a mistake that needs them (the solution's other objects beside
    it, or an edit of the solution) is described, not run.
    """
    try:
        return _report(mistake, seed, width)
    except SolutionsMissing as e:
        head = _head(mistake)
        return (f"{head}\n{'=' * min(len(head), 110)}\nNot run here: {e}.\nThe grader's words for this mistake:\n"
                + mistake.message)


def _head(mistake: Mistake) -> str:
    objects = get_lab(mistake.lab_id).questions[mistake.question].objects
    return f"{mistake.lab_id} {mistake.question} ({', '.join(objects)}): {mistake.title}"


def _report(mistake: Mistake, seed: int, width: int) -> str:
    head = _head(mistake)
    if mistake.variant:
        head += f"\n  written as: {mistake.variant}"
    parts = [head, "=" * min(len(head.splitlines()[0]), 110)]
    if mistake.fn is None:
        parts.append("No wrong implementation is known for this mistake yet (see KNOWN_MISTAKES.hand_written in "
                     f"flashlab/grading/{mistake.lab_id}.py); the grader's words for it:\n" + mistake.message)
        return "\n".join(parts)
    diff = source_diff(mistake)
    if diff:
        parts.append("The code, right (-) and wrong (+):\n" + diff + "\n")
    gpu_missing = needs_gpu(mistake.lab_id) and not gpu_here()
    if gpu_missing:
        parts.append("Running it needs a GPU: this lab's questions launch CUDA kernels, and this machine has none. "
                     "On a GPU this cell runs the mistake and grades it. The grader's words for this mistake:\n"
                     + mistake.message)
    else:
        rows = demo(mistake)
        if rows is not None:
            parts.append(format_rows(rows, demo_for(mistake).names))
        elif mistake.group == "other diagnoses":
            parts.append("(the grader measures this one; its message below holds the measurement)")
        else:
            parts.append("(no hand-picked input for this one: the grader's smallest failing input below shows the "
                         "expected output beside the mistake's)")
    result = grade(mistake, seed)
    if gpu_missing:
        parts.append("\nThe grader on this machine, given this mistake:")
    else:
        mark = "recognised" if diagnosed(mistake, result) else "NOT recognised by name"
        parts.append(f"\nThe grader, on this mistake submitted as {mistake.obj} ({mark}):")
    parts.append(f"{result.name}: {result.score:g}/{result.max_score:g} points (seed {result.seed})")
    parts.append(_shorten(result.feedback, width))
    return "\n".join(parts)


def _shorten(text: str, width: int) -> str:
    """Long lines (inputs printed in full) cut to ``width`` characters, marked with an ellipsis."""
    return "\n".join(line if len(line) <= width else line[:width - 2] + " …" for line in text.splitlines())


# ------------------------------------------------------------------------------------------------ the chapter
def slow_to_grade(lab_id: str) -> str:
    """Why chapter 9 shows most of a lab's mistakes from the record (:data:`RECORD`) rather than grading each, or ''
    when it grades them all: its grader compiles each mistake's kernel (g++ on a CPU, seconds each and minutes for
    all). The CUDA simulator is slow too, but its reports change from run to run (which race the threads meet
    first), so they could not be checked against a record: they are graded live."""
    from .grading import batch

    return "its grader compiles each mistake's kernel (g++ on a CPU)" if lab_id in batch.GPU_LABS else ""


# -------------------------------------------------------------------------------------- the recorded reports
#: The recorded reports of the mistakes of the labs slow to grade (:func:`slow_to_grade`), which chapter 9 shows
#: rather than grades one by one: JSON Lines, the first line the provenance, then one mistake per line (so that a
#: regeneration changes the lines of the mistakes that changed). ``tests/test_mistakes.py`` checks it is current.
RECORD = ROOT / "data" / "mistakes" / "chapter9.jsonl"
#: The one command that regenerates :data:`RECORD`.
RECORD_COMMAND = "python -m flashlab mistakes --record > data/mistakes/chapter9.jsonl"


def record_key(mistake: Mistake) -> str:
    """What identifies a mistake in the record: lab, question, group, message and variant."""
    return "\x1f".join((mistake.lab_id, mistake.question, mistake.group, mistake.message, mistake.variant))


def recorded_mistakes(lab_ids: Sequence[str] | None = None) -> list[Mistake]:
    """The mistakes the record holds: every mistake of the slow labs among ``lab_ids`` (default all labs)."""
    return [m for m in catalogue(lab_ids) if slow_to_grade(m.lab_id)]


def record_lines(lab_ids: Sequence[str] | None = None, seed: int = SEED) -> list[str]:
    """The record, line by line: the provenance, then each recorded mistake's :func:`report` with ``seed``."""
    import datetime
    import platform

    provenance = {"command": RECORD_COMMAND, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "seed": seed, "gpu": gpu_here(), "python": platform.python_version(),
        "numpy": np.__version__}
    lines = [json.dumps({"provenance": provenance}, ensure_ascii=False)]
    for m in recorded_mistakes(lab_ids):
        entry = {"lab": m.lab_id, "question": m.question, "group": m.group, "message": m.message,
                 "variant": m.variant, "report": report(m, seed)}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return lines


def read_record(path: pathlib.Path | None = None) -> tuple[dict, dict[str, str]]:
    """The record's provenance and its reports by :func:`record_key` (empty when there is no record); ``path``
    defaults to :data:`RECORD`."""
    path = path or RECORD
    if not path.exists():
        return {}, {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    reports = {"\x1f".join((r["lab"], r["question"], r["group"], r["message"], r["variant"])): r["report"]
               for r in rows[1:]}
    return rows[0]["provenance"], reports


# ------------------------------------------------------------------------------------------------ the chapter
class Showcase:
    """What chapter 9 calls: ``book.show(lab_id, phrase)`` prints the report of the mistake whose message holds
    ``phrase``; ``book.rest()`` prints every mistake not shown yet (new labs' and new mutants' included).

    ``show`` always grades live. ``rest`` (and :meth:`report`) grades live every mistake of a lab that is quick to
    grade, and one of each slow lab (:func:`slow_to_grade`) that :meth:`show` has not graded yet; the others of a slow
    lab come from the record (:data:`RECORD`), marked as recorded. A mistake the record lacks, or a seed other than
    the record's, is graded live; ``recorded=False`` grades everything live.
    """

    def __init__(self, seed: int = SEED, recorded: bool = True) -> None:
        self.seed = seed
        self.shown: list[Mistake] = []
        provenance, reports = read_record() if recorded else ({}, {})
        self.provenance = provenance if provenance.get("seed") == seed else {}
        self.recorded = reports if self.provenance else {}
        self.graded_live: set[str] = set()  # the labs of which a mistake was graded live

    def show(self, lab_id: str, phrase: str, question: str | None = None, variant: str | None = None,
             group: str | None = None) -> None:
        """Print the report of the one mistake :func:`find` picks with these arguments, graded live."""
        mistake = find(lab_id, phrase, question, variant, group)
        self.shown.append(mistake)
        self.graded_live.add(lab_id)
        print(report(mistake, self.seed))

    def report(self, mistake: Mistake) -> str:
        """The mistake's report: graded live, or from the record (see the class docstring)."""
        lab_id = mistake.lab_id
        recorded = self.recorded.get(record_key(mistake))
        if recorded is None or lab_id not in self.graded_live or not slow_to_grade(lab_id):
            self.graded_live.add(lab_id)
            return report(mistake, self.seed)
        head, _, body = recorded.partition("\n")
        note = (f"[recorded on {self.provenance['date_utc'][:10]} by `{self.provenance['command'].split(' >')[0]}`, "
                f"seed {self.seed}: {slow_to_grade(lab_id)}; mistakes.report(mistake) grades it here]")
        return f"{head}\n{note}\n{body}"

    def remaining(self, lab_ids: Sequence[str] | None = None) -> list[Mistake]:
        """The mistakes of ``lab_ids`` (default all labs) not shown yet."""
        return [m for m in catalogue(lab_ids) if all(m is not s for s in self.shown)]

    def rest(self, lab_ids: Sequence[str] | None = None) -> None:
        """Print the report of every mistake not shown yet."""
        left = self.remaining(lab_ids)
        if not left:
            print("Every mistake of " + (", ".join(lab_ids) if lab_ids else "every lab") + " has been shown above.")
        for mistake in left:
            self.shown.append(mistake)
            print(self.report(mistake), end="\n\n")


#: A check cell's line that names a mistake as the likely one: "Likely mistake (...): <message>".
_LIKELY = re.compile(r"Likely mistake(?: \([^)]*\))?: (.+)")
#: The targets of the seed sweep: each mistake named in at least this share of the seeds ...
NAMED_TARGET = 0.95
#: ... and no seed at all where a mistake that is not there is printed as the likely one.
FALSE_LIKELY_TARGET = 0


def likely_titles(result: Result) -> list[str]:
    """Titles of the mistakes a result's feedback prints as the likely one."""
    return [mistake_title(m.group(1)) for m in _LIKELY.finditer(result.feedback)]


def false_likely(mistake: Mistake, result: Result) -> list[str]:
    """Mistakes printed as the likely one for this submission that are not ``mistake`` (a wrong guess)."""
    own = {mistake.title.lower(), mistake_title(mistake.expect).lower()} - {""}
    printed = [m.group(1) for m in _LIKELY.finditer(result.feedback)]
    # A grader may add to the title ("reading past the last ragged tile (see the IndexError below)").
    return [mistake_title(text) for text in printed if not any(t in text.lower() for t in own)]


@dataclass
class Outcome:
    """One grading of the seed sweep: the mistake, the seed, whether it was named, and any wrong guesses."""

    mistake: Mistake
    seed: int
    result: Result
    named: bool
    wrong_guesses: list[str]


def _grade_seeds(mistake: Mistake, seeds: Sequence[int], time_limit: float | None
                 ) -> list[tuple[int, Result, bool, list[str]]]:
    out = []
    for seed in seeds:
        result = grade(mistake, int(seed), time_limit)
        out.append((int(seed), result, diagnosed(mistake, result), false_likely(mistake, result)))
    return out


def _grade_in_worker(job: tuple[int, tuple[str, ...] | None, tuple[int, ...], float | None]):
    index, lab_ids, seeds, time_limit = job  # the mistake by its place in the catalogue: its functions do not pickle
    return index, _grade_seeds(catalogue(list(lab_ids) if lab_ids else None)[index], seeds, time_limit)


def sweep(seeds: Sequence[int], lab_ids: Sequence[str] | None = None, *, simulator: bool = False,
          progress: Callable[[str], None] | None = None, jobs: int = 1,
          time_limit: float | None = None) -> list[Outcome]:
    """Grade every runnable mistake with each seed and record, per grading, whether the grader named it and
    whether it printed another mistake as the likely one. ``jobs > 1`` grades that many mistakes at once, in
    forked worker processes (each mistake's seeds in one of them).

    ``time_limit`` bounds each question (none by default): the sweep checks diagnoses, and on a busy machine a
    question of the course's own wrong code may take longer than a student's check is allowed to."""
    found = catalogue(lab_ids)
    todo = [i for i, m in enumerate(found)
            if runnable_here(m) and not (needs_simulator(m.lab_id) and not simulator)]
    seeds = tuple(int(s) for s in seeds)
    graded: dict[int, list] = {}

    def report(index: int) -> None:
        rows = graded[index]
        bad = sum(not named for _, _, named, _ in rows)
        guessed = sum(bool(wrong) for _, _, _, wrong in rows)
        if progress:
            notes = [f"{bad} of {len(rows)} seeds not named"] if bad else []
            notes += [f"{guessed} of {len(rows)} seeds name another mistake"] if guessed else []
            progress(f"{'ok  ' if not notes else 'MISS'} {found[index]!r}" + (": " + "; ".join(notes) if notes else ""))

    if jobs > 1 and len(todo) > 1:
        import multiprocessing

        key = tuple(lab_ids) if lab_ids else None
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            jobs_ = [(i, key, seeds, time_limit) for i in todo]
            for index, rows in pool.imap_unordered(_grade_in_worker, jobs_):
                graded[index] = rows
                report(index)
    else:
        for index in todo:
            graded[index] = _grade_seeds(found[index], seeds, time_limit)
            report(index)
    return [Outcome(found[i], seed, result, named, wrong) for i in todo for seed, result, named, wrong in graded[i]]


def seed_sweep(seeds: Sequence[int], lab_ids: Sequence[str] | None = None, *, simulator: bool = False,
               progress: Callable[[str], None] | None = None, time_limit: float | None = None
               ) -> list[tuple[Mistake, int, str]]:
    """Grade every runnable mistake with each seed; return (mistake, seed, feedback) wherever it is not named or
    another mistake is printed as the likely one.

    Students get a fresh seed at every check, so a diagnosis must hold for any draw, not only for the seed the
    tests use. ``simulator=True`` includes the labs graded in the CUDA simulator (slow).
    """
    outcomes = sweep(seeds, lab_ids, simulator=simulator, progress=progress, time_limit=time_limit)
    return [(o.mistake, o.seed, o.result.feedback) for o in outcomes if not o.named or o.wrong_guesses]


@dataclass
class LabRates:
    """A lab's seed-sweep rates: per mistake how often it was named, and how often another was guessed."""

    lab_id: str
    named: dict[str, tuple[int, int]] = field(default_factory=dict)  # repr(mistake) -> (named, gradings)
    false_likely: int = 0
    gradings: int = 0

    @property
    def named_rate(self) -> float:
        """Share of all gradings that named their mistake."""
        return sum(k for k, _ in self.named.values()) / max(1, self.gradings)

    @property
    def lowest(self) -> tuple[str, float]:
        """The mistake named least often, and its rate."""
        name, (k, n) = min(self.named.items(), key=lambda kv: kv[1][0] / max(1, kv[1][1]))
        return name, k / max(1, n)

    @property
    def meets_targets(self) -> bool:
        return (not self.named or self.lowest[1] >= NAMED_TARGET) and self.false_likely <= FALSE_LIKELY_TARGET

    def line(self) -> str:
        if not self.named:
            return f"{self.lab_id}: no mistake runnable here"
        name, low = self.lowest
        verdict = "meets both targets" if self.meets_targets else "MISSES A TARGET"
        return (f"{self.lab_id}: {len(self.named)} mistakes, {self.gradings} gradings; named correctly "
                f"{self.named_rate:.1%} (lowest {low:.1%}, {name}; target >= {NAMED_TARGET:.0%} each); "
                f"another mistake printed as likely {self.false_likely} times "
                f"({self.false_likely / max(1, self.gradings):.1%}; target {FALSE_LIKELY_TARGET}): {verdict}")


def rates(outcomes: Sequence[Outcome]) -> dict[str, LabRates]:
    """The sweep's outcomes summed up per lab."""
    per_lab: dict[str, LabRates] = {}
    for o in outcomes:
        lab = per_lab.setdefault(o.mistake.lab_id, LabRates(o.mistake.lab_id))
        k, n = lab.named.get(repr(o.mistake), (0, 0))
        lab.named[repr(o.mistake)] = (k + o.named, n + 1)
        lab.false_likely += bool(o.wrong_guesses)
        lab.gradings += 1
    return per_lab


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashlab.mistakes",
                                description="Check that every grader diagnosis holds over many random seeds: each "
                                            f"mistake named in >= {NAMED_TARGET:.0%} of the seeds, and no seed "
                                            "where another mistake is printed as the likely one.")
    p.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    p.add_argument("--first", type=int, default=1000, help="first seed (default 1000)")
    p.add_argument("--labs", nargs="*", default=None, help="lab ids (default: all)")
    p.add_argument("--simulator", action="store_true", help="include the labs graded in the CUDA simulator (slow)")
    p.add_argument("--jobs", type=int, default=1, help="mistakes graded at once, in worker processes (default 1)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds a question may run (default 0: no limit; the sweep checks diagnoses, not speed)")
    p.add_argument("--record", action="store_true",
                   help="print chapter 9's record of the slow labs' mistakes (JSON Lines) instead of sweeping: "
                        f"{RECORD_COMMAND}")
    args = p.parse_args(argv)
    if args.record:  # the record may cover a simulator lab: chosen before numba.cuda is first imported
        from .numba_cuda import use_simulator

        use_simulator()
        print("\n".join(record_lines(args.labs)))
        return 0
    if args.simulator:  # chosen before anything imports numba.cuda, as the simulator must be
        from .numba_cuda import use_simulator

        use_simulator()
    outcomes = sweep(range(args.first, args.first + args.seeds), args.labs, simulator=args.simulator,
                     progress=lambda line: print(line, flush=True), jobs=args.jobs,
                     time_limit=args.time_limit or None)
    misses = [o for o in outcomes if not o.named or o.wrong_guesses]
    for o in misses:
        why = "not named" if not o.named else "named as likely: " + "; ".join(o.wrong_guesses)
        print(f"\n--- {o.mistake!r} with seed {o.seed}: {why}\n{o.result.feedback}")
    per_lab = rates(outcomes)
    print()
    for lab in per_lab.values():
        print(lab.line())
    print(f"\n{len(misses)} misses")
    return 0 if all(lab.meets_targets for lab in per_lab.values()) else 1


def overview() -> str:
    """One line per lab: its title, how many mistakes its graders name, and where they run."""
    lines = []
    for lab_id in labs():
        found = catalogue([lab_id])
        from .grading import batch

        where = ("a GPU" if needs_gpu(lab_id) else "a GPU, or the CPU through g++" if lab_id in batch.GPU_LABS
                 else "the CUDA simulator (CPU)" if needs_simulator(lab_id) else "NumPy (CPU)")
        per_q = ", ".join(f"{q}: {sum(m.question == q for m in found)}" for q in get_lab(lab_id).questions)
        lines.append(f"{lab_id}  {get_lab(lab_id).title:<40} {len(found):>2} mistakes ({per_q}); runs on {where}")
    return "\n".join(lines)


__all__ = [
    "ROOT", "SEED", "Demo", "LabRates", "Mistake", "Outcome", "Row", "Showcase", "catalogue", "declared_mutants",
    "RECORD", "RECORD_COMMAND", "demo", "demo_for", "diagnosed", "false_likely", "find", "format_rows", "grade",
    "grader_message", "group_questions", "implementation", "is_mutant", "known", "lab_module", "labs",
    "likely_titles", "local_mutants", "mutant_groups", "needs_gpu", "needs_simulator", "overview", "rates",
    "read_record", "record_key", "record_lines", "recorded_mistakes", "report", "runnable_here", "seed_sweep",
    "slow_to_grade", "solution_object", "source_diff", "sweep", "unmapped_groups",
]


if __name__ == "__main__":
    raise SystemExit(main())
