"""Lab 05 — a FlashAttention kernel in ``numba.cuda``, graded in the CUDA simulator.

q1 ``make_kernel(BLOCK_Q, BLOCK_K, D, DV)`` returns the student's kernel (the tile loop is theirs: stage K and V
tiles in shared memory, barrier, update each row's state, barrier). It is launched through
:func:`flashlab.numba_cuda.launch` inside :func:`flashlab.racetrace.trace_shared_memory`, which records
every shared-memory access with the barrier count of the thread that made it. That makes the three classic
mistakes visible whatever order the simulator ran the threads in:

* a missing ``cuda.syncthreads()`` — two threads touch one shared element between the same two barriers, one
  writing (a data race; on a GPU the result depends on timing, in the simulator usually garbage);
* reading past the last ragged tile — the simulator raises IndexError for a read of K or V beyond m (a GPU reads
  whatever lies there), or, when the load is guarded but the update still walks all BLOCK_K rows, the answer
  is wrong only when m is not a multiple of BLOCK_K;
* a shared tile of the wrong size — the trace holds every shared array's shape; too small raises IndexError.

q2 ``run_kernel(kernel, Q, K, V, BLOCK_Q)`` launches a (correct, package) kernel: grid, block, outputs, scale.
"""

from __future__ import annotations

import math
import os
import traceback
from typing import Callable

import numpy as np

from .. import numba_cuda, racetrace, reference
from .core import Case, Lab, Mutant, Trial, allclose
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis, demo_qkv, solution_variant
from .remote import remote_exception

LAB = Lab("lab05", "A FlashAttention kernel in numba.cuda")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. q1's check launches the
# kernel with flashlab.numba_cuda.launch, so launch stays usable there; q2's builds the course's kernel with
# make_cuda_kernel, so that stays usable in q2. Computing the answer on the CPU answers either.
_CPU = ("flashlab.reference.attention", "flashlab.tiled.forward", "flashlab.numba_cpu.tiled_forward",
        "flashlab.numba_cpu.fast_forward")
ANSWERS = {
    "q1": ("flashlab.numba_cuda.make_cuda_kernel", "flashlab.numba_cuda.cuda_forward", *_CPU),
    "q2": ("flashlab.numba_cuda.launch", "flashlab.numba_cuda.cuda_forward", *_CPU),
}
# q2's grading builds the course's kernel with make_cuda_kernel in the notebook's process, so the sandbox's copy
# of the package keeps it (answers.student_package); q1's factory is judged apart (RUN_APART), where its source
# may use numba.cuda and math only, so handing in make_cuda_kernel is refused there.
# The lab's own last cell compares the learner's kernel with flashlab.reference.attention, so that stays too;
# q2 checks that run_kernel launched the kernel it was given, which computing on the CPU does not.
SANDBOX_KEEP = ("flashlab.numba_cuda.make_cuda_kernel", "flashlab.reference.attention")
# The batch grader takes make_kernel's source out of the notebook, checks that it is kernel language, and launches
# and traces it in a fresh sandbox (flashlab.grading.kernelcheck): the race report cannot be tampered with there.
RUN_APART = ("make_kernel",)

_NEEDS_SIMULATOR = (
    "this lab runs kernels in the CUDA simulator: restart the kernel and run the first cells in order "
    "(use_simulator() must run before numba.cuda is imported)"
)


def _qkv(t: Trial, batch: int, n: int, m: int, d: int, dv: int):
    return (t.rng.standard_normal((batch, n, d)), t.rng.standard_normal((batch, m, d)),
            t.rng.standard_normal((batch, m, dv)))


def _case(t: Trial, batch, n, m, d, dv, bq, bk) -> Case:
    return Case((*_qkv(t, batch, n, m, d, dv), bq, bk),
                f"batch={batch}, n={n}, m={m}, d={d}, dv={dv}, BLOCK_Q={bq}, BLOCK_K={bk}",
                names=("Q", "K", "V", "BLOCK_Q", "BLOCK_K"))


def _ref(case: Case):
    return reference.attention(*case.args[:3])


def _zero_padded_ref(case: Case):
    """What a kernel computes when its last tile runs over all BLOCK_K rows, the missing keys read as zeros."""
    Q, K, V, _, bk = case.args
    pad = (-K.shape[1]) % bk
    K = np.concatenate([K, np.zeros(K.shape[:1] + (pad, K.shape[2]))], axis=1)
    V = np.concatenate([V, np.zeros(V.shape[:1] + (pad, V.shape[2]))], axis=1)
    scale = 1.0 / math.sqrt(Q.shape[2])
    return reference.attention(Q, K, V, scale=scale)


def _visits(case: Case, *, drop_ragged: bool = False, step_q: bool = False, skipped: str = "",
            no_offset: str = "") -> list[tuple[int, int]]:
    """The (K row, V row) pairs a kernel's update loop folds in, in order, tile by tile: the right loop visits
    (j, j) for j = 0 .. m - 1; each switch is one wrong loop (a tile step of BLOCK_Q, the "first" or "last" key of
    every tile skipped, the tile loads of "K", "V" or "KV" without the tile's offset k0)."""
    _, K, _, bq, bk = case.args
    m = K.shape[1] - (K.shape[1] % bk if drop_ragged else 0)
    visits = []
    for k0 in range(0, m, bq if step_q else bk):
        for j in range(1 if skipped == "first" else 0, min(bk, m - k0) - (skipped == "last")):
            visits.append((j if "K" in no_offset else k0 + j, j if "V" in no_offset else k0 + j))
    return visits


def _emulate(case: Case, *, update_max: bool = True, rescale_acc: bool = True, rescale_l: bool = True,
             subtract_max: bool = True, alpha_flipped: bool = False, max_first: bool = False,
             alpha_on_new: bool = False, **loop) -> tuple[np.ndarray, np.ndarray]:
    """(O, L) of the kernel's loop, key by key in float64, with one of the classic wrong updates switched on: what
    a kernel with that mistake returns (the known mistakes of q1 are recognised by these outputs). ``loop`` picks
    the keys visited (:func:`_visits`)."""
    Q, K, V, _, bk = case.args
    q = Q / math.sqrt(Q.shape[2])
    mx = np.full(Q.shape[:2], -np.inf)
    l = np.zeros(Q.shape[:2])  # noqa: E741 -- the kernel's name
    acc = np.zeros(Q.shape[:2] + (V.shape[2],))
    with np.errstate(all="ignore"):
        for kj, vj in _visits(case, **loop):
            s = np.einsum("bnd,bd->bn", q, K[:, kj])
            m_new = np.maximum(mx, s)
            if max_first and update_max:
                mx = m_new
            alpha = np.exp(m_new - mx) if alpha_flipped else np.exp(mx - m_new)
            p = np.exp(s - m_new) if subtract_max else np.exp(s)
            if alpha_on_new:
                l, acc = l + alpha * p, acc + (alpha * p)[..., None] * V[:, vj][:, None, :]  # noqa: E741
            else:
                l = (l * alpha if rescale_l else l) + p  # noqa: E741
                acc = (acc * alpha[..., None] if rescale_acc else acc) + p[..., None] * V[:, vj][:, None, :]
            if update_max:
                mx = m_new
        return acc / l[..., None], mx + np.log(l)


def _emulated(**switches) -> Callable:
    def explains(case, got, expected):
        return allclose(got, _emulate(case, **switches))

    return explains


# Mistakes of the update loop, each recognised by the outputs it gives (``_emulate``).
UPDATE_MUTANTS = [
    Mutant("the running max is never updated (m_i = m_new is missing): every key then counts as the first, and O "
           "is the last key's value row. Set m_i = m_new after the update.", explains=_emulated(update_max=False)),
    Mutant("the accumulator is not rescaled: when the max grows, acc must be multiplied by alpha = exp(m_old - "
           "m_new) before adding p * v, like l.", explains=_emulated(rescale_acc=False)),
    Mutant("l is not rescaled: when the max grows, l must be multiplied by alpha = exp(m_old - m_new) before "
           "adding p, like the accumulator.", explains=_emulated(rescale_l=False)),
    Mutant("the max is not subtracted from the score: p = exp(s - m_new), so that p and alpha count against the "
           "same max.", explains=_emulated(subtract_max=False)),
    Mutant("alpha is inverted: the rescale factor is exp(m_old - m_new) (at most 1), not exp(m_new - m_old).",
           explains=_emulated(alpha_flipped=True)),
    Mutant("the max is updated before alpha is computed: alpha = exp(m_i - m_new) is then always 1 and nothing is "
           "rescaled. Compute alpha with the old max, then set m_i = m_new.", explains=_emulated(max_first=True)),
    Mutant("alpha multiplies the new term instead of what was accumulated: l_i = l_i * alpha + p and acc = acc * "
           "alpha + p * v (alpha rescales the old sums to the new max; p is already against it).",
           explains=_emulated(alpha_on_new=True)),
    Mutant("the tile loop steps by BLOCK_Q instead of BLOCK_K: for k0 in range(0, m, BLOCK_K) — with BLOCK_Q < "
           "BLOCK_K keys are counted twice, with BLOCK_Q > BLOCK_K some are never seen.",
           explains=_emulated(step_q=True)),
    Mutant("one key of every tile is skipped (an off-by-one in the update loop's bounds): j runs over "
           "range(min(BLOCK_K, m - k0)), from the tile's first key to its last.", explains=lambda case, got, _: any(
               allclose(got, _emulate(case, skipped=which)) for which in ("first", "last"))),
]


def _without_offset(case, got, expected):
    # K, V or both loaded as K[b, j, c] instead of K[b, k0 + j, c]: every tile then holds the first one's keys
    return any(allclose(got, _emulate(case, no_offset=which)) for which in ("K", "V", "KV"))


UPDATE_MUTANTS.append(
    Mutant("the tile load forgets the tile's offset: K[b, j, c] (or V[b, j, c]) reads the first tile again for "
           "every k0; load K[b, k0 + j, c] and V[b, k0 + j, c].", explains=_without_offset))


# ------------------------------------------------------------------------------------------- q1: the kernel
@LAB.question("q1", points=6, objects=("make_kernel",))
def q1(t: Trial, make_kernel):
    """make_kernel's kernel stages K/V tiles in shared memory, synchronises, and updates each row's state."""
    if getattr(make_kernel, "rejected", None):
        return 0.0, f"not graded: {make_kernel.rejected}."
    if not (make_kernel.procedure("flashlab.grading.lab05:simulator_state") if hasattr(make_kernel, "procedure")
            else numba_cuda.simulator_active()):
        return 0.0, _NEEDS_SIMULATOR
    info: dict[str, dict] = {}

    def run(factory, case: Case):
        Q, K, V, bq, bk = case.args
        record = info.setdefault(case.label, {})
        if not hasattr(factory, "procedure"):
            return _traced(factory, Q, K, V, bq, bk, record)
        # The batch grader's proxy: launch and trace where the notebook runs.
        O, L, remote_record = factory.procedure("flashlab.grading.lab05:traced_launch", Q, K, V, bq, bk)
        if not isinstance(remote_record, dict):
            raise TypeError("the traced launch returned no record")
        record.update(remote_record)
        error = record.get("error")
        if error:
            raise remote_exception(str(error[0]), str(error[1]))
        return O, L

    def raced(*kinds):
        def explains(case, got, expected):
            return any(isinstance(r, dict) and r.get("missing") in kinds
                       for r in info.get(case.label, {}).get("races", []))

        return explains

    def whole_last_tile(case, got, expected):
        record = info.get(case.label, {})
        if not record.get("ragged") or record.get("races") or allclose(got, _emulate(case, drop_ragged=True)):
            return False
        if allclose(got[:1], _zero_padded_ref(case)[:1]):
            return True  # the padding rows were zeros
        # garbage (old keys) in the padding: wrong only where the last tile is ragged
        return bool(full_tiles_right)

    def low_precision(case, got, expected):
        return any(v != "float64" for v in info.get(case.label, {}).get("dtypes", {}).values())

    mutants = [
        Mutant("missing barrier: the threads read a shared tile that other threads had not finished writing "
               "(or overwrote it while others still read it). Call cuda.syncthreads() after loading a tile and "
               "again after using it; the race report below says which one is missing.",
               explains=raced("after loading", "after using")),
        Mutant("reading past the last ragged tile: when m is not a multiple of BLOCK_K the last tile has only "
               "m - k0 keys; the update must stop there (the extra rows of the tile hold zeros or old keys).",
               explains=whole_last_tile),
        Mutant("shared tiles in a lower precision than the inputs: allocate them as float64, like Q, K and V.",
               explains=low_precision),
        *UPDATE_MUTANTS,
    ]
    full_tiles_right: list[bool] = []  # set after the first part: were all inputs without a ragged tile right?
    names = ("O", "L")

    # The first input of each part has at least two K/V tiles: with one tile a missing second barrier (the next
    # tile overwriting one still being read) cannot happen, and the part would pass such a kernel.
    even = []
    for i in range(3):
        bq, bk = (int(x) for x in t.rng.choice([4, 8, 16], size=2))
        n, m = bq * int(t.rng.integers(1, 3)), bk * int(t.rng.integers(2 if i == 0 else 1, 4))
        d, dv = (int(x) for x in t.rng.integers(1, 7, size=2))
        even.append(_case(t, int(t.rng.integers(1, 3)), n, m, d, dv, bq, bk))
    if t.compare("n and m multiples of the blocks", 2, student=make_kernel, cases=even, reference=_ref, run=run,
                 mutants=mutants, names=names):
        full_tiles_right.append(True)

    ragged = [_case(t, 1, 1, 1, 2, 3, 4, 4)]  # one query, one key: far smaller than a tile
    for i in range(4):
        bq, bk = (int(x) for x in t.rng.choice([4, 8, 16], size=2))
        n = int(t.rng.integers(1, 40))
        m = bk * int(t.rng.integers(1 if i == 0 else 0, 3)) + int(t.rng.integers(1, bk))
        d, dv = (int(x) for x in t.rng.integers(1, 7, size=2))
        ragged.append(_case(t, int(t.rng.integers(1, 3)), n, m, d, dv, bq, bk))
    ok = t.compare("ragged: n or m not a multiple of the blocks", 2, student=make_kernel, cases=ragged,
                   reference=_ref, run=run, mutants=mutants, names=names)
    if not ok and any(r.get("overrun") for r in info.values()):
        label, got, points, message = t.parts[-1]  # the message may be computed later (a callable)

        def with_hint(message=message):
            # The IndexError names the mistake, so the "no known mistake explains..." line would contradict it.
            text = message() if callable(message) else message
            text = "\n".join(line for line in text.splitlines() if not line.startswith("No known mistake explains"))
            return "Likely mistake: reading past the last ragged tile (see the IndexError below).\n" + text

        t.parts[-1] = (label, got, points, with_hint)

    # Tile shapes on a launch where BLOCK_Q != BLOCK_K and D != DV, so that every confusion shows.
    bq, bk, d, dv = 8, 4, 3, 5
    shape_case = _case(t, 1, 11, 9, d, dv, bq, bk)
    try:
        first = run(make_kernel, shape_case)
    except Exception:
        first = None
    # The structure parts pay for a kernel that computes: run again with V doubled; a kernel that multiplies by V
    # writes a different O (even with a race or a ragged-tile bug: the diagnoses below still need its tiles), one
    # that only declares tiles and barriers, or writes constants, writes the same one (or nothing: NaN) twice.
    Q, K, V, _, _ = shape_case.args
    doubled = Case((Q, K, 2 * V, bq, bk), shape_case.label + ", V doubled")
    try:
        second = run(make_kernel, doubled)
    except Exception:
        second = None
    computes = False
    if first is not None and second is not None:
        o1, o2 = (np.asarray(x[0], dtype=np.float64) for x in (first, second))
        if o1.shape == o2.shape:
            both = np.isfinite(o1) & np.isfinite(o2)
            computes = bool(np.any(np.abs(o1[both]) > 1e-200)) and not np.array_equal(o1[both], o2[both])
    if not computes:
        why = ("structure not credited: your kernel's output does not come from its inputs (on an input with "
               "V doubled it wrote the same O, or nothing but zeros or NaN): the tile and barrier parts pay for a "
               "kernel that computes")
        t.expect("shared tiles are (BLOCK_K, D) and (BLOCK_K, DV), float64", 1, False, why)
        t.expect("no data races on shared memory", 1, False, why)
        return None
    record = info.get(shape_case.label, {})
    shapes, dtypes = record.get("shapes", {}), record.get("dtypes", {})
    want = sorted([(bk, d), (bk, dv)])
    got = sorted(tuple(s) for s in shapes.values())
    if got == want and all(v == "float64" for v in dtypes.values()):
        t.expect("shared tiles are (BLOCK_K, D) and (BLOCK_K, DV), float64", 1, True)
    else:
        shown = ", ".join(f"{s} {dtypes.get(k, '')}" for k, s in shapes.items()) or "none"
        t.expect("shared tiles are (BLOCK_K, D) and (BLOCK_K, DV), float64", 1, False,
                 f"shared tile of the wrong size: with BLOCK_Q={bq}, BLOCK_K={bk}, D={d}, DV={dv} your kernel "
                 f"allocated {shown}; a K tile holds BLOCK_K keys of D values, a V tile BLOCK_K rows of DV, in "
                 f"float64 like the inputs.")

    records = list(info.values())
    races = [r for rec in records for r in rec.get("races", []) if isinstance(r, dict)]
    ran = any(rec.get("shapes") for rec in records) and any(rec.get("barriers") for rec in records)
    if races:
        # The threads' own order tells which barrier is missing; the simulator's order only where it cannot.
        telling = [r for r in races if r.get("certain")] or races
        races = telling + [r for r in races if r not in telling]
        missing = [m for m in ("after loading", "after using") if any(r.get("missing") == m for r in telling)]
        why = {"after loading": "a thread read the tile before every thread had finished loading it: call "
                                "cuda.syncthreads() after the loads, before the first read",
               "after using": "a thread loaded the next tile while another still read this one: call "
                              "cuda.syncthreads() after the update loop, before the next loads"}
        said = "; ".join(f"missing barrier {m}: {why[m]}" for m in missing) or (
            "two threads wrote the same shared element between two barriers: check the copy loop's index against "
            "the tile's shape")
        t.expect("no data races on shared memory", 1, False, f"{said}. First race seen: {races[0].get('text')}.")
    else:
        t.expect("no data races on shared memory", 1, ran,
                 "the kernel never staged a tile in shared memory with a barrier (cuda.shared.array and "
                 "cuda.syncthreads())")
    return None


# ---------------------------------------------------------------------- what runs where the notebook runs
def simulator_state(_obj) -> bool:
    """Whether the notebook's process runs numba.cuda in the simulator (a remote procedure of the batch grader)."""
    return numba_cuda.simulator_active()


def _kernel_line(error: BaseException) -> str:
    """"at line N: <code>" of the deepest frame of ``error`` in the learner's kernel (outside the course's package
    and numba), or "" when there is none."""
    skip = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(numba_cuda.__file__))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(skip) and "numba" not in f.filename]
    if not frames:
        return ""
    return f"at line {frames[-1].lineno}" + (f": {frames[-1].line}" if frames[-1].line else " of make_kernel's cell")


def _traced(factory: Callable, Q, K, V, bq: int, bk: int, record: dict):
    """Build the student's kernel with ``factory(bq, bk, D, DV)`` and launch it on (Q, K, V) inside a shared-memory
    trace; ``record`` receives what the trace saw (races, tile shapes and dtypes, barriers)."""
    kernel = factory(bq, bk, Q.shape[2], V.shape[2])
    with racetrace.trace_shared_memory() as trace:
        try:
            return numba_cuda.launch(kernel, Q, K, V, block_q=bq)
        except IndexError as e:
            if trace.out_of_bounds:
                name, index, shape, where = trace.out_of_bounds[0]
                record["small_tile"] = True
                record["out_of_bounds"] = [name, where]
                raise IndexError(f"{name} of shape {shape} was indexed at {list(index)}"
                                 + (f" on {where}" if where else "") + f" (BLOCK_K={bk}, D={Q.shape[2]}, "
                                 f"DV={V.shape[2]}): check that index against {name}'s shape") from None
            if K.shape[1] % bk:
                record["overrun"] = True
                overrun = IndexError(f"read past the end of K or V on the last ragged tile (m={K.shape[1]}, "
                                     f"BLOCK_K={bk}): only rows k0 + j < m exist; guard the load ({e})")
                overrun.where = _kernel_line(e)  # the learner's line, not this one
                raise overrun from None
            raise
        finally:
            record.update(races=[{"text": str(r), "missing": r.missing, "certain": r.certain} for r in trace.races],
                          shapes=dict(trace.shapes), dtypes=dict(trace.dtypes),
                          barriers=trace.barriers, ragged=K.shape[1] % bk != 0)


def traced_launch(factory: Callable, Q, K, V, bq: int, bk: int) -> tuple:
    """``(O, L, record)`` of one traced launch of the student's kernel (O and L None and ``record["error"]`` =
    (type name, message) if it raised), in plain values that can be sent back.

    The batch grader runs this in a fresh sandbox that holds only the student's kernel factory, taken out of the
    notebook and checked to be kernel language (:mod:`flashlab.grading.kernelcheck`); outputs and trace are judged
    outside.
    """
    record: dict = {}
    O = L = None
    try:
        O, L = _traced(factory, Q, K, V, bq, bk, record)
    except Exception as e:  # the student's kernel may raise anything
        record["error"] = [type(e).__name__, str(e)[:1000]]
    record.update(races=[{"text": str(r.get("text", "")), "missing": str(r.get("missing", ""))}
                         for r in record.get("races", [])],
                  shapes={str(k): [int(x) for x in v] for k, v in record.get("shapes", {}).items()},
                  dtypes={str(k): str(v) for k, v in record.get("dtypes", {}).items()},
                  barriers=int(record.get("barriers", 0)), ragged=bool(record.get("ragged", False)))
    return O, L, record


class _CountedKernel:
    """A kernel that counts its launches (``kernel[grid, block](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, config):
        self.launches += 1
        return self.kernel[config]


def launch_with_package_kernel(run_kernel: Callable, Q, K, V, bq: int, bk: int):
    """``(O, L, launches)``: ``run_kernel(kernel, Q, K, V, bq)`` with the package's kernel for these shapes, and
    how many times it launched that kernel (a remote procedure)."""
    kernel = _CountedKernel(numba_cuda.make_cuda_kernel(bq, bk, Q.shape[2], V.shape[2], "float64"))
    O, L = run_kernel(kernel, Q, K, V, bq)
    return O, L, kernel.launches


# ------------------------------------------------------------------------------------------ q2: the launch
def _launch_with(grid_fn, threads_fn=lambda bq: bq, scale_fn=lambda d: 1.0 / math.sqrt(d)):
    def run_kernel(kernel, Q, K, V, BLOCK_Q):
        batch, n, d = Q.shape
        O = np.zeros((batch, n, V.shape[2]))
        L = np.zeros((batch, n))
        kernel[grid_fn(n, batch, BLOCK_Q), threads_fn(BLOCK_Q)](Q, K, V, O, L, n, K.shape[1], scale_fn(d), False)
        return O, L

    return run_kernel


LAUNCH_MUTANTS = [
    Mutant("the last ragged block of queries is never launched: n // BLOCK_Q blocks miss the last n % BLOCK_Q "
           "rows; launch ceil(n / BLOCK_Q) = (n + BLOCK_Q - 1) // BLOCK_Q blocks along x.",
           fn=_launch_with(lambda n, b, bq: (max(n // bq, 1), b))),
    Mutant("grid axes swapped: the kernel reads the query block from blockIdx.x and the batch entry from "
           "blockIdx.y, so the grid is (query blocks, batch).",
           fn=_launch_with(lambda n, b, bq: (b, (n + bq - 1) // bq))),
    Mutant("missing the 1/sqrt(d) scale: pass scale = 1 / sqrt(d) to the kernel.",
           fn=_launch_with(lambda n, b, bq: ((n + bq - 1) // bq, b), scale_fn=lambda d: 1.0)),
]


@LAB.question("q2", points=2, objects=("run_kernel",))
def q2(t: Trial, run_kernel):
    """run_kernel(kernel, Q, K, V, BLOCK_Q) launches one block of BLOCK_Q threads per query block and batch entry."""
    if not numba_cuda.simulator_active():
        return 0.0, _NEEDS_SIMULATOR

    def run(fn, case: Case):
        Q, K, V, bq, bk = case.args
        try:
            if hasattr(fn, "procedure"):  # the batch grader's proxy: the package's kernel is built where it runs
                O, L, launches = fn.procedure("flashlab.grading.lab05:launch_with_package_kernel", Q, K, V, bq, bk)
            else:
                O, L, launches = launch_with_package_kernel(fn, Q, K, V, bq, bk)
        except IndexError as e:
            raise IndexError(f"a thread block indexed outside Q, K or V: is the grid (query blocks, batch), "
                             f"with blockIdx.x walking the queries? ({e})") from None
        if not launches:
            raise ValueError("run_kernel returned without launching the kernel it was given: launch it as "
                             "kernel[grid, threads](Q, K, V, O, L, n, m, scale, False)")
        return O, L

    cases = [_case(t, 2, 9, 5, 3, 2, 4, 4)]
    for _ in range(3):
        bq, bk = (int(x) for x in t.rng.choice([4, 8], size=2))
        n, m = (int(x) for x in t.rng.integers(1, 30, size=2))
        cases.append(_case(t, int(t.rng.integers(1, 4)), n, m, int(t.rng.integers(1, 6)), 3, bq, bk))
    t.compare("outputs of the launched kernel", 2, student=run_kernel, cases=cases, reference=_ref, run=run,
              mutants=LAUNCH_MUTANTS, names=("O", "L"))
    return None


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _kernel(*edits: tuple[str, str]) -> Callable[[], Callable]:
    """A builder of the solution's make_kernel with ``edits`` applied to its source."""
    def build():
        from numba import float32

        return solution_variant("lab05", "make_kernel", edits, {"float32": float32})

    return build


_TILE_LOADED = "cuda.syncthreads()                           # the tile is complete before anyone reads it"
_TILE_USED = "cuda.syncthreads()                           # everyone is done before the next tile overwrites it"
_MAX_UPDATE = "                    m_i = m_new\n"
_MAX_FIRST = "m_i = m_new\n                    alpha = math.exp(m_i - m_new)"


def _launch_demo() -> Demo:
    def run(fn, args):
        Q, K, V, bq, bk = args
        kernel = numba_cuda.make_cuda_kernel(bq, bk, Q.shape[2], V.shape[2], "float64")
        return fn(kernel, Q, K, V, bq)

    return Demo(
        examples=[("batch = 3, n = 5, m = 5, d = 3, dv = 1, BLOCK_Q = BLOCK_K = 4",
                   (*demo_qkv(5, 5, 3, 1, seed=4, batch=3), 4, 4))],
        run=run,
        right=lambda args: reference.attention(*args[:3]),
        names=("O", "L"),
    )


def _kernel_demo() -> Demo:
    def run(factory, args):
        Q, K, V, bq, bk = args
        with racetrace.trace_shared_memory() as trace:
            O, L = numba_cuda.launch(factory(bq, bk, Q.shape[2], V.shape[2]), Q, K, V, block_q=bq)
        return O, L, len(trace.races)

    return Demo(
        examples=[("batch = 1, n = 5, m = 6, d = dv = 2, BLOCK_Q = BLOCK_K = 4 (the last K/V tile holds 2 keys)",
                   (*demo_qkv(5, 6, 2, 2, seed=6, batch=1), 4, 4))],
        run=run,
        right=lambda args: (*reference.attention(*args[:3]), 0),
        names=("O", "L", "data races seen"),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"LAUNCH_MUTANTS": _launch_demo, "q1": _kernel_demo},
    hand_written={
        ("q1", "missing barrier"): [
            HandWritten("no cuda.syncthreads() after loading a tile", _kernel((_TILE_LOADED, "pass")),
                        expect="missing barrier after loading"),
            HandWritten("no cuda.syncthreads() after using a tile", _kernel((_TILE_USED, "pass")),
                        expect="missing barrier after using"),
        ],
        ("q1", "reading past the last ragged tile"): [
            HandWritten("the update walks all BLOCK_K rows of the last tile",
                        _kernel(("range(min(BLOCK_K, m - k0))", "range(BLOCK_K)"))),
            HandWritten("the tile load is not guarded by k0 + j < m", _kernel((" if k0 + j < m else 0.0", "")),
                        expect="ragged tile"),
        ],
        ("q1", "the running max is never updated"): [
            HandWritten("m_i = m_new left out", _kernel((_MAX_UPDATE, "                    pass\n"))),
        ],
        ("q1", "the accumulator is not rescaled"): [
            HandWritten("acc += p * v", _kernel(("acc[c] * alpha + p", "acc[c] + p"))),
        ],
        ("q1", "l is not rescaled"): [
            HandWritten("l_i += p", _kernel(("l_i = l_i * alpha + p", "l_i = l_i + p"))),
        ],
        ("q1", "the max is not subtracted"): [
            HandWritten("p = exp(s)", _kernel(("p = math.exp(s - m_new)", "p = math.exp(s)"))),
        ],
        ("q1", "alpha is inverted"): [
            HandWritten("alpha = exp(m_new - m_i)", _kernel(("math.exp(m_i - m_new)", "math.exp(m_new - m_i)"))),
        ],
        ("q1", "the max is updated before alpha"): [
            HandWritten("m_i = m_new before alpha", _kernel(("alpha = math.exp(m_i - m_new)", _MAX_FIRST))),
        ],
        ("q1", "alpha multiplies the new term"): [
            HandWritten("l_i + alpha * p, acc + alpha * p * v",
                        _kernel(("l_i = l_i * alpha + p", "l_i = l_i + alpha * p"),
                                ("acc[c] * alpha + p * v_tile[j, c]", "acc[c] + alpha * p * v_tile[j, c]"))),
        ],
        ("q1", "the tile loop steps by BLOCK_Q"): [
            HandWritten("range(0, m, BLOCK_Q)", _kernel(("range(0, m, BLOCK_K)", "range(0, m, BLOCK_Q)"))),
        ],
        ("q1", "one key of every tile is skipped"): [
            HandWritten("j from 1", _kernel(("range(min(BLOCK_K, m - k0))", "range(1, min(BLOCK_K, m - k0))"))),
            HandWritten("j to the tile's end - 1",
                        _kernel(("range(min(BLOCK_K, m - k0))", "range(min(BLOCK_K, m - k0) - 1)"))),
        ],
        ("q1", "the tile load forgets the tile's offset"): [
            HandWritten("K[b, j, c]", _kernel(("K[b, k0 + j, c] if", "K[b, j, c] if"))),
            HandWritten("K and V at j", _kernel(("K[b, k0 + j, c] if", "K[b, j, c] if"),
                                                ("V[b, k0 + j, c] if", "V[b, j, c] if"))),
        ],
        ("q1", "shared tiles in a lower precision"): [
            HandWritten("float32 shared tiles", _kernel(("shared.array((BLOCK_K, D), float64)",
                                                         "shared.array((BLOCK_K, D), float32)"))),
        ],
    },
    # The swapped grid often makes the simulator raise IndexError before any output can be matched; the grader
    # then names it in its hint about the grid instead of by the message. Both name the grid this way.
    expect={("q2", "grid axes swapped"): "(query blocks, batch)"},
    other_diagnoses=[
        OtherDiagnosis("q1", "make_kernel", "shared tile of the wrong size",
                       HandWritten("the K tile allocated as (BLOCK_Q, D)",
                                   _kernel(("shared.array((BLOCK_K, D)", "shared.array((BLOCK_Q, D)")),
                                   expect="shared tile of the wrong size")),
    ],
)
