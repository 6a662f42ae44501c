"""Lab 06 — the online-softmax update inside the first CUDA kernel (rung 1: one thread per query row).

The student's notebook holds the whole kernel as CUDA C in a Python string, ``KERNEL``; the part to write is the
loop body that folds one key into the row's state ``(mx, l, acc)``. Both questions grade that string:

q1 (1 point) the source compiles and defines the three entry points ``attn_lab_d16/32/64``. On a GPU it is
   compiled by CuPy (NVRTC), as it will run; without one by ``nvcc -cubin -arch=sm_75`` in a temporary directory
   where nvcc is installed, else by g++ for the CPU (below). Compiler line numbers count from the
   ``KERNEL = r\"\"\"`` line of the cell.
q2 (5 points) the kernel is launched on fresh random shapes (ragged n, m != n, several batch entries,
   d in {16, 32, 64}), outputs poisoned with NaN first, and compared with :mod:`flashlab.reference` by the rule
   of CONTRIBUTING.md, Correctness, for fp32: ||out - ref|| / ||ref|| <= 1e-5 for O and for the finite entries
   of L, NaN nowhere, and a row that sees no key (causal, n > m) must give O = 0 and L = -inf. Three parts: random
   shapes (2), causal with rows that see no key (2), huge logits (1). The huge-logit inputs have integer Q and K
   and d in {16, 64}, so that the scores (up to about +-2000) are exact in fp32 and the test measures the
   overflow of exp alone, not fp32 rounding of large scores.

Without a GPU, q2 runs the kernel on the CPU: :mod:`flashlab.hostcuda` compiles it with g++ against a host version
of CUDA, each block's threads one after another, and runs every launch in one fresh process, inside the sandbox of
:mod:`flashlab.grading.sandbox` where bwrap works (with limits alone otherwise), under a time limit: a kernel that
loops forever, writes out of bounds or floods its output ends that process, never the grader, and the feedback
says what happened. The compiler runs in the sandbox too (its messages could quote any file it can read). Same
inputs, same rule, same diagnoses as on the GPU; what a CPU cannot show is races and speed.

Diagnoses come from mutants: the same kernel with the classic wrong updates (:data:`MUTANTS`), compiled into one
module and run on the failing inputs; the mutant whose outputs match the student's names the mistake.

Points this machine cannot grade are not counted: ``max_score`` is 6 with a GPU or g++, 1 with nvcc alone
(compile only) and 0 with none of them, and the feedback says which points need what ("q2: 5 points need a GPU
or a C++ compiler (g++); not graded here"). A grade is then what was graded, never a zero for work nobody checked.

Helpers for the notebook: :func:`attention` launches a kernel source on NumPy arrays (GPU, or CPU with g++),
:func:`can_run` says whether it can here, :func:`compile_report` compiles one with nvcc and returns the registers
per kernel, :func:`machine` says what this machine can grade.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from .. import hostcuda, reference
from ..gpu import gpu_available, parse_resource_usage
from .core import Lab, NotImplementedYet, Trial, mistake_title
from .known import Demo, KnownMistakes

LAB = Lab("lab06", "The online-softmax update in a CUDA kernel")

# The course's own answers to each question (flashlab.grading.answers). None: the answer is a CUDA C string, built
# before any check runs, so no package function is called while it is graded.
ANSWERS: dict[str, tuple[str, ...]] = {}
# ... but the answer's lines are in this module (the solution, and the statements every mutant is built from): in
# the sandbox's copy of the package they are poisoned (answers.student_package), so that a KERNEL assembled from
# them fails to compile with an error that names them.
SANDBOX_POISON = ("SOLUTION", "_GUARD", "_HEAD", "_CORR", "_P", "_L", "_ACC_UPDATE", "_MX")

HEAD_DIMS = (16, 32, 64)
THREADS = 128  # threads per block: one query row each
TOLERANCE = 1e-5  # fp32 rule of CONTRIBUTING.md, Correctness; relative in the 2-norm
MATCH = 1e-4  # a student's output "matches" a mutant's when they differ by less than this (relative)
NVCC_ARCH = 75  # Colab's T4: the oldest GPU the course supports
RUN_TIMEOUT = 30.0  # seconds for all of a question's launches on the CPU (they need well under one)
Q1_POINTS, Q2_POINTS = 1, 5
ENTRY_POINTS = tuple(f"attn_lab_d{d}" for d in HEAD_DIMS)
# release.py's markers and stub comment, spelled out: release imports nbformat, which a GPU box may lack.
MARKER_LINES = ("### BEGIN SOLUTION", "### END SOLUTION", "# YOUR CODE HERE")

# The kernel the student completes. "/*UPDATE*/" marks the loop body they write; render() fills it in. The
# solution notebook's KERNEL is render(SOLUTION) with the release markers around the update (a test checks it).
TEMPLATE = r"""// Lab 06 -- rung 1 of the ladder: one thread per query row, online softmax key by key, fp32.
//
// Thread i owns query row i of batch entry b. It walks over the m keys one at a time, keeping in registers
// the running max mx of the row's scores, the running sum l of exp(s - mx) and the unnormalised output
// acc[D] = sum of exp(s - mx) * v_j. After the last key it divides by l once.
// Layout: q (B, n, D), k and v (B, m, D), o (B, n, D), lse (B, n); all float32.
// Grid: (ceil(n / 128), B); block: 128 threads.

#define NEG_INF (-__int_as_float(0x7f800000))

template <int D>
__device__ void attn_row(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         float* __restrict__ o, float* __restrict__ lse, int n, int m, float scale, int causal) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t row = (size_t)blockIdx.y * n + i;
    const float* qi = q + row * D;
    const float* kb = k + (size_t)blockIdx.y * m * D;
    const float* vb = v + (size_t)blockIdx.y * m * D;

    float acc[D];        // sum over the keys so far of exp(s - mx) * v_j
#pragma unroll
    for (int c = 0; c < D; ++c) acc[c] = 0.f;
    float mx = NEG_INF;  // the largest score so far
    float l = 0.f;       // sum over the keys so far of exp(s - mx)

    for (int j = 0; j < m; ++j) {
        const float* kj = kb + (size_t)j * D;
        const float* vj = vb + (size_t)j * D;  // key j's value row: vj[0] ... vj[D - 1]
        float s = 0.f;
#pragma unroll 16
        for (int c = 0; c < D; ++c) s += qi[c] * kj[c];
        s *= scale;
        // Causal, aligned at the bottom right as in flashlab.reference: query i sees keys j <= i + (m - n).
        // A masked key still comes through here, with s = -inf (as in a tiled kernel's diagonal tile).
        if (causal && j > i + (m - n)) s = NEG_INF;

        // Fold key j (score s, value row vj) into the state (mx, l, acc).
/*UPDATE*/
    }

    // acc and l are sums against the final max mx: divide once. A row that saw no key has l = 0: its output
    // is 0 and its logsumexp -inf, as in flashlab.reference.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* oi = o + row * D;
#pragma unroll
    for (int c = 0; c < D; ++c) oi[c] = acc[c] * inv;
    lse[row] = l > 0.f ? mx + logf(l) : NEG_INF;
}

extern "C" __global__ void __launch_bounds__(128)
attn_lab_d16(const float* q, const float* k, const float* v, float* o, float* lse, int n, int m, float scale,
             int causal) { attn_row<16>(q, k, v, o, lse, n, m, scale, causal); }
extern "C" __global__ void __launch_bounds__(128)
attn_lab_d32(const float* q, const float* k, const float* v, float* o, float* lse, int n, int m, float scale,
             int causal) { attn_row<32>(q, k, v, o, lse, n, m, scale, causal); }
extern "C" __global__ void __launch_bounds__(128)
attn_lab_d64(const float* q, const float* k, const float* v, float* o, float* lse, int n, int m, float scale,
             int causal) { attn_row<64>(q, k, v, o, lse, n, m, scale, causal); }
"""

INDENT = " " * 8  # the loop body's indentation in TEMPLATE

SOLUTION = """\
// A masked key adds nothing. Skipping it also keeps a row that has seen only masked keys (mx = -inf)
// away from exp(-inf - (-inf)) = NaN.
if (s == NEG_INF) continue;
const float mnew = fmaxf(mx, s);
const float corr = expf(mx - mnew);  // rescales what was summed against the old max; 0 on the first key
const float p = expf(s - mnew);
l = l * corr + p;
#pragma unroll
for (int c = 0; c < D; ++c) acc[c] = acc[c] * corr + p * vj[c];
mx = mnew;"""


def render(update: str, prefix: str = "attn_lab") -> str:
    """TEMPLATE with ``update`` as the loop body; ``prefix`` renames the kernels (mutants share one module)."""
    body = "\n".join(line if not line.strip() or re.match(r"#\s*[a-z]", line) else INDENT + line
                     for line in update.split("\n"))  # preprocessor lines stay in column 0, as in r1_scalar.cu
    source = TEMPLATE.replace("/*UPDATE*/", body)
    if prefix != "attn_lab":
        source = source.replace("attn_lab_d", f"{prefix}_d").replace("attn_row", f"{prefix}_row")
        source = source.replace("#define NEG_INF", "#undef NEG_INF\n#define NEG_INF", 1)
    return source


@dataclasses.dataclass(frozen=True)
class CudaMutant:
    """A known mistake: a wrong loop body for TEMPLATE, and the message that names it."""

    tag: str
    message: str
    update: str


_NO_RESCALE = ("no rescale when the max grows: when a key raises the max from mx to mnew, everything already in "
               "acc and l was summed against the old max; multiply both by exp(mx - mnew) before adding the new "
               "key's exp(s - mnew).")
_NO_MAX = ("no max subtraction: expf(s) of a raw score overflows to inf for s > 88 in fp32 (then inf/inf = NaN), "
           "and the logsumexp mx + log(l) assumes l was summed against mx. Exponentiate s - mnew, where mnew is the "
           "running max.")
_IN_LOOP = ("dividing by l inside the loop: acc must stay an unnormalised sum of exp(s - mx) * v_j; the code after "
            "the loop divides by l once. Dividing in the loop divides twice (or mixes terms divided by different "
            "l's).")
_GUARD = "if (s == NEG_INF) continue;\n"
_HEAD = "const float mnew = fmaxf(mx, s);\n"
_ACC = "#pragma unroll\nfor (int c = 0; c < D; ++c) "


_CORR = "const float corr = expf(mx - mnew);"
_P = "const float p = expf(s - mnew);"
_L = "l = l * corr + p;"
_ACC_UPDATE = "acc[c] = acc[c] * corr + p * vj[c];"
_MX = "mx = mnew;"


def _update(guard: str = _GUARD, corr: str = _CORR, p: str = _P, l: str = _L, acc: str = _ACC_UPDATE,
            mx: str = _MX) -> str:
    """The solution's loop body (without its comments) with the given statements in place of its own."""
    return guard + _HEAD + "\n".join([corr, p, l, _ACC + acc, mx]).rstrip("\n")

MUTANTS: tuple[CudaMutant, ...] = (
    CudaMutant("no_rescale", _NO_RESCALE,
               _GUARD + _HEAD + "const float p = expf(s - mnew);\nl += p;\n"
               + _ACC + "acc[c] += p * vj[c];\nmx = mnew;"),
    CudaMutant("no_rescale_acc", "acc is not rescaled when the max grows (l is): " + _NO_RESCALE,
               _GUARD + _HEAD + "const float corr = expf(mx - mnew);\nconst float p = expf(s - mnew);\n"
               "l = l * corr + p;\n" + _ACC + "acc[c] += p * vj[c];\nmx = mnew;"),
    CudaMutant("no_rescale_l", "l is not rescaled when the max grows (acc is): " + _NO_RESCALE,
               _GUARD + _HEAD + "const float corr = expf(mx - mnew);\nconst float p = expf(s - mnew);\n"
               "l += p;\n" + _ACC + "acc[c] = acc[c] * corr + p * vj[c];\nmx = mnew;"),
    CudaMutant("flipped", "the correction factor is upside down: it is exp(mx - mnew) <= 1 (old max minus new), "
               "not exp(mnew - mx); on the first key that gives exp(+inf) = inf and then NaN.",
               _GUARD + _HEAD + "const float corr = expf(mnew - mx);\nconst float p = expf(s - mnew);\n"
               "l = l * corr + p;\n" + _ACC + "acc[c] = acc[c] * corr + p * vj[c];\nmx = mnew;"),
    CudaMutant("no_max", _NO_MAX,
               _GUARD + "const float p = expf(s);\nl += p;\n" + _ACC + "acc[c] += p * vj[c];\nmx = fmaxf(mx, s);"),
    CudaMutant("no_max_at_all", _NO_MAX,
               "const float p = expf(s);\nl += p;\n" + _ACC + "acc[c] += p * vj[c];"),
    CudaMutant("unguarded", "a row whose keys are all masked gives NaN: with mx = s = -inf, "
               "expf(mx - mnew) = expf(-inf + inf) = NaN. Skip a masked key (s == -inf), or exponentiate against 0 "
               "while the max is still -inf.",
               _HEAD + "const float corr = expf(mx - mnew);\nconst float p = expf(s - mnew);\nl = l * corr + p;\n"
               + _ACC + "acc[c] = acc[c] * corr + p * vj[c];\nmx = mnew;"),
    CudaMutant("divide_in_loop", _IN_LOOP,
               _GUARD + _HEAD + "const float corr = expf(mx - mnew);\nconst float p = expf(s - mnew);\n"
               "const float lnew = l * corr + p;\n"
               + _ACC + "acc[c] = (acc[c] * l * corr + p * vj[c]) / lnew;\nl = lnew;\nmx = mnew;"),
    CudaMutant("divide_in_loop_only_new", _IN_LOOP,
               _GUARD + _HEAD + "const float corr = expf(mx - mnew);\nconst float p = expf(s - mnew);\n"
               "l = l * corr + p;\n" + _ACC + "acc[c] = (acc[c] * corr + p * vj[c]) / l;\nmx = mnew;"),
    CudaMutant("v_for_vj", "reading v[c] for vj[c]: v is the start of the whole V array (batch entry 0, key 0), so "
               "every row averages that one value row. Key j's value row is vj = vb + j * D: read vj[c].",
               _update(acc="acc[c] = acc[c] * corr + p * v[c];")),
    CudaMutant("k_for_vj", "reading kj[c] for vj[c]: the weights then average the key rows instead of the value "
               "rows. Multiply p by key j's value row, vj[c].",
               _update(acc="acc[c] = acc[c] * corr + p * kj[c];")),
    CudaMutant("unweighted_value", "the value row is added without its weight: acc must gain p * vj[c], not vj[c] "
               "(l sums the weights p, so O = acc / l needs the same weights in acc).",
               _update(acc="acc[c] = acc[c] * corr + vj[c];")),
    CudaMutant("short_value_loop", "the value loop stops one short: c < D - 1 leaves acc[D - 1], the last column "
               "of O, at 0. Loop while c < D.",
               _update().replace("c < D;", "c < D - 1;")),
    CudaMutant("mx_not_updated", "mx is never updated (mx = mnew is missing): every key is then exponentiated "
               "against its own score, every rescale multiplies by exp(-inf) = 0, so O is the last key's value row "
               "and the logsumexp mx + log(l) stays -inf. End the update with mx = mnew.",
               _update(mx="")),
    CudaMutant("mx_is_s", "mx = s keeps the last score, not the running max: after a key below the max, the next "
               "keys are weighted and rescaled against the wrong max. Keep mx = mnew = fmaxf(mx, s).",
               _update(mx="mx = s;")),
    CudaMutant("p_old_max", "the new key's weight uses the old max: p = exp(s - mx) must be exp(s - mnew), against "
               "the max that acc and l are rescaled to (on the first key mx = -inf makes it exp(+inf) = inf).",
               _update(p="const float p = expf(s - mx);")),
    CudaMutant("p_without_max", "p = expf(s) while acc and l are rescaled against the running max: the sums then "
               "mix terms taken against 0 and against mx (and expf(s) overflows for s > 88). Use p = expf(s - mnew).",
               _update(p="const float p = expf(s);")),
    CudaMutant("rescaled_after_adding", "the rescale also shrinks the new key: exp(mx - mnew) applies only to what "
               "was summed against the old max. Write l = l * corr + p and acc[c] = acc[c] * corr + p * vj[c], "
               "not (l + p) * corr.",
               _update(l="l = (l + p) * corr;", acc="acc[c] = (acc[c] + p * vj[c]) * corr;")),
    CudaMutant("ratio_of_exps", "exp(a - b) computed as expf(a) / expf(b): each factor overflows to inf once a "
               "score passes about 88 (then inf / inf = NaN), which is what subtracting the max avoids. "
               "Exponentiate the difference: expf(mx - mnew), expf(s - mnew).",
               _update(corr="const float corr = expf(mx) / expf(mnew);", p="const float p = expf(s) / expf(mnew);")),
    CudaMutant("scaled_twice", "the score is scaled twice: the template has already multiplied s by scale "
               "(1/sqrt(d)) before the update; multiplying again computes softmax(Q K^T / d). Use s as it comes.",
               _update(guard="s *= scale;\n" + _GUARD)),
    CudaMutant("guard_on_mx", "the guard tests mx instead of s: mx starts at -inf, so every key is skipped and "
               "every row gives O = 0, L = -inf. Skip a key when its own score s is -inf.",
               _update(guard="if (mx == NEG_INF) continue;\n")),
    CudaMutant("guard_returns", "return instead of continue on a masked key: the thread leaves the kernel before "
               "it writes its row, so O and L keep their NaN in every row that has a masked key. continue skips "
               "just that key.",
               _update(guard="if (s == NEG_INF) return;\n")),
    CudaMutant("masked_again", "masking again with j > i: the causal mask is aligned at the bottom right (query i "
               "sees the keys j <= i + (m - n)) and the template has already set s = -inf for the keys it hides; "
               "with m > n, j > i also hides keys the row must see. Drop your own mask.",
               _update(guard="if (causal && j > i) continue;\n" + _GUARD)),
)


def mutant_source() -> str:
    """One CUDA module holding every mutant; mutant ``tag``'s kernels are ``attn_<tag>_d16`` etc."""
    return "\n".join(render(mu.update, f"attn_{mu.tag}") for mu in MUTANTS)


# ------------------------------------------------------------------------------------------- the source string
_LINE = re.compile(r"^\s*raise\s+NotImplementedError\b")


def clean_source(source: str) -> str:
    """The CUDA source to compile from the notebook's ``KERNEL``.

    Raises NotImplementedError while the released stub is still in it. The solution's ``### BEGIN/END
    SOLUTION`` lines (and the stub's ``# YOUR CODE HERE``) become empty lines, so compiler line numbers still
    match the cell.
    """
    if not isinstance(source, str):
        raise TypeError(f"KERNEL must be a str holding the CUDA C source; got {type(source).__name__}")
    lines = source.split("\n")
    if any(_LINE.match(line) for line in lines):
        raise NotImplementedError("the kernel still holds the stub: replace the `raise NotImplementedError` line")
    return "\n".join("" if line.strip().startswith(MARKER_LINES) else line for line in lines)


def _student(source) -> str:
    try:
        return clean_source(source)
    except NotImplementedError as e:
        raise NotImplementedYet(str(e)) from e


# ------------------------------------------------------------------------------------------------- machines
@functools.lru_cache(maxsize=None)
def _has_gpu() -> bool:
    return gpu_available()


def _nvcc() -> str | None:
    return shutil.which("nvcc")


def _host_cc() -> bool:
    """Whether g++ here compiles CUDA for the host (flashlab.hostcuda): then q2 runs the kernel on the CPU."""
    return hostcuda.compiler_problem() is None


def can_run() -> bool:
    """Whether :func:`attention` can run a kernel here: on the GPU, or on the CPU compiled with g++."""
    return _has_gpu() or _host_cc()


def _needs(question: str) -> str:
    """What question ``question`` needs that this machine lacks, in one line."""
    if question == "q1":
        return f"q1: {Q1_POINTS} point needs a GPU, nvcc or a C++ compiler (g++); not graded here."
    why = hostcuda.compiler_problem()
    extra = f" ({why})" if why and hostcuda.compiler() else ""
    return f"q2: {Q2_POINTS} points need a GPU or a C++ compiler (g++){extra}; not graded here."


def machine() -> str:
    """One line: what this machine can grade in this lab, and how."""
    if _has_gpu():
        return "GPU found: both questions are graded here (compile with CuPy/NVRTC, then run on the GPU)."
    cpu = ("q2 runs the kernel on the CPU (compiled with g++ against a host version of CUDA, one thread after "
           "another; it shows wrong results, not races or speed)")
    if _nvcc() and _host_cc():
        return f"No GPU here: q1 (compiling) is graded with nvcc for sm_{NVCC_ARCH}; {cpu}."
    if _host_cc():
        return ("No GPU and no nvcc here: q1 compiles the kernel for the CPU with g++ (errors only the CUDA compiler "
                f"makes show on a GPU or with nvcc); {cpu}.")
    if _nvcc():
        return f"No GPU here, but nvcc is: q1 (compiling) is graded with nvcc for sm_{NVCC_ARCH}. " + _needs("q2")
    return ("No GPU, no nvcc and no C++ compiler here: nothing in this lab can be graded on this machine. "
            + _needs("q1") + " " + _needs("q2") + " Open the lab in Colab, or install g++.")


# --------------------------------------------------------------------------------------------- compiling
def nvcc_compile(source: str, arch: int = NVCC_ARCH, timeout: float = 120) -> tuple[bool, str, list[dict]]:
    """Compile ``source`` with ``nvcc -cubin -arch=sm_<arch>`` in a temporary directory.

    Returns (ok, compiler log, resource usage per kernel). Raises FileNotFoundError when nvcc is absent.
    """
    nvcc = _nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH")
    with tempfile.TemporaryDirectory(prefix="flashlab-lab06-") as tmp:
        cu = Path(tmp) / "kernel.cu"
        cu.write_text(source)
        cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "--std=c++17", "--resource-usage", "-o",
               str(Path(tmp) / "kernel.cubin"), str(cu)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    log = (res.stderr + res.stdout).replace(str(cu), "kernel.cu")
    return res.returncode == 0, log, parse_resource_usage(log) if res.returncode == 0 else []


def compile_report(source: str, arch: int = NVCC_ARCH) -> list[dict] | None:
    """nvcc's registers, shared memory and spills per kernel of ``source`` (None when nvcc is absent)."""
    if _nvcc() is None:
        return None
    ok, log, usage = nvcc_compile(clean_source(source), arch)
    if not ok:
        raise RuntimeError("nvcc could not compile the kernel:\n" + _errors(log))
    return usage


def _errors(log: str, limit: int = 12) -> str:
    """The compiler's error lines (and the lines right after, which show the code), at most ``limit``."""
    lines = log.splitlines()
    keep: list[str] = []
    for index, line in enumerate(lines):
        if re.search(r"\berror\b", line):
            keep += lines[index:index + 3]
    keep = keep or lines
    text = "\n".join(dict.fromkeys(line.rstrip() for line in keep if line.strip()))
    short = text.splitlines()[:limit]
    return "\n".join(short) + ("\n..." if len(text.splitlines()) > limit else "")


@functools.lru_cache(maxsize=16)
def _module(source: str):
    import cupy

    return cupy.RawModule(code=source, options=("--std=c++17",))


class MissingKernels(Exception):
    """The source compiles but does not define every entry point."""


def _cupy_compile(source: str, names: tuple[str, ...]) -> None:
    """Compile with CuPy (NVRTC) and look up every kernel; raises with the compiler's log on failure."""
    module = _module(source)
    missing = []
    for name in names:
        try:
            module.get_function(name)
        except Exception as e:  # noqa: BLE001 - CompileException propagates; a missing name is collected
            if "not found" not in str(e).lower():
                raise
            missing.append(name)
    if missing:
        raise MissingKernels(f"compiles, but these kernels are missing: {', '.join(missing)}")


_UNDECLARED = re.compile(r"hostcuda-launchers\.cpp:\d+:\d+: error: \W(\w+)\W was not declared")


def _host_program(source: str, names: tuple[str, ...] = ENTRY_POINTS, trusted: bool = False) -> hostcuda.Program:
    """Compile ``source`` for the CPU (flashlab.hostcuda; sandboxed unless ``trusted``). Raises MissingKernels when
    it defines only some of ``names``, hostcuda.CompileError with g++'s messages otherwise."""
    try:
        return hostcuda.program(source, names, trusted=trusted)
    except hostcuda.CompileError as e:
        missing = [name for name in dict.fromkeys(_UNDECLARED.findall(e.log)) if name in names]
        own = [line for line in e.log.splitlines() if hostcuda.SOURCE_NAME in line and "error" in line]
        if missing and not own:
            raise MissingKernels(f"compiles, but these kernels are missing: {', '.join(missing)}") from e
        raise


# ---------------------------------------------------------------------------------------------- launching
@dataclasses.dataclass
class Case:
    """One launch: q (B, n, d), k and v (B, m, d) float32, the scale and the mask."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: float
    label: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, n, d = self.q.shape
        return B, n, self.k.shape[1], d


def _launch(source: str, prefix: str, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """Run kernel ``<prefix>_d<d>`` of ``source`` on the GPU; outputs are poisoned with NaN before the launch."""
    import cupy

    B, n, m, d = case.shape
    kernel = _module(source).get_function(f"{prefix}_d{d}")
    q, k, v = (cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.float32)) for x in (case.q, case.k, case.v))
    o = cupy.full((B, n, d), cupy.nan, dtype=cupy.float32)
    lse = cupy.full((B, n), cupy.nan, dtype=cupy.float32)
    kernel((math.ceil(n / THREADS), B), (THREADS,),
           (q, k, v, o, lse, np.int32(n), np.int32(m), np.float32(case.scale), np.int32(bool(case.causal))))
    return cupy.asnumpy(o), cupy.asnumpy(lse)


def attention(source: str, Q, K, V, *, causal: bool = False, scale: float | None = None):
    """Launch the kernel in ``source`` (the notebook's KERNEL) on Q (n, d) or (B, n, d), K and V; return (O, L).

    NumPy in, NumPy out (float32); d must be 16, 32 or 64. Runs on a GPU with CuPy, else on the CPU compiled with
    g++ (in a separate process: a crash there raises :class:`flashlab.hostcuda.LaunchFailed`).
    """
    if not _has_gpu() and not _host_cc():
        raise RuntimeError("attention() runs the kernel on a GPU, or on the CPU with g++; neither is here")
    Q, K, V = (np.asarray(x, dtype=np.float32) for x in (Q, K, V))
    if not (Q.ndim == K.ndim == V.ndim and Q.ndim in (2, 3)):
        raise ValueError(f"Q, K, V must all be (n, d) or all (B, n, d); got {Q.shape}, {K.shape}, {V.shape}")
    squeeze = Q.ndim == 2
    if squeeze:
        Q, K, V = Q[None], K[None], V[None]
    if K.shape != V.shape or Q.shape[0] != K.shape[0] or Q.shape[2] != K.shape[2]:
        raise ValueError(f"need Q (B, n, d) and K, V (B, m, d) with the same B and d; got {Q.shape}, {K.shape}, "
                         f"{V.shape}")
    if Q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"d must be one of {HEAD_DIMS}; got {Q.shape[2]}")
    if Q.shape[1] < 1 or K.shape[1] < 1:
        raise ValueError(f"need n >= 1 and m >= 1; got n = {Q.shape[1]}, m = {K.shape[1]}")
    scale = 1.0 / math.sqrt(Q.shape[2]) if scale is None else float(scale)
    case = Case(Q, K, V, bool(causal), float(np.float32(scale)), "")
    if _has_gpu():
        try:
            O, L = _launch(clean_source(source), "attn_lab", case)
        except Exception as e:  # CuPy's CompileException, which CuPy does not export under one name
            if type(e).__name__ != "CompileException":
                raise
            raise CompileFailed(str(e)) from None
    else:
        try:
            program = _host_program(clean_source(source))
        except hostcuda.CompileError as e:
            raise CompileFailed(e.log) from None
        (result,) = hostcuda.run(program, [_host_launch("attn_lab", case)], timeout=RUN_TIMEOUT)
        if isinstance(result, Exception):
            raise result
        O, L = result
    return (O[0], L[0]) if squeeze else (O, L)


class CompileFailed(Exception):
    """The notebook's KERNEL does not compile; the message is the compiler's log."""


def _host_launch(prefix: str, case: Case) -> hostcuda.Launch:
    """The launch of kernel ``<prefix>_d<d>`` on ``case`` for flashlab.hostcuda, as the GPU path launches it."""
    B, n, m, d = case.shape
    o = np.full((B, n, d), np.nan, dtype=np.float32)
    lse = np.full((B, n), np.nan, dtype=np.float32)
    args = (*(np.ascontiguousarray(x, dtype=np.float32) for x in (case.q, case.k, case.v)), o, lse, np.int32(n),
            np.int32(m), np.float32(case.scale), np.int32(bool(case.causal)))
    return hostcuda.Launch(f"{prefix}_d{d}", (math.ceil(n / THREADS), B), THREADS, args, outputs=(3, 4))


def _reference(case: Case) -> tuple[np.ndarray, np.ndarray]:
    return reference.attention(case.q.astype(np.float64), case.k.astype(np.float64), case.v.astype(np.float64),
                               causal=case.causal, scale=case.scale)


# -------------------------------------------------------------------------------------------- comparing
def _rel(x: np.ndarray, y: np.ndarray) -> float:
    """||x - y|| / ||y|| over finite entries (absolute when y is all zeros)."""
    # Sums of squares, not np.linalg.norm: its BLAS threads make the many small norms of a diagnosis slow on a
    # busy machine.
    diff = math.sqrt(float(np.square(x - y).sum()))
    size = math.sqrt(float(np.square(y).sum()))
    return diff / size if size > 0 else diff


def _errors_of(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> dict:
    """What differs between an output (O, L) and the truth, in numbers."""
    (O, L), (Or, Lr) = got, want
    O, L = np.asarray(O, dtype=np.float64), np.asarray(L, dtype=np.float64)
    info = {"nan_O": int(np.isnan(O).sum()), "nan_L": int(np.isnan(L).sum()), "inf_O": int(np.isinf(O).sum())}
    empty = np.isneginf(Lr)  # rows that see no key
    info["empty_rows"] = int(empty.sum())
    info["empty_wrong"] = int((~np.isneginf(L[empty])).sum() + (O[empty] != 0).any(axis=-1).sum())
    info["inf_L_wrong"] = int(np.isinf(L[~empty]).sum())
    fo, fl = np.isfinite(O), np.isfinite(L) & ~empty
    info["err_O"] = _rel(np.where(fo, O, 0), Or) if fo.all() else math.inf
    info["err_L"] = _rel(L[fl], Lr[fl]) if fl.sum() == (~empty).sum() else math.inf
    info["max_O"] = float(np.max(np.abs(O - Or), initial=0.0)) if fo.all() else math.inf
    return info


def close(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], tol: float = TOLERANCE) -> bool:
    """The pass rule: no NaN, rows without keys give O = 0 and L = -inf, relative errors of O and L <= tol."""
    e = _errors_of(got, want)
    return (e["nan_O"] == e["nan_L"] == e["empty_wrong"] == e["inf_L_wrong"] == 0
            and e["err_O"] <= tol and e["err_L"] <= tol)


def same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], tol: float = MATCH) -> bool:
    """Two (possibly wrong) outputs agree: NaN and inf in the same places, finite values within ``tol``."""
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != y.shape or not np.array_equal(np.isnan(x), np.isnan(y)):
            return False
        if not np.array_equal(np.where(np.isinf(x), x, 0), np.where(np.isinf(y), y, 0)):
            return False
        f = np.isfinite(x)
        if f.any() and _rel(x[f], y[f]) > tol and float(np.max(np.abs(x[f] - y[f]))) > tol:
            return False
    return True


def _describe(case: Case, got) -> str:
    B, n, m, d = case.shape
    where = f"B={B}, n={n}, m={m}, d={d}{', causal' if case.causal else ''} [{case.label}]"
    if isinstance(got, BaseException):
        return f"{where}: the launch failed: {type(got).__name__}: {str(got)[:300]}"
    e = _errors_of(got, _reference(case))
    bits = []
    if e["nan_O"] or e["nan_L"]:
        bits.append(f"{e['nan_O']} NaN in O and {e['nan_L']} in L (outputs are filled with NaN before the launch, "
                    "so a NaN is also a value never written)")
    if e["empty_wrong"]:
        bits.append(f"{e['empty_wrong']} of the {e['empty_rows']} rows that see no key are not O = 0, L = -inf")
    if e["inf_O"]:
        bits.append(f"{e['inf_O']} infinite values in O")
    if e["inf_L_wrong"]:
        bits.append(f"L is infinite in {e['inf_L_wrong']} rows that see keys (L = mx + log(l) there)")
    if math.isfinite(e["err_O"]):
        bits.append(f"O: relative error {e['err_O']:.2e} (max abs {e['max_O']:.2e})")
    if math.isfinite(e["err_L"]):
        bits.append(f"L: relative error {e['err_L']:.2e}")
    return f"{where}: " + "; ".join(bits) + f" (allowed {TOLERANCE:g})"


Runner = Callable[[str, Case], tuple]


def _check_part(t: Trial, label: str, points: float, run: Runner, cases: list[Case],
                passed: list | None = None) -> bool:
    """Run the student's kernel (``run("attn_lab", case)``) on ``cases``; on failure name the mutant that matches.

    A mutant that fails an input the student passes is not the student's mistake. ``passed``, shared by a
    question's parts, collects the inputs passed in every part (the diagnosis runs after the last part): a mutant
    that fails this part's inputs as the student does but also inputs of another part that the student passes (a
    NaN everywhere where the student overflows only on huge logits) is not named."""
    failures, passes = [], []
    passed = passes if passed is None else passed
    for case in cases:
        want = _reference(case)
        try:
            got = run("attn_lab", case)
        except Exception as e:  # noqa: BLE001 - a failed launch is feedback
            failures.append((case, want, e))
            continue
        (failures if not close(got, want) else passes).append((case, want, got))
    if passed is not passes:
        passed.extend(passes)
    if not failures:
        return t.expect(f"{label} ({len(cases)} random inputs)", points, True)

    def diagnose() -> str:
        best, best_hits, best_score = None, 0, 0
        for mu in MUTANTS:
            hits = contradictions = 0
            for case, want, got in failures:
                if isinstance(got, BaseException):
                    continue
                try:
                    wrong = run(f"attn_{mu.tag}", case)
                except Exception:  # noqa: BLE001
                    continue
                hits += (not close(wrong, want)) and same(got, wrong)
            if hits:
                for case, want, _ in passed:
                    try:
                        contradictions += not close(run(f"attn_{mu.tag}", case), want)
                    except Exception:  # noqa: BLE001
                        contradictions += 1
            if hits - contradictions > best_score:
                best, best_hits, best_score = mu, hits, hits - contradictions
        smallest = min(failures, key=lambda f: f[0].q.size + f[0].k.size)
        text = "Smallest failing input: " + _describe(smallest[0], smallest[2])
        if best is None:
            return text
        how = "all" if best_hits == len(failures) else f"{best_hits} of the {len(failures)}"
        t.diagnoses.append(mistake_title(best.message))
        return f"Likely mistake ({how} failing inputs match it): {best.message}\n{text}"

    t.parts.append((f"{label} (failed {len(failures)} of {len(cases)} inputs)", 0.0, points, diagnose))
    return False


# ---------------------------------------------------------------------------------------------- the inputs
def _case(t: Trial, B: int, n: int, m: int, d: int, causal: bool, label: str, huge: bool = False) -> Case:
    if huge:
        # Integer Q and K and a power-of-two scale: the scores are exact in fp32 and reach about +-2000.
        q = t.rng.integers(-500, 501, size=(B, n, d)).astype(np.float32)
        k = t.rng.integers(-2, 3, size=(B, m, d)).astype(np.float32)
    else:
        q = t.rng.standard_normal((B, n, d)).astype(np.float32)
        k = t.rng.standard_normal((B, m, d)).astype(np.float32)
    v = t.rng.standard_normal((B, m, d)).astype(np.float32)
    scale = float(np.float32(1.0 / math.sqrt(d)))
    return Case(q, k, v, causal, scale, label)


def _dim(t: Trial, dims=HEAD_DIMS) -> int:
    return int(t.rng.choice(dims))


def random_cases(t: Trial) -> dict[str, list[Case]]:
    """The three parts' inputs, fresh every run (shapes too)."""
    primes = [p for p in range(2, 300) if all(p % f for f in range(2, int(p ** 0.5) + 1))]
    plain = [_case(t, 1, 1, int(t.rng.integers(1, 20)), _dim(t), False, "n = 1")]
    plain.append(_case(t, int(t.rng.integers(1, 4)), int(t.rng.choice([p for p in primes if p > THREADS])),
                       int(t.rng.choice(primes)), _dim(t), False, "prime n > 128: a ragged second block"))
    for _ in range(4):
        n, m = (int(x) for x in t.rng.integers(1, 300, size=2))
        plain.append(_case(t, int(t.rng.integers(1, 4)), n, m, _dim(t), False, "random shape"))
    causal = []
    for _ in range(2):  # n > m: the first n - m rows see no key at all
        m = int(t.rng.integers(1, 60))
        causal.append(_case(t, int(t.rng.integers(1, 3)), m + int(t.rng.integers(1, 200)), m, _dim(t), True,
                            "causal, n > m (rows that see no key)"))
    n = int(t.rng.integers(1, 150))
    causal.append(_case(t, 2, n, n + int(t.rng.integers(1, 150)), _dim(t), True, "causal, m > n"))
    n = int(t.rng.integers(2, 300))
    causal.append(_case(t, 1, n, n, _dim(t), True, "causal, m = n"))
    huge = [_case(t, 1, int(t.rng.integers(1, 300)), int(t.rng.integers(2, 300)), _dim(t, (16, 64)), False,
                  "huge logits", huge=True) for _ in range(2)]
    # n <= m: every row sees a key, so that this part is about overflow alone (rows that see no key have their
    # own part; one missing guard must not cost this point too)
    m = int(t.rng.integers(2, 200))
    huge.append(_case(t, 2, m - int(t.rng.integers(0, m)), m, _dim(t, (16, 64)), True,
                      "huge logits, causal (every row sees a key)", huge=True))
    return {"plain": plain, "causal": causal, "huge": huge}


def _host_runner(source: str, cases: list[Case]) -> Runner:
    """Runner on the CPU: the student's kernel on every case at once, in one isolated process (a crash or an endless
    loop there becomes a failed launch). The mutants run when a diagnosis first asks: every mutant on the cases the
    student fails, in one process; a mutant's other cases (are they passed?) only when asked for, one process each."""
    student = _host_program(source)
    got = dict(zip(map(id, cases), hostcuda.run(student, [_host_launch("attn_lab", c) for c in cases],
                                                 timeout=RUN_TIMEOUT), strict=True))
    wrong: dict[tuple[str, int], object] = {}

    def compute(jobs: list[tuple[str, Case]]) -> None:
        names = tuple(f"attn_{mu.tag}_d{d}" for mu in MUTANTS for d in HEAD_DIMS)
        outs = hostcuda.run(_host_program(mutant_source(), names, trusted=True),
                            [_host_launch(prefix, c) for prefix, c in jobs], timeout=RUN_TIMEOUT)
        wrong.update({(prefix, id(c)): out for (prefix, c), out in zip(jobs, outs, strict=True)})

    def run(prefix: str, case: Case):
        if prefix == "attn_lab":
            out = got[id(case)]
        else:
            if not wrong:
                failed = [c for c in cases if isinstance(got[id(c)], Exception) or not close(got[id(c)],
                                                                                            _reference(c))]
                compute([(f"attn_{mu.tag}", c) for mu in MUTANTS for c in failed or cases])
            if (prefix, id(case)) not in wrong:
                compute([(prefix, c) for c in cases if (prefix, id(c)) not in wrong])
            out = wrong[(prefix, id(case))]
        if isinstance(out, Exception):
            raise out
        return out

    return run


def _gpu_runner(source: str) -> Runner:
    mutants = mutant_source()

    def run(prefix: str, case: Case):
        return _launch(source if prefix == "attn_lab" else mutants, prefix, case)

    return run


# ----------------------------------------------------------------------------------------------- questions
def _compile_feedback(log: str) -> str:
    return ("the kernel does not compile (line numbers count from the `KERNEL = r\"\"\"` line of the cell):\n"
            + _errors(log))


def _q2_where() -> str:
    """Where q2 runs, for q1's feedback on a machine without a GPU."""
    return ("q2 runs the kernel on the CPU (g++)." if _host_cc() else _needs("q2"))


@LAB.question("q1", points=Q1_POINTS if (_has_gpu() or _nvcc() or _host_cc()) else 0, objects=("KERNEL",))
def q1(t: Trial, KERNEL):
    """KERNEL compiles (CuPy/NVRTC on a GPU; nvcc for sm_75, or g++ for the CPU, without one) and defines
    attn_lab_d16/32/64."""
    source = _student(KERNEL)
    if _has_gpu():
        try:
            _cupy_compile(source, ENTRY_POINTS)
        except MissingKernels as e:
            return 0.0, str(e)
        except Exception as e:  # noqa: BLE001 - CompileException: the compiler's log is the feedback
            return 0.0, _compile_feedback(str(e))
        return float(Q1_POINTS), "compiles with NVRTC (CuPy) and defines " + ", ".join(ENTRY_POINTS)
    if _nvcc() is not None:
        ok, log, usage = nvcc_compile(source)
        if not ok:
            return 0.0, _compile_feedback(log) + "\n" + _q2_where()
        found = {u["kernel"] for u in usage}
        missing = [name for name in ENTRY_POINTS if name not in found]
        if missing:
            return 0.0, f"compiles, but these kernels are missing: {', '.join(missing)}\n" + _q2_where()
        regs = ", ".join(f"{u['kernel']} {u['registers']} registers" for u in usage if u["kernel"] in ENTRY_POINTS)
        return float(Q1_POINTS), f"compiles with nvcc for sm_{NVCC_ARCH} ({regs}).\n" + _q2_where()
    if not _host_cc():
        return 0.0, _needs("q1") + "\n" + _needs("q2")
    try:
        _host_program(source)
    except MissingKernels as e:
        return 0.0, str(e)
    except hostcuda.CompileError as e:
        return 0.0, _compile_feedback(e.log)
    return float(Q1_POINTS), ("compiles for the CPU with g++ and defines " + ", ".join(ENTRY_POINTS) + " (no nvcc "
                              "here: an error only the CUDA compiler makes would show on a GPU or with nvcc).")


@LAB.question("q2", points=Q2_POINTS if (_has_gpu() or _host_cc()) else 0, objects=("KERNEL",))
def q2(t: Trial, KERNEL):
    """Random shapes, causal with rows that see no key, and huge logits, against the reference: on the GPU, or on
    the CPU (g++) without one."""
    source = _student(KERNEL)
    if _has_gpu():
        try:
            _cupy_compile(source, ENTRY_POINTS)
        except MissingKernels as e:
            return 0.0, f"cannot run: {e} (fix q1 first)"
        except Exception as e:  # noqa: BLE001
            return 0.0, "cannot run: " + _compile_feedback(str(e)) + "\n(fix q1 first)"
        cases = random_cases(t)
        run = _gpu_runner(source)
    elif _host_cc():
        try:
            _host_program(source)
        except MissingKernels as e:
            return 0.0, f"cannot run: {e} (fix q1 first)"
        except hostcuda.CompileError as e:
            return 0.0, "cannot run: " + _compile_feedback(e.log) + "\n(fix q1 first)"
        cases = random_cases(t)
        run = _host_runner(source, [c for part in cases.values() for c in part])
    else:
        return 0.0, _needs("q2")
    passed: list = []  # filled by every part before any diagnosis runs (in t.result())
    _check_part(t, "random shapes: ragged n, m != n, n = 1, several blocks", 2, run, cases["plain"], passed)
    _check_part(t, "causal, including rows that see no key", 2, run, cases["causal"], passed)
    _check_part(t, "huge logits (scores up to about +-2000)", 1, run, cases["huge"], passed)
    return None


#: Whether this lab's questions need a GPU here (flashlab.mistakes): not where g++ runs the kernels on the CPU.
NEEDS_GPU = not (_has_gpu() or _host_cc())


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _mutants_demo() -> Demo:
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, n, 16)).astype(np.float32) for n in (3, 5, 5))
    big = (rng.integers(-500, 501, (1, 3, 16)).astype(np.float32), rng.integers(-2, 3, (1, 5, 16)).astype(np.float32),
           v)
    return Demo(
        examples=[("random, n = 3, m = 5, d = 16", (q, k, v, False)),
                  ("causal with n = 5 > m = 3: the first two rows see no key", (k, q, q, True)),
                  ("causal with m = 5 > n = 3: row i sees the keys j <= i + 2", (q, k, v, True)),
                  ("integer Q and K: scores up to about +-2000", (*big, False))],
        run=lambda source, args: attention(source, *args[:3], causal=args[3]),
        right=lambda args: reference.attention(*(a.astype(np.float64) for a in args[:3]), causal=args[3],
                                               scale=float(np.float32(0.25))),
        names=("O", "L"),
        rtol=1e-4, atol=1e-5,  # fp32 kernels: rounding is not a mistake (lab 06 matches outputs within 1e-4)
    )


# A mutant here is a wrong loop body, not a function: a student hands in the notebook's KERNEL string with it.
KNOWN_MISTAKES = KnownMistakes(
    demos={"MUTANTS": _mutants_demo},
    submission=lambda mutant: render(mutant.update),
    sources=lambda mutant: (SOLUTION, mutant.update),
)
