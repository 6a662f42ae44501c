"""Judging outside the submission's process: the wire format, untrusted replies, and proxies of notebook objects."""

from __future__ import annotations

import io
import os
import pathlib
import zipfile

import numpy as np
import pytest

from flashlab import reference
from flashlab.grading import answers, lab02, remote, run_question
from flashlab.grading.core import QuestionTimeout


# ------------------------------------------------------------------------------------------------ wire format
def test_values_survive_the_wire(tmp_path):
    value = {
        "arrays": (np.arange(6.0).reshape(2, 3), np.array([1, 2], dtype=np.int32), np.array([True, False])),
        "numbers": [1, -2**70, 0.5, float("nan"), float("-inf"), np.float32(2.5), True, None],
        "text": "ünïcode",
        "empty": (np.zeros((0, 4)), [], ()),
    }
    remote.write_message(tmp_path, "m", value)
    back = remote.read_message(tmp_path, "m")
    assert set(back) == set(value)
    a, i, b = back["arrays"]
    assert isinstance(back["arrays"], tuple) and a.shape == (2, 3) and i.dtype == np.int32 and b.dtype == bool
    np.testing.assert_array_equal(a, value["arrays"][0])
    nums = back["numbers"]
    assert isinstance(nums, list) and nums[:3] == [1, -2**70, 0.5] and np.isnan(nums[3]) and nums[4] == -np.inf
    assert nums[5] == np.float32(2.5) and nums[5].dtype == np.float32 and nums[6] is True and nums[7] is None
    assert back["text"] == "ünïcode" and back["empty"][0].shape == (0, 4) and back["empty"][1:] == ([], ())


@pytest.mark.parametrize("value", [np.array([object()], dtype=object), {1: 2}, {3}, print, np.array(["a"])])
def test_what_cannot_be_sent_is_refused(tmp_path, value):
    with pytest.raises(remote.WireError):
        remote.write_message(tmp_path, "m", value)


def _write(tmp_path, head: str, npz: bytes | None = None):
    (tmp_path / "m.json").write_text(head)
    if npz is not None:
        (tmp_path / "m.npz").write_bytes(npz)


@pytest.mark.parametrize("head", ['{"value": {"t": "nd", "v": "a0"}, "arrays": []}', "[1, 2]", "not json",
                                  '{"value": {"t": "tuple", "v": 3}, "arrays": []}',
                                  '{"value": {"t": "float", "v": "1"}, "arrays": []}'])
def test_malformed_messages_are_refused(tmp_path, head):
    _write(tmp_path, head)
    with pytest.raises(remote.WireError):
        remote.read_message(tmp_path, "m")


def test_pickles_are_never_loaded(tmp_path):
    buf = io.BytesIO()
    np.savez(buf, a0=np.array([{"x": 1}], dtype=object))  # an object array is stored as a pickle
    _write(tmp_path, '{"value": {"t": "nd", "v": "a0"}, "arrays": ["a0"]}', buf.getvalue())
    with pytest.raises(remote.WireError):
        remote.read_message(tmp_path, "m")


def test_a_small_archive_that_unpacks_to_gigabytes_is_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a0.npy", b"\0" * (80 << 20))  # compresses to ~80 KB
    _write(tmp_path, '{"value": {"t": "nd", "v": "a0"}, "arrays": ["a0"]}', buf.getvalue())
    assert (tmp_path / "m.npz").stat().st_size < 1 << 20
    with pytest.raises(remote.WireError, match="too large"):
        remote.read_message(tmp_path, "m", cap=64 << 20)


def test_links_fifos_and_huge_files_are_not_read(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"value": {"t": "str", "v": "secret"}, "arrays": []}')
    (tmp_path / "link.json").symlink_to(secret)
    with pytest.raises(remote.UntrustedFileError):
        remote.read_message(tmp_path, "link")
    os.mkfifo(tmp_path / "fifo.json")  # a reader that opened it normally would wait forever
    with pytest.raises(remote.UntrustedFileError, match="not a regular file"):
        remote.read_untrusted(tmp_path / "fifo.json")
    (tmp_path / "big").write_bytes(b"x" * 1001)
    with pytest.raises(remote.UntrustedFileError, match="more than 1000"):
        remote.read_untrusted(tmp_path / "big", cap=1000)


# ------------------------------------------------------------------------------------------------- proxies
def _session(tmp_path: pathlib.Path, namespace: dict) -> remote.Session:
    """A session whose 'sandbox' is this process: each request is served at once from ``namespace``."""
    requests, replies = tmp_path / "requests", tmp_path / "replies"
    requests.mkdir()
    replies.mkdir()

    def send(n: int, left: float) -> str:
        remote.serve(namespace, str(requests), str(replies), n)
        return "done"

    return remote.Session(send, requests, replies)


class ShapeError(Exception):
    pass


def test_calls_values_and_exceptions_come_back(tmp_path):
    def add(a, b=1):
        return a + b, [a]

    def bad_value(x):
        raise ValueError(f"bad {x}")

    def custom(x):
        raise ShapeError("no")

    def stub(x):
        raise NotImplementedError("write it")

    ns = {"add": add, "bad_value": bad_value, "custom": custom, "stub": stub, "KERNEL": "__global__ void k() {}",
          "opaque": lambda: object()}
    s = _session(tmp_path, ns)
    assert s.describe(["add", "KERNEL", "nothing"]) == {"add": "callable", "KERNEL": "value", "nothing": "missing"}
    assert s.value("KERNEL") == ns["KERNEL"]
    out, rest = remote.RemoteFunction(s, "add")(np.arange(3.0), b=2)
    np.testing.assert_array_equal(out, [2.0, 3.0, 4.0])
    assert isinstance(rest, list) and rest[0].shape == (3,)
    with pytest.raises(ValueError, match="bad 3") as e:
        remote.RemoteFunction(s, "bad_value")(3)
    assert "raise ValueError" in e.value.where  # where it was raised, in the student's code
    with pytest.raises(remote.RemoteError) as e:
        remote.RemoteFunction(s, "custom")(1)
    assert type(e.value).__name__ == "ShapeError" and str(e.value) == "no"
    with pytest.raises(NotImplementedError):
        remote.RemoteFunction(s, "stub")(1)
    got = remote.RemoteFunction(s, "opaque")()
    assert type(got).__name__ == "object" and "object at" in repr(got)


def test_questions_judge_proxies_like_the_functions_themselves(tmp_path):
    def naive(Q, K, V, block_q, block_k):
        return reference.attention(Q, K, V)  # right, but builds the whole n x m matrix

    ns = {"right": lab02._switch(), "naive": naive, "wrong": lab02._switch(rescale=False)}
    s = _session(tmp_path, ns)
    with answers.trusted():  # these stand-ins reuse the course's answers, which a student may not call
        for name in ("right", "naive", "wrong"):
            here = run_question("lab02", "q2", [ns[name]], seed=5)
            there = run_question("lab02", "q2", [remote.RemoteFunction(s, name)], seed=5)
            assert (there.score, there.feedback.splitlines()[0]) == (here.score, here.feedback.splitlines()[0])
            assert (there.score == there.max_score) is (name == "right")
        naive_there = run_question("lab02", "q2", [remote.RemoteFunction(s, "naive")], seed=5)
    assert naive_there.score == 3 and "peak memory" in naive_there.feedback  # measured where the function ran


def test_a_call_past_the_question_deadline_times_out(tmp_path):
    s = _session(tmp_path, {"f": lambda: 1})
    s.deadline = 0.0
    with pytest.raises(QuestionTimeout):
        remote.RemoteFunction(s, "f")()


def test_a_kernel_that_stops_answering_fails_every_later_call(tmp_path):
    answers = iter(["dead"])
    s = remote.Session(lambda n, left: next(answers), tmp_path, tmp_path)
    for _ in range(2):
        with pytest.raises(remote.KernelGone):
            remote.RemoteFunction(s, "f")(1)


def test_a_forged_reply_fails_that_call_only(tmp_path):
    requests, replies = tmp_path / "rq", tmp_path / "rp"
    requests.mkdir()
    replies.mkdir()

    def send(n: int, left: float) -> str:
        (replies / f"resp{n}.json").write_text('{"value": {"t": "dict", "v": [["ok", {"t": "nd", "v": "zz"}]]},'
                                               ' "arrays": []}')
        return "done"

    s = remote.Session(send, requests, replies)
    with pytest.raises(remote.WireError, match="could not be read back"):
        remote.RemoteFunction(s, "f")(1)


# ---------------------------------------------------------------------------------- memory, from outside
PROBE_CELLS = [
    "import numpy as np\nfrom flashlab.grading import lab\ncheck = lab('lab02')",
    "demo = np.ones((3000, 3000))  # the notebook's own 72 MB demo must not count\ndel demo",
    "def whole(n):\n    a = np.ones((n, n))\n    return float(a.sum())",
    "def streamed(n):\n    return float(sum(np.ones(n).sum() for _ in range(n)))",
    "check('q2', whole)",
]


def test_peak_memory_is_measured_in_a_fresh_process_from_outside(tmp_path):
    from flashlab.grading import memprobe

    options = _probe_options()
    whole, out = memprobe.measure(PROBE_CELLS, "whole", (1000,), folder=tmp_path, timeout=120, **options)
    assert out == 1e6 and whole > 6e6  # an n x n float64 array is 8 MB
    streamed, out = memprobe.measure(PROBE_CELLS, "streamed", (1000,), folder=tmp_path, timeout=120, **options)
    assert out == 1e6 and streamed < 2e6


# A cheat's function builds the n x n matrix (134 MB at n = 4096) and tries to hide it from the measurement.
_SQUARE = "def square(n):\n    a = np.ones((n, n))\n    return float(a.sum())\n"
MEMORY_CHEATS = {
    "resets the high-water mark after the work": [
        "import numpy as np",
        "def square(n):\n    a = np.ones((n, n))\n    s = float(a.sum())\n    del a\n"
        "    open('/proc/self/clear_refs', 'w').write('5')\n    return s\n",
    ],
    "does the work in a child process": [
        "import numpy as np, os",
        "def square(n):\n    r, w = os.pipe()\n    if os.fork() == 0:\n"
        "        os.write(w, str(float(np.ones((n, n)).sum())).encode())\n        os._exit(0)\n"
        "    os.close(w)\n    s = float(os.read(r, 100))\n    os.wait()\n    return s\n",
    ],
    "holds memory before the call and frees it inside": [
        "import numpy as np\n_hold = np.ones((4200, 4200))",
        "def square(n):\n    global _hold\n    _hold = None\n    a = np.ones((n, n))\n    return float(a.sum())\n",
    ],
    "forges the probe's words, then holds memory": [
        "import numpy as np, os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n"
        "        os.write(fd, b'floor\\nready\\n')\n    except OSError:\n        pass\n"
        "import time; time.sleep(0.3)\n_hold = np.ones((4200, 4200))",
        "def square(n):\n    global _hold\n    _hold = None\n    a = np.ones((n, n))\n    return float(a.sum())\n",
    ],
    "makes itself undumpable so that the grader cannot reset its mark": [
        "import numpy as np, ctypes\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)",
        "def square(n):\n    a = np.ones((n, n))\n    s = float(a.sum())\n    del a\n"
        "    try:\n        open('/proc/self/clear_refs', 'w').write('5')\n    except OSError:\n        pass\n"
        "    return s\n",
    ],
}


def _probe_options():
    from flashlab.grading import sandbox

    root = pathlib.Path(__file__).resolve().parents[1]
    # The package is shown to the sandbox explicitly: a checkout under /tmp lies in the sandbox's private /tmp.
    return {"allow_unsandboxed": sandbox.sandbox_problem() is not None, "expose": [root / "flashlab"],
            "env": {"FLASHLAB_BATCH_GRADING": "1", "PYTHONPATH": str(root)}}


@pytest.mark.parametrize("cheat", sorted(MEMORY_CHEATS))
def test_memory_cheats_are_measured_or_refused(tmp_path, cheat):
    from flashlab.grading import memprobe

    n = 4096
    try:
        peak, out = memprobe.measure(MEMORY_CHEATS[cheat], "square", (n,), folder=tmp_path, timeout=120,
                                     **_probe_options())
    except RuntimeError as e:
        assert "keep" in str(e) and "MB in memory before the call" in str(e), e  # refused, with the reason
    else:
        assert out == n * n and peak >= 0.9 * n * n * 8, f"{cheat}: measured {peak / 1e6:.1f} MB"


def test_an_honest_function_is_measured_the_same_beside_big_transient_cells(tmp_path):
    from flashlab.grading import memprobe

    cells = ["import numpy as np", "demo = np.ones((6000, 6000)); del demo  # 288 MB, gone before the call",
             _SQUARE, "def streamed(n):\n    return float(sum(np.ones(n).sum() for _ in range(n)))"]
    streamed, out = memprobe.measure(cells, "streamed", (4096,), folder=tmp_path, timeout=120, **_probe_options())
    assert out == 4096 * 4096 and streamed < 2e6
    whole, out = memprobe.measure(cells, "square", (4096,), folder=tmp_path, timeout=120, **_probe_options())
    assert out == 4096 * 4096 and 0.9 * 4096**2 * 8 <= whole <= 1.2 * 4096**2 * 8
