"""Judging a notebook from outside its process: proxies of its functions, a wire format, untrusted replies.

The batch grader (:mod:`flashlab.grading.batch`) runs a submission's notebook in a sandboxed kernel and then runs
every question in its own process, on :class:`RemoteFunction` proxies of the notebook's functions. Calling a
proxy writes a request (:func:`write_message`: a JSON structure plus an ``.npz`` of its arrays; numbers,
strings, bools, None, NumPy arrays and tuples/lists/dicts of them; never a pickle) into a folder the sandbox can
only read; the worker inside has the kernel run :func:`serve`, which calls the student's function and writes
the reply into the sandbox's own folder; the host reads it with :func:`read_message`.

Everything under a sandbox's writable folder was written by code the grader does not trust: a file there may be a
symbolic link (to a secret of the host), a FIFO (which blocks a reader forever), a device, a zip archive that
unpacks to gigabytes, or simply a forged reply. :func:`read_untrusted` reads one file safely and
:func:`read_message` checks every node; a bad reply fails that one call with :class:`WireError`. The student's
exceptions come back as (type name, message, where) and are raised again on the host (:func:`remote_exception`).
"""

from __future__ import annotations

import builtins
import importlib
import io
import itertools
import json
import os
import pathlib
import re
import stat
import time
import traceback
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

#: Bytes read back from one file written in a sandbox unless the caller says otherwise.
DEFAULT_CAP = 64 << 20


class UntrustedFileError(OSError):
    """A file written in the sandbox is not a regular file of acceptable size."""


def read_untrusted(path: str | os.PathLike, cap: int = DEFAULT_CAP) -> bytes:
    """The bytes of ``path``, a regular file of at most ``cap`` bytes, opened without following a symbolic link.

    Raises :class:`UntrustedFileError` (an ``OSError``) for a link, FIFO, device, folder or a file too large,
    and ``OSError`` if it cannot be opened.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise UntrustedFileError(e.errno, f"cannot open {os.fspath(path)!r} safely: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFileError(f"{os.fspath(path)!r} is not a regular file")
        if info.st_size > cap:
            raise UntrustedFileError(f"{os.fspath(path)!r} has {info.st_size} bytes, more than {cap}")
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:  # it grew after fstat
                raise UntrustedFileError(f"{os.fspath(path)!r} has more than {cap} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ wire format
# A message is a JSON structure plus an .npz of the arrays it refers to. Values: None, bools, ints, floats
# (nan and inf included), strings, NumPy arrays and scalars (numbers only), and tuples, lists and dicts with
# string keys of those. Nothing is ever unpickled.
MAX_DEPTH = 32
MAX_NODES = 200_000
MAX_ARRAYS = 20_000


class WireError(ValueError):
    """A value cannot be sent, or a message read back is malformed."""

    where = "while passing values between the grader and your notebook"  # shown instead of a grader's line


def encode(obj: Any, arrays: dict[str, np.ndarray], depth: int = 0) -> Any:
    """The JSON structure of ``obj``; arrays it holds are added to ``arrays`` (name -> array)."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    if obj is None or isinstance(obj, (bool, str)):
        return {"t": type(obj).__name__ if obj is not None else "none", "v": obj}
    if isinstance(obj, int):
        return {"t": "int", "v": int(obj)}
    if isinstance(obj, float):
        return {"t": "float", "v": float(obj)}
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc":
            raise WireError(f"an array of dtype {arr.dtype} (only numbers are sent)")
        if len(arrays) >= MAX_ARRAYS:
            raise WireError("too many arrays")
        name = f"a{len(arrays)}"
        arrays[name] = np.ascontiguousarray(arr)
        return {"t": "nd" if isinstance(obj, np.ndarray) else "scalar", "v": name}
    if isinstance(obj, (tuple, list)):
        return {"t": type(obj).__name__, "v": [encode(x, arrays, depth + 1) for x in obj]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise WireError("a dict with keys that are not strings")
        return {"t": "dict", "v": [[k, encode(v, arrays, depth + 1)] for k, v in obj.items()]}
    raise WireError(f"a value of type {type(obj).__name__}")


def decode(node: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The value a structure from :func:`encode` describes (raises :class:`WireError` if it is malformed)."""
    count = [0]

    def walk(node: Any, depth: int) -> Any:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise WireError("message too deep or too large")
        if not isinstance(node, dict) or set(node) != {"t", "v"}:
            raise WireError("malformed node")
        kind, value = node["t"], node["v"]
        plain = {"none": type(None), "bool": bool, "str": str, "float": (float, int)}
        if kind in plain and isinstance(value, plain[kind]) and not (kind == "float" and isinstance(value, bool)):
            return float(value) if kind == "float" else value
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in ("nd", "scalar") and isinstance(value, str) and value in arrays:
            arr = arrays[value]
            return arr if kind == "nd" else arr[()]
        if kind in ("tuple", "list") and isinstance(value, list):
            items = [walk(x, depth + 1) for x in value]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict" and isinstance(value, list):
            out = {}
            for pair in value:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise WireError("malformed dict")
                out[pair[0]] = walk(pair[1], depth + 1)
            return out
        raise WireError(f"malformed node of kind {str(kind)[:20]!r}")

    return walk(node, 0)


def write_message(folder: str | os.PathLike, stem: str, obj: Any) -> None:
    """Write ``obj`` as ``stem.json`` (+ ``stem.npz`` when it holds arrays) in ``folder``."""
    arrays: dict[str, np.ndarray] = {}
    structure = encode(obj, arrays)
    folder = pathlib.Path(folder)
    if arrays:
        with open(folder / f"{stem}.npz.part", "wb") as f:
            np.savez(f, **arrays)
        os.replace(folder / f"{stem}.npz.part", folder / f"{stem}.npz")
    (folder / f"{stem}.json.part").write_text(json.dumps({"value": structure, "arrays": sorted(arrays)}))
    os.replace(folder / f"{stem}.json.part", folder / f"{stem}.json")


def _load_arrays(data: bytes, names: list[str], cap: int) -> dict[str, np.ndarray]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            if len(infos) > MAX_ARRAYS or sum(i.file_size for i in infos) > cap:
                raise WireError("the arrays are too large")  # a small compressed file can unpack to gigabytes
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                if sorted(npz.files) != sorted(names):
                    raise WireError("the arrays do not match the message")
                return {name: npz[name] for name in names}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"unreadable arrays: {type(e).__name__}: {e}"[:200]) from None


def read_message(folder: str | os.PathLike, stem: str, cap: int = DEFAULT_CAP) -> Any:
    """The value :func:`write_message` wrote, read as untrusted data (raises :class:`WireError` or ``OSError``)."""
    folder = pathlib.Path(folder)
    try:
        head = json.loads(read_untrusted(folder / f"{stem}.json", 1 << 24).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"malformed message: {e}"[:200]) from None
    if not isinstance(head, dict) or not isinstance(head.get("arrays"), list) or "value" not in head:
        raise WireError("malformed message")
    names = head["arrays"]
    if not all(isinstance(n, str) for n in names) or len(names) > MAX_ARRAYS:
        raise WireError("malformed message")
    arrays = _load_arrays(read_untrusted(folder / f"{stem}.npz", cap), names, cap) if names else {}
    return decode(head["value"], arrays)


# --------------------------------------------------------------------------------- inside: serving the calls
#: Functions a request may run inside the sandbox on a student's object (module:function); nothing else can be named.
PROCEDURES = frozenset({"flashlab.grading.lab05:traced_launch", "flashlab.grading.lab05:launch_with_package_kernel",
                        "flashlab.grading.lab05:simulator_state"})


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return f"at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""


def serve(namespace: Mapping[str, Any], requests: str, replies: str, request_id: int) -> None:
    """Answer request ``request_id`` (runs inside the sandbox, in the notebook's kernel): read it from the
    ``requests`` folder, run it on the notebook's objects in ``namespace``, write the reply to ``replies``.

    Requests: ``describe`` (which of ``names`` are defined, callable or values), ``value`` (an object's value),
    ``call`` (the function ``name`` on ``args``/``kwargs``), ``peak`` (a call under tracemalloc, with its peak),
    ``procedure`` (one of :data:`PROCEDURES` on the object ``name``). Exceptions come back as (type name,
    message, where), outputs that cannot be sent as (type name, repr).
    """
    reply: dict[str, Any]
    try:
        req = read_message(requests, f"req{request_id}")
        op = req["op"]
        if op == "describe":
            reply = {"ok": {n: "missing" if namespace.get(n) is None else
                            "callable" if callable(namespace[n]) else "value" for n in req["names"]}}
        elif op == "value":
            reply = {"ok": namespace.get(req["name"])}
        elif op in ("call", "peak"):
            fn = namespace[req["name"]]
            if op == "peak":
                from ..measure import peak_memory

                peak, out = peak_memory(fn, *req["args"], **req["kwargs"])
                reply = {"ok": out, "peak": int(peak)}
            else:
                reply = {"ok": fn(*req["args"], **req["kwargs"])}
        elif op == "procedure" and req["procedure"] in PROCEDURES:
            module, name = req["procedure"].split(":")
            proc = getattr(importlib.import_module(module), name)
            reply = {"ok": proc(namespace[req["name"]], *req["args"])}
        else:
            reply = {"error": ["ValueError", f"unknown request {op!r}", ""]}
    except BaseException as e:  # noqa: BLE001 -- the student's code may raise anything, even SystemExit
        reply = {"error": [type(e).__name__, str(e)[:1000], _where(e)]}
    try:
        write_message(replies, f"resp{request_id}", reply)
    except WireError:
        out = reply.get("ok")
        write_message(replies, f"resp{request_id}", {"unsendable": [type(out).__name__, repr(out)[:300]]})


# ------------------------------------------------------------------------------------ outside: the proxies
class RemoteError(Exception):
    """Base of the exceptions re-raised on the host for a student's exception whose type is not a builtin."""

    where = ""


class KernelGone(Exception):
    """The notebook's kernel died or stopped answering; every later call fails with this."""

    where = "did your code call exit(), crash the kernel or use all the memory?"


class Opaque:
    """Stands for a value the student's function returned that cannot be sent (its type name and repr)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _named(base: type, name: str) -> type:
    clean = "".join(c for c in name if c.isalnum() or c == "_")[:60] or "Error"
    if clean[0].isdigit():
        clean = "_" + clean
    return type(clean, (base,), {})


def remote_exception(name: str, message: str, where: str = "") -> Exception:
    """The exception to raise on the host for one the student's code raised inside: a builtin keeps its type
    (so that ``except ValueError`` in a question still applies), others get a class of the same name."""
    if name == "AnswerCalled":  # the sandbox's package copy has no answer code, only this raise naming it
        called = re.match(r"calls (\S+) ", message)
        if called:
            from .answers import AnswerCalled  # here: answers imports core, which imports this module

            e = AnswerCalled(called.group(1))
            e.where = where  # type: ignore[attr-defined]
            return e  # type: ignore[return-value]
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin.__module__ == "builtins":
        try:
            e = builtin(message)
        except Exception:
            e = _named(RemoteError, name)(message)
    else:
        e = _named(RemoteError, name)(message)
    e.where = where  # type: ignore[attr-defined]
    return e


class Session:
    """The host's end of a served notebook: sends requests, waits for each answer, reads it as untrusted data.

    ``send(request_id, timeout)`` passes a request to the sandboxed worker and returns its answer line (or raises
    :class:`KernelGone`); requests are written to ``requests`` (a folder only the host can write), replies read
    from ``replies`` (the sandbox's writable folder). ``deadline`` (``time.monotonic()``) bounds every call of
    the current question: past it a call raises :class:`~flashlab.grading.core.QuestionTimeout`.
    """

    def __init__(self, send: Callable[[int, float], str], requests: pathlib.Path, replies: pathlib.Path) -> None:
        self._send = send
        self.requests, self.replies = requests, replies
        self.deadline = float("inf")
        self.gone: str | None = None
        #: ``(name, args) -> (peak bytes, outputs)`` measuring from outside (:mod:`flashlab.grading.memprobe`);
        #: None: the peak is measured inside, around the call.
        self.measure_memory: Callable[[str, tuple], tuple[int, Any]] | None = None
        self._ids = itertools.count()

    def request(self, req: dict) -> dict:
        from .core import QuestionTimeout

        if self.gone:
            raise KernelGone(self.gone)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise QuestionTimeout()
        n = next(self._ids)
        write_message(self.requests, f"req{n}", req)
        answer = self._send(n, left)
        if answer == "timeout":
            raise QuestionTimeout()
        if answer != "done":
            self.gone = "the notebook's kernel died or stopped answering while running your code"
            raise KernelGone(self.gone)
        try:
            reply = read_message(self.replies, f"resp{n}")
        except (OSError, WireError) as e:
            raise WireError(f"your function's answer could not be read back: {e}"[:300]) from None
        if not isinstance(reply, dict):
            raise WireError("your function's answer could not be read back")
        return reply

    def result(self, req: dict) -> Any:
        reply = self.request(req)
        if "ok" in reply:
            return reply
        if "unsendable" in reply and _strings(reply["unsendable"], 2):
            name, text = reply["unsendable"]
            return {"ok": _named(Opaque, name)(text)}
        if "error" in reply and _strings(reply["error"], 3):
            raise remote_exception(*reply["error"])
        raise WireError("your function's answer could not be read back (malformed reply)")

    def describe(self, names: Sequence[str]) -> dict[str, str]:
        kinds = self.result({"op": "describe", "names": list(names)})["ok"]
        if not isinstance(kinds, dict):
            raise WireError("malformed reply")
        return {n: kinds.get(n) if kinds.get(n) in ("missing", "callable", "value") else "missing" for n in names}

    def value(self, name: str) -> Any:
        return self.result({"op": "value", "name": name})["ok"]


def _strings(x: Any, n: int) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == n and all(isinstance(v, str) for v in x)


class RemoteFunction:
    """Stands on the host for the notebook's function ``name``: calling it runs the student's function inside
    the sandbox on the (sent) arguments and returns its (received) outputs."""

    runs_in_sandbox = True  # the host runs none of the student's code (answers.Guard stays unarmed)

    def __init__(self, session: Session, name: str) -> None:
        self.session, self.__name__ = session, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.session.result({"op": "call", "name": self.__name__, "args": list(args), "kwargs": kwargs})["ok"]

    def peak_memory(self, *args: Any) -> tuple[int, Any]:
        """(peak bytes the call needed, its outputs): measured from outside when the session can, else inside."""
        if self.session.measure_memory is not None:
            from .core import QuestionTimeout

            if self.session.deadline <= time.monotonic():
                raise QuestionTimeout()
            return self.session.measure_memory(self.__name__, tuple(args))
        reply = self.session.result({"op": "peak", "name": self.__name__, "args": list(args), "kwargs": {}})
        peak = reply.get("peak")
        if not isinstance(peak, int) or isinstance(peak, bool) or peak < 0:
            raise WireError("malformed peak memory in the reply")
        return peak, reply["ok"]

    def procedure(self, procedure: str, *args: Any) -> Any:
        """Run ``procedure`` (one of :data:`PROCEDURES`) inside, on this object and ``args``."""
        req = {"op": "procedure", "procedure": procedure, "name": self.__name__, "args": list(args)}
        return self.session.result(req)["ok"]

    def __repr__(self) -> str:
        return f"<notebook function {self.__name__}>"
