"""Peak memory of a student's function, measured from outside its process (the batch grader's memory parts).

A question's memory part (:meth:`flashlab.grading.core.Trial.memory`) asks how much memory the student's function
needs at a large n. Measured inside the notebook's kernel (tracemalloc), a student could fake it. Here the grader
starts a fresh sandboxed Python that runs the notebook's code cells (``check`` cells are no-ops there, as in batch
grading), loads the question's inputs and calls the function once; the kernel's own accounting gives the peak
resident memory of that process (``os.wait4``'s ``ru_maxrss``), counted from just before the call (the probe
resets the process's high-water mark after the notebook's cells ran). A second, identical run that only loads the
inputs is the baseline; the difference is the function's peak. The grader keeps the threshold.

The count is the kernel's, read by the probe's parent, a process of the sandbox that runs none of the student's
code (the outermost bubblewrap process does not reap the command itself, so the grader cannot read it directly).
Both run as the same uid in the sandbox, and the reset happens in the probe: a determined student could reset the
high-water mark again (``/proc/self/clear_refs``) or interfere with the parent, and so hide memory; honest
submissions are measured without tracemalloc's view of their process.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import sandbox
from .remote import read_message, read_untrusted, write_message


def _max_rss(argv: Sequence[str], *, workdir: pathlib.Path, timeout: float, **sandbox_options: Any) -> int | None:
    """Peak resident bytes of the probe process of one sandboxed run of ``argv``; None if it did not finish."""
    done = sandbox.run(argv, workdir=workdir, timeout=timeout, **sandbox_options)
    lines = done.stdout.decode("ascii", "replace").split()
    if done.timed_out or done.returncode != 0 or len(lines) != 3 or lines[0] != "maxrss":
        return None
    try:
        kib, status = int(lines[1]), int(lines[2])
    except ValueError:
        return None
    return kib * 1024 if status == 0 and kib >= 0 else None


def measure(cells: Sequence[str], name: str, args: tuple, *, folder: pathlib.Path, timeout: float,
            **sandbox_options: Any) -> tuple[int, Any]:
    """(peak bytes the notebook function ``name`` needed on ``args``, its outputs), from two fresh sandboxed runs
    of the notebook's code ``cells``: one calling it, one only loading the inputs. ``folder`` is a scratch folder
    of the grader's. Raises ``RuntimeError`` (with a reason for the feedback) if a run fails or runs too long."""
    requests = folder / "probe-requests"
    requests.mkdir(parents=True, exist_ok=True)
    os.chmod(requests, 0o755)
    (requests / "cells.json").write_text(json.dumps(list(cells)))
    write_message(requests, "args", tuple(args))
    sandbox_options = {**sandbox_options, "expose": [*sandbox_options.get("expose", ()), requests]}
    peaks = {}
    end = time.monotonic() + timeout
    out: Any = None
    for mode in ("baseline", "call"):
        work = folder / f"probe-{mode}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        cmd = [sys.executable, "-m", "flashlab.grading.memprobe", str(requests), name, mode]
        peak = _max_rss(cmd, workdir=work, timeout=max(1.0, end - time.monotonic()), **sandbox_options)
        if peak is None:
            raise RuntimeError("the memory measurement did not finish (your notebook's code, run again in a fresh"
                               " process, failed or ran too long)")
        peaks[mode] = peak
        if mode == "call":
            try:
                reply = read_message(work, "out")
            except (OSError, ValueError) as e:
                raise RuntimeError(f"the memory measurement's output could not be read back: {e}"[:300]) from None
            out = reply.get("ok") if isinstance(reply, dict) else None
            if not isinstance(reply, dict) or "ok" not in reply:
                raise RuntimeError("your function raised or returned nothing readable when its memory was measured")
    return max(0, peaks["call"] - peaks["baseline"]), out


def remote_peak(cells: Sequence[str], folder: pathlib.Path, deadline: Callable[[], float],
                **sandbox_options: Any) -> Callable[[str, tuple], tuple[int, Any]]:
    """A ``(name, args) -> (peak, outputs)`` measurer for :class:`flashlab.grading.remote.Session`."""
    def peak(name: str, args: tuple) -> tuple[int, Any]:
        return measure(cells, name, args, folder=folder, timeout=deadline() - time.monotonic(), **sandbox_options)

    return peak


def _strip_magics(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _reset_peak() -> None:
    """Start the process's peak-RSS count afresh: what the notebook's own cells used must not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets the high-water mark of resident memory to the current size
    except OSError:
        pass


def _probe(requests: str, name: str, mode: str) -> int:
    """Runs inside the sandbox: the notebook's cells, then (``mode == "call"``) one call of ``name``."""
    cells = json.loads(read_untrusted(pathlib.Path(requests) / "cells.json"))
    namespace: dict = {"__name__": "__main__"}
    for i, source in enumerate(cells):
        try:
            exec(compile(_strip_magics(source), f"<cell {i + 1}>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 -- as in the notebook: a failing cell does not stop the next
            pass
    args = read_message(requests, "args")
    _reset_peak()
    if mode == "call":
        try:
            write_message(".", "out", {"ok": namespace[name](*args)})
        except BaseException:  # noqa: BLE001
            write_message(".", "out", {"failed": True})
    return 0


def _measure(requests: str, name: str, mode: str) -> int:
    """Runs inside the sandbox: the probe in a child process; prints its peak RSS (KiB) from ``os.wait4``."""
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open(os.devnull, os.O_WRONLY)  # only this parent writes to the grader's pipe
            os.dup2(null, 1)
            os.dup2(null, 2)
            _probe(requests, name, mode)
        finally:
            os._exit(0)
    _, status, usage = os.wait4(pid, 0)
    print(f"maxrss {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_measure(*sys.argv[1:4]))
