"""The graders' known mistakes, listed, run and graded: the code behind chapter 9 ("common mistakes").

Every lab module ``flashlab/grading/labNN.py`` describes the mistakes its questions recognise as
:class:`~flashlab.grading.core.Mutant` objects: a message and, usually, a wrong implementation ``fn``. This
module finds them without a list to keep up to date:

* :func:`catalogue` walks every lab module. A module-level list of mutants (``UPDATE_MUTANTS``, ...) belongs to
  the question whose function refers to it, directly or through the module's helper functions (found from the
  functions' bytecode names). ``Mutant(...)`` calls written inside a question function (lab 05's kernel
  mistakes, which are recognised from a trace rather than by running a wrong function) are found in the
  module's source. A mutant without ``fn`` is run through a hand-written wrong implementation from
  :data:`HAND_WRITTEN` (e.g. a lab 05 kernel with one ``cuda.syncthreads()`` removed, edited from the lab's
  solution); :data:`OTHER_DIAGNOSES` adds diagnoses that are not mutants (memory limits, tile shapes).
* :func:`grade` submits a mistake to its question exactly as a student's function would be submitted
  (:func:`flashlab.grading.run_question`, with a fixed seed), the other objects of the question taken from the
  lab's solution notebook.
* :func:`demo` runs the mistake on small, telling inputs (:data:`DEMOS`) beside the right answer;
  :func:`report` puts the demo and the grader's message together, and :class:`Showcase` is what the chapter
  calls.

``tests/test_mistakes.py`` checks that every mutant of every lab is in the catalogue, runnable, and named by
its own grader; it says what to add here when a new lab's mistake is not.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import iocount, online, reference, tiled
from .grading.core import Case, Mutant, Result, allclose, as_outputs, available_labs, fmt, get_lab, run_question

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The seed every grading in the chapter uses, so that its messages are the same on every run.
SEED = 0
LN3 = float(np.log(3.0))


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
        head = re.split(r"[:;]\s|\.\s", self.message, maxsplit=1)[0]
        return head.strip().rstrip(".")

    def __repr__(self) -> str:
        extra = f", variant={self.variant!r}" if self.variant else ""
        return f"Mistake({self.lab_id} {self.question} {self.group}: {self.title!r}{extra})"


# ------------------------------------------------------------------------------------------------ lab modules
def lab_module(lab_id: str) -> types.ModuleType:
    """The module ``flashlab.grading.<lab_id>`` (imported, so that its questions are registered)."""
    get_lab(lab_id)
    return sys.modules[f"flashlab.grading.{lab_id}"]


def is_mutant(x: Any) -> bool:
    """A :class:`Mutant`, or a lab's own kind of mutant (a class named ``...Mutant`` with a ``message``, such as
    lab 06's CudaMutant, whose wrong code is CUDA source rather than a Python function)."""
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
    """Global names a function uses, following the module's own functions it calls (lab03: q2 -> helper -> list)."""
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


#: Where introspection cannot tell which question a module-level group belongs to: (lab, group) -> question.
QUESTION_OF: dict[tuple[str, str], str] = {}
#: Which object of a multi-object question a group's mutants stand for, where the names do not tell:
#: (lab, group) -> object name.
OBJECT_OF: dict[tuple[str, str], str] = {
    ("lab03", "BLOCK_MUTANTS"): "paper_blocks",
}


def group_questions(lab_id: str) -> dict[str, list[str]]:
    """For each module-level group of a lab, the questions that use it (one, unless QUESTION_OF must decide)."""
    module = lab_module(lab_id)
    questions = get_lab(lab_id).questions
    out: dict[str, list[str]] = {}
    for group in mutant_groups(lab_id):
        if (lab_id, group) in QUESTION_OF:
            out[group] = [QUESTION_OF[(lab_id, group)]]
            continue
        out[group] = [name for name, q in questions.items() if group in _reachable_names(q.run, module)]
    return out


def _tokens(name: str) -> set[str]:
    return {t for t in name.lower().split("_") if t and t != "mutants"}


def _object_for(lab_id: str, question: str, group: str) -> str:
    """The graded object a group's mutants replace: the only one, the table's, or the one its name shares most with."""
    objects = get_lab(lab_id).questions[question].objects
    if len(objects) == 1:
        return objects[0]
    if (lab_id, group) in OBJECT_OF:
        return OBJECT_OF[(lab_id, group)]
    overlap = [len(_tokens(group) & _tokens(o)) for o in objects]
    best = max(overlap)
    if best > 0 and overlap.count(best) == 1:
        return objects[overlap.index(best)]
    raise LookupError(
        f"{lab_id}.{group}: cannot tell which of {', '.join(objects)} (question {question}) its mutants replace; "
        f"add ({lab_id!r}, {group!r}): '<object name>' to OBJECT_OF in flashlab/mistakes.py"
    )


def _literal(node: ast.AST, module: types.ModuleType) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return getattr(module, node.id)
    return None


def _message_position(cls: Any) -> int:
    """Where ``message`` sits among a mutant class's positional arguments (0 for Mutant; 1 for lab 06's)."""
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


# ------------------------------------------------------------------------------------------ the solution labs
def solution_path(lab_id: str) -> pathlib.Path:
    """``solutions/<lab_id>_*.ipynb``, the solved lab."""
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
                              "HAND_WRITTEN / OTHER_DIAGNOSES in flashlab/mistakes.py to the solution's new text")
        cell = cell.replace(old, new)
    ns = dict(_solution_namespace(lab_id), **(extra or {}))
    exec(compile(cell, f"<{lab_id} {name}, edited>", "exec"), ns)  # noqa: S102
    return ns[name]


# -------------------------------------------------------------------------- wrong code written as students do
def _drop_last_query_tile(Q, K, V, block_q, block_k):
    """The tile loop stops at the last full query tile: ``range(0, n - n % block_q, block_q)``."""
    n = Q.shape[0]
    O, L = np.zeros((n, V.shape[1])), np.zeros(n)
    for q0 in range(0, n - n % block_q, block_q):
        O[q0:q0 + block_q], L[q0:q0 + block_q] = tiled.forward(Q[q0:q0 + block_q], K, V, block_q=block_q,
                                                               block_k=block_k)
    return O, L


def _whole_score_matrix(Q, K, V, block_q, block_k):
    """Right, but builds the whole n x m score matrix (plain softmax attention)."""
    S = Q @ K.T / np.sqrt(Q.shape[1])
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    return (P @ V) / l, (m + np.log(l))[:, 0]


def _stores_p(Q, K, V, O, L, dO, block_q, block_k):
    """Right, but keeps the whole n x m matrix P (the backward without recomputation)."""
    return reference.attention_backward(Q, K, V, dO)


def _kernel(*edits: tuple[str, str]) -> Callable[[], Callable]:
    """A builder of lab 05's make_kernel with ``edits`` applied to the solution's source."""
    def build():
        from numba import float32

        return solution_variant("lab05", "make_kernel", edits, {"float32": float32})

    return build


_TILE_LOADED = "cuda.syncthreads()                           # the tile is complete before anyone reads it"
_TILE_USED = "cuda.syncthreads()                           # everyone is done before the next tile overwrites it"


@dataclass(frozen=True)
class HandWritten:
    """A wrong implementation written by hand: ``build()`` returns it; ``expect`` is the phrase its grader shows."""

    variant: str
    build: Callable[[], Callable]
    expect: str = ""


#: Implementations for mutants without ``fn`` (recognised by a predicate, not by running them), keyed by
#: (lab, question, the start of the mutant's message). One mutant may have several (lab 05's two barriers).
HAND_WRITTEN: dict[tuple[str, str, str], list[HandWritten]] = {
    ("lab02", "q2", "the last ragged query tile is dropped"): [
        HandWritten("the query loop is range(0, n - n % block_q, block_q)", lambda: _drop_last_query_tile),
    ],
    ("lab05", "q1", "missing barrier"): [
        HandWritten("no cuda.syncthreads() after loading a tile", _kernel((_TILE_LOADED, "pass"))),
        HandWritten("no cuda.syncthreads() after using a tile", _kernel((_TILE_USED, "pass"))),
    ],
    ("lab05", "q1", "reading past the last ragged tile"): [
        HandWritten("the update walks all BLOCK_K rows of the last tile",
                    _kernel(("range(min(BLOCK_K, m - k0))", "range(BLOCK_K)"))),
        HandWritten("the tile load is not guarded by k0 + j < m",
                    _kernel((" if k0 + j < m else 0.0", "")),
                    expect="ragged tile"),
    ],
    ("lab05", "q1", "shared tiles in a lower precision"): [
        HandWritten("float32 shared tiles", _kernel(("shared.array((BLOCK_K, D), float64)",
                                                     "shared.array((BLOCK_K, D), float32)"))),
    ],
}


#: Mutants whose grader shows a different phrase than the mutant's message, keyed like HAND_WRITTEN. Lab 05's
#: swapped grid makes the simulator raise IndexError before any output can be matched, so the grader names it
#: in its hint about the grid instead.
EXPECT: dict[tuple[str, str, str], str] = {
    ("lab05", "q2", "grid axes swapped"): "is the grid (query blocks, batch)",
}


def _lab06_kernel(module: types.ModuleType, mutant: Any) -> str:
    return module.render(mutant.update)


#: For labs whose mutants are not Python functions: lab -> submission(module, mutant), the object a student
#: would hand in with that mistake (lab 06: the notebook's KERNEL string with the wrong loop body).
SUBMISSIONS: dict[str, Callable[[types.ModuleType, Any], Any]] = {
    "lab06": _lab06_kernel,
}
#: For the same labs: lab -> (right code, wrong code) of a mutant, shown as a diff (the CUDA loop body).
SOURCES: dict[str, Callable[[types.ModuleType, Any], tuple[str, str]]] = {
    "lab06": lambda module, mutant: (module.SOLUTION, mutant.update),
}


@dataclass(frozen=True)
class OtherDiagnosis:
    """A diagnosis that is not a mutant (a memory limit, a tile shape), with an implementation that earns it."""

    lab_id: str
    question: str
    obj: str
    message: str
    impl: HandWritten


OTHER_DIAGNOSES: list[OtherDiagnosis] = [
    OtherDiagnosis("lab02", "q2", "flash_forward",
                   "the whole n x m score matrix is built (right answer, too much memory)",
                   HandWritten("plain softmax attention, S = Q K^T / sqrt(d) in one piece", lambda: _whole_score_matrix,
                               expect="one block_q x block_k tile at a time")),
    OtherDiagnosis("lab03", "q2", "best_q_outer_blocks", "blocks that do not fit in SRAM",
                   HandWritten("B_r = M / d (forgets that K and V tiles need room too)",
                               lambda: lambda n, d, sram: (sram // d, 1), expect="do not fit")),
    OtherDiagnosis("lab03", "q2", "best_q_outer_blocks", "the paper's blocks reused for FlashAttention-2's order",
                   HandWritten("the blocks of Algorithm 1 for the q-outer order",
                               lambda: lambda n, d, sram: iocount.default_blocks("q_outer", d, sram),
                               expect="is possible")),
    OtherDiagnosis("lab04", "q1", "flash_backward",
                   "P is stored whole instead of recomputed tile by tile (right answer, too much memory)",
                   HandWritten("the backward of plain attention, keeping P", lambda: _stores_p,
                               expect="recompute each block_q x block_k tile")),
    OtherDiagnosis("lab05", "q1", "make_kernel", "shared tile of the wrong size",
                   HandWritten("the K tile allocated as (BLOCK_Q, D)",
                               _kernel(("shared.array((BLOCK_K, D)", "shared.array((BLOCK_Q, D)")),
                               expect="shared tile of the wrong size")),
]


# ---------------------------------------------------------------------------------------------- the catalogue
def _hand_written(lab_id: str, question: str, message: str) -> list[HandWritten]:
    return [h for (lab, q, start), hs in HAND_WRITTEN.items() if lab == lab_id and q == question
            and message.startswith(start) for h in hs]


def _entries(lab_id, question, group, message, obj, mutant=None) -> list[Mistake]:
    expect = next((e for (lab, q, start), e in EXPECT.items() if lab == lab_id and q == question
                   and message.startswith(start)), message)
    if mutant is not None and getattr(mutant, "fn", None) is not None:
        return [Mistake(lab_id, question, group, message, mutant.fn, obj, expect, mutant)]
    if mutant is not None and lab_id in SUBMISSIONS:
        module, make = lab_module(lab_id), SUBMISSIONS[lab_id]
        return [Mistake(lab_id, question, group, message, lambda: make(module, mutant), obj, expect, mutant,
                        getattr(mutant, "tag", ""))]
    hand = _hand_written(lab_id, question, message)
    if not hand:  # listed, but nothing to run: tests/test_mistakes.py asks for a HAND_WRITTEN entry
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
    for other in OTHER_DIAGNOSES:
        if other.lab_id == lab_id and other.question in by_question:
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
    return bool(re.search(r"\bcupy\b|flashlab\.gpu\b|from \.\.gpu\b|from \.\. import gpu\b",
                          inspect.getsource(module)))


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
        raise LookupError(f"{mistake!r} has no implementation: add one to HAND_WRITTEN in flashlab/mistakes.py")
    if mistake.mutant is not None and getattr(mistake.mutant, "fn", None) is mistake.fn:
        return mistake.fn
    return mistake.fn()  # a builder


def _submission(mistake: Mistake) -> list:
    question = get_lab(mistake.lab_id).questions[mistake.question]
    wrong = implementation(mistake)
    return [wrong if name == mistake.obj else solution_object(mistake.lab_id, name) for name in question.objects]


def grade(mistake: Mistake, seed: int = SEED) -> Result:
    """Grade the mistake as a student's submission: the wrong object in its place, the solution's elsewhere."""
    return run_question(mistake.lab_id, mistake.question, _submission(mistake), seed=seed)


def grader_message(mistake: Mistake, seed: int = SEED) -> str:
    """What the check cell prints for this mistake: points, then the feedback."""
    r = grade(mistake, seed)
    return f"{r.name}: {r.score:g}/{r.max_score:g} points (seed {r.seed})\n{r.feedback}"


def diagnosed(mistake: Mistake, result: Result) -> bool:
    """Whether the grader lost points and named this mistake."""
    return result.score < result.max_score and mistake.expect.lower() in result.feedback.lower()


# ------------------------------------------------------------------------------------------------ the demos
@dataclass
class Demo:
    """Small telling inputs for one group: ``run(fn, args)`` and ``right(args)`` give outputs named ``names``."""

    examples: list[tuple[str, tuple]]
    run: Callable[[Callable, tuple], Any]
    right: Callable[[tuple], Any]
    names: tuple[str, ...]
    rtol: float = 1e-9  # what counts as "the same" (the graders' float64 tolerance; fp32 kernels need more)
    atol: float = 1e-12


def _result_of(state) -> tuple:
    m, l, u = (np.asarray(x, dtype=float) for x in state)
    with np.errstate(all="ignore"):
        result = np.where(l == 0, 0.0, u / np.where(l == 0, 1.0, l))  # an empty row's result is 0 by convention
    return (result, m, l, u)


def _lab01():
    from .grading import lab01

    return lab01


def _update_demo() -> Demo:
    lab01 = _lab01()
    return Demo(
        examples=[
            ("the scalar example: scores [0, 0, ln 3, ln 3], values [0, 0, 1, 1], two blocks of two",
             (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), [2])),
            ("logits near 1000: scores [998, 1000], values [0, 1], one score per block",
             (np.array([998.0, 1000.0]), np.array([0.0, 1.0]), [1])),
            ("a fully masked first block: scores [-inf, -inf, 0, ln 3], values [5, 5, 0, 1], two blocks of two",
             (np.array([-np.inf, -np.inf, 0, LN3]), np.array([5.0, 5, 0, 1]), [2])),
        ],
        run=lambda fn, args: _result_of(lab01._fold(fn, Case(args))),
        right=lambda args: _result_of(lab01._ref_state(args[0], args[1])),
        names=("result u/l", "m", "l", "u"),
    )


def _merge_demo() -> Demo:
    lab01 = _lab01()
    return Demo(
        examples=[
            ("the scalar example split in two: scores [0, 0 | ln 3, ln 3], values [0, 0 | 1, 1]",
             (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2)),
            ("logits +-1000: scores [1000 | -1000], values [1 | 0]", (np.array([1000.0, -1000.0]), np.array([1.0, 0]),
                                                                     1)),
            ("both halves fully masked: scores [-inf | -inf]", (np.array([-np.inf, -np.inf]), np.array([1.0, 2.0]),
                                                                1)),
        ],
        run=lambda fn, args: _result_of(lab01._merge_run(fn, Case(args))),
        right=lambda args: _result_of(lab01._ref_state(args[0], args[1])),
        names=("result u/l", "m", "l", "u"),
    )


def _attend_demo() -> Demo:
    return Demo(
        examples=[
            ("the scalar example, block = 2", (np.array([0, 0, LN3, LN3]), np.array([0.0, 0, 1, 1]), 2)),
            ("a ragged last block: scores [0, 0, ln 3, ln 3, 2], values [0, 0, 1, 1, 4], block = 2",
             (np.array([0, 0, LN3, LN3, 2.0]), np.array([0.0, 0, 1, 1, 4]), 2)),
        ],
        run=lambda fn, args: fn(*args),
        right=lambda args: online.attend(args[0], args[1]),
        names=("result",),
    )


def _tiles_demo() -> Demo:
    from .grading import lab02

    return Demo(
        examples=[("n = 7, block = 3", (7, 3)), ("n = 6, block = 3", (6, 3)), ("n = 2, block = 5", (2, 5))],
        run=lambda fn, args: lab02._tiles_run(fn, Case(args)),
        right=lambda args: lab02._tiles_run(lab02._tiles_ref, Case(args)),
        names=("tiles (start, stop)",),
    )


def _small_qkv(n: int, m: int, d: int, dv: int, seed: int, top: float | None = None):
    rng = np.random.default_rng(seed)
    Q, K, V = rng.standard_normal((n, d)), rng.standard_normal((m, d)), rng.standard_normal((m, dv))
    if top is not None:
        Q = Q * (top / (Q @ K.T / np.sqrt(d)).max())  # the largest scaled score is exactly `top`
    return Q, K, V


def _forward_demo() -> Demo:
    return Demo(
        examples=[
            ("random, n = 3, m = 5, d = 2, dv = 1, block_q = block_k = 2 (both last tiles ragged)",
             (*_small_qkv(3, 5, 2, 1, seed=1), 2, 2)),
            ("the same shapes with scores up to 1000", (*_small_qkv(3, 5, 2, 1, seed=1, top=1000.0), 2, 2)),
        ],
        run=lambda fn, args: fn(*args),
        right=lambda args: reference.attention(*args[:3]),
        names=("O", "L"),
    )


def _counts_demo(algorithm: str, examples: list[tuple[str, tuple]]) -> Demo:
    return Demo(
        examples=examples,
        run=lambda fn, args: fn(*args),
        right=lambda args: (lambda c: (c.reads, c.writes))(
            iocount.predict(algorithm, args[0], args[1], sram=args[2], block_q=args[3], block_k=args[4])),
        names=("reads", "writes"),
    )


_TILED_COUNT_EXAMPLES = [("n = 1000, d = 64, M = 20000, block_q = 48, block_k = 64", (1000, 64, 20000, 48, 64))]


def _blocks_demo() -> Demo:
    return Demo(
        examples=[("d = 64, M = 1000", (64, 1000)), ("d = 64, M = 116224 (227 KB of bf16)", (64, 116224))],
        run=lambda fn, args: fn(*args),
        right=lambda args: iocount.default_blocks("kv_outer", *args),
        names=("(B_r, B_c)",),
    )


def _backward_case(n, m, d, dv, seed):
    Q, K, V = _small_qkv(n, m, d, dv, seed)
    dO = np.random.default_rng(seed + 100).standard_normal((n, dv))
    O, L = tiled.forward(Q, K, V, block_q=8, block_k=8)
    return Q, K, V, O, L, dO


def _backward_demo() -> Demo:
    return Demo(
        examples=[("random, n = m = 4, d = dv = 2, block_q = block_k = 2", (*_backward_case(4, 4, 2, 2, 3), 2, 2))],
        run=lambda fn, args: fn(*args),
        right=lambda args: reference.attention_backward(args[0], args[1], args[2], args[5]),
        names=("dQ", "dK", "dV"),
    )


def _flops_demo() -> Demo:
    from .grading import lab04

    return Demo(
        examples=[("n = m = 1024, d = dv = 64, recompute", (1024, 1024, 64, 64, True)),
                  ("n = 1000, m = 500, d = 64, dv = 32, recompute", (1000, 500, 64, 32, True))],
        run=lambda fn, args: fn(*args),
        right=lambda args: lab04._flops(*args),
        names=("FLOPs",),
    )


def _batched_qkv(batch, n, m, d, dv, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, n, d)), rng.standard_normal((batch, m, d)),
            rng.standard_normal((batch, m, dv)))


def _launch_demo() -> Demo:
    def run(fn, args):
        from . import numba_kernels

        Q, K, V, bq, bk = args
        kernel = numba_kernels.make_cuda_kernel(bq, bk, Q.shape[2], V.shape[2], "float64")
        return fn(kernel, Q, K, V, bq)

    return Demo(
        examples=[("batch = 3, n = 5, m = 5, d = 3, dv = 1, BLOCK_Q = BLOCK_K = 4",
                   (*_batched_qkv(3, 5, 5, 3, 1, seed=4), 4, 4))],
        run=run,
        right=lambda args: reference.attention(*args[:3]),
        names=("O", "L"),
    )


def _kernel_demo() -> Demo:
    def run(factory, args):
        from . import numba_kernels

        Q, K, V, bq, bk = args
        with numba_kernels.trace_shared_memory() as trace:
            O, L = numba_kernels.launch(factory(bq, bk, Q.shape[2], V.shape[2]), Q, K, V, block_q=bq)
        return O, L, len(trace.races)

    return Demo(
        examples=[("batch = 1, n = 5, m = 6, d = dv = 2, BLOCK_Q = BLOCK_K = 4 (the last K/V tile holds 2 keys)",
                   (*_batched_qkv(1, 5, 6, 2, 2, seed=6), 4, 4))],
        run=run,
        right=lambda args: (*reference.attention(*args[:3]), 0),
        names=("O", "L", "data races seen"),
    )


def _lab06_demo() -> Demo:
    from .grading import lab06

    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, n, 16)).astype(np.float32) for n in (3, 5, 5))
    big = (rng.integers(-500, 501, (1, 3, 16)).astype(np.float32), rng.integers(-2, 3, (1, 5, 16)).astype(np.float32),
           v)
    return Demo(
        examples=[("random, n = 3, m = 5, d = 16", (q, k, v, False)),
                  ("causal with n = 5 > m = 3: the first two rows see no key", (k, q, q, True)),
                  ("integer Q and K: scores up to about +-2000", (*big, False))],
        run=lambda source, args: lab06.attention(source, *args[:3], causal=args[3]),
        right=lambda args: reference.attention(*(a.astype(np.float64) for a in args[:3]), causal=args[3],
                                               scale=float(np.float32(0.25))),
        names=("O", "L"),
        rtol=1e-4, atol=1e-5,  # fp32 kernels: rounding is not a mistake (lab 06 matches outputs within 1e-4)
    )


def _lab08():
    from .grading import lab08

    return lab08


def _partials_demo() -> Demo:
    ln2, ln6 = float(np.log(2.0)), float(np.log(6.0))
    return Demo(
        examples=[
            ("the scalar example as two splits: o = (0, 1), lse = (ln 2, ln 6)",
             (np.array([[[0.0], [1.0]]]), np.array([[ln2, ln6]]))),
            ("lse near 1000: o = (1, 0), lse = (1000, 998)", (np.array([[[1.0], [0.0]]]), np.array([[1000.0, 998.0]]))),
            ("a row whose splits are all empty: lse = (-inf, -inf)",
             (np.zeros((1, 2, 1)), np.array([[-np.inf, -np.inf]]))),
        ],
        run=lambda fn, args: fn(*args),
        right=lambda args: _lab08()._merge(*args),
        names=("o", "lse"),
    )


def _splits_demo() -> Demo:
    def qkv(m, seed):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((1, 2)), rng.standard_normal((m, 2)), rng.standard_normal((m, 1))

    return Demo(
        examples=[("n = 1, m = 10 keys, d = 2, 4 splits (L = 3: the last split holds 1 key)", (*qkv(10, 9), 4)),
                  ("n = 1, m = 5 keys, 4 splits (L = 2: the last split is empty)", (*qkv(5, 10), 4))],
        run=lambda fn, args: fn(*args),
        right=lambda args: _lab08()._split_truth(*args),
        names=("o_parts", "lse_parts"),
    )


def _cache_bytes_demo() -> Demo:
    return Demo(
        examples=[("batch = 1, kv_heads = 8, m = 128000, d = 128, bf16 (2 bytes)", (1, 8, 128_000, 128, 2))],
        run=lambda fn, args: fn(*args),
        right=lambda args: _lab08()._bytes(*args),
        names=("bytes",),
    )


#: Telling inputs, per (lab, group) — or per (lab, question) for mutants built inside a question and for the
#: other diagnoses. A group without an entry is shown through its grader's message alone (which already shows
#: the smallest failing input with the expected and the actual output).
DEMOS: dict[tuple[str, str], Callable[[], Demo]] = {
    ("lab01", "UPDATE_MUTANTS"): _update_demo,
    ("lab01", "MERGE_MUTANTS"): _merge_demo,
    ("lab01", "ATTEND_MUTANTS"): _attend_demo,
    ("lab02", "TILES_MUTANTS"): _tiles_demo,
    ("lab02", "FORWARD_MUTANTS"): _forward_demo,
    ("lab03", "STANDARD_MUTANTS"): lambda: _counts_demo("standard", [
        ("n = 1000 <= M = 20000, block_q = block_k = 96", (1000, 64, 20000, 96, 96)),
        ("n = 5000 > M = 4096 (a row of S does not fit), blocks 32", (5000, 64, 4096, 32, 32))]),
    ("lab03", "KV_OUTER_MUTANTS"): lambda: _counts_demo("kv_outer", _TILED_COUNT_EXAMPLES),
    ("lab03", "Q_OUTER_MUTANTS"): lambda: _counts_demo("q_outer", _TILED_COUNT_EXAMPLES),
    ("lab03", "BLOCK_MUTANTS"): _blocks_demo,
    ("lab04", "MUTANTS"): _backward_demo,
    ("lab04", "FLOP_MUTANTS"): _flops_demo,
    ("lab05", "LAUNCH_MUTANTS"): _launch_demo,
    ("lab05", "q1"): _kernel_demo,
    ("lab06", "MUTANTS"): _lab06_demo,
    ("lab08", "MERGE_MUTANTS"): _partials_demo,
    ("lab08", "SPLIT_MUTANTS"): _splits_demo,
    ("lab08", "BYTES_MUTANTS"): _cache_bytes_demo,
}


def demo_for(mistake: Mistake) -> Demo | None:
    """The demo of a mistake's group (or, for the other diagnoses and in-question mutants, of its question)."""
    if mistake.group == "other diagnoses":
        return None  # memory limits, block choices, tile shapes: the grader's message holds the measurement
    make = DEMOS.get((mistake.lab_id, mistake.group))
    if make is None and mistake.group.startswith("inside "):
        make = DEMOS.get((mistake.lab_id, mistake.question))
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
        """Whether the outputs at ``indices`` (e.g. 0: lab 01's result u/l alone) differ, or the mistake raised."""
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
    """For a mutant that is source code (lab 06's CUDA loop bodies): a diff of the right code and the wrong one."""
    import difflib

    if mistake.lab_id not in SOURCES or mistake.mutant is None:
        return None
    right, wrong = SOURCES[mistake.lab_id](lab_module(mistake.lab_id), mistake.mutant)

    def code(text: str) -> list[str]:  # comments differ between the two; the code is what matters
        lines = (re.sub(r"\s*//.*$", "", line).rstrip() for line in text.splitlines())
        return [line for line in lines if line.strip()]

    lines = difflib.unified_diff(code(right), code(wrong), "right", "wrong", lineterm="", n=9)
    return "\n".join(line for line in list(lines)[2:] if not line.startswith("@@"))


def report(mistake: Mistake, seed: int = SEED, width: int = 240) -> str:
    """The chapter's view of one mistake: what it is, its demo, and the grader's message when it is submitted
    (lines longer than ``width`` cut short)."""
    objects = get_lab(mistake.lab_id).questions[mistake.question].objects
    head = f"{mistake.lab_id} {mistake.question} ({', '.join(objects)}): {mistake.title}"
    if mistake.variant:
        head += f"\n  written as: {mistake.variant}"
    parts = [head, "=" * min(len(head.splitlines()[0]), 110)]
    if mistake.fn is None:
        parts.append("No wrong implementation is known for this mistake yet (see HAND_WRITTEN in "
                     "flashlab/mistakes.py); the grader's words for it:\n" + mistake.message)
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
class Showcase:
    """What chapter 9 calls: ``book.show("lab01", "not rescaled")`` prints one mistake's report;
    ``book.rest()`` prints every mistake not shown yet (new labs' and new mutants' included)."""

    def __init__(self, seed: int = SEED) -> None:
        self.seed = seed
        self.shown: list[Mistake] = []

    def show(self, lab_id: str, phrase: str, question: str | None = None, variant: str | None = None,
             group: str | None = None) -> None:
        """Print the report of the one mistake :func:`find` picks with these arguments."""
        mistake = find(lab_id, phrase, question, variant, group)
        self.shown.append(mistake)
        print(report(mistake, self.seed))

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
            print(report(mistake, self.seed), end="\n\n")


def seed_sweep(seeds: Sequence[int], lab_ids: Sequence[str] | None = None, *, simulator: bool = False,
               progress: Callable[[str], None] | None = None) -> list[tuple[Mistake, int, str]]:
    """Grade every runnable mistake with each seed; return (mistake, seed, feedback) wherever it is not named.

    Students get a fresh seed at every check, so a diagnosis must hold for any draw, not only for the seed the
    tests use. ``simulator=True`` includes lab 05 (the CUDA simulator: minutes per seed).
    """
    misses = []
    for mistake in catalogue(lab_ids):
        if not runnable_here(mistake) or (needs_simulator(mistake.lab_id) and not simulator):
            continue
        bad = 0
        for seed in seeds:
            result = grade(mistake, int(seed))
            if not diagnosed(mistake, result):
                misses.append((mistake, int(seed), result.feedback))
                bad += 1
        if progress:
            progress(f"{'ok  ' if not bad else 'MISS'} {mistake!r}" + (f": {bad} of {len(seeds)} seeds" if bad else ""))
    return misses


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashlab.mistakes",
                                description="Check that every grader diagnosis holds over many random seeds.")
    p.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    p.add_argument("--first", type=int, default=1000, help="first seed (default 1000)")
    p.add_argument("--labs", nargs="*", default=None, help="lab ids (default: all)")
    p.add_argument("--simulator", action="store_true", help="include lab 05 (CUDA simulator; slow)")
    args = p.parse_args(argv)
    misses = seed_sweep(range(args.first, args.first + args.seeds), args.labs, simulator=args.simulator,
                        progress=lambda line: print(line, flush=True))
    for mistake, seed, feedback in misses:
        print(f"\n--- {mistake!r} not named with seed {seed}:\n{feedback}")
    print(f"\n{len(misses)} misses")
    return 1 if misses else 0


def overview() -> str:
    """One line per lab: its title, how many mistakes its graders name, and where they run."""
    lines = []
    for lab_id in labs():
        found = catalogue([lab_id])
        where = ("a GPU" if needs_gpu(lab_id) else "the CUDA simulator (CPU)" if needs_simulator(lab_id)
                 else "NumPy (CPU)")
        per_q = ", ".join(f"{q}: {sum(m.question == q for m in found)}" for q in get_lab(lab_id).questions)
        lines.append(f"{lab_id}  {get_lab(lab_id).title:<40} {len(found):>2} mistakes ({per_q}); runs on {where}")
    return "\n".join(lines)


__all__ = [
    "DEMOS", "EXPECT", "HAND_WRITTEN", "OBJECT_OF", "OTHER_DIAGNOSES", "QUESTION_OF", "SEED", "SOURCES",
    "SUBMISSIONS", "Demo", "HandWritten", "Mistake", "OtherDiagnosis", "Row", "Showcase", "catalogue",
    "declared_mutants", "demo", "diagnosed", "find", "format_rows", "grade", "grader_message", "group_questions",
    "implementation", "is_mutant", "labs", "local_mutants", "mutant_groups", "needs_gpu", "needs_simulator",
    "overview", "report", "runnable_here", "seed_sweep", "solution_object", "solution_variant", "source_diff",
    "unmapped_groups",
]


if __name__ == "__main__":
    raise SystemExit(_main())
