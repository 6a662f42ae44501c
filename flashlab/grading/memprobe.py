"""Peak memory of a student's function, measured from outside its process (the batch grader's memory parts).

A question's memory part (:meth:`flashlab.grading.core.Trial.memory`) asks how much memory the student's function
needs at a large n. Measured inside the notebook's kernel (tracemalloc), a student could fake it. Here the grader
starts a fresh sandboxed Python that runs the notebook's code cells (``check`` cells are no-ops there, as in batch
grading), loads the question's inputs and calls the function once, and the grader itself watches that sandbox's
processes through ``/proc``: every count below is the kernel's, read by the grader, never a number the sandbox
reports.

The probe waits after each phase word until the grader has read that phase's numbers.

- **floor**: the resident memory of the sandbox once the probe has imported what it needs, before any student
  code runs (the probe says ``floor`` on its output; nothing of the student's has run yet).
- **before**: the resident memory when the probe says ``ready`` (the cells ran, the inputs are loaded); the grader
  then resets every process's high-water mark (``/proc/PID/clear_refs``).
- **peak**: from then until the probe exits, the grader samples every process of the sandbox every few
  milliseconds, summing each one's high-water mark (its resident size where the reset was refused); the peak is
  the largest sum. The function needs ``peak - before``.

What a student could try, and why it fails: lying on the output (a forged ``ready`` before the cells hold memory
only adds that memory to the call; a forged ``floor`` comes after the real one; the grader never stops watching
before the probe exits); resetting the high-water mark from inside (the samples taken while the memory was held
keep it); doing the work in a child process (every process of the sandbox is summed; its PID namespace holds them
all); holding memory before the call and releasing it inside (``before - floor`` is what the cells hold: past
:data:`MAX_HELD` the part is refused with a reason, and a memory part's inputs are chosen so that materialising
its n x m matrix costs more than ``MAX_HELD`` plus its limit). What it does not see: memory held outside
processes (files in the sandbox's tmpfs, capped by its size limits).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import sandbox
from .remote import read_message, read_untrusted, write_message

#: What the notebook's own cells may keep resident before the call (bytes above the probe's floor).
MAX_HELD = 64_000_000
#: Seconds between samples of the sandbox's memory.
SAMPLE_EVERY = 0.002
#: Seconds between rescans of the sandbox's process tree: every sample. A child that does the work and exits lives
#: a few tens of milliseconds, which a rescan every 20 ms missed on a loaded machine; a rescan reads /proc in about
#: a millisecond.
RESCAN_EVERY = SAMPLE_EVERY


def _status_kib(pid: int, keys: tuple[bytes, ...]) -> dict[bytes, int] | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in keys:
            try:
                values[key] = int(rest.split()[0])
            except (ValueError, IndexError):
                pass
    return values


def resident(pids: Sequence[int]) -> int:
    """Bytes resident in the processes ``pids`` (VmRSS from ``/proc``; processes gone count 0)."""
    total = 0
    for pid in pids:
        values = _status_kib(pid, (b"VmRSS",))
        total += (values or {}).get(b"VmRSS", 0) * 1024
    return total


def _reset_peak(pid: int) -> bool:
    """Reset the high-water mark of resident memory of ``pid`` to its current size (Linux ``clear_refs`` 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Watch:
    """Samples the peak resident memory of a process tree from outside, in a thread, until :meth:`stop`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.pids = sandbox.process_tree(root)
        # A process whose mark was reset counts by its high-water mark (nothing it held since is missed between
        # samples); one that refused the reset, and one that existed before, by its resident size when sampled.
        self.marked = {pid for pid in self.pids if _reset_peak(pid)}
        self.known = set(self.pids)
        self.peak = self._sample()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for pid in self.pids:
            values = _status_kib(pid, (b"VmRSS", b"VmHWM"))
            if not values:
                continue
            rss = values.get(b"VmRSS", 0)
            total += max(rss, values.get(b"VmHWM", 0)) if pid in self.marked else rss
        return total * 1024

    def _run(self) -> None:
        rescan = time.monotonic() + RESCAN_EVERY
        while not self._done.wait(SAMPLE_EVERY):
            if time.monotonic() >= rescan:
                self.pids = sandbox.process_tree(self.root)
                # Born after the reset: its whole life is the call's, so its high-water mark counts.
                self.marked |= {pid for pid in self.pids if pid not in self.known}
                self.known |= set(self.pids)
                rescan = time.monotonic() + RESCAN_EVERY
            self.peak = max(self.peak, self._sample())

    def stop(self) -> int:
        """Stop sampling; the peak bytes seen."""
        self._done.set()
        self._thread.join()
        return self.peak


class _Markers:
    """The probe's phase words, read from its output with a deadline. Only the first of each word counts."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.fd = proc.stdout.fileno()
        self.buffer = b""
        self.seen: set[str] = set()

    def wait_for(self, word: str, deadline: float) -> bool:
        while True:
            while b"\n" in self.buffer:
                line, _, self.buffer = self.buffer.partition(b"\n")
                self.seen.add(line.strip().decode("ascii", "replace"))
                if word in self.seen:
                    return True
            if len(self.buffer) > 4096:
                self.buffer = self.buffer[-4096:]  # not a phase word: only the probe's own short lines matter
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    return word in self.seen
                self.buffer += chunk


def _go(proc: subprocess.Popen) -> None:
    """Let the probe go on: it waits after each phase word, so that what the grader reads is that phase's."""
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    except OSError:
        pass  # the probe is gone: the next wait sees it


def measure(cells: Sequence[str], name: str, args: tuple, *, folder: pathlib.Path, timeout: float,
            **sandbox_options: Any) -> tuple[int, Any]:
    """(peak bytes the notebook function ``name`` needed on ``args``, its outputs), watched from outside one fresh
    sandboxed run of the notebook's code ``cells``. ``folder`` is a scratch folder of the grader's. Raises
    ``RuntimeError`` (with a reason for the feedback) if the run fails, runs too long, or its cells keep more
    than :data:`MAX_HELD` resident before the call."""
    requests = folder / "probe-requests"
    requests.mkdir(parents=True, exist_ok=True)
    os.chmod(requests, 0o755)
    (requests / "cells.json").write_text(json.dumps(list(cells)))
    write_message(requests, "args", tuple(args))
    sandbox_options = {**sandbox_options, "expose": [*sandbox_options.get("expose", ()), requests]}
    work = folder / "probe"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    end = time.monotonic() + max(1.0, timeout)
    cmd = [sys.executable, "-m", "flashlab.grading.memprobe", str(requests), name]
    proc, _ = sandbox.popen(cmd, workdir=work, stdin=subprocess.PIPE, **sandbox_options)
    watch = None
    try:
        markers = _Markers(proc)
        if not markers.wait_for("floor", end):
            raise RuntimeError("the memory measurement did not start (a fresh Python with the course's package)")
        floor = resident(sandbox.process_tree(proc.pid))
        _go(proc)
        if not markers.wait_for("ready", end):
            raise RuntimeError("the memory measurement did not finish (your notebook's code, run again in a fresh"
                               " process, failed or ran too long)")
        before = resident(sandbox.process_tree(proc.pid))
        watch = Watch(proc.pid)
        _go(proc)
        while not sandbox._exited(proc.pid):
            if time.monotonic() >= end:
                raise RuntimeError("the memory measurement ran too long (your function, called once on the"
                                   " large input in a fresh process)")
            time.sleep(0.01)
        peak = watch.stop()
    finally:
        if watch is not None:
            watch.stop()
        sandbox.stop(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
    held = before - floor
    if held > MAX_HELD:
        raise RuntimeError(
            f"not measured: your notebook's cells keep {held / 1e6:.0f} MB in memory before the call (at most"
            f" {MAX_HELD / 1e6:.0f} MB can be told apart from what the function needs); delete big arrays your"
            " cells keep (del name) or compute them inside a function")
    try:
        reply = read_message(work, "out")
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the memory measurement's output could not be read back: {e}"[:300]) from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise RuntimeError("your function raised or returned nothing readable when its memory was measured")
    return max(0, peak - before), reply["ok"]


def remote_peak(cells: Sequence[str], folder: pathlib.Path, deadline: Callable[[], float],
                **sandbox_options: Any) -> Callable[[str, tuple], tuple[int, Any]]:
    """A ``(name, args) -> (peak, outputs)`` measurer for :class:`flashlab.grading.remote.Session`."""
    def peak(name: str, args: tuple) -> tuple[int, Any]:
        return measure(cells, name, args, folder=folder, timeout=deadline() - time.monotonic(), **sandbox_options)

    return peak


def _strip_magics(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _probe(requests: str, name: str) -> int:
    """Runs inside the sandbox: says ``floor``, runs the notebook's cells, loads the inputs, says ``ready`` and
    calls ``name`` once. The words go to the grader on the original stdout; the cells' own output is dropped."""
    words = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    cells = json.loads(read_untrusted(pathlib.Path(requests) / "cells.json"))
    args = read_message(requests, "args")
    namespace: dict = {"__name__": "__main__"}
    print("floor", file=words, flush=True)
    sys.stdin.readline()
    for i, source in enumerate(cells):
        try:
            exec(compile(_strip_magics(source), f"<cell {i + 1}>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 -- as in the notebook: a failing cell does not stop the next
            pass
    import gc

    gc.collect()  # what the cells dropped is not what they hold
    print("ready", file=words, flush=True)
    sys.stdin.readline()
    try:
        write_message(".", "out", {"ok": namespace[name](*args)})
    except BaseException:  # noqa: BLE001
        write_message(".", "out", {"failed": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(_probe(*sys.argv[1:3]))
