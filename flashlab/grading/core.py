"""The grading core: labs register questions; a question is a function that runs randomized tests.

See the package docstring (:mod:`flashlab.grading`) for how to add a lab. This module holds

* the registry (:class:`Lab`, :func:`get_lab`, :func:`available_labs`), found by module name: lab ``labNN``
  lives in ``flashlab/grading/labNN.py`` and is imported on first use;
* :class:`Trial`, the helper a question uses to draw fresh random inputs, compare the student's function with
  the truth, name the mistake by matching known-wrong implementations ("mutants"), and bound peak memory;
* :func:`run_question` / :func:`grade_namespace` (used by notebooks' check cells and by the batch grader).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
import re
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..measure import peak_memory
from . import answers

#: Environment variable set by the batch grader: check cells then skip their tests (the grader runs them itself).
BATCH_ENV = "FLASHLAB_BATCH_GRADING"
#: Seconds one question may run before it scores 0 ("took too long"); the batch grader also has a hard limit.
QUESTION_TIME_LIMIT = 60.0

_REGISTRY: dict[str, "Lab"] = {}
_LAB_ID = re.compile(r"^lab\d{2,}$")


# --------------------------------------------------------------------------------------------------- registry
@dataclass
class Question:
    """One graded question: ``run(trial, *objects)`` tests the notebook objects named in ``objects``."""

    lab_id: str
    name: str
    points: float
    objects: tuple[str, ...]
    run: Callable[..., Any]
    title: str = ""
    #: Objects of the notebook that the graded code calls and that an earlier question grades (lab 01's q3 calls
    #: the learner's ``online_update``). When this question loses points and such an object fails its own
    #: question, the feedback says so instead of naming a mistake of the code under test.
    uses: tuple[str, ...] = ()


class Lab:
    """A lab's questions, in the order they appear in the notebook.

    ``LAB = Lab("lab03", "Tiled backward")`` at the top of ``flashlab/grading/lab03.py`` registers the lab;
    ``@LAB.question("q1", points=4, objects=("flash_backward",))`` registers a question.
    """

    def __init__(self, lab_id: str, title: str = "") -> None:
        if not _LAB_ID.match(lab_id):
            raise ValueError(f"a lab id looks like 'lab01' (the notebook's name prefix); got {lab_id!r}")
        self.id = lab_id
        self.title = title
        self.questions: dict[str, Question] = {}
        _REGISTRY[lab_id] = self

    def question(self, name: str, *, points: float, objects: Sequence[str], title: str = "",
                 uses: Sequence[str] = ()) -> Callable:
        """Decorator registering ``fn(trial, *objects)`` as question ``name`` worth ``points``.

        ``uses`` names objects the graded code calls that an earlier question grades (see :attr:`Question.uses`).
        """
        if isinstance(objects, str):
            objects = (objects,)
        if isinstance(uses, str):
            uses = (uses,)

        def register(fn: Callable) -> Callable:
            doc = (fn.__doc__ or "").strip().splitlines()
            title_ = title or (doc[0] if doc else "")
            self.questions[name] = Question(self.id, name, float(points), tuple(objects), fn, title_, tuple(uses))
            return fn

        return register

    @property
    def max_score(self) -> float:
        return sum(q.points for q in self.questions.values())

    def grader_of(self, obj: str, besides: str = "") -> "Question | None":
        """The first question (other than ``besides``) that grades the notebook object ``obj``."""
        return next((q for q in self.questions.values() if obj in q.objects and q.name != besides), None)

    def __repr__(self) -> str:
        return f"Lab({self.id!r}, questions={list(self.questions)}, max_score={self.max_score:g})"


def available_labs() -> list[str]:
    """Ids of every lab module in this package (``labNN.py``), found with pkgutil: there is no list to edit."""
    here = os.path.dirname(__file__)
    return sorted(m.name for m in pkgutil.iter_modules([here]) if _LAB_ID.match(m.name))


def get_lab(lab_id: str) -> Lab:
    """The registered :class:`Lab` ``lab_id``, importing ``flashlab.grading.<lab_id>`` on first use."""
    if not isinstance(lab_id, str) or not _LAB_ID.match(lab_id):
        raise ValueError(f"a lab id looks like 'lab01'; got {lab_id!r}")
    if lab_id not in _REGISTRY:
        if lab_id not in available_labs():
            raise ValueError(f"unknown lab {lab_id!r}; known labs: {', '.join(available_labs()) or 'none'}")
        importlib.import_module(f"{__package__}.{lab_id}")
    if lab_id not in _REGISTRY:
        raise ValueError(f"module flashlab.grading.{lab_id} does not create Lab({lab_id!r})")
    return _REGISTRY[lab_id]


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class Result:
    """Outcome of one question: points earned out of ``max_score`` and the feedback shown to the student."""

    name: str
    score: float
    max_score: float
    feedback: str
    seed: int | None = None
    #: Titles of the known mistakes the feedback names (:func:`mistake_title`), for the class summary.
    diagnoses: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"name": self.name, "score": self.score, "max_score": self.max_score, "feedback": self.feedback,
                "seed": self.seed, "diagnoses": list(self.diagnoses)}


def mistake_title(message: str) -> str:
    """A mutant message's first clause (up to ``: ``, ``; `` or ``. ``), e.g. "averaging block results"."""
    return re.split(r"[:;]\s|\.\s", message, maxsplit=1)[0].strip().rstrip(".")


class NotImplementedYet(Exception):
    """Raised inside a trial when the student's code raised NotImplementedError (the released stub)."""


class BadReturn(Exception):
    """The student's function returned something that is not numbers or arrays (e.g. None)."""


class QuestionTimeout(BaseException):
    # BaseException so that a student's `except Exception:` cannot swallow it.
    pass


# ------------------------------------------------------------------------------------------------ trial tools
@dataclass
class Case:
    """One input. ``args`` go to the function under test (through the question's ``run`` adapter).

    ``names`` label the arguments in feedback (``("Q", "K", "V", "block_q", "block_k")``); without them the
    feedback takes the parameter names of the student's function when the case is passed to it as it is.
    """

    args: tuple
    label: str = ""
    kwargs: dict = field(default_factory=dict)
    names: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(np.size(a) for a in (*self.args, *self.kwargs.values()) if isinstance(a, (np.ndarray, list, tuple)))


@dataclass
class Mutant:
    """A known mistake: ``message`` names it; ``fn`` is a wrong implementation of the student's function.

    A student is diagnosed with the mistake when, on a failing input, their output matches ``fn``'s (on the parts
    selected by ``key``, default all) while ``fn``'s differs from the truth. For mistakes that leave garbage (e.g.
    rows never written) give ``explains(case, student_output, expected) -> bool`` instead of ``fn``.
    """

    message: str
    fn: Callable | None = None
    key: Callable[[tuple], tuple] | None = None
    explains: Callable[[Case, tuple, tuple], bool] | None = None


def as_outputs(x: Any) -> tuple[np.ndarray, ...]:
    """Normalise a function's return value to a tuple of float64 arrays (raises TypeError if that is impossible)."""
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    out = []
    for item in items:
        arr = np.asarray(item)
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise TypeError(f"expected numbers or arrays, got {type(item).__name__}")
        out.append(arr.astype(np.float64))
    return tuple(out)


def allclose(a: Sequence[np.ndarray], b: Sequence[np.ndarray], rtol: float = 1e-9, atol: float = 1e-12) -> bool:
    """Same number of outputs, same shapes (up to squeezing), values close; nan matches nan, inf matches inf."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=False):
        # a scalar against an array: e.g. u = 0 for a row that saw only masked keys
        pair = _aligned(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
        if pair is None:
            return False
        x, y = pair
        with np.errstate(invalid="ignore"):
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
    return True


def fmt(x: Any, width: int = 300) -> str:
    """Short printable form of an input or output (arrays rounded; large ones as their shape and range)."""
    if isinstance(x, (tuple, list)) and not (x and np.isscalar(x[0])):
        return "(" + ", ".join(fmt(v, width) for v in x) + ")"
    arr = np.asarray(x)
    if arr.dtype == object:
        return repr(x)[:width]
    if arr.ndim == 0:
        return np.array2string(arr, precision=6)
    text = np.array2string(arr, precision=4, separator=", ", threshold=40, max_line_width=10_000)
    text = " ".join(text.split())  # 2-D arrays on one line
    if arr.size <= 40 and len(text) <= width:
        return text
    with np.errstate(all="ignore"):
        finite = arr[np.isfinite(arr)] if arr.dtype.kind in "biuf" else arr.ravel()[:0]
    span = f", values {finite.min():.4g} .. {finite.max():.4g}" if finite.size else ""
    return f"<array shape {arr.shape}{span}>"


def _copy(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, tuple):
        return tuple(_copy(v) for v in x)
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


def _copy_case(case: Case) -> Case:
    return Case(_copy(case.args), case.label, _copy(case.kwargs), case.names)


def _call_case(fn: Callable, case: Case) -> Any:
    return fn(*case.args, **case.kwargs)


def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def parameter_names(fn: Any) -> tuple[str, ...]:
    """The positional parameter names of ``fn`` (empty when its signature cannot be read, e.g. a proxy)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _aligned(got: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The two arrays in one shape, as :func:`allclose` compares them, or None when they cannot be."""
    if got.shape == expected.shape:
        return got, expected
    if got.squeeze().shape == expected.squeeze().shape:  # (n,) for (n, 1); a flattened or transposed array is not
        return got.reshape(expected.shape), expected
    if got.size == 1 or expected.size == 1:
        return tuple(np.broadcast_arrays(got, expected))  # type: ignore[return-value]
    return None


def difference(expected: Any, got: Any, rtol: float = 1e-9, atol: float = 1e-12) -> str:
    """Where an output differs: for arrays, the largest difference with its index and both values, and how many
    entries differ, so that two printouts that look the same (or a large array) still show the mistake."""
    e, g = np.asarray(expected, dtype=np.float64), np.asarray(got, dtype=np.float64)
    pair = _aligned(g, e)
    if pair is None:
        return f"expected shape {e.shape}, got shape {g.shape}"
    g, e = pair
    with np.errstate(invalid="ignore"):
        bad = ~np.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    if e.ndim == 0 or e.size == 1:
        return f"expected {fmt(e.ravel()[0] if e.ndim else e)}, got {fmt(g.ravel()[0] if g.ndim else g)}"
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.where(bad, np.abs(g - e), -1.0)
    gap = np.where(bad & np.isnan(gap), np.inf, gap)  # nan or inf where the answer is a number: the worst
    where = np.unravel_index(int(np.argmax(gap)), e.shape)
    index = ", ".join(str(int(i)) for i in where)
    head = ""
    if e.size <= 40:
        small_e, small_g = fmt(e), fmt(g)
        head = f"expected {small_e}, got {small_g}; " if small_e != small_g else f"expected {small_e} (printed alike); "
    return (f"{head}largest difference at [{index}]: expected {fmt(e[where])}, got {fmt(g[where])} "
            f"({int(bad.sum())} of {e.size} entries differ)")


class Trial:
    """What a question function receives: a seeded generator and the tools to score the student's code.

    Each tool (:meth:`compare`, :meth:`memory`, :meth:`expect`) is one *part* of the question worth ``points``;
    a part scores all of its points or none. The question's score is the sum over parts.
    """

    def __init__(self, seed: int, guard: Any = None) -> None:
        self.seed = int(seed)
        # Arms the course's own answers to the question while the student's code runs (see grading.answers).
        self.guard = guard if guard is not None else contextlib.nullcontext()
        self.rng = np.random.default_rng(self.seed)
        # (label, points earned, points, message); a message may be a callable, evaluated in result(), so that a
        # diagnosis can use the inputs that later parts of the same question got right.
        self.parts: list[tuple[str, float, float, Any]] = []
        # (student, run, case, expected, rtol, atol): each pass keeps the tolerance it was judged with, so that a
        # mutant is contradicted only where it would have failed that same check.
        self._passes: list[tuple[Any, Callable, Case, tuple, float, float]] = []
        # (label, student, run, failures, mutants, rtol, atol) of every compare part, its failures empty when it
        # passed: a mistake named as likely in one part must not be contradicted by another part of the question.
        self._compared: list[tuple[str, Any, Callable, list, Sequence[Mutant], float, float]] = []
        self.diagnoses: list[str] = []  # titles of the mistakes named, filled as the feedback is written
        #: Set by run_question when the code under test calls an earlier answer that fails its own question: the
        #: feedback then says so first and names no mistake of the code under test.
        self.dependency_note = ""

    # -- calling the student ---------------------------------------------------------------------------------
    def call(self, fn: Callable, *args, **kwargs):
        """Call student code; NotImplementedError anywhere means the whole question is "not implemented yet"."""
        try:
            with self.guard:
                return fn(*args, **kwargs)
        except NotImplementedError as e:
            raise NotImplementedYet(str(e)) from e

    @property
    def lost_points(self) -> bool:
        """Whether some part so far earned less than its points."""
        return any(got < pts for _, got, pts, _ in self.parts)

    # -- parts ------------------------------------------------------------------------------------------------
    def expect(self, label: str, points: float, ok: bool, hint: str = "") -> bool:
        """A part decided by the caller: ``ok`` earns ``points``, otherwise ``hint`` is shown."""
        self.parts.append((label, points if ok else 0.0, points, "" if ok else hint))
        return bool(ok)

    def compare(
        self,
        label: str,
        points: float,
        *,
        student: Callable,
        cases: Iterable[Case],
        reference: Callable[[Case], Any],
        run: Callable[[Callable, Case], Any] | None = None,
        mutants: Sequence[Mutant] = (),
        rtol: float = 1e-9,
        atol: float = 1e-12,
        names: Sequence[str] | None = None,
        arg_names: Sequence[str] | None = None,
    ) -> bool:
        """Run ``student`` on every case and compare with ``reference(case)``.

        ``run(fn, case)`` applies an implementation to a case (default ``fn(*case.args, **case.kwargs)``); the
        student and each mutant go through it, so a question can test e.g. a fold of many updates. ``names`` label
        the outputs in feedback (e.g. ``("O", "L")``), ``arg_names`` the arguments of cases that carry no
        ``names`` of their own (default: the student's parameter names, when ``run`` passes the case as it is).
        On failure the feedback names a known mistake only when its mutant explains every failing input and is
        right wherever the student is right; otherwise it says which outputs are wrong, without guessing, and
        shows the smallest failing input.
        """
        run = run or _call_case
        if arg_names is None and run is _call_case:
            arg_names = parameter_names(student)
        failures: list[tuple[Case, tuple, Any]] = []  # (case, expected, student output or exception)
        n_cases = 0
        for case in cases:
            n_cases += 1
            if not case.names and arg_names:
                case = Case(case.args, case.label, case.kwargs, tuple(arg_names))
            expected = as_outputs(reference(case))
            try:
                raw = self.call(run, student, _copy_case(case))
            except (NotImplementedYet, QuestionTimeout):
                raise
            except Exception as e:  # the student's bug, reported as feedback
                failures.append((case, expected, e))
                continue
            try:
                got = as_outputs(raw)
            except Exception:
                failures.append((case, expected, BadReturn(f"returned {fmt(raw)} ({type(raw).__name__})")))
                continue
            if not allclose(got, expected, rtol, atol):
                failures.append((case, expected, got))
            else:
                self._passes.append((student, run, case, expected, rtol, atol))
        self._compared.append((label, student, run, failures, mutants, rtol, atol))
        if not failures:
            self.parts.append((f"{label} ({n_cases} random inputs)", points, points, ""))
            return True

        def message() -> str:
            return self._diagnose(failures, self._passes_of(student, run), run, mutants, rtol, atol, names)

        self.parts.append((f"{label} (failed {len(failures)} of {n_cases} inputs)", 0.0, points, message))
        return False

    def memory(
        self,
        label: str,
        points: float,
        fn: Callable,
        args: tuple,
        limit_bytes: int,
        *,
        reference: Any | None = None,
        hint: str = "",
        rtol: float = 1e-9,
        atol: float = 1e-12,
        shapes: Sequence[tuple[int, ...]] | None = None,
        computed: tuple[tuple, int, tuple[int, ...], str] | None = None,
    ) -> bool:
        """Peak memory (tracemalloc) of ``fn(*args)`` must stay under ``limit_bytes``.

        With ``reference``, the output must also be right: a wrong answer does not earn memory points. With
        ``shapes`` instead, memory is scored on its own: any output of those shapes is measured, right or wrong
        (the question scores correctness in its other parts). A function that runs elsewhere (the batch grader's
        proxies) measures its own peak: ``fn.peak_memory(*args)``.

        ``computed = (small_args, i, outputs, name)``: memory scored right or wrong is scored only for a function
        that computes something from its inputs, not for a template's arrays returned unfilled. The function is
        called on ``small_args`` and again with argument ``i`` (named ``name``) doubled; the ``outputs`` (indices)
        are linear in that argument for any attempt that multiplies by it (attention's O in V; the gradients in
        dO), so they must double, and must not all be zero.
        """
        if computed is not None:
            problem = self._not_computed(fn, *computed)
            if problem:
                return self.expect(label, points, False, f"memory not measured: {problem}")
        try:
            if hasattr(fn, "peak_memory"):
                peak, out = self.call(fn.peak_memory, *_copy(args))
            else:
                peak, out = peak_memory(self.call, fn, *_copy(args))
        except (NotImplementedYet, QuestionTimeout):
            raise
        except Exception as e:  # no peak to report: say so rather than look like a failed measurement
            self.parts.append((f"{label} (not measured: your code raised {type(e).__name__})", 0.0, points,
                               f"memory not measured: your code raised {_describe_error(e)}"))
            return False
        if shapes is not None:
            try:
                got = [np.shape(o) for o in as_outputs(out)]
            except TypeError:
                got = None
            want = [tuple(s) for s in shapes]
            if got != want:
                shown = "values that are not arrays" if got is None else ", ".join(map(str, got))
                msg = (f"memory not measured: your function returned {shown}; expected arrays of shapes "
                       f"{', '.join(map(str, want))}")
                return self.expect(label, points, False, msg)
        if reference is not None:
            try:
                right = allclose(as_outputs(out), as_outputs(reference), rtol, atol)
            except TypeError:
                right = False
            if not right:
                return self.expect(label, points, False, "memory not measured: the output on this input is wrong")
        ok = peak <= limit_bytes
        msg = f"peak memory {peak / 1e6:.2f} MB, allowed {limit_bytes / 1e6:.2f} MB. {hint}".strip()
        self.parts.append((f"{label} (peak {peak / 1e6:.2f} MB)", points if ok else 0.0, points, "" if ok else msg))
        return ok

    def _not_computed(self, fn: Callable, small_args: tuple, i: int, outputs: tuple[int, ...],
                      name: str) -> str | None:
        """Why ``fn`` does not look like a computation (see ``memory``'s ``computed``), or None."""
        doubled = tuple(2 * a if j == i else a for j, a in enumerate(small_args))
        try:
            once, twice = (as_outputs(self.call(fn, *_copy(a))) for a in (small_args, doubled))
        except (NotImplementedYet, QuestionTimeout):
            raise
        except Exception as e:  # noqa: BLE001 - any error of student code: reported, not raised
            return f"your code raised {_describe_error(e)}"
        try:
            picked = [(once[k], twice[k]) for k in outputs]
        except IndexError:
            return f"your function returned {len(once)} arrays; expected at least {max(outputs) + 1}"
        # "zero" includes denormals: memory left in an unfilled np.empty array often holds them
        if all(a.shape == b.shape and not np.any(np.abs(a) > 1e-200) for a, b in picked):
            return ("your function returned only zeros on a small input: that is the template's arrays, not an "
                    "attempt")
        # relative only: an unfilled array returned twice holds the same tiny values both times, which no absolute
        # tolerance may pass as doubled
        if not all(a.shape == b.shape and np.allclose(b, 2 * a, rtol=1e-6, atol=0.0, equal_nan=True)
                   for a, b in picked):
            return (f"doubling {name} did not double what your function returned, as it does for any attempt that "
                    f"multiplies by {name}: its arrays do not come from its inputs (the template's arrays, left "
                    "unfilled?)")
        return None

    # -- feedback ---------------------------------------------------------------------------------------------
    @staticmethod
    def _explains(mutant: Mutant, outputs, passes, run, rtol, atol, *, mutant_wrong: bool = True) -> bool:
        """Whether ``mutant`` accounts for every failing input (the student's output is the mutant's there, and
        the mutant's is wrong) and is right on every input the student got right. With ``mutant_wrong=False``,
        only whether the student's output is the mutant's on every failing input (the mutant may be right there
        under its key: it is then merely not contradicted)."""
        key = mutant.key or (lambda out: out)

        def mutant_output(case):
            return run(mutant.fn, _copy_case(case))

        for case, expected, got in outputs:
            try:
                if mutant.explains is not None:
                    if isinstance(got, BaseException) or not mutant.explains(case, got, expected):
                        return False
                    continue
                try:
                    wrong = as_outputs(mutant_output(case))
                except Exception as e:  # a mistake that crashes explains a crash of the same kind, and only that
                    if not (isinstance(got, BaseException) and type(got) is type(e)):
                        return False
                    continue
                if isinstance(got, BaseException):
                    return False
                if mutant_wrong and allclose(key(wrong), key(expected), rtol, atol):
                    return False
                if not allclose(key(got), key(wrong), rtol, atol):
                    return False
            except Exception:
                return False
        if mutant.fn is not None:
            for case, expected, pass_rtol, pass_atol in passes:
                try:
                    if not allclose(key(as_outputs(mutant_output(case))), key(expected), pass_rtol, pass_atol):
                        return False
                except Exception:
                    return False
        return True

    def _passes_of(self, student: Any, run: Callable) -> list[tuple[Case, tuple, float, float]]:
        """The inputs ``student`` got right through ``run`` in any part so far, each with its tolerance."""
        return [(c, e, rt, at) for s, r, c, e, rt, at in self._passes if s is student and r is run]

    def _contradicted_in(self, mutant: Mutant, failures: list) -> str:
        """The label of another part of this question that tested this same ``mutant`` and contradicts it ("" if
        none): its output differs from the student's on one of that part's failing inputs, or is wrong on one the
        student got right there. That mistake cannot be the student's."""
        for label, student, run, other, mutants, rtol, atol in self._compared:
            if other is failures or not any(m is mutant for m in mutants):
                continue
            if not self._explains(mutant, other, self._passes_of(student, run), run, rtol, atol, mutant_wrong=False):
                return label
        return ""

    def _diagnose(self, failures, passes, run, mutants, rtol, atol, names) -> str:
        smallest = min(failures, key=lambda f: f[0].size)
        text = self._show_case(*smallest, names, rtol, atol)
        if self.dependency_note:  # the failures may well be the earlier answer's: no guess about this code
            return text
        explaining = [m for m in mutants if self._explains(m, failures, passes, run, rtol, atol)]
        contradicted = {id(m): self._contradicted_in(m, failures) for m in explaining}
        ruled_out = {mistake_title(m.message): contradicted[id(m)] for m in explaining if contradicted[id(m)]}
        explaining = [m for m in explaining if not contradicted[id(m)]]
        titles = list(dict.fromkeys(mistake_title(m.message) for m in explaining))
        if not titles and ruled_out:  # they fit these inputs, but not those another part of the question failed
            known = self._what_is_known(failures, names, rtol, atol)
            known += "".join(f" {title[:1].upper() + title[1:]} fits these inputs but not those of the part "
                             f"\"{other}\", so it is not the mistake." for title, other in ruled_out.items())
            return f"{known.strip()}\n{text}"
        if len(titles) == 1:
            self.diagnoses.append(titles[0])
            how = "the failing input" if len(failures) == 1 else f"all {len(failures)} failing inputs"
            return f"Likely mistake (it explains {how}): {explaining[0].message}\n{text}"
        known = self._what_is_known(failures, names, rtol, atol)
        if titles:
            known += (" Several known mistakes fit every failing input and these inputs cannot tell them apart: "
                      + "; ".join(titles) + ".")
        return f"{known}\n{text}" if known else text

    @staticmethod
    def _what_is_known(failures, names, rtol, atol) -> str:
        """Which outputs are wrong on how many of the failing inputs, e.g. "O wrong, L right on 3 of 3 failing
        inputs" (no mistake is named: none explains them all)."""
        total = len(failures)
        raised = sum(isinstance(got, BaseException) for _, _, got in failures)
        compared = [(e, g) for _, e, g in failures if not isinstance(g, BaseException) and len(g) == len(e)]
        bits = []
        if compared:
            labels = list(names) if names else [f"output[{i}]" for i in range(len(compared[0][0]))]
            wrong = [sum(not allclose((g[i],), (e[i],), rtol, atol) for e, g in compared) for i in range(len(labels))]
            if len(compared) == total:
                states = ", ".join(f"{n} {'wrong' if w else 'right'}" for n, w in zip(labels, wrong, strict=False))
                if all(w in (0, total) for w in wrong):
                    bits.append(f"{states} on {total} of {total} failing inputs")
                else:
                    bits.append(", ".join(f"{name} wrong on {w}" for name, w in zip(labels, wrong, strict=False))
                                + f" of {total} failing inputs")
            else:
                bits.append(", ".join(f"{name} wrong on {w}" for name, w in zip(labels, wrong, strict=False))
                            + f" of the {len(compared)} failing inputs where it returned values")
        if raised:
            bits.append(f"your code raised an exception on {raised} of {total} failing inputs")
        if not bits:
            return ""
        return "No known mistake explains every failing input. What is known: " + "; ".join(bits) + "."

    @staticmethod
    def _show_case(case: Case, expected: tuple, got: Any, names, rtol: float = 1e-9, atol: float = 1e-12) -> str:
        lines = [f"Smallest failing input{' (' + case.label + ')' if case.label else ''}:"]
        arg_names = list(case.names) + [f"arg{i + 1}" for i in range(len(case.names), len(case.args))]
        shown = [f"{k} = {fmt(a)}" for k, a in zip(arg_names, case.args, strict=False)]
        shown += [f"{k} = {fmt(v)}" for k, v in case.kwargs.items()]
        lines.append("  " + ", ".join(shown))
        labels = list(names) if names else [f"output[{i}]" for i in range(len(expected))]
        if isinstance(got, BadReturn):
            lines.append(f"  your code {got} instead of {', '.join(labels)}")
            return "\n".join(lines)
        if isinstance(got, BaseException):
            lines.append(f"  your code raised {_describe_error(got)}")
            tb = traceback.extract_tb(got.__traceback__)
            if getattr(got, "where", ""):  # raised in another process: where it was raised there
                lines.append(f"  ({got.where})")
            elif tb:
                frame = tb[-1]
                lines.append(f"  (at line {frame.lineno}: {frame.line})")
            return "\n".join(lines)
        if len(got) != len(expected):
            lines.append(f"  you returned {len(got)} value(s), expected {len(expected)} ({', '.join(labels)})")
            return "\n".join(lines)
        for name, e, g in zip(labels, expected, got, strict=False):
            if allclose((g,), (e,), rtol, atol):
                lines.append(f"  {name}: correct")
            else:
                lines.append(f"  {name}: {difference(e, g, rtol, atol)}")
        return "\n".join(lines)

    # -- summary ----------------------------------------------------------------------------------------------
    def result(self, name: str, max_score: float) -> Result:
        earned = sum(p[1] for p in self.parts)
        total = sum(p[2] for p in self.parts)
        score = max_score * earned / total if total > 0 else 0.0
        lines = [self.dependency_note] if self.dependency_note else []
        for label, got, pts, msg in self.parts:
            msg = msg() if callable(msg) else msg
            mark = "ok  " if got == pts else "FAIL"
            lines.append(f"[{mark}] {label}: {got:g}/{pts:g}")
            lines += ["       " + m for m in msg.splitlines() if m]
        diagnoses = list(dict.fromkeys(self.diagnoses))  # a mistake named by two parts counts once
        return Result(name, round(score, 3), max_score, "\n".join(lines), self.seed, diagnoses)


# ----------------------------------------------------------------------------------------------- running them
@contextlib.contextmanager
def _time_limit(seconds: float | None):
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise QuestionTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def new_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def run_question(
    lab_id: str,
    name: str,
    objects: Sequence[Any],
    *,
    seed: int | None = None,
    time_limit: float | None = QUESTION_TIME_LIMIT,
    uses: Mapping[str, Any] | None = None,
    earlier: Mapping[str, Result] | None = None,
) -> Result:
    """Run question ``name`` of ``lab_id`` on ``objects``. Never raises because of the student's code.

    ``uses`` gives the notebook's objects that the question declares it calls (:attr:`Question.uses`), by name;
    ``earlier`` the results of questions already graded in the same run (reused rather than graded again). When
    the question loses points and one of those objects fails the question that grades it, the feedback says
    "q3 uses your online_update, which fails q1 — fix that first" instead of naming a mistake.
    """
    question = get_lab(lab_id).questions.get(name)
    if question is None:
        known = ", ".join(get_lab(lab_id).questions)
        return Result(name, 0.0, 0.0, f"{lab_id} has no question {name!r} (it has {known})", seed)
    seed = new_seed() if seed is None else int(seed)
    if len(objects) != len(question.objects):
        want = ", ".join(question.objects)
        msg = f"check({name!r}, ...) expects {len(question.objects)} object(s): {want}"
        return Result(name, 0.0, question.points, msg, seed)
    missing = [n for n, o in zip(question.objects, objects, strict=False) if o is None]
    if missing:
        return Result(name, 0.0, question.points, f"not defined yet: {', '.join(missing)}", seed)
    trial = Trial(seed, answers.Guard(lab_id, name, objects))
    try:
        with np.errstate(all="ignore"), _time_limit(time_limit):
            out = question.run(trial, *objects)
        if out is not None:  # a question may compute its own (points, feedback)
            points, feedback = out
            result = Result(name, round(float(points), 3), question.points, str(feedback), seed)
        else:
            if trial.lost_points and question.uses:  # graded outside this question's time limit: it has its own
                trial.dependency_note = _dependency_note(lab_id, question, uses or {}, earlier or {}, seed,
                                                         time_limit)
            with np.errstate(all="ignore"), _time_limit(time_limit):
                result = trial.result(name, question.points)  # diagnoses run here: mutants may divide by zero too
    except answers.AnswerCalled as e:  # the verdict below names the function
        calls = getattr(trial.guard, "calls", None)
        if calls is not None and e.name not in calls:  # raised in a sandbox by its package copy: record it here
            calls.append(e.name)
        result = Result(name, 0.0, question.points, "", seed)
    except NotImplementedYet:
        msg = "not implemented yet (your function still raises NotImplementedError)"
        result = Result(name, 0.0, question.points, msg, seed)
    except QuestionTimeout:
        msg = f"took longer than {time_limit:g} s: is there an endless loop?"
        result = Result(name, 0.0, question.points, msg, seed)
    except Exception as e:  # a bug the tests did not anticipate: report, never crash the notebook
        result = Result(name, 0.0, question.points, f"the check could not run your code: {_describe_error(e)}", seed)
    # Even when the student's code caught the tripwire's exception, reaching the course's answer scores 0.
    return answers.verdict(trial.guard, result)


def _dependency_note(lab_id: str, question: Question, uses: Mapping[str, Any], earlier: Mapping[str, Result],
                     seed: int, time_limit: float | None) -> str:
    """The sentence saying which earlier answer the question's code calls fails its own question ("" if none)."""
    lab_ = get_lab(lab_id)
    notes = []
    for obj in question.uses:
        grader = lab_.grader_of(obj, besides=question.name)
        if grader is None:
            continue
        if grader.name in earlier:
            r = earlier[grader.name]
        else:
            if uses.get(obj) is None:
                continue
            their = [uses.get(n) for n in grader.objects]
            if any(o is None for o in their):
                continue
            r = run_question(lab_id, grader.name, their, seed=seed, time_limit=time_limit)
        if r.score < r.max_score:
            notes.append(f"{question.name} uses your {obj}, which fails {grader.name} ({r.score:g}/{r.max_score:g} "
                         f"points) — fix that first: the failures below may be its mistakes, not this code's.")
    return "\n".join(notes)


def grade_namespace(
    lab_id: str, namespace: dict, *, seed: int | None = None, time_limit: float | None = QUESTION_TIME_LIMIT
) -> list[Result]:
    """Grade every question of ``lab_id`` on the objects found by name in ``namespace`` (a notebook's globals)."""
    results: dict[str, Result] = {}
    for q in get_lab(lab_id).questions.values():
        objs = [namespace.get(n) for n in q.objects]
        uses = {n: namespace.get(n) for n in q.uses}
        results[q.name] = run_question(lab_id, q.name, objs, seed=seed, time_limit=time_limit, uses=uses,
                                       earlier=results)
    return list(results.values())


def format_result(r: Result, lab_id: str = "") -> str:
    head = f"{r.name}: {r.score:g}/{r.max_score:g} points"
    if r.seed is not None:
        head += f"   (seed {r.seed}; replay with check({r.name!r}, ..., seed={r.seed}))"
    return head + ("\n" + r.feedback if r.feedback else "")


class Checker:
    """The ``check`` of a lab notebook: ``check("q1", online_update)`` runs q1's tests and prints the result."""

    def __init__(self, lab_id: str) -> None:
        self.lab = get_lab(lab_id)

    def __call__(self, name: str, *objects: Any, seed: int | None = None) -> None:
        """Run question ``name`` on ``objects`` (default: the notebook's globals of the names it grades)."""
        if os.environ.get(BATCH_ENV):
            print(f"{name}: check deferred (the batch grader runs every question after your notebook)")
            return None
        question = self.lab.questions.get(name)
        caller = sys._getframe(1).f_globals
        if not objects and question is not None:
            objects = tuple(caller.get(n) for n in question.objects)
        uses = {n: caller.get(n) for n in question.uses} if question is not None else {}
        print(format_result(run_question(self.lab.id, name, objects, seed=seed, uses=uses), self.lab.id))
        return None

    def __repr__(self) -> str:
        return f"<check for {self.lab.id}: questions {', '.join(self.lab.questions)}>"


def lab(lab_id: str) -> Checker:
    """``check = lab("lab01")`` at the top of a lab notebook gives the check function of its check cells."""
    return Checker(lab_id)

