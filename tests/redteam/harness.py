"""What the red-team suite watches while the grader runs: the grader itself (run as an instructor would, through
``python -m flashlab grade``), a decoy process, a TCP listener, file checksums and processes left behind."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import attacks as A

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the repository's own files a submission could reach through flashlab.__file__
WATCHED = ("flashlab", "solutions", "labs")


@dataclass
class Graded:
    """One run of ``python -m flashlab grade``: its rows (by file name), exit code, stderr and wall time."""

    rows: dict[str, dict]
    returncode: int
    stderr: str
    seconds: float


def grader_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def grader_options() -> str:
    """The grader's ``--help`` text (to tell which options this checkout's grader has)."""
    done = subprocess.run([sys.executable, "-m", "flashlab", "grade", "--help"], cwd=ROOT, env=grader_env(),
                          capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def grade(folder: pathlib.Path, options: list[str], *, cwd: pathlib.Path, timeout: float) -> Graded:
    """Grade every notebook of ``folder`` in one run, as an instructor would; rows keyed by file name."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flashlab", "grade", str(folder), "--json", *options], cwd=cwd,
                          env=grader_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    rows = {}
    for line in done.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "path" in row:
                rows[pathlib.Path(row["path"]).name] = row
    return Graded(rows, done.returncode, done.stderr[-5000:], seconds)


def scores(row: dict) -> dict[str, float]:
    return {q["name"]: q["score"] for q in row.get("questions", [])}


# ------------------------------------------------------------------------------------------------- checksums
def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under ``folder`` (bytecode caches left out)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if "__pycache__" in p.parts or p.suffix == ".pyc" or not p.is_file() or p.is_symlink():
            continue
        out[str(p.relative_to(folder))] = digest(p)
    return out


def repository_bytes() -> dict[pathlib.Path, bytes]:
    """The watched repository files' contents, to compare after the run (and put back if a submission wrote)."""
    out = {}
    for top in WATCHED:
        for rel in snapshot(ROOT / top):
            out[ROOT / top / rel] = (ROOT / top / rel).read_bytes()
    return out


def changed_files(before: dict[pathlib.Path, bytes]) -> list[str]:
    """Watched repository files changed, deleted or added since ``before``."""
    now = {ROOT / top / rel for top in WATCHED for rel in snapshot(ROOT / top)}
    out = [str(p.relative_to(ROOT)) + " (added)" for p in sorted(now - set(before))]
    for p, data in before.items():
        if not p.exists():
            out.append(str(p.relative_to(ROOT)) + " (deleted)")
        elif p.read_bytes() != data:
            out.append(str(p.relative_to(ROOT)))
    return out


def restore(before: dict[pathlib.Path, bytes]) -> None:
    """Put the watched repository files back as they were: a failing run must not leave the checkout patched."""
    for p, data in before.items():
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)
    for top in WATCHED:
        for rel in snapshot(ROOT / top):
            if ROOT / top / rel not in before:
                (ROOT / top / rel).unlink()


# ------------------------------------------------------------------------------------------------- processes
def start_decoy(marker: str) -> subprocess.Popen:
    """A process of the instructor's that no submission may touch (in a session and process group of its own)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", f"decoy-{marker}"],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def processes_with(marker: str, *, skip: frozenset[int] | set[int] = frozenset()) -> dict[int, str]:
    """pid -> command line of every process whose command line or name carries ``marker``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip or int(entry) == os.getpid():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = pathlib.Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if marker in cmdline or marker in comm:
            out[int(entry)] = (cmdline or comm)[:200]
    return out


def kill(pids) -> None:
    """SIGKILL the given processes (each one the suite found carrying its own marker)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Listener:
    """A TCP server on the host's 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


# ------------------------------------------------------------------------------------------ the whole exercise
@dataclass
class ClassRun:
    """Everything observed around one graded class (see :func:`run_class`)."""

    ctx: A.Context
    files: dict[str, str]  # attack name -> file name
    alone: Graded  # the honest, wrong and broken submissions graded without the others
    graded: Graded | None  # the whole class in one run; None when the run itself did not finish
    error: str  # why ``graded`` is None
    changed_submissions: list[str] = field(default_factory=list)  # notebooks of the class folder
    changed_outside: list[str] = field(default_factory=list)  # sentinel folder and repository files
    decoy_alive: bool = True
    leftovers: dict[int, str] = field(default_factory=dict)
    connections: int = 0

    def row(self, attack: str) -> dict | None:
        return None if self.graded is None else self.graded.rows.get(self.files[attack])


def _diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    out = [f"{p} (added)" for p in sorted(set(after) - set(before))]
    out += [f"{p} (removed)" for p in sorted(set(before) - set(after))]
    return out + [p for p in sorted(set(before) & set(after)) if before[p] != after[p]]


def _notebooks(files: dict[str, str]) -> dict[str, str]:
    # the grader may write its reports beside the submissions; only notebooks count as submissions
    return {p: h for p, h in files.items() if p.endswith(".ipynb")}


def run_class(base: pathlib.Path, options: list[str], *, timeout: float = 1800.0, settle: float = 8.0) -> ClassRun:
    """Build the hostile class under ``base``, grade it in one run with ``options``, and record what changed.

    Before: a decoy process, a TCP listener, sentinel files, checksums. The benign submissions are first graded
    without the others (same file names and options) for their reference scores. After the run the suite waits
    ``settle`` seconds (a daemon left behind writes within 3 s), then looks. Whatever happened, processes
    carrying the marker and the decoy are killed and the repository's files are put back.
    """
    marker = "rt" + uuid.uuid4().hex[:8]
    outside = base / "outside"
    outside.mkdir(parents=True)
    ctx = None
    decoy = start_decoy(marker)
    listener = Listener()
    repo = repository_bytes()
    try:
        ctx = A.Context(folder=base / "class", outside=outside, decoy_pid=decoy.pid, marker=marker,
                        port=listener.port)
        ctx.sentinel.write_text("the instructor's file\n")
        ctx.canary.write_text("visible only outside the sandbox\n")
        paths = A.write_class(ctx.folder, ctx)
        files = {name: p.name for name, p in paths.items()}
        benign = [a for a in A.ATTACKS if a.kind in ("honest", "wrong", "broken")]
        A.write_class(base / "alone", ctx, benign)
        alone = grade(base / "alone", options, cwd=base, timeout=timeout)
        before_class, before_outside = _notebooks(snapshot(ctx.folder)), snapshot(outside)
        graded, error = None, ""
        try:
            graded = grade(ctx.folder, options, cwd=base, timeout=timeout)
        except subprocess.TimeoutExpired:
            error = f"the grader did not finish within {timeout:g} s"
        time.sleep(settle)
        run = ClassRun(ctx, files, alone, graded, error)
        run.leftovers = processes_with(marker, skip={decoy.pid})
        run.decoy_alive = decoy.poll() is None
        run.changed_submissions = _diff(before_class, _notebooks(snapshot(ctx.folder)))
        run.changed_outside = [f"outside/{p}" for p in _diff(before_outside, snapshot(outside))]
        run.changed_outside += changed_files(repo)
        run.connections = listener.connections
        return run
    finally:
        kill(processes_with(marker, skip={decoy.pid}))
        decoy.kill()
        decoy.wait()
        listener.close()
        restore(repo)
