"""``python -m flashlab grade PATH... [--json] [--csv FILE] [--out DIR] [--timeout S] [--jobs N] [--lab ID]``.

Grades lab submissions (notebooks, or directories searched for ``*.ipynb``). For each submission:

1. its bytes are read once and copied into a fresh temporary directory; the original is never opened for
   writing, and the copy is what runs (a submission that deletes files only deletes its own sandbox);
2. a worker subprocess, in its own process group, executes the copy top to bottom in a fresh Jupyter kernel
   (nbclient, kernel "python3") with that directory as cwd. Errors in the student's cells do not stop the run; a
   cell that runs too long is interrupted; printed output kept per cell is capped;
3. then the worker appends one cell of its own that runs every question of the lab
   (:func:`flashlab.grading.core.grade_namespace`) on the objects the notebook defined, and writes the result to
   a file outside the sandbox. The student's own ``check(...)`` calls are skipped during batch grading and their
   printed output is never trusted;
4. at ``--timeout`` seconds the worker's and the kernel's process groups are killed, and the submission gets an
   error row with 0 points; the other submissions are unaffected.

The lab is found from the notebook's metadata ``{"flashlab": {"lab": "lab01"}}``, else from its
``lab("lab01")`` line, else from a ``labNN`` file-name prefix (``--lab`` overrides). A missing or unknown lab,
or an unreadable notebook, gives an error row, not a crash.

Output: a readable table (``--feedback`` adds each question's feedback), or with ``--json`` one object per
submission per line: ``{"path", "lab", "score", "max_score", "questions": [{"name", "score", "max_score",
"feedback", "seed", "diagnoses"}], "error"}``. ``--csv FILE`` writes one row per submission (student = file stem),
one column per question, and the total. A summary (mean per question) ends the run. ``--out DIR`` writes a
gradebook (a CSV per lab with a row per student, a feedback file per student, a class summary; students named by
``--id-pattern`` or ``--roster``): see :mod:`flashlab.grading.report`, which writes every report.

Known risk, not solved: the student's code runs in the same kernel as the grading cell, so a determined
student could monkeypatch the grader (e.g. replace ``flashlab.grading.core.run_question``) or write a fake
result file. Grading runs the checks with fresh random inputs, after the student's cells, and ignores
everything the notebook printed, which stops accidents and casual cheating, not a deliberate attack; for
high-stakes grading run the checks in a separate process that receives only pickled functions, or review code.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import report
from .core import BATCH_ENV, available_labs, get_lab

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 300.0
OUTPUT_CAP = 20_000  # characters of printed output kept per cell while the notebook runs
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


def _kill_group(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _drain(stream, keep: collections.deque) -> None:
    # Read everything so the worker never blocks on a full pipe; keep only the last chunks.
    for chunk in iter(lambda: stream.read(4096), b""):
        keep.append(chunk)


def grade_one(path: pathlib.Path, *, timeout: float = DEFAULT_TIMEOUT, lab_id: str | None = None) -> dict:
    """Grade one submission in a sandboxed worker; always returns a row, never raises for a bad submission."""
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
        sandbox = tmp / "work"
        sandbox.mkdir()
        copy = sandbox / path.name
        copy.write_bytes(data)
        result_file, pid_file = tmp / "result.json", tmp / "kernel.pid"
        env = dict(os.environ)
        env[BATCH_ENV] = "1"
        env["MPLBACKEND"] = "Agg"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "flashlab.grading.batch", "--worker", str(copy), str(result_file),
               str(pid_file), lab_id, str(timeout)]
        proc = subprocess.Popen(cmd, cwd=sandbox, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log: collections.deque = collections.deque(maxlen=16)
        reader = threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        kernel_pid = int(pid_file.read_text() or 0) if pid_file.exists() else None
        _kill_group(proc.pid)  # the worker and anything it started in its group
        _kill_group(kernel_pid)  # the kernel runs in a session of its own
        proc.wait()
        reader.join(timeout=5)
        if timed_out:
            return _error_row(path, f"timed out after {timeout:g} s (the notebook or a check never finished)", lab_id)
        try:
            result = json.loads(result_file.read_text())
        except (OSError, ValueError):
            tail = b"".join(log).decode("utf-8", "replace").strip().splitlines()[-5:]
            return _error_row(path, "the grader could not finish: " + " | ".join(tail)[-500:], lab_id)
        if "error" in result:
            return _error_row(path, result["error"], lab_id)
        questions = result["questions"]
        return {
            "path": str(path),
            "lab": lab_id,
            "score": round(sum(q["score"] for q in questions), 3),
            "max_score": sum(q["max_score"] for q in questions),
            "questions": questions,
            "error": None,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the worker
def _worker(notebook: str, result_file: str, pid_file: str, lab_id: str, timeout: float) -> int:
    """Runs inside the sandbox: execute the notebook, then grade the objects it defined; write JSON."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

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

    def write(obj: dict) -> None:
        pathlib.Path(result_file).write_text(json.dumps(obj))

    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as e:
        write({"error": f"not a readable notebook: {type(e).__name__}: {e}"[:500]})
        return 0
    nb.cells = [c for c in nb.cells if c.cell_type in ("code", "markdown", "raw")]
    first = nbformat.v4.new_code_cell(f"import os as _fl_os\nopen({pid_file!r}, 'w').write(str(_fl_os.getpid()))")
    question_time = max(5.0, min(60.0, timeout / 4))
    last = nbformat.v4.new_code_cell(
        "import json as _fl_json\n"
        "from flashlab.grading.core import grade_namespace as _fl_grade\n"
        f"_fl_results = _fl_grade({lab_id!r}, globals(), time_limit={question_time!r})\n"
        f"with open({result_file!r}, 'w') as _fl_file:\n"
        "    _fl_json.dump({'questions': [r.as_dict() for r in _fl_results]}, _fl_file)\n"
    )
    nb.cells = [first, *nb.cells, last]
    client = CappedClient(
        nb,
        timeout=int(max(5, timeout / 2)),
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={"ename": "CellTimeout", "evalue": "interrupted: the cell ran too long", "traceback": []},
        resources={"metadata": {"path": str(pathlib.Path(notebook).parent)}},
        record_timing=False,
    )
    try:
        client.execute()
    except DeadKernelError:
        write({"error": "the kernel died while running the notebook (did it call exit() or use all the memory?)"})
        return 0
    except Exception as e:  # nbclient could not run it at all
        write({"error": f"could not execute the notebook: {type(e).__name__}: {e}"[:500]})
        return 0
    if not pathlib.Path(result_file).exists():
        errors = [o for o in last.get("outputs", []) if o.get("output_type") == "error"]
        why = f"{errors[0]['ename']}: {errors[0]['evalue']}" if errors else "no result written"
        write({"error": f"the grading cell failed after the notebook ran: {why}"[:500]})
    return 0


# --------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        notebook, result_file, pid_file, lab_id, timeout = argv[1:6]
        return _worker(notebook, result_file, pid_file, lab_id, float(timeout))
    parser = argparse.ArgumentParser(prog="python -m flashlab grade", description="grade lab submissions")
    parser.add_argument("paths", nargs="+", help="notebooks, or directories holding them")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per submission (300)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="submissions in parallel")
    parser.add_argument("--lab", help="grade every submission as this lab (e.g. lab01)")
    report.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.jobs < 1:
        parser.error("--timeout must be > 0 and --jobs >= 1")
    if args.lab and args.lab not in available_labs():
        parser.error(f"unknown lab {args.lab!r}; known: {', '.join(available_labs())}")
    options = report.check_arguments(parser, args)
    paths = collect(args.paths)
    if not paths:
        print("no notebooks found in " + " ".join(args.paths), file=sys.stderr)
        return 2
    rows: list[dict | None] = [None] * len(paths)
    graded_at = report.utc_now()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(grade_one, p, timeout=args.timeout, lab_id=args.lab): i for i, p in enumerate(paths)}
        for done, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            i = futures[future]
            try:
                rows[i] = future.result()
            except Exception as e:  # a bug of ours must not lose the other submissions
                rows[i] = _error_row(paths[i], f"grader error: {type(e).__name__}: {e}")
            r = rows[i]
            status = "error" if r["error"] else f"{r['score']:g}/{r['max_score']:g}"
            elapsed = time.perf_counter() - start
            print(f"[{done}/{len(paths)} {elapsed:5.1f}s] {paths[i]}: {status}", file=sys.stderr, flush=True)
    final = [r for r in rows if r is not None]
    return report.emit(final, args, options, lab_id=args.lab, graded_at=graded_at)


if __name__ == "__main__":
    raise SystemExit(main())
