"""``python -m flashlab grade PATH... [--json] [--csv FILE] [--out DIR] [--timeout S] [--jobs N] [--lab ID]
[--seed N] [--no-sandbox]``.

Grades lab submissions (notebooks, or directories searched for ``*.ipynb``). For each submission:

1. its bytes are read once and copied into a fresh temporary directory; the original is never opened for
   writing, and the copy is what runs;
2. a worker runs in a sandbox (:mod:`flashlab.grading.sandbox`: bubblewrap; read-only filesystem except that
   directory, no network, its own process namespace, limits; the repository checkout, with ``solutions/``, and
   every submission's folder are hidden, only the ``flashlab`` package is shown). The worker and the Jupyter
   kernel it starts both run inside: it executes the copy top to bottom (nbclient, kernel "python3"). Errors in
   the student's cells do not stop the run; a cell that runs too long is interrupted; printed output kept per
   cell is capped;
3. then the notebook's kernel only *serves calls*: the questions run here, in the grader's own process, which
   draws the inputs, computes the expected outputs, compares, diagnoses and gives the points. Each object a
   question needs is a proxy (:class:`flashlab.grading.remote.RemoteFunction`): calling it sends the arguments
   (a small wire format: JSON plus ``.npz`` arrays, never a pickle) to the worker, which has the kernel call
   the student's function and write its outputs back; values that are not functions (a constant, lab 06's
   CUDA source) are fetched once. Expected values, reference code and seeds never enter the sandbox, so a
   notebook that patches the grader or walks the stack patches and finds nothing that judges it. Everything
   read back is untrusted (regular files only, no links, size caps; a malformed answer fails that call). A
   call past its question's time limit is interrupted. The student's own ``check(...)`` calls are
   skipped during batch grading and their printed output is never trusted;
4. at ``--timeout`` seconds the sandbox is killed, every process in it with it (through the handle of the
   process the grader started, never a process id read from a file), and the submission gets an error row with
   0 points; the other submissions are unaffected.

Without a usable bubblewrap, grading refuses (saying why and how to install it) unless ``--no-sandbox``: then
the worker runs with the same limits and no isolation, and every row says ``"sandboxed": false``.

Reproducible: ``--seed N`` grades every submission with seed N, else one fresh seed is drawn for the run; each
row records it, grading again with it gives the same scores, and the feedback of a question not at full marks
ends with the line that replays it in the student's notebook (``check("q2", ..., seed=...)``). When the
notebook's cells raised, each such feedback starts with the notebook's first error (cell number, exception),
which is usually the cause of what follows.

The lab is found from the notebook's metadata ``{"flashlab": {"lab": "lab01"}}``, else from its
``lab("lab01")`` line, else from a ``labNN`` file-name prefix (``--lab`` overrides). A missing or unknown lab,
or an unreadable notebook, gives an error row, not a crash.

Output: a readable table (``--feedback`` adds each question's feedback), or with ``--json`` one object per
submission per line: ``{"path", "lab", "score", "max_score", "questions": [{"name", "score", "max_score",
"feedback"}], "error", "notebook_error", "seed", "sandboxed"}``. ``--csv FILE`` writes one row per submission
(student = file stem), one column per question, and the total. A summary (mean per question) ends the run.
``--out DIR`` writes a gradebook (a CSV per lab with a row per student, a feedback file per student, a class
summary; students named by ``--id-pattern`` or ``--roster``): see :mod:`flashlab.grading.report`, which writes
every report.

Memory parts (``Trial.memory``) are measured in a fresh sandboxed process, watched from outside through the
kernel's accounting of its resident memory (:mod:`flashlab.grading.memprobe`), not with tracemalloc inside the
notebook's kernel.

A lab whose grading must observe a function's behaviour from inside the process that runs it (lab 05's race
report) names it in ``RUN_APART``: its source is taken out of the notebook, checked to be kernel language, and run
alone in a fresh sandbox (:mod:`flashlab.grading.kernelcheck`). :data:`JUDGED_INSIDE` lists labs graded entirely
in the notebook's kernel (none today). The worker is inside the sandbox too, so the protocol lines it sends are
untrusted like everything else from there.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import glob
import hashlib
import importlib
import json
import math
import os
import pathlib
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence

import numpy as np

from .. import numba_cuda
from . import answers, astguard, core, kernelcheck, memprobe, remote, report, sandbox
from .core import BATCH_ENV, available_labs, get_lab, new_seed
from .remote import read_untrusted

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 300.0
OUTPUT_CAP = 20_000  # characters of printed output kept per cell while the notebook runs
RESULT_CAP = 4 << 20  # bytes of the result file read back from the sandbox
#: Labs whose checks use the GPU when the machine has one: their sandbox gets the GPU's device files.
GPU_LABS = frozenset({"lab06", "lab07"})
#: A Jupyter kernel with NumPy, Numba and a ZMQ client beside it: threads count as processes.
SANDBOX_LIMITS = sandbox.Limits(memory=8 << 30, processes=256, output=1 << 20)
LINE_CAP = 1 << 16  # bytes of one protocol line from the worker
CALL_GRACE = 15.0  # seconds a worker has, past a call's limit, to interrupt the kernel and answer
#: Labs graded in the notebook's own (sandboxed) kernel, because their objects cannot be called from outside.
JUDGED_INSIDE: frozenset[str] = frozenset()
#: Labs whose questions launch numba.cuda kernels in the CUDA simulator in the grader's process too (mutants).
SIMULATOR_LABS = frozenset({"lab05"})
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install"
                " bubblewrap), or grade trusted submissions only with --no-sandbox")
_LAB_CALL = re.compile(r"""\blab\(\s*["'](lab\d{2,})["']\s*\)""")
_LAB_PREFIX = re.compile(r"^(lab\d{2,})")


# ------------------------------------------------------------------------------------------ finding the lab
def find_lab_id(nb: dict, path: pathlib.Path) -> str | None:
    """The lab a notebook belongs to: metadata, then its ``lab("labNN")`` call, then its file-name prefix."""
    meta = nb.get("metadata", {}).get("flashlab", {})
    if isinstance(meta, dict) and isinstance(meta.get("lab"), str):
        return meta["lab"]
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            match = _LAB_CALL.search(source)
            if match:
                return match.group(1)
    match = _LAB_PREFIX.match(path.name)
    return match.group(1) if match else None


def _lab_or_none(path: pathlib.Path, lab_id: str | None) -> str | None:
    """The lab of ``path`` for an error row (None when it cannot be told): such a row still counts in its lab."""
    if lab_id:
        return lab_id
    try:
        found = find_lab_id(json.loads(path.read_bytes().decode("utf-8")), path)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return found if found in available_labs() else None


def collect(paths: list[str]) -> list[pathlib.Path]:
    """Notebooks named, and every ``*.ipynb`` under directories named (checkpoints skipped), in order."""
    out: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            out.append(p)  # a missing file becomes an error row
    return out


# ------------------------------------------------------------------------------------------------- a row
def _error_row(path: pathlib.Path, error: str, lab_id: str | None = None) -> dict:
    questions = []
    if lab_id:
        questions = [
            {"name": q.name, "score": 0.0, "max_score": q.points, "feedback": error}
            for q in get_lab(lab_id).questions.values()
        ]
    return {
        "path": str(path),
        "lab": lab_id,
        "score": 0.0,
        "max_score": sum(q["max_score"] for q in questions),
        "questions": questions,
        "error": error,
    }


def question_seed(seed: int, name: str) -> int:
    """The seed question ``name`` runs with when its submission is graded with ``seed`` (a pure function of both).

    Replaying it in the notebook, ``check(name, fn, seed=question_seed(seed, name))``, draws the same inputs.
    """
    entropy = [int(seed)] + list(name.encode("utf-8"))
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] % 2**31)


def _drain(stream, keep: collections.deque) -> None:
    # Read everything so the worker never blocks on a full pipe; keep only the last chunks.
    for chunk in iter(lambda: stream.read(4096), b""):
        keep.append(chunk)


def _replay_line(name: str, seed: int) -> str:
    return f"replay: check({name!r}, ..., seed={seed})"


def _checked_questions(lab_id: str, raw: object) -> list[dict] | None:
    """The worker's question results, validated against the lab (untrusted: types, names and bounds checked)."""
    questions = get_lab(lab_id).questions
    if not isinstance(raw, list) or len(raw) != len(questions):
        return None
    out = []
    for item, q in zip(raw, questions.values(), strict=True):
        if not isinstance(item, dict) or item.get("name") != q.name:
            return None
        score, feedback = item.get("score"), item.get("feedback")
        if not isinstance(score, (int, float)) or not isinstance(feedback, str) or not 0 <= score <= q.points:
            return None
        out.append({"name": q.name, "score": float(score), "max_score": q.points, "feedback": feedback[:20_000]})
    return out


@functools.lru_cache(maxsize=None)
def _given_cells(lab_id: str) -> frozenset[str]:
    """Digests of the code cells of the released lab (``labs/``): the cells a learner is given, not written."""
    found = sorted((ROOT / "labs").glob(f"{lab_id}_*.ipynb"))
    if not found:
        return frozenset()
    cells = json.loads(found[0].read_text()).get("cells", [])
    return frozenset(_digest("".join(c.get("source", ""))) for c in cells if c.get("cell_type") == "code")


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _first_relevant_error(errors: object, lab_id: str) -> object:
    """The first error worth naming to the learner. A given cell that reaches one of the course's answers (a
    quick look comparing the learner's code with the package) raises AnswerCalled in the sandbox's copy of the
    package by design; that error says nothing about the learner's work, so the next one is named instead."""
    for error in errors if isinstance(errors, list) else ():
        if isinstance(error, dict) and not (error.get("ename") == "AnswerCalled"
                                            and error.get("source") in _given_cells(lab_id)):
            return error
    return None


def _first_error_text(first: object) -> str | None:
    if not isinstance(first, dict):
        return None
    cell, ename, evalue = first.get("cell"), first.get("ename"), first.get("evalue")
    if not isinstance(cell, int) or not isinstance(ename, str) or not isinstance(evalue, str):
        return None
    if ename in ("KeyboardInterrupt", "CellTimeout"):  # the kernel's answer to the interrupt at the cells' time limit
        return f"cell {cell} was interrupted ({ename}): a cell still running when the cells' time is up is stopped"
    return f"cell {cell} raised {ename}: {evalue}"[:500]


def _needs_gpu(lab_id: str) -> bool:
    return lab_id in GPU_LABS and bool(glob.glob("/dev/nvidia*"))


def grade_one(path: pathlib.Path, *, timeout: float = DEFAULT_TIMEOUT, lab_id: str | None = None,
              seed: int | None = None, hide: Sequence[pathlib.Path] = (), sandboxed: bool = True) -> dict:
    """Grade one submission in a sandboxed worker; always returns a row, never raises for a bad submission.

    ``seed`` (default: a fresh one) determines every question's inputs (:func:`question_seed`); ``hide`` are
    folders the submission must not see besides the repository checkout (e.g. the other submissions' folders).
    ``sandboxed=False`` runs without isolation (same limits), for machines without bubblewrap; the row says so.
    Raises :class:`~flashlab.grading.sandbox.SandboxUnavailable` if ``sandboxed`` and no sandbox can be made.
    """
    seed = new_seed() if seed is None else int(seed)
    row = _grade(path, timeout=timeout, lab_id=lab_id, seed=seed, hide=hide, sandboxed=sandboxed)
    row["seed"] = seed
    row["sandboxed"] = bool(row.get("sandboxed", sandboxed)) and sandboxed
    return row


def _grade(path: pathlib.Path, *, timeout: float, lab_id: str | None, seed: int, hide: Sequence[pathlib.Path],
           sandboxed: bool) -> dict:
    try:
        data = path.read_bytes()
    except OSError as e:
        return _error_row(path, f"cannot read the notebook: {e.strerror or e}")
    try:
        nb = json.loads(data.decode("utf-8"))
        if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
            raise ValueError("no list of cells")
    except (UnicodeDecodeError, ValueError) as e:
        return _error_row(path, f"not a readable notebook (.ipynb JSON): {e}")
    lab_id = lab_id or find_lab_id(nb, path)
    if lab_id is None:
        return _error_row(path, 'cannot tell which lab this is: no lab("labNN") line and no labNN name prefix')
    if lab_id not in available_labs():
        return _error_row(path, f"unknown lab {lab_id!r} (known: {', '.join(available_labs())})")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="flashlab-grade-"))
    try:
        work, requests = tmp / "work", tmp / "requests"
        work.mkdir()
        requests.mkdir()  # written by the grader only; the sandbox sees it read-only
        copy = work / "submission.ipynb"  # a fixed name: the student's file name never reaches a command line
        copy.write_bytes(data)
        for folder in (tmp, requests):
            os.chmod(folder, 0o755)  # the scratch uid the sandbox runs as must reach work/ and read requests/
        # The sandbox imports a copy of the package without this lab's answers (answers.student_package): the
        # course's own implementation of the task is neither callable nor readable there.
        package = answers.student_package(tmp / "package", lab_id)
        os.chmod(tmp / "package", 0o755)
        extra = library_paths([ROOT, *hide])
        env = {BATCH_ENV: "1", "MPLBACKEND": "Agg", "PYTHONPATH": os.pathsep.join([str(package.parent), *extra]),
               "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
        mode = "inside" if lab_id in JUDGED_INSIDE else "serve"
        cmd = [sys.executable, "-m", "flashlab.grading.batch", "--worker", copy.name, str(requests), lab_id,
               str(timeout), mode, str(seed) if mode == "inside" else "-"]
        options = {"hide": [ROOT, *(p for p in hide if _hideable(p))], "expose": [package.parent, *extra],
                   "gpu": _needs_gpu(lab_id), "env": env, "limits": SANDBOX_LIMITS, "allow_unsandboxed": not sandboxed}
        proc, isolated = sandbox.popen(cmd, workdir=work, **{**options, "expose": [*options["expose"], requests]},
                                       stdin=subprocess.PIPE)
        cells = [_source(c) for c in nb["cells"] if isinstance(c, dict) and c.get("cell_type") == "code"]
        probe = {"cells": cells, "folder": tmp, "options": options}
        try:
            row = _judge(path, lab_id, seed, proc, work, requests, timeout, probe)
        finally:
            _finish(proc)
        return {**row, "sandboxed": isolated}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def library_paths(hidden: Sequence[str | os.PathLike]) -> list[str]:
    """Folders of packages the grader's Python finds through ``PYTHONPATH`` or the user's site folder (an
    instructor's ``pip install --user`` or ``--target``): the sandbox gets them too, read-only, unless they hold
    or lie in a hidden folder (the course's checkout, with ``solutions/``, never enters)."""
    import site

    candidates = [*os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    hidden_real = [pathlib.Path(os.path.realpath(h)) for h in hidden]
    found = []
    for entry in candidates:
        if not entry or not os.path.isdir(entry):
            continue
        real = pathlib.Path(os.path.realpath(entry))
        if any(real == h or h in real.parents or real in h.parents for h in hidden_real):
            continue
        found.append(str(real))
    return list(dict.fromkeys(found))


def _finish(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End the worker: first ask (it shuts its kernel down, which matters unsandboxed, where the kernel runs in a
    session of its own), then kill what is left of the sandbox through our own handle."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end and not sandbox._exited(proc.pid):
        time.sleep(0.05)
    sandbox.stop(proc)


class _Lines:
    """Protocol lines from the sandboxed worker (untrusted: each capped, read with a deadline)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.fd = proc.stdout.fileno()
        self.buffer = b""
        self.closed = False

    def read(self, deadline: float) -> str | None:
        """The next line, or None at the deadline or when the worker closed its output."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.closed = True
                self.buffer = (self.buffer + chunk)[-LINE_CAP:]
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line[:LINE_CAP].decode("utf-8", "replace")


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(map(str, source)) if isinstance(source, list) else str(source)


def _judge(path: pathlib.Path, lab_id: str, seed: int, proc: subprocess.Popen, work: pathlib.Path,
           requests: pathlib.Path, timeout: float, probe: dict) -> dict:
    """Talk to the sandboxed worker: wait for the notebook to run, then judge every question here, outside."""
    start = time.monotonic()
    end = start + timeout
    log: collections.deque = collections.deque(maxlen=16)
    threading.Thread(target=_drain, args=(proc.stderr, log), daemon=True).start()
    lines = _Lines(proc)
    first = lines.read(end)

    def failed(default: str) -> dict:
        if time.monotonic() >= end:
            return _error_row(path, f"timed out after {timeout:g} s (the notebook or a check never finished)", lab_id)
        tail = b"".join(log).decode("utf-8", "replace").strip().splitlines()[-5:]
        return _error_row(path, "the grader could not finish: " + (" | ".join(tail)[-500:] or default), lab_id)

    head, _, payload = (first or "").partition(" ")
    try:
        info = json.loads(payload) if head in ("ready", "error", "result") else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return failed("the worker stopped before the notebook ran")
    if head == "error":
        return _error_row(path, str(info.get("error"))[:500], lab_id)
    first_error = _first_error_text(_first_relevant_error(info.get("errors"), lab_id))
    if head == "result":  # judged inside the sandbox (JUDGED_INSIDE)
        questions = _checked_questions(lab_id, info.get("questions"))
        if questions is None:
            return _error_row(path, "the grader's result was malformed", lab_id)
    else:
        questions = _judge_outside(lab_id, seed, proc, lines, work, requests, end, timeout, probe)
    for q in questions:
        if q["score"] < q["max_score"]:
            parts = [q["feedback"]] if q["feedback"] else []
            if first_error:
                parts.insert(0, f"Your notebook's first error: {first_error}. Fix that first: later cells"
                                " depend on it.")
            parts.append(_replay_line(q["name"], question_seed(seed, q["name"])))
            q["feedback"] = "\n".join(parts)
    return {
        "path": str(path),
        "lab": lab_id,
        "score": round(sum(q["score"] for q in questions), 3),
        "max_score": sum(q["max_score"] for q in questions),
        "questions": questions,
        "error": None,
        "notebook_error": first_error,
    }


def _judge_outside(lab_id: str, seed: int, proc: subprocess.Popen, lines: _Lines, work: pathlib.Path,
                   requests: pathlib.Path, end: float, timeout: float, probe: dict) -> list[dict]:
    """Every question run here, in the grader's process, on proxies of the notebook's objects."""
    def send(n: int, left: float) -> str:
        try:
            proc.stdin.write(f"{n} {left:.3f}\n".encode())
            proc.stdin.flush()
        except OSError:
            return "dead"
        until = min(time.monotonic() + left + CALL_GRACE, end)
        while True:  # answers to earlier, abandoned requests may still come: skip them
            line = lines.read(until)
            if line is None:
                return "dead"
            word, _, number = line.partition(" ")
            if number == str(n):
                return word

    session = remote.Session(send, requests, work)
    session.measure_memory = memprobe.remote_peak(probe["cells"], probe["folder"], lambda: session.deadline,
                                                  **probe["options"])
    if lab_id in SIMULATOR_LABS:
        try:
            numba_cuda.use_simulator()
        except RuntimeError:  # numba.cuda already runs on a GPU in this process: mutants cannot be launched here
            pass
    lab = get_lab(lab_id)
    names = list(dict.fromkeys(n for q in lab.questions.values() for n in (*q.objects, *q.uses)))
    session.deadline = end
    objects: dict[str, object] = {}
    # Functions the lab judges apart from the notebook (lab 05's kernel factory): their source runs alone, in a
    # fresh sandbox (flashlab.grading.kernelcheck), where what is measured about them cannot be tampered with.
    apart: dict[str, object] = dict.fromkeys(getattr(importlib.import_module(f"{__package__}.{lab_id}"),
                                                     "RUN_APART", ()))
    try:
        return _run_questions(lab, lab_id, seed, session, names, objects, apart, probe, end, timeout)
    finally:
        for obj in apart.values():
            if obj is not None:
                obj.close()


def _run_questions(lab, lab_id: str, seed: int, session, names: list[str], objects: dict, apart: dict,
                   probe: dict, end: float, timeout: float) -> list[dict]:
    try:
        kinds = session.describe(names)
        for name, kind in kinds.items():
            if kind == "callable" and name in apart:
                objects[name] = apart[name] = kernelcheck.KernelProbe(probe["cells"], name, probe["folder"],
                                                                      **probe["options"])
            elif kind == "callable":
                objects[name] = remote.RemoteFunction(session, name)
            elif kind == "value":
                objects[name] = session.value(name)
    except (Exception, core.QuestionTimeout) as e:
        why = f"could not reach the notebook's objects: {type(e).__name__}: {e}"[:300]
        return [{"name": q.name, "score": 0.0, "max_score": q.points, "feedback": why} for q in lab.questions.values()]
    question_time = max(5.0, min(60.0, timeout / 4))
    out = []
    earlier: dict[str, core.Result] = {}  # a question that uses an earlier answer says when that one fails
    for q in lab.questions.values():
        session.deadline = min(time.monotonic() + question_time, end)
        for obj in apart.values():
            if getattr(obj, "session", None) is not None:
                obj.session.deadline = session.deadline
        r = core.run_question(lab_id, q.name, [objects.get(n) for n in q.objects], seed=question_seed(seed, q.name),
                              time_limit=question_time, uses={n: objects.get(n) for n in q.uses}, earlier=earlier)
        earlier[q.name] = r
        out.append(r.as_dict())
    return out


def _hideable(p: pathlib.Path) -> bool:
    """Hiding a folder that holds the interpreter or the temporary folders (where each sandbox's copy lives), or
    the root, would hide what the grader itself runs on; a temporary folder is private to each sandbox anyway."""
    p = pathlib.Path(os.path.realpath(p))
    needed = [*sandbox.python_paths(), os.path.realpath(tempfile.gettempdir())]
    return p != pathlib.Path("/") and not any(pathlib.Path(x) == p or p in pathlib.Path(x).parents for x in needed)


# ------------------------------------------------------------------------------------------------ the worker
MAX_ERRORS = 50  # error cells reported from the sandbox; the grader names the first relevant one


def _errors(cells: list) -> list[dict]:
    """The notebook's error outputs in order, each with its cell's number and source digest: the first is usually
    the cause of the later ones (a NameError, say)."""
    found = []
    for number, cell in enumerate(cells, start=1):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if out.get("output_type") == "error" and len(found) < MAX_ERRORS:
                found.append({"cell": number, "ename": str(out.get("ename", "")), "evalue": str(out.get("evalue", "")),
                              "source": _digest(str(cell.get("source", "")))})
    return found


def _worker(notebook: str, requests: str, lab_id: str, timeout: float, mode: str, seed: str) -> int:
    """Runs inside the sandbox: execute the notebook, then serve the grader's requests (``mode == "serve"``) or
    grade the objects here (``"inside"``, :data:`JUDGED_INSIDE`). Speaks one line per answer on its stdout."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    # The protocol gets private descriptors; the kernel inherits /dev/null and stderr, so nothing it prints or
    # reads can reach the grader's end.
    proto_in = os.fdopen(os.dup(0), "r")
    proto_out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)

    def say(word: str, payload: object = None) -> None:
        proto_out.write(word + ("" if payload is None else " " + json.dumps(payload)) + "\n")
        proto_out.flush()

    class CappedClient(NotebookClient):
        """Keeps at most OUTPUT_CAP characters of printed output per cell (a notebook may print megabytes)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kept: dict[int, int] = {}

        def output(self, outs, msg, display_id, cell_index):
            if msg["msg_type"] == "stream":
                size = self.kept.get(cell_index, 0) + len(msg["content"].get("text", ""))
                self.kept[cell_index] = size
                if size > OUTPUT_CAP:
                    return None
            return super().output(outs, msg, display_id, cell_index)

    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as e:
        say("error", {"error": f"not a readable notebook: {type(e).__name__}: {e}"[:500]})
        return 0
    student = list(nb.cells)
    nb.cells = [c for c in nb.cells if c.cell_type in ("code", "markdown", "raw")]
    client = CappedClient(
        nb,
        timeout=int(max(5, timeout / 2)),
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={"ename": "CellTimeout", "evalue": "interrupted: the cell ran too long", "traceback": []},
        resources={"metadata": {"path": str(pathlib.Path(notebook).resolve().parent)}},
        record_timing=False,
    )
    serving = False
    try:
        client.reset_execution_trackers()
        with client.setup_kernel():
            # The cells share one budget of half the time (each cell at least 5 s), so that two endless cells
            # cannot use up the time the questions need.
            budget_end = time.monotonic() + max(5, timeout / 2)
            for index, cell in enumerate(list(nb.cells)):
                client.timeout = int(max(5, budget_end - time.monotonic()))
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            errors = _errors(student)
            if mode == "inside":
                say("result", {"questions": _grade_here(client, nb, lab_id, timeout, int(seed)), "errors": errors})
                return 0
            say("ready", {"errors": errors})
            serving = True
            nb.cells.append(nbformat.v4.new_code_cell(""))
            slot = len(nb.cells) - 1
            for line in proto_in:
                n, limit = line.split()
                cell = nbformat.v4.new_code_cell(
                    f"__import__('flashlab.grading.remote', fromlist=['serve']).serve(globals(), {requests!r}, '.', "
                    f"{int(n)})")
                nb.cells[slot] = cell
                client.timeout = max(1, math.ceil(float(limit)))
                client.execute_cell(cell, slot, store_history=False)
                timed_out = any(o.get("ename") == "CellTimeout" for o in cell.get("outputs", []))
                say(f"{'timeout' if timed_out else 'done'} {int(n)}")
    except DeadKernelError:
        if serving:
            say("dead")
        else:
            say("error", {"error": "the kernel died while running the notebook (did it call exit() or use all the"
                                   " memory?)"})
    except Exception as e:  # nbclient could not run it at all
        if not serving:
            say("error", {"error": f"could not execute the notebook: {type(e).__name__}: {e}"[:500]})
    return 0


def _grade_here(client, nb, lab_id: str, timeout: float, seed: int) -> list[dict]:
    """Grade in the notebook's own kernel (labs in :data:`JUDGED_INSIDE`), each question with its own seed."""
    import nbformat

    question_time = max(5.0, min(60.0, timeout / 4))
    seeds = {name: question_seed(seed, name) for name in get_lab(lab_id).questions}
    result_file = "result.json"
    cell = nbformat.v4.new_code_cell(
        "import json as _fl_json\n"
        "from flashlab.grading.core import get_lab as _fl_get_lab, run_question as _fl_run\n"
        "_fl_earlier = {}\n"
        f"for _q in _fl_get_lab({lab_id!r}).questions.values():\n"
        f"    _fl_earlier[_q.name] = _fl_run({lab_id!r}, _q.name, [globals().get(_n) for _n in _q.objects],\n"
        f"                                   seed={seeds!r}[_q.name], time_limit={question_time!r},\n"
        "                                   uses={_n: globals().get(_n) for _n in _q.uses}, earlier=_fl_earlier)\n"
        "_fl_results = list(_fl_earlier.values())\n"
        f"with open({result_file!r}, 'w') as _fl_file:\n"
        "    _fl_json.dump([r.as_dict() for r in _fl_results], _fl_file)\n"
    )
    nb.cells.append(cell)
    client.execute_cell(cell, len(nb.cells) - 1)
    try:
        return json.loads(read_untrusted(result_file, RESULT_CAP))
    except (OSError, ValueError):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        why = f"{errors[0]['ename']}: {errors[0]['evalue']}" if errors else "no result written"
        return [{"name": q.name, "score": 0.0, "max_score": q.points, "feedback": f"the grading cell failed: {why}"}
                for q in get_lab(lab_id).questions.values()]


# --------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        notebook, requests, lab_id, timeout, mode, seed = argv[1:7]
        return _worker(notebook, requests, lab_id, float(timeout), mode, seed)
    astguard.install()  # submissions are graded in threads, and each parses Python: one parse at a time
    parser = argparse.ArgumentParser(prog="python -m flashlab grade", description="grade lab submissions")
    parser.add_argument("paths", nargs="+", help="notebooks, or directories holding them")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per submission (300)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="submissions in parallel")
    parser.add_argument("--lab", help="grade every submission as this lab (e.g. lab01)")
    report.add_arguments(parser)
    parser.add_argument("--seed", type=int, help="seed of every submission's inputs (default: a fresh one, recorded"
                        " in each row); grading again with it gives the same scores")
    parser.add_argument("--no-sandbox", action="store_true", help="run submissions without isolation (limits only;"
                        " for trusted notebooks, where bubblewrap is missing); every row says sandboxed: false")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.jobs < 1:
        parser.error("--timeout must be > 0 and --jobs >= 1")
    if args.lab and args.lab not in available_labs():
        parser.error(f"unknown lab {args.lab!r}; known: {', '.join(available_labs())}")
    options = report.check_arguments(parser, args)
    if args.seed is not None and not 0 <= args.seed < 2**63:
        parser.error("--seed must be a non-negative integer")
    if not args.no_sandbox:
        problem = sandbox.sandbox_problem()
        if problem is not None:
            print(f"cannot grade in a sandbox: {problem}\n{INSTALL_HINT}", file=sys.stderr)
            return 2
    else:
        print("warning: grading WITHOUT a sandbox: submissions can read and change anything you can",
              file=sys.stderr)
    paths = collect(args.paths)
    if not paths:
        print("no notebooks found in " + " ".join(args.paths), file=sys.stderr)
        return 2
    seed = new_seed() if args.seed is None else args.seed
    # No submission may see another's notebook (or its own original), only the copy it runs.
    folders = sorted({p.resolve().parent for p in paths if p.exists()})
    rows: list[dict | None] = [None] * len(paths)
    graded_at = report.utc_now()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(grade_one, p, timeout=args.timeout, lab_id=args.lab, seed=seed, hide=folders,
                               sandboxed=not args.no_sandbox): i for i, p in enumerate(paths)}
        for done, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            i = futures[future]
            try:
                rows[i] = future.result()
            except Exception as e:  # a bug of ours must not lose the other submissions
                traceback.print_exc()  # for whoever runs the grader: the bug, with where it happened
                rows[i] = {**_error_row(paths[i], f"grader error: {type(e).__name__}: {e}", _lab_or_none(paths[i],
                                                                                                   args.lab)),
                           "seed": seed, "sandboxed": False}
            r = rows[i]
            status = "error" if r["error"] else f"{r['score']:g}/{r['max_score']:g}"
            elapsed = time.perf_counter() - start
            print(f"[{done}/{len(paths)} {elapsed:5.1f}s] {paths[i]}: {status}", file=sys.stderr, flush=True)
    final = [r for r in rows if r is not None]
    return report.emit(final, args, options, lab_id=args.lab, graded_at=graded_at)


if __name__ == "__main__":
    raise SystemExit(main())
