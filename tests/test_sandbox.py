"""The grading sandbox (flashlab.grading.sandbox): each attack runs for real inside a sandbox, and the host is
checked afterwards. Skipped, with the reason, where bwrap is missing or cannot make namespaces; the unsandboxed
fallback is tested everywhere."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from flashlab.grading import sandbox
from flashlab.grading.sandbox import Limits, SandboxUnavailable

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process limits and bwrap need a POSIX system")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBLEM = sandbox.sandbox_problem()
needs_sandbox = pytest.mark.skipif(PROBLEM is not None, reason=f"no usable sandbox here: {PROBLEM}")


def run_py(code: str, workdir: pathlib.Path, *, timeout: float = 60, **kwargs) -> sandbox.Completed:
    """Python code run as a submission would be: checkout hidden, only its package shown."""
    kwargs.setdefault("hide", [ROOT])
    kwargs.setdefault("expose", [ROOT / "flashlab"])
    kwargs.setdefault("env", {"PYTHONPATH": str(ROOT)})
    return sandbox.run([sys.executable, "-c", textwrap.dedent(code)], workdir=workdir, timeout=timeout, **kwargs)


def report(done: sandbox.Completed) -> dict:
    """The last stdout line of a payload, a JSON object (the error output helps when it is missing)."""
    assert done.stdout.strip(), done
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def host_processes_with(token: str) -> list[int]:
    """Host processes whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if token.encode() in pathlib.Path("/proc", entry, "cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def wait_until_gone(token: str, seconds: float = 5.0) -> list[int]:
    """Processes holding ``token`` still alive after ``seconds`` (a killed namespace takes a moment to empty)."""
    end = time.monotonic() + seconds
    while (left := host_processes_with(token)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


@pytest.fixture
def outside():
    """A world-writable folder on the host that sandboxes see (not under /tmp, which they get privately)."""
    base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
    path = pathlib.Path(tempfile.mkdtemp(prefix="flashlab-sandbox-test-", dir=base))
    if str(path).startswith("/tmp/"):
        pytest.skip("no writable folder outside /tmp to check what a sandbox sees")
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------- the probe
def test_the_probe_passes_wherever_bwrap_itself_runs():
    """A bug in the options must fail here, not turn every test below into a skip."""
    bwrap = sandbox.find_bwrap()
    if bwrap is None or sys.platform != "linux":
        pytest.skip("bwrap not found")
    bare = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-pid", "--", "true"], capture_output=True)
    if bare.returncode != 0:
        pytest.skip(f"bwrap cannot make namespaces here: {bare.stderr.decode(errors='replace').strip()}")
    assert PROBLEM is None


# ------------------------------------------------------------------------------------------------- filesystem
@needs_sandbox
def test_writes_outside_the_workdir_fail_and_leave_files_unchanged(tmp_path, outside):
    sentinel = outside / "sentinel.txt"
    sentinel.write_text("the host's own bytes\n")
    sentinel.chmod(0o666)  # so that the read-only mount, not file permissions, is what stops the write
    grader = ROOT / "flashlab" / "grading" / "core.py"
    marker = pathlib.Path(sys.prefix) / "pyvenv.cfg" if (pathlib.Path(sys.prefix) / "pyvenv.cfg").exists() else None
    targets = [p for p in (sentinel, grader, marker) if p is not None]
    before = {str(p): digest(p) for p in targets}
    done = run_py(f"""
        import json, os
        results = {{}}
        open("evil.py", "w").write("x = 1")
        for path in {[str(p) for p in targets]!r}:
            for action in ("append", "replace", "remove", "new file beside"):
                try:
                    if action == "append":
                        open(path, "a").write("tampered")
                    elif action == "replace":
                        os.replace("evil.py", path)
                    elif action == "remove":
                        os.remove(path)
                    else:
                        open(os.path.join(os.path.dirname(path), "planted.py"), "w").write("x = 1")
                    results[path + " " + action] = "succeeded"
                except OSError as e:
                    results[path + " " + action] = e.strerror
        open("mine.txt", "w").write("allowed")
        print(json.dumps(results))
    """, tmp_path, expose=[ROOT / "flashlab", outside])
    results = report(done)
    assert results and all(v != "succeeded" for v in results.values()), results
    assert {str(p): digest(p) for p in targets} == before
    assert not (outside / "planted.py").exists() and not (grader.parent / "planted.py").exists()
    assert (tmp_path / "mine.txt").read_text() == "allowed"  # the workdir is writable, and seen by the host


@needs_sandbox
def test_hidden_folders_are_empty_and_exposed_ones_readable(tmp_path, outside):
    secret = outside / "solutions" / "lab01.ipynb"
    secret.parent.mkdir()
    secret.write_text("the answers")
    code = f"""
        import json, os
        try:
            text = open({str(secret)!r}).read()
        except OSError as e:
            text = e.strerror
        try:
            open({str(secret.parent / "planted")!r}, "w").close()
            planted = True
        except OSError:
            planted = False
        try:
            listing = os.listdir({str(secret.parent)!r})
        except OSError:
            listing = []
        print(json.dumps({{"listing": listing, "read": text, "planted": planted,
                           "checkout": os.path.exists({str(ROOT / "solutions")!r}),
                           "package": os.path.exists({str(ROOT / "flashlab" / "grading" / "core.py")!r})}}))
    """
    seen = report(run_py(code, tmp_path, hide=[ROOT], expose=[ROOT / "flashlab", outside]))
    assert seen["listing"] == ["lab01.ipynb"] and seen["read"] == "the answers"  # the control: exposed, visible
    covered = report(run_py(code, tmp_path, hide=[ROOT]))  # outside the system's folders: covered unless exposed
    assert covered["listing"] == [] and covered["read"] != "the answers" and covered["package"]
    hidden = report(run_py(code, tmp_path, hide=[ROOT, secret.parent], expose=[ROOT / "flashlab", outside]))
    assert hidden["listing"] == [] and hidden["read"] != "the answers"
    assert not hidden["planted"]  # the cover is read-only too: nothing to hand over between cells through it
    assert (ROOT / "solutions").exists() and not hidden["checkout"]
    assert hidden["package"]


@needs_sandbox
@pytest.mark.skipif(not os.access("/", os.W_OK), reason="needs a new top-level folder (root)")
def test_another_copy_of_the_course_in_a_top_level_folder_is_covered(tmp_path):
    """A teacher's other checkout, say /srv/course/solutions, is out of sight, wherever it lies outside the system's
    folders; the package and the Python that the submission runs stay."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="flashlab-sandbox-test-", dir="/"))
    try:
        (top / "solutions").mkdir()
        (top / "solutions" / "lab03.ipynb").write_text("the answers")
        top.chmod(0o755)
        (top / "solutions").chmod(0o755)
        (top / "solutions" / "lab03.ipynb").chmod(0o644)
        found = report(run_py(f"""
            import json, os
            try:
                text = open({str(top / "solutions" / "lab03.ipynb")!r}).read()
            except OSError as e:
                text = e.strerror
            print(json.dumps({{"top": os.listdir({str(top)!r}), "read": text,
                               "system": os.path.exists("/usr/bin") and os.path.exists("/etc/passwd")}}))
        """, tmp_path))
        assert found["top"] == [] and found["read"] != "the answers" and found["system"], found
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- network
@needs_sandbox
def test_no_network_but_a_working_loopback(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        done = run_py(f"""
            import json, socket
            out = {{}}
            for name, address in (("host loopback", ("127.0.0.1", {port})), ("outside", ("192.0.2.1", 80))):
                try:
                    socket.create_connection(address, timeout=3).close()
                    out[name] = "connected"
                except OSError as e:
                    out[name] = e.errno
            inner = socket.socket()
            inner.bind(("127.0.0.1", 0))
            inner.listen()
            socket.create_connection(inner.getsockname(), timeout=3).close()
            out["own loopback"] = "connected"
            print(json.dumps(out))
        """, tmp_path)
        out = report(done)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert out["host loopback"] == errno.ECONNREFUSED
    assert out["outside"] == errno.ENETUNREACH
    assert out["own loopback"] == "connected"  # what a Jupyter kernel's ZMQ sockets need


# -------------------------------------------------------------------------------------------------- processes
@needs_sandbox
def test_daemons_die_with_the_run(tmp_path):
    token = f"daemon-{uuid.uuid4().hex}"
    done = run_py(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {token!r}], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c",
                         "import time\\nwhile True:\\n open('beat', 'a').write('.')\\n time.sleep(0.05)", {token!r}])
            os._exit(0)
        while not os.path.exists("beat"):
            time.sleep(0.05)
        print("started")
    """, tmp_path)
    assert done.returncode == 0 and b"started" in done.stdout, done
    assert wait_until_gone(token) == []
    size = (tmp_path / "beat").stat().st_size
    time.sleep(0.3)
    assert (tmp_path / "beat").stat().st_size == size  # the heartbeat stopped


@needs_sandbox
def test_a_fork_bomb_is_bounded_and_the_run_completes(tmp_path):
    token = f"bomb-{uuid.uuid4().hex}"
    done = run_py(f"""
        import os, time
        {token!r}
        while True:
            try:
                os.fork()
            except OSError:
                open(f"full-{{os.getpid()}}", "w").close()
                time.sleep(0.05)
    """, tmp_path, timeout=6, limits=Limits(processes=64))
    assert done.timed_out and done.seconds < 15
    assert list(tmp_path.glob("full-*")), "no process ever reached the limit"
    assert wait_until_gone(token) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@needs_sandbox
def test_a_known_host_pid_cannot_be_signalled(tmp_path):
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "kernel.pid").write_text(str(decoy.pid))
        done = run_py("""
            import json, os, signal
            pid = int(open("kernel.pid").read())
            try:
                os.kill(pid, signal.SIGKILL)
                out = "sent"
            except OSError as e:
                out = e.strerror
            open("kernel.pid", "w").write(str(os.getpid()))  # a pid file the caller must not trust
            print(json.dumps(out))
        """, tmp_path)
        assert report(done) == "No such process"  # the host's pid does not exist in the sandbox's namespace
        time.sleep(0.2)
        assert decoy.poll() is None, "the decoy on the host was killed"
    finally:
        decoy.kill()
        decoy.wait()


@needs_sandbox
def test_kill_minus_one_inside_spares_the_host(tmp_path):
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        done = run_py("""
            import json, os, signal, subprocess
            child = subprocess.Popen(["sleep", "60"])
            # Only where the sandbox is certain (own pid namespace, not root): elsewhere this would kill the host.
            if os.getuid() != 0 and open("/proc/1/comm").read().strip() == "bwrap":
                os.kill(-1, signal.SIGKILL)
                print(json.dumps({"own child": child.wait()}))
        """, tmp_path)
        assert report(done) == {"own child": -signal.SIGKILL}  # it reached its own processes, and only those
        time.sleep(0.2)
        assert decoy.poll() is None
    finally:
        decoy.kill()
        decoy.wait()


@needs_sandbox
def test_the_timeout_kills_the_whole_tree(tmp_path):
    token = f"tree-{uuid.uuid4().hex}"
    done = run_py(f"""
        import subprocess, sys, time
        sleeper = [sys.executable, "-c", "import time; time.sleep(300)", {token!r}]
        subprocess.Popen(sleeper)
        subprocess.Popen(["sh", "-c", " ".join(repr(a) for a in sleeper) + " & wait"])
        subprocess.Popen(sleeper, start_new_session=True)
        print("spawned", flush=True)
        time.sleep(300)
    """, tmp_path, timeout=3)
    assert done.timed_out and done.returncode < 0 and done.seconds < 10
    assert b"spawned" in done.stdout
    assert wait_until_gone(token) == []


# ----------------------------------------------------------------------------------------------------- limits
@needs_sandbox
def test_limits_are_set_inside(tmp_path):
    limits = Limits(memory=3 << 30, processes=100, cpu_seconds=77, file_size=5 << 20)
    got = report(run_py("""
        import json, resource
        print(json.dumps({n: resource.getrlimit(getattr(resource, "RLIMIT_" + n)) for n in ("AS", "NPROC", "CPU",
                                                                                                 "FSIZE")}))
    """, tmp_path, limits=limits))
    assert got == {"AS": [3 << 30] * 2, "NPROC": [100] * 2, "CPU": [77] * 2, "FSIZE": [5 << 20] * 2}


@needs_sandbox
def test_memory_beyond_the_limit_fails_inside(tmp_path):
    done = run_py("""
        import json
        try:
            big = bytearray(1 << 30)
            out = "allocated"
        except MemoryError:
            out = "MemoryError"
        small = bytearray(64 << 20)  # the process goes on within its limit
        print(json.dumps(out))
    """, tmp_path, limits=Limits(memory=512 << 20))
    assert done.returncode == 0 and report(done) == "MemoryError"


@needs_sandbox
def test_output_beyond_the_cap_is_truncated_and_the_run_killed(tmp_path):
    done = run_py("""
        import sys
        while True:
            sys.stdout.write("x" * 4096)
    """, tmp_path, timeout=30, limits=Limits(output=64 << 10))
    assert done.truncated and not done.timed_out and done.returncode < 0
    assert len(done.stdout) + len(done.stderr) == 64 << 10
    assert done.seconds < 10


@needs_sandbox
def test_a_large_file_is_cut_at_the_file_size_limit(tmp_path):
    done = run_py("""
        import json
        try:
            with open("big.bin", "wb") as f:
                f.write(b"\\0" * (4 << 20))
            out = "written"
        except OSError as e:
            out = e.strerror
        print(json.dumps(out))
    """, tmp_path, limits=Limits(file_size=1 << 20))
    assert report(done) != "written"
    assert (tmp_path / "big.bin").stat().st_size <= 1 << 20


@needs_sandbox
def test_the_private_tmp_is_bounded(tmp_path):
    if not sandbox._knows_size(sandbox.find_bwrap()):
        pytest.skip("this bwrap cannot bound a tmpfs (--size needs bubblewrap 0.7)")
    done = run_py("""
        import json
        try:
            with open("/tmp/fill", "wb") as f:
                f.write(b"\\1" * (8 << 20))
            out = "written"
        except OSError as e:
            out = e.strerror
        print(json.dumps(out))
    """, tmp_path, limits=Limits(tmp_size=1 << 20))
    assert report(done) == os.strerror(errno.ENOSPC)


# ----------------------------------------------------------------------------------------------- the kernel
@needs_sandbox
@pytest.mark.slow
def test_a_jupyter_kernel_runs_a_notebook_inside(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, flashlab, numpy as np\n"
        f"print(int(np.arange(4).sum()), flashlab.__file__, os.path.exists({str(ROOT / 'solutions')!r}))")]
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    done = run_py("""
        import flashlab, nbclient, nbformat, numpy
        nb = nbformat.read("tiny.ipynb", as_version=4)
        nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
        print(nb.cells[0].outputs[0]["text"], end="")
    """, tmp_path, timeout=120)
    assert done.returncode == 0, done
    assert done.stdout.decode().split() == ["6", str(ROOT / "flashlab" / "__init__.py"), "False"]


@pytest.mark.gpu
@needs_sandbox
def test_gpu_devices_work_inside(tmp_path):
    done = run_py("""
        import cupy
        print(int(cupy.arange(5).sum()))
    """, tmp_path, gpu=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == [b"10"], done


# --------------------------------------------------------------------------------- without bwrap
@pytest.mark.parametrize("prlimit", [True, False], ids=["prlimit", "python-setrlimit"])
def test_without_bwrap_run_refuses_unless_allowed_and_then_flags_it(tmp_path, monkeypatch, prlimit):
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda bwrap=None: "bwrap not found")
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0]); open('out.txt', 'w').write('ok')"
    argv = [sys.executable, "-c", code]
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed"):
        sandbox.run(argv, workdir=tmp_path, timeout=30)
    if not prlimit:
        which = shutil.which
        monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "prlimit" else which(name))
    done = sandbox.run(argv, workdir=tmp_path, timeout=30, allow_unsandboxed=True, limits=Limits(file_size=3 << 20))
    assert not done.sandboxed and done.returncode == 0, done
    assert int(done.stdout) == 3 << 20
    assert (tmp_path / "out.txt").read_text() == "ok"


def test_find_bwrap_looks_on_path_first(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert sandbox.find_bwrap() == str(fake)


def _named(comm: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and pathlib.Path(f"/proc/{entry}/comm").read_text().strip() == comm:
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_unsandboxed_timeout_leaves_nothing_the_notebook_started_running(tmp_path):
    """Without the sandbox, a notebook's kernel runs in a session of its own and may start processes of its own
    (which outlive the kernel); a timeout still ends them all."""
    import nbformat

    from flashlab.grading import batch

    comm = "flk" + uuid.uuid4().hex[:12]  # the notebook's child names itself so that the test can find it
    child = f"import ctypes, time; ctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0); time.sleep(600)"
    nb = nbformat.v4.new_notebook(metadata={"flashlab": {"lab": "lab01"}})
    spawn = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])"
    nb.cells = [nbformat.v4.new_code_cell(spawn),
                nbformat.v4.new_code_cell("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                          "while True:\n    time.sleep(0.1)"),
                *(nbformat.v4.new_code_cell("while True:\n    time.sleep(0.1)") for _ in range(3))]
    path = tmp_path / "hangs.ipynb"
    nbformat.write(nb, path)
    row = batch.grade_one(path, timeout=20, sandboxed=False)  # past it, the worker is killed, not asked to stop
    assert not row["sandboxed"] and row["error"], row
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _named(comm):
        time.sleep(0.2)
    assert not _named(comm), "a process the notebook started outlived its grading"


def test_library_folders_of_the_grader_reach_the_sandbox_but_never_the_checkout(tmp_path, monkeypatch):
    from flashlab.grading import batch

    libs, checkout = tmp_path / "libs", tmp_path / "course"
    (checkout / "vendored").mkdir(parents=True)
    libs.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(libs), str(checkout), str(checkout / "vendored"), "",
                                                      str(tmp_path / "missing")]))
    found = batch.library_paths([checkout])
    assert str(libs.resolve()) in found
    assert not any(pathlib.Path(p) == checkout.resolve() or checkout.resolve() in pathlib.Path(p).parents
                   for p in found)
