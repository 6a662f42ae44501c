"""A student's Numba CUDA kernel, launched and traced in a process where nothing else of the notebook runs.

Lab 05 grades a kernel by what it does to shared memory (data races, tile shapes), which
:mod:`flashlab.racetrace` can only see in the process that runs the kernel. Traced in the notebook's own
process, a notebook could patch the tracer and report no races. So the batch grader takes the kernel's factory
(``make_kernel``) out of the notebook's source instead:

1. **here, in the grader**: :func:`extract` parses the notebook's code cells, finds the last definition of the
   factory and the module-level definitions it uses (device functions, constants), and checks that all of it is
   the language a Numba CUDA kernel is written in (:func:`check_kernel_source`): arithmetic, loops, ``cuda.*``,
   ``math.*`` and NumPy/Numba number types. No imports, no attribute of anything else, nothing starting with
   an underscore, no ``global``, no class, no assignment to an attribute. What a CUDA kernel cannot do, it may
   not do here either, so the checked code has no way to reach the tracer;
2. **in a fresh sandbox** (:class:`KernelProbe`): a Python with the course's package starts the CUDA simulator,
   runs only that checked source in a namespace holding ``cuda``, ``math``, ``np``, ``numba`` and the number
   types, and serves the grader's requests (:func:`flashlab.grading.remote.serve`): each one a traced launch of
   the kernel on inputs the grader sends. The outputs are judged by the grader, and so is the trace.

A factory that uses something outside that language is refused with a reason (:class:`KernelRejected`); the
course's own kernel (``flashlab.numba_cuda``) is outside it, so handing that in is refused too.
"""

from __future__ import annotations

import ast
import linecache
import math
import os
import pathlib
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import remote, sandbox
from .memprobe import _strip_magics

#: Names a kernel's source may use without defining them: what the probe's namespace provides...
PROVIDED = frozenset({"cuda", "math", "np", "numpy", "numba", "float64", "float32", "float16", "int32", "int64",
                      "uint32", "int8", "boolean"})
#: ...and the builtins a Numba CUDA kernel (or the Python that builds one) can use.
BUILTINS = frozenset({"range", "min", "max", "abs", "int", "float", "bool", "len", "round", "print", "enumerate",
                      "zip", "tuple", "list", "True", "False", "None", "ValueError", "TypeError", "IndexError",
                      "NotImplementedError", "AssertionError", "isinstance", "divmod", "pow", "sum", "any", "all"})
#: Attribute names a kernel's source may read: ``cuda``'s API, array and dimension fields, number types, ``math``.
ATTRIBUTES = frozenset({
    "jit", "shared", "local", "const", "array", "array_like", "syncthreads", "syncthreads_count", "syncthreads_and",
    "syncthreads_or", "syncwarp", "threadfence", "threadfence_block", "threadIdx", "blockIdx", "blockDim", "gridDim",
    "grid", "gridsize", "laneid", "warpsize", "atomic", "add", "sub", "max", "min", "exch", "cas", "shfl_sync",
    "shfl_xor_sync", "shfl_down_sync", "shfl_up_sync", "all_sync", "any_sync", "ballot_sync", "activemask",
    "fma", "x", "y", "z", "shape", "size", "ndim", "dtype", "cuda", "types",
    "float64", "float32", "float16", "int32", "int64", "uint32", "int8", "boolean", "inf", "nan",
    *(name for name in dir(math) if not name.startswith("_")),
})
#: Statements and expressions that no kernel needs and that could reach outside the checked code.
_FORBIDDEN = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef, ast.Await,
              ast.Yield, ast.YieldFrom, ast.With, ast.AsyncWith, ast.AsyncFor, ast.Try, ast.Delete,
              ast.NamedExpr)
#: Module-level imports whose names the probe's namespace already holds (the student's spelling of them).
_IMPORTS = {"math": "math", "numpy": "np", "numba": "numba", "numba.cuda": "cuda"}


class KernelRejected(Exception):
    """The factory's source uses something a Numba CUDA kernel cannot; the message says what and where."""


def _module_statements(cells: Sequence[str]) -> list[ast.stmt]:
    statements = []
    for source in cells:
        try:
            statements.extend(ast.parse(_strip_magics(source)).body)
        except SyntaxError:
            continue  # as in the notebook: a cell that does not parse defines nothing
    return statements


def _imported(stmt: ast.stmt) -> dict[str, str]:
    """What an allowed module-level import binds (the student's name -> the probe's), else {}."""
    bound = {}
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name in _IMPORTS and alias.asname in (None, _IMPORTS[alias.name], alias.name.split(".")[-1]):
                bound[alias.asname or alias.name.split(".")[0]] = _IMPORTS[alias.name]
    elif isinstance(stmt, ast.ImportFrom) and stmt.module in ("numba", "math", "numpy") and not stmt.level:
        for alias in stmt.names:
            if alias.asname in (None, alias.name) and alias.name in PROVIDED | ATTRIBUTES - {"jit"}:
                bound[alias.name] = alias.name
    return bound


def _defined(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
        return [t.id for t in stmt.targets]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
        return [stmt.target.id]
    return []


def _where(node: ast.AST) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


class _Checker(ast.NodeVisitor):
    """Finds the first construct of a definition that is not kernel language, and the module names it uses."""

    def __init__(self, name: str, module_names: set[str], course_names: set[str]) -> None:
        self.name = name
        self.module_names = module_names
        self.course_names = course_names
        self.used: set[str] = set()
        self.local: set[str] = set()

    def fail(self, node: ast.AST, what: str) -> None:
        raise KernelRejected(f"{self.name} uses {what} ({_where(node)} of its definition)")

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, _FORBIDDEN):
            kind = type(node).__name__.lower()
            self.fail(node, f"a statement a CUDA kernel cannot contain ({kind})")
        super().generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.local.add(node.name)
        args = node.args
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
            if arg is not None:
                self.local.add(arg.arg)
        for child in ast.walk(node):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                self.local.add(child.id)
            elif isinstance(child, ast.arg):
                self.local.add(child.arg)
        self.generic_visit(node)

    visit_Lambda = generic_visit

    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("_") and node.id != "_":
            self.fail(node, f"the name {node.id!r} (names starting with an underscore are not kernel code)")
        if isinstance(node.ctx, ast.Load) and node.id not in self.local:
            if node.id in self.module_names:
                self.used.add(node.id)
            elif node.id not in PROVIDED and node.id not in BUILTINS:
                hint = " — the course's own code: write the kernel yourself" if node.id in self.course_names else ""
                self.fail(node, f"{node.id!r}, which a kernel of yours cannot use{hint} (only numba.cuda, math,"
                          " NumPy/Numba number types and your own module-level functions and constants)")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not isinstance(node.ctx, ast.Load):
            self.fail(node, f"an assignment to the attribute .{node.attr}")
        if node.attr not in ATTRIBUTES:
            self.fail(node, f"the attribute .{node.attr}, which is not part of numba.cuda, math or a number type")
        self.generic_visit(node)


def check_kernel_source(stmt: ast.stmt, module_names: set[str], course_names: set[str] = frozenset()) -> set[str]:
    """Check one module-level definition (a function or a constant); the module-level names it uses.
    Raises :class:`KernelRejected` for anything that is not kernel language (naming ``course_names``, what the
    notebook imported from the course's package, as the course's own code)."""
    name = _defined(stmt)[0] if _defined(stmt) else "the definition"
    checker = _Checker(name, module_names, course_names)
    if isinstance(stmt, ast.FunctionDef):
        checker.visit_FunctionDef(stmt)
    else:
        checker.visit(stmt.value)  # type: ignore[attr-defined]
    return checker.used


def extract(cells: Sequence[str], name: str) -> str:
    """The source that defines ``name`` as the notebook finally does, with every module-level function and
    constant it uses (each the last definition before ``name``'s), checked to be kernel language. Raises
    :class:`KernelRejected` (with the reason) if it is not, or if ``name`` is not defined by a ``def``."""
    from .answers import AST_LOCK

    with AST_LOCK:  # the batch grader's threads: see answers.AST_LOCK
        return _extract(cells, name)


def _extract(cells: Sequence[str], name: str) -> str:
    statements = _module_statements(cells)
    aliases: dict[str, str] = {}
    definitions: dict[str, tuple[int, ast.stmt]] = {}
    course = {"flashlab"}
    for i, stmt in enumerate(statements):
        aliases.update(_imported(stmt))
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == "flashlab":
            course |= {alias.asname or alias.name for alias in stmt.names}
        for defined in _defined(stmt):
            definitions[defined] = (i, stmt)
            aliases.pop(defined, None)
    if name not in definitions or not isinstance(definitions[name][1], ast.FunctionDef):
        raise KernelRejected(f"{name} is not defined by a def statement in the notebook")
    module_names = set(definitions) | set(aliases)
    chosen: dict[int, ast.stmt] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current in aliases or current in PROVIDED:
            continue
        index, stmt = definitions[current]
        if index in chosen:
            continue
        chosen[index] = stmt
        for used in check_kernel_source(stmt, module_names - {current}, course):
            todo.append(used)
    renames = "".join(f"{mine} = {theirs}\n" for mine, theirs in sorted(aliases.items()) if mine != theirs)
    return renames + "\n\n".join(ast.unparse(chosen[i]) for i in sorted(chosen)) + "\n"


# ------------------------------------------------------------------------------------------- the fresh probe
class KernelProbe:
    """A fresh sandboxed Python serving traced launches of one checked kernel factory (see the module's doc).

    ``procedure(name, *args)`` runs one of :data:`flashlab.grading.remote.PROCEDURES` there, as a
    :class:`~flashlab.grading.remote.RemoteFunction` does in the notebook's kernel. ``rejected`` is the reason
    when the source was refused (then nothing is started).
    """

    runs_in_sandbox = True  # the host runs none of the student's code (answers.Guard stays unarmed)

    def __init__(self, cells: Sequence[str], name: str, folder: pathlib.Path, **sandbox_options: Any) -> None:
        self.__name__ = name
        self.rejected: str | None = None
        self.proc: subprocess.Popen | None = None
        try:
            source = extract(cells, name)
        except KernelRejected as e:
            self.rejected = str(e)
            return
        self.requests, self.replies = folder / "kernel-requests", folder / "kernel-work"
        for path in (self.requests, self.replies):
            path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.requests, 0o755)
        (self.requests / "kernel.py").write_text(source)
        package = pathlib.Path(__file__).resolve().parents[1]
        env = sandbox_options.get("env", {})
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)[1:] if p]  # libraries, not the package
        env = {**env, "PYTHONPATH": os.pathsep.join([str(package.parent), *theirs])}
        options = {**sandbox_options, "env": env,
                   "expose": [*sandbox_options.get("expose", ()), self.requests, package]}
        cmd = [sys.executable, "-m", "flashlab.grading.kernelcheck", str(self.requests), name]
        self.proc, _ = sandbox.popen(cmd, workdir=self.replies, stdin=subprocess.PIPE, **options)
        self.session = remote.Session(self._send, self.requests, self.replies)
        self.buffer = b""

    def _send(self, n: int, left: float) -> str:
        assert self.proc is not None
        try:
            self.proc.stdin.write(f"{n}\n".encode())
            self.proc.stdin.flush()
        except OSError:
            return "dead"
        end = time.monotonic() + left
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.buffer:
                line, _, self.buffer = self.buffer.partition(b"\n")
                if line.strip() == f"done {n}".encode():
                    return "done"
            self.buffer = self.buffer[-4096:]
            wait = end - time.monotonic()
            if wait <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(wait, 1.0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return "dead"
                self.buffer += chunk

    def procedure(self, procedure: str, *args: Any) -> Any:
        if self.rejected:
            raise KernelRejected(self.rejected)
        req = {"op": "procedure", "procedure": procedure, "name": self.__name__, "args": list(args)}
        return self.session.result(req)["ok"]

    def close(self) -> None:
        if self.proc is not None:
            sandbox.stop(self.proc)
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None

    def __repr__(self) -> str:
        return f"<{self.__name__} from your notebook, run apart>"


def _serve(requests: str, name: str) -> int:
    """Runs in the fresh sandbox: the checked source in the provided namespace, then one request per stdin line."""
    from .. import numba_cuda

    numba_cuda.use_simulator()
    import numba
    import numpy as np
    from numba import cuda

    words = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    namespace: dict[str, Any] = {"cuda": cuda, "math": math, "np": np, "numpy": np, "numba": numba}
    for type_name in PROVIDED - {"cuda", "math", "np", "numpy", "numba"}:
        if hasattr(numba, type_name):
            namespace[type_name] = getattr(numba, type_name)
    source = remote.read_untrusted(pathlib.Path(requests) / "kernel.py").decode()
    filename = f"<your {name}>"
    # The race report quotes the kernel's lines and names its arrays from them (flashlab.racetrace).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    for line in sys.stdin:
        try:
            n = int(line)
        except ValueError:
            continue
        remote.serve(namespace, requests, ".", n)
        print(f"done {n}", file=words, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve(*sys.argv[1:3]))
