"""Lab 05's kernel factory judged apart: its source taken out of the notebook, checked, traced in a fresh sandbox."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import nbformat
import pytest

from flashlab.grading import batch, kernelcheck, sandbox

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_numba_cuda.ipynb"


def _cells(path: pathlib.Path = SOLUTION) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_the_solution_is_kernel_language_and_extracted_alone():
    source = kernelcheck.extract(_cells(), "make_kernel")
    assert source.count("def make_kernel") == 1 and "cuda.syncthreads()" in source
    assert "check(" not in source and "trace_shared_memory" not in source  # nothing but the factory


def test_module_level_helpers_and_constants_come_along():
    cells = ["from numba import cuda\nimport math\nTILE = 4\nunused = open('x')",
             "@cuda.jit(device=True)\ndef combine(a, b):\n    return max(a, b) + math.log1p(math.exp(-abs(a - b)))",
             "def make_kernel(BQ, BK, D, DV):\n    @cuda.jit\n    def k(Q, O):\n        O[0] = combine(Q[0], TILE)\n"
             "    return k"]
    source = kernelcheck.extract(cells, "make_kernel")
    assert "def combine" in source and "TILE = 4" in source and "open" not in source


FACTORY = "def make_kernel(BQ, BK, D, DV):\n    @cuda.jit\n    def k(Q, O):\n        {body}\n    return k\n"


@pytest.mark.parametrize("body, named", [
    ("import os", "import"),
    ("O[0] = open('/etc/passwd')", "'open'"),
    ("O[0] = getattr(Q, 'x')", "'getattr'"),
    ("O[0] = Q.__class__", ".__class__"),
    ("cuda.syncthreads = print", ".syncthreads"),
    ("O[0] = Q.tofile('x')", ".tofile"),
    ("global Q", "global"),
    ("O[0] = make_cuda_kernel(1, 1, 1, 1, 'float64')", "the course's own code"),
    ("O[0] = trace_shared_memory", "the course's own code"),
    ("O[0] = np.load('x')", ".load"),
    ("O[0] = __import__('os')", "'__import__'"),
])
def test_what_a_cuda_kernel_cannot_do_is_refused_with_its_name(body, named):
    cells = ["from numba import cuda\nimport numpy as np\nfrom flashlab.numba_cuda import make_cuda_kernel\n"
             "from flashlab.racetrace import trace_shared_memory", FACTORY.format(body=body)]
    with pytest.raises(kernelcheck.KernelRejected, match="make_kernel uses") as info:
        kernelcheck.extract(cells, "make_kernel")
    assert named in str(info.value)


def test_a_factory_that_is_not_a_def_is_refused():
    with pytest.raises(kernelcheck.KernelRejected, match="not defined by a def"):
        kernelcheck.extract(["from flashlab.numba_cuda import make_cuda_kernel as make_kernel"], "make_kernel")


def _notebook(tmp_path: pathlib.Path, name: str, edit) -> pathlib.Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    edit(nb)
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


_BARRIERS = ("cuda.syncthreads()                           # the tile is complete before anyone reads it",
             "cuda.syncthreads()                           # everyone is done before the next tile overwrites it")
_QUIET_TRACER = """import contextlib
import flashlab.racetrace as tracer
import flashlab.grading.lab05 as grader
real = tracer.trace_shared_memory
@contextlib.contextmanager
def quiet():
    with real() as t:
        yield t
        t.races.clear()
tracer.trace_shared_memory = grader.racetrace.trace_shared_memory = quiet"""


def _no_barriers_quiet_tracer(nb):
    cell = next(c for c in nb.cells if "def make_kernel" in c.source)
    for line in _BARRIERS:
        cell.source = cell.source.replace(line, "pass")
    nb.cells.insert(nb.cells.index(cell) + 1, nbformat.v4.new_code_cell(_QUIET_TRACER))


def _kernel_from_the_course(nb):
    cell = next(c for c in nb.cells if "def make_kernel" in c.source)
    cell.source = ("from flashlab.numba_cuda import make_cuda_kernel\n"
                   "def make_kernel(BLOCK_Q, BLOCK_K, D, DV):\n"
                   "    return make_cuda_kernel(BLOCK_Q, BLOCK_K, D, DV, 'float64')\n")


def _launch_on_the_cpu(nb):
    cell = next(c for c in nb.cells if "def run_kernel" in c.source)
    cell.source = "def run_kernel(kernel, Q, K, V, BLOCK_Q):\n    return reference.attention(Q, K, V)\n"


@pytest.mark.slow
def test_lab05_is_judged_apart_in_one_batch_run(tmp_path):
    if sandbox.sandbox_problem() is not None:
        pytest.skip(f"needs the sandbox: {sandbox.sandbox_problem()}")
    paths = [_notebook(tmp_path, "honest", lambda nb: None),
             _notebook(tmp_path, "quiet_tracer", _no_barriers_quiet_tracer),
             _notebook(tmp_path, "course_kernel", _kernel_from_the_course),
             _notebook(tmp_path, "cpu_launch", _launch_on_the_cpu)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert batch.main([*map(str, paths), "--json", "--jobs", "2", "--timeout", "600", "--seed", "3"]) == 0
    rows = {pathlib.Path(r["path"]).stem: r for r in map(json.loads, buf.getvalue().splitlines()) if r}
    q = {name: {x["name"]: x for x in row["questions"]} for name, row in rows.items()}
    assert rows["honest"]["score"] == rows["honest"]["max_score"]
    races = q["quiet_tracer"]["q1"]["feedback"]
    assert "[FAIL] no data races" in races and "missing barrier" in races  # seen, though the notebook hid them
    assert q["course_kernel"]["q1"]["score"] == 0 and "the course's own code" in q["course_kernel"]["q1"]["feedback"]
    assert q["cpu_launch"]["q2"]["score"] == 0 and "without launching" in q["cpu_launch"]["q2"]["feedback"]
    assert q["cpu_launch"]["q1"]["score"] == q["cpu_launch"]["q1"]["max_score"]
