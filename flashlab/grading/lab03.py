"""Lab 03 — counting HBM accesses: the closed forms of chapter 3, block sizes for a given M, the n = 65 536 ratio,
and one count the chapter does not print: the backward pass in FlashAttention-2's loop order.

Every forward formula is graded against :func:`flashlab.iocount.predict`, which chapter 3 and
``tests/test_iocount.py`` check against the access counter itself. The counting model and the default blocks are
those of :mod:`flashlab.iocount`.

q1: ``standard_counts(n, d, sram, block_q, block_k)``, ``kv_outer_counts(...)`` and ``q_outer_counts(...)``
return ``(reads, writes)``; one part each, so a student who has written only the first sees it graded.
q2: ``paper_blocks(d, sram)`` returns ``(B_r, B_c)``; ``best_q_outer_blocks(n, d, sram)`` returns blocks that fit
and move (almost) as little as possible. q3: ``traffic_ratio(n, d, sram)`` is standard's accesses over
Algorithm 1's with default blocks; it is meant to call the student's q1 and q2 functions, which q3 therefore
receives too: when one of them is wrong on q3's inputs, q3 says so instead of diagnosing the ratio.
q4: ``q_outer_backward_counts(n, d, sram, block_q, block_k)`` — the backward with query blocks outside, derived by
the student — is graded against :func:`count_q_outer_backward`, which runs that backward through the counter's
HBM and SRAM (real data, gradients checked against the reference) on every input.

q5: ``tile_kinds(n, m, block_q, block_k, left, right, stride)`` classifies the tiles of a window pattern (chapter 3,
section 11: ``-left <= delta <= right`` and ``delta % stride == 0``, ``delta = j - (i + m - n)``) as EMPTY, PARTIAL
or FULL, graded against :mod:`flashlab.blocksparse`, whose patterns the learner may not call. q6:
``tile_work(n, m, d, block_q, block_k, left, right, stride)`` counts the tiles of each kind and the forward's FLOPs,
4 r c d per computed tile; it is meant to call the learner's ``tile_kinds``.

Each part's inputs are drawn from fixed kinds (ragged, divisible, smaller than a block, n = 1, and for standard
attention rows that do not fit in SRAM), so that a mistake fails the same parts whatever the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .. import blocksparse, iocount, reference
from .core import Case, Lab, Mutant, NotImplementedYet, Trial, allclose, as_outputs
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis

LAB = Lab("lab03", "Counting memory accesses")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. The counter and its
# closed forms answer every question; iocount.count is fine in the notebook's own comparison cells, not inside a
# graded function.
# The counter and the simulators it runs (a learner could drive those directly)
_COUNTERS = ("flashlab.iocount.predict", "flashlab.iocount.count", "flashlab.iocount.run",
             *(f"flashlab.iocount.{name}" for name in ("_standard", "_kv_outer", "_q_outer", "_tile_update")))
# flashlab.blocksparse classifies tiles in its patterns' methods, which ANSWERS cannot list: its constructors are
# listed, and the two module-level helpers every classification runs (block_mask and mask check the sizes with
# _check_size; the tile kinds start from _edges), so that a pattern built from its class trips as well.
_PATTERNS = tuple(f"flashlab.blocksparse.{name}" for name in (
    "causal", "sliding_window", "dilated", "local_global", "from_mask", "from_blocks", "as_pattern", "_check_size",
    "_edges"))
# The tile classification itself lives in the patterns' methods: the student copy of the package has them stubbed
# (flashlab.grading.answers.sandbox_methods), so that a sandboxed submission can neither call nor read them.
SANDBOX_METHODS = {"flashlab.blocksparse": ("Pattern._kinds", "Window._kinds", "Window._tile")}
_MASK_MOD = ("flashlab.bench.sparse.mask_mod",)  # FlexAttention's element mask of the same windows
ANSWERS = {
    "q1": (*_COUNTERS, "flashlab.grading.lab03._standard", "flashlab.grading.lab03._kv_outer",
           "flashlab.grading.lab03._q_outer"),
    "q2": (*_COUNTERS, "flashlab.iocount.default_blocks", "flashlab.grading.lab03.best_q_outer"),
    "q3": (*_COUNTERS, "flashlab.iocount.default_blocks"),
    "q4": (*_COUNTERS, "flashlab.grading.lab03.count_q_outer_backward", "flashlab.grading.lab03._q_outer_backward"),
    "q5": (*_PATTERNS, *_MASK_MOD, "flashlab.grading.lab03._kinds", "flashlab.grading.lab03._reduce"),
    "q6": (*_PATTERNS, *_MASK_MOD, "flashlab.grading.lab03._kinds", "flashlab.grading.lab03._reduce",
           "flashlab.grading.lab03.tile_work_of", "flashlab.grading.lab03._work"),
}


def _rw(c: iocount.Counts) -> tuple[int, int]:
    return c.reads, c.writes


# ------------------------------------------------------------------------------------- mutants (wrong formulas)
def _blocks_of(n: int, b: int, ceil) -> float:
    """How many blocks of b rows cover n: right with ceil=True; n / b or n // b for the two ways to get it wrong."""
    if ceil == "floor":
        return n // b
    return math.ceil(n / b) if ceil else n / b


def _standard(n, d, sram, bq, bk, *, rereads=True, second_pass=True, ceil=True, element_bytes=1):
    t_r = _blocks_of(n, bq, ceil)
    kv = 2 * t_r * n * d if rereads else 2 * n * d
    s_reads = 2 * n * n if (n > sram and second_pass) else n * n
    return element_bytes * (n * d + kv + s_reads + n * n), element_bytes * (2 * n * n + n * d)


def _kv_outer(n, d, sram, bq, bk, *, stats=True, init=True, ceil=True, outer="c", reread_q=True):
    b = bk if outer == "c" else bq
    t = _blocks_of(n, b, ceil)
    s = 2 * n if stats else 0
    q_reads = t * n * d if reread_q else n * d
    return 2 * n * d + q_reads + t * (n * d + s), (n * d + s) * ((1 if init else 0) + t)


def _q_outer(n, d, sram, bq, bk, *, write_l=True, ceil=True, outer="r", reread_q=False, o_per_k_tile=False):
    b = bq if outer == "r" else bk
    t = _blocks_of(n, b, ceil)
    q_reads = n * d * (t if reread_q else 1)
    o_writes = math.ceil(n / bk) * n * d if o_per_k_tile else n * d
    return q_reads + 2 * t * n * d, o_writes + (n if write_l else 0)


def _flag(fn, **flags):
    def wrong(n, d, sram, bq, bk):
        return fn(n, d, sram, bq, bk, **flags)

    return wrong


CEIL = ("a ragged last block still costs a whole pass: the number of blocks is ceil(n / B), not n / B "
        "(use math.ceil, or -(-n // B)).")
FLOOR_R = ("T_r = n // block_q drops the ragged last query block: when block_q does not divide n, the last "
           "n % block_q rows are one more block. T_r = ceil(n / block_q) (math.ceil, or -(-n // block_q)).")
FLOOR_C = ("T_c = n // block_k drops the ragged last K/V block: when block_k does not divide n, the last "
           "n % block_k rows are one more block. T_c = ceil(n / block_k) (math.ceil, or -(-n // block_k)).")

STANDARD_MUTANTS = [
    Mutant("K and V are read once per block of B_r query rows, not once: pass 1 re-reads K and pass 3 re-reads V "
           "ceil(n / B_r) times (the paper's accounting, 2nd instead of 2 T_r nd, is a lower bound).",
           fn=_flag(_standard, rereads=False)),
    Mutant("when a row of S does not fit in SRAM (n > M) the softmax reads S twice: once for the max and sum, "
           "once to normalise.", fn=_flag(_standard, second_pass=False)),
    Mutant(CEIL, fn=_flag(_standard, ceil=False)),
    Mutant(FLOOR_R, fn=_flag(_standard, ceil="floor")),
    Mutant("counted in bytes: an access is one element moved, whatever its size (the model counts elements; "
           "multiply by 2 or 4 bytes only when you turn accesses into bytes).",
           fn=_flag(_standard, element_bytes=2)),
]

KV_OUTER_MUTANTS = [
    Mutant("the statistics travel too: each visit reads l_i and m_i (2 B_r numbers) and writes them back.",
           fn=_flag(_kv_outer, stats=False)),
    Mutant("Algorithm 1 first initialises O, l and m in HBM (line 2): nd + 2n writes before the loops.",
           fn=_flag(_kv_outer, init=False)),
    Mutant("the outer loop runs over K/V blocks, so Q and O are re-read T_c = ceil(n / B_c) times (block_k), "
           "not T_r times.", fn=_flag(_kv_outer, outer="r")),
    Mutant(CEIL, fn=_flag(_kv_outer, ceil=False)),
    Mutant(FLOOR_C, fn=_flag(_kv_outer, ceil="floor")),
    Mutant("Q is re-read on every visit too: the inner loop runs over query blocks, so Q_i leaves SRAM after each "
           "one and is loaded again for the next K/V block (T_c nd reads of Q, not nd).",
           fn=_flag(_kv_outer, reread_q=False)),
]

Q_OUTER_MUTANTS = [
    Mutant("L is an output too: n writes besides O's nd.", fn=_flag(_q_outer, write_l=False)),
    Mutant("the outer loop is over Q blocks, so K and V are re-read T_r = ceil(n / B_r) times (block_q).",
           fn=_flag(_q_outer, outer="c")),
    Mutant("Q_i stays in SRAM for the whole inner loop: Q is read once (nd), only K and V are re-read.",
           fn=_flag(_q_outer, reread_q=True)),
    Mutant(CEIL, fn=_flag(_q_outer, ceil=False)),
    Mutant(FLOOR_R, fn=_flag(_q_outer, ceil="floor")),
    Mutant("O_i is written once, after the last K/V block: its accumulator stays on chip for the whole inner loop "
           "(nd writes of O, not one per K/V block).", fn=_flag(_q_outer, o_per_k_tile=True)),
]


#: The kinds of input every part of q1 (and q4) always contains; only the numbers are drawn afresh.
CASE_KINDS = ("ragged", "ragged", "ragged", "divisible", "divisible", "smaller than a block", "n = 1")
#: Standard attention adds rows of S that do not fit in SRAM (n > M: S is streamed twice).
ROW_TOO_LONG = ("n > M", "n > M")


def _one_case(t: Trial, algorithm: str, kind: str, n_max: int, tiles: int) -> tuple[int, int, int, int, int]:
    """(n, d, sram, block_q, block_k) of one kind; block_q != block_k, so that T_r and T_c differ."""
    ints = lambda lo, hi: int(t.rng.integers(lo, hi + 1))  # noqa: E731
    while True:
        if kind == "n > M":
            d, bq, bk = ints(1, 16), ints(1, 40), ints(1, 40)
            sram = (bq + bk) * d + ints(0, 2000)
            n = sram + ints(1, 3000)
        else:
            d = ints(1, 128 if n_max > 1000 else 16)
            bq, bk = ints(2, max(3, n_max // 8)), ints(2, max(3, n_max // 8))
            if kind == "ragged":  # two or more blocks each way, the last one short
                n = ints(2 * max(bq, bk) + 1, max(2 * max(bq, bk) + 1, n_max))
                if n % bq == 0 or n % bk == 0:
                    continue
            elif kind == "divisible":  # one block a multiple of the other, n a multiple of both
                small = ints(2, max(2, n_max // 200))
                bq, bk = (small, small * ints(2, 8))[:: 1 if ints(0, 1) else -1]
                n = max(bq, bk) * ints(2, 10)
            elif kind == "smaller than a block":
                n = ints(1, min(bq, bk) - 1)
            else:
                n = 1
            sram = tiles * (bq + bk) * d + ints(0, 60_000 if n_max > 1000 else 500)
        if bq == bk:
            continue
        try:
            if algorithm in iocount.ALGORITHMS:
                iocount.predict(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
        except iocount.SramOverflow:
            continue
        return n, d, sram, bq, bk


def _cases(t: Trial, algorithm: str) -> list[Case]:
    kinds = CASE_KINDS + (ROW_TOO_LONG if algorithm == "standard" else ())
    tiles = 1 if algorithm == "standard" else 2  # standard holds (B_r + B_c) d, the tiled orders 2 (B_r + B_c) d
    cases = []
    for kind in kinds:
        n, d, sram, bq, bk = _one_case(t, algorithm, kind, 5000, tiles)
        cases.append(Case((n, d, sram, bq, bk), f"{kind}: n={n}, d={d}, sram={sram}, block_q={bq}, block_k={bk}"))
    return cases


def _part(t: Trial, label: str, points: float, grade) -> None:
    """One part of a multi-function question; an unwritten function costs its part only."""
    try:
        grade()
    except NotImplementedYet:
        t.expect(label, points, False, "not implemented yet (your function still raises NotImplementedError)")


def _formula_part(t: Trial, name: str, student, algorithm: str, mutants) -> None:
    cases = _cases(t, algorithm)

    def truth(case: Case):
        n, d, sram, bq, bk = case.args
        return _rw(iocount.predict(algorithm, n, d, sram=sram, block_q=bq, block_k=bk))

    label = f"{name}: (reads, writes) equal the counter's"
    _part(t, label, 2, lambda: t.compare(label, 2, student=student, cases=cases, reference=truth, mutants=mutants,
                                         names=("reads", "writes"), rtol=0, atol=0.5))


@LAB.question("q1", points=6, objects=("standard_counts", "kv_outer_counts", "q_outer_counts"))
def q1(t: Trial, standard_counts, kv_outer_counts, q_outer_counts) -> None:
    """(reads, writes) of standard attention, Algorithm 1 and FlashAttention-2's order."""
    _formula_part(t, "standard_counts", standard_counts, "standard", STANDARD_MUTANTS)
    _formula_part(t, "kv_outer_counts", kv_outer_counts, "kv_outer", KV_OUTER_MUTANTS)
    _formula_part(t, "q_outer_counts", q_outer_counts, "q_outer", Q_OUTER_MUTANTS)


# ------------------------------------------------------------------------------------- q2: the paper's blocks
def _blocks_ceil(d, sram):
    b_c = math.ceil(sram / (4 * d))
    return min(b_c, d), b_c


def _blocks_no_min(d, sram):
    b_c = sram // (4 * d)
    return b_c, b_c


def _blocks_swapped(d, sram):
    b_c = sram // (4 * d)
    return b_c, min(b_c, d)


def _blocks_precedence(d, sram):
    b_c = sram // 4 * d  # reads as (sram // 4) * d
    return min(b_c, d), b_c


def _blocks_d_rows(d, sram):
    return d, sram // (4 * d)


BLOCK_MUTANTS = [
    Mutant("round down: with ceil(M / 4d) the four tiles 4 B_c d can exceed M (e.g. M = 1000, d = 64 gives "
           "1024 > 1000); the course uses floor(M / 4d).", fn=_blocks_ceil),
    Mutant("B_r = min(B_c, d): the query block is capped at d rows.", fn=_blocks_no_min),
    Mutant("the order is (B_r, B_c) = (block_q, block_k): the K/V block B_c = floor(M / 4d) comes second.",
           fn=_blocks_swapped),
    Mutant("operator precedence: sram // 4 * d is (sram // 4) * d, a block d^2 times too large. Write "
           "sram // (4 * d).", fn=_blocks_precedence),
    Mutant("the query block is capped by B_c as well: when floor(M / 4d) < d, B_r = d rows leave too little room "
           "beside B_c; take the smaller of the two.", fn=_blocks_d_rows),
]


def _paper_blocks_part(t: Trial, paper_blocks) -> None:
    cases = []
    for i in range(8):  # half with B_c = floor(M / 4d) > d (B_r is capped), half with B_c < d
        d = int(t.rng.integers(8, 257))
        sram = int(t.rng.integers(4 * d * (d + 2), 4 * d * (d + 60))) if i % 2 else int(t.rng.integers(4 * d,
                                                                                                         4 * d * d))
        if sram % (4 * d) == 0:  # rounding up and down must differ
            sram += 1
        cases.append(Case((d, sram), f"d={d}, sram={sram}, floor(M / 4d) {'>' if i % 2 else '<'} d"))
    t.compare("paper_blocks", 1, student=paper_blocks, cases=cases, mutants=BLOCK_MUTANTS, names=("B_r", "B_c"),
              reference=lambda c: iocount.default_blocks("kv_outer", *c.args), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- q2: choose blocks
def best_q_outer(n: int, d: int, sram: int) -> tuple[int, int, int]:
    """(accesses, B_r, B_c) of the q_outer blocks that move the least, by exhaustive search over what fits."""
    best = None
    for b_c in range(1, sram // (2 * d)):
        b_r = sram // (2 * d) - b_c  # the largest B_r for this B_c
        if b_r < 1:
            break
        acc = iocount.predict("q_outer", n, d, sram=sram, block_q=b_r, block_k=b_c).accesses
        if best is None or acc < best[0]:
            best = (acc, b_r, b_c)
        if b_c > 64:  # B_c only costs SRAM: the optimum has a small one
            break
    return best


def _best_blocks_part(t: Trial, best_q_outer_blocks) -> None:
    failures = []
    for _ in range(6):
        d = int(t.rng.choice([16, 32, 64, 128]))
        sram = int(t.rng.integers(8 * d, 120_000))
        n = int(t.rng.integers(1000, 70_000))
        best, _, _ = best_q_outer(n, d, sram)
        try:
            b_r, b_c = (int(x) for x in t.call(best_q_outer_blocks, n, d, sram))
            got = iocount.predict("q_outer", n, d, sram=sram, block_q=b_r, block_k=b_c).accesses
        except iocount.SramOverflow as e:
            failures.append(f"n={n}, d={d}, sram={sram}: your blocks do not fit ({e})")
            continue
        except (TypeError, ValueError) as e:
            failures.append(f"n={n}, d={d}, sram={sram}: return two positive integers (B_r, B_c); {e}")
            continue
        if got > 1.01 * best:
            failures.append(f"n={n}, d={d}, sram={sram}: your ({b_r}, {b_c}) move {got:,} elements; "
                            f"{best:,} is possible. Which loop re-reads what? Make that block large.")
    t.expect("best_q_outer_blocks: blocks fit and are (near) optimal", 2, not failures, "\n".join(failures[:3]))


@LAB.question("q2", points=3, objects=("paper_blocks", "best_q_outer_blocks"))
def q2(t: Trial, paper_blocks, best_q_outer_blocks) -> None:
    """Block sizes: the paper's rule, and the best blocks for FlashAttention-2's order."""
    _part(t, "paper_blocks", 1, lambda: _paper_blocks_part(t, paper_blocks))
    _part(t, "best_q_outer_blocks", 2, lambda: _best_blocks_part(t, best_q_outer_blocks))


# ---------------------------------------------------------------------------------------------- q3: the ratio
def _ratio(n, d, sram, standard=None, tiled=None):
    """Standard's accesses over a tiled order's, each (reads, writes) pair from the functions given."""
    b = sram // (2 * d)
    b_r, b_c = iocount.default_blocks("kv_outer", d, sram)
    standard = standard or (lambda *a: _rw(iocount.predict("standard", *a[:2], sram=a[2], block_q=a[3],
                                                           block_k=a[4])))
    tiled = tiled or (lambda *a: _rw(iocount.predict("kv_outer", *a[:2], sram=a[2], block_q=a[3], block_k=a[4])))
    return sum(standard(n, d, sram, b, b)) / sum(tiled(n, d, sram, b_r, b_c))


RATIO_MUTANTS = [
    Mutant("the ratio is upside down: standard attention's accesses divided by Algorithm 1's (it is above 1).",
           fn=lambda n, d, sram: 1 / _ratio(n, d, sram)),
    Mutant("reads only: an access is a read or a write; add both counts for each algorithm.",
           fn=lambda n, d, sram: _ratio(n, d, sram, standard=lambda *a: _standard(*a)[:1],
                                        tiled=lambda *a: _kv_outer(*a)[:1])),
    Mutant("standard attention with the paper's blocks: its default is B_r = B_c = floor(M / 2d) (two tiles, not "
           "four), the largest square blocks that fit.",
           fn=lambda n, d, sram: sum(_standard(n, d, sram, *iocount.default_blocks("kv_outer", d, sram)))
           / sum(_kv_outer(n, d, sram, *iocount.default_blocks("kv_outer", d, sram)))),
    Mutant("FlashAttention-2's order instead of Algorithm 1: the ratio asked for is standard over kv_outer, with "
           "the paper's blocks.", fn=lambda n, d, sram: _ratio(n, d, sram, tiled=_q_outer)),
]


def earlier_answer_problem(t: Trial, question: str, uses: list[tuple[str, str, object, list[tuple[tuple, object]]]]
                           ) -> str:
    """The first earlier answer that ``question`` relies on and that is wrong on the inputs it gets from it.

    ``uses`` holds (object name, the question that grades it, the student's object, [(args, right output)]).
    Returns "q3 uses your standard_counts, which fails q1 — fix that first" or "". A stub (NotImplementedError)
    propagates: the question is then not implemented yet.
    """
    for name, graded_in, fn, checks in uses:
        for args, right in checks:
            try:
                ok = allclose(as_outputs(t.call(fn, *args)), as_outputs(right), 0, 0.5)
            except NotImplementedYet:
                raise
            except Exception:
                ok = False
            if not ok:
                return (f"{question} uses your {name}, which fails {graded_in} (on {', '.join(map(str, args))}) "
                        f"— fix that first")
    return ""


@LAB.question("q3", points=1, objects=("traffic_ratio", "standard_counts", "kv_outer_counts", "paper_blocks"))
def q3(t: Trial, traffic_ratio, standard_counts, kv_outer_counts, paper_blocks) -> None:
    """traffic_ratio(n, d, sram): standard attention's accesses / Algorithm 1's, both with default blocks."""
    cases = [Case((65_536, 64, 227 * 1024 // 2), "n=65536, d=64, M=116224 (H200, bf16)")]
    for _ in range(5):
        d = int(t.rng.choice([32, 64, 128]))
        cases.append(Case((int(t.rng.integers(1000, 200_000)), d, int(t.rng.integers(16 * d, 150_000))), ""))

    def truth(case: Case):
        n, d, sram = case.args
        standard = iocount.predict("standard", n, d, sram=sram).accesses
        return standard / iocount.predict("kv_outer", n, d, sram=sram).accesses

    if t.compare("ratio", 1, student=traffic_ratio, cases=cases, reference=truth, names=("ratio",), rtol=1e-9,
                 mutants=RATIO_MUTANTS):
        return
    # The inputs traffic_ratio gives the earlier functions when it uses them as task 6 says.
    uses = [("paper_blocks", "q2", paper_blocks, []), ("standard_counts", "q1", standard_counts, []),
            ("kv_outer_counts", "q1", kv_outer_counts, [])]
    for n, d, sram in (c.args for c in cases):
        b = sram // (2 * d)
        b_r, b_c = iocount.default_blocks("kv_outer", d, sram)
        uses[0][3].append(((d, sram), (b_r, b_c)))
        uses[1][3].append(((n, d, sram, b, b), _rw(iocount.predict("standard", n, d, sram=sram, block_q=b,
                                                                   block_k=b))))
        uses[2][3].append(((n, d, sram, b_r, b_c), _rw(iocount.predict("kv_outer", n, d, sram=sram))))
    problem = earlier_answer_problem(t, "q3", uses)
    if problem:  # the ratio's own diagnosis would blame the wrong thing
        label, _, points, _ = t.parts[-1]
        t.parts[-1] = (label, 0.0, points, problem)


# ------------------------------------------------------------------------------- q4: the backward, q-outer order
def count_q_outer_backward(n: int, d: int, *, sram: int, block_q: int, block_k: int, seed: int = 0
                           ) -> iocount.Counts:
    """Run the backward with query blocks outside through the counter's HBM and SRAM, and count it.

    The forward saved O and the logsumexp L; dO is given. dK and dV are first set to zero in HBM (as in
    Algorithm 4). For each query block, Q_i, O_i and dO_i are loaded, L_i read and dQ_i accumulated on chip; every
    K/V block streams past with its dK_j and dV_j, which are read, updated and written back; dQ_i is written once.
    The gradients are checked against :func:`flashlab.reference.attention_backward`.
    """
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((n, d)) for _ in range(4))
    O, L = reference.attention(Q, K, V)
    hbm = {name: iocount.HBM(name, x) for name, x in (("Q", Q), ("K", K), ("V", V), ("O", O), ("L", L), ("dO", dO))}
    for name in ("dQ", "dK", "dV"):
        hbm[name] = iocount.HBM(name, np.zeros((n, d)))
    chip, scale, flops = iocount.SRAM(sram), 1.0 / math.sqrt(d), 0
    hbm["dK"].write(np.s_[:], np.zeros((n, d)))
    hbm["dV"].write(np.s_[:], np.zeros((n, d)))
    for r0 in range(0, n, block_q):
        rows = np.s_[r0:min(r0 + block_q, n)]
        Qi, Oi, dOi = chip.load(hbm["Q"], rows), chip.load(hbm["O"], rows), chip.load(hbm["dO"], rows)
        Li, dQi = hbm["L"].read(rows), chip.alloc(Qi.shape)
        Di = np.sum(dOi * Oi, axis=1, keepdims=True)
        for c0 in range(0, n, block_k):
            cols = np.s_[c0:min(c0 + block_k, n)]
            Kj, Vj = chip.load(hbm["K"], cols), chip.load(hbm["V"], cols)
            dKj, dVj = chip.load(hbm["dK"], cols), chip.load(hbm["dV"], cols)
            P = np.exp(scale * Qi @ Kj.T - Li[:, None])
            dVj += P.T @ dOi
            dS = P * (dOi @ Vj.T - Di)
            dQi += scale * dS @ Kj
            dKj += scale * dS.T @ Qi
            flops += 2 * P.size * d * 5
            hbm["dK"].write(cols, dKj)
            hbm["dV"].write(cols, dVj)
            chip.free(Kj, Vj, dKj, dVj)
        hbm["dQ"].write(rows, dQi)
        chip.free(Qi, Oi, dOi, dQi)
    want = reference.attention_backward(Q, K, V, dO)
    err = max(np.abs(hbm[g].data - w).max() for g, w in zip(("dQ", "dK", "dV"), want, strict=True))
    if not err <= 1e-10:
        raise RuntimeError(f"the q-outer backward computed wrong gradients through the counter (error {err:.3g})")
    reads = sum(a.reads for a in hbm.values())
    writes = sum(a.writes for a in hbm.values())
    return iocount.Counts(reads, writes, flops, n * n, chip.peak)


def _q_outer_backward(n, d, sram, bq, bk, *, init=True, read_back=True, write_each=True, dq_each=False,
                      l_and_m=False, outer="r", ceil=True, read_o=True, init_dq=False, kv_formula=False):
    """Closed form of :func:`count_q_outer_backward`, with one switch per mistake (defaults = right)."""
    nd = n * d
    if kv_formula:  # the chapter's count for Algorithm 4 (K/V blocks outside)
        t_c = math.ceil(n / bk)
        return 2 * nd + t_c * (4 * nd + 2 * n), 5 * nd + t_c * nd
    t = _blocks_of(n, bq if outer == "r" else bk, ceil)
    reads = (3 if read_o else 2) * nd + (2 if l_and_m else 1) * n + t * (4 if read_back else 2) * nd
    writes = (2 * nd if init else 0) + (nd if init_dq else 0) + (2 * t * nd if write_each else 2 * nd)
    writes += math.ceil(n / bk) * nd if dq_each else nd
    return reads, writes


Q_OUTER_BACKWARD_MUTANTS = [
    Mutant("dK and dV start as zeros in HBM: 2nd writes before the loops (every query block adds to them there).",
           fn=_flag(_q_outer_backward, init=False)),
    Mutant("dK_j and dV_j are read back on every visit: each query block adds its share to what HBM holds, so it "
           "reads them (2 B_c d) before writing them back, T_r times in all.", fn=_flag(_q_outer_backward,
                                                                                      read_back=False)),
    Mutant("dK_j and dV_j are written back after every query block, not once: with query blocks outside, no K/V "
           "block stays on chip from one query block to the next (2 T_r nd writes).",
           fn=_flag(_q_outer_backward, write_each=False)),
    Mutant("dQ_i is written once per query block: its accumulator stays on chip while every K/V block streams "
           "past (nd writes, not one per K/V block).", fn=_flag(_q_outer_backward, dq_each=True)),
    Mutant("this order reads the forward's logsumexp L (n numbers), not l and m (2n): FlashAttention-2's forward "
           "saves L alone.", fn=_flag(_q_outer_backward, l_and_m=True)),
    Mutant("the K/V blocks are the inner loop here: they are re-read once per query block, T_r = ceil(n / block_q) "
           "times, not T_c.", fn=_flag(_q_outer_backward, outer="c")),
    Mutant(FLOOR_R, fn=_flag(_q_outer_backward, ceil="floor")),
    Mutant("O is read too: D_i = rowsum(dO_i * O_i) needs O_i (nd reads, once per query block).",
           fn=_flag(_q_outer_backward, read_o=False)),
    Mutant("dQ needs no zeros in HBM: it is accumulated on chip and written once, so only dK and dV are "
           "initialised (2nd writes, not 3nd).", fn=_flag(_q_outer_backward, init_dq=True)),
    Mutant("that is Algorithm 4's count (K/V blocks outside, chapter 3 section 8). With query blocks outside, what "
           "stays on chip and what travels swap: derive it from this loop order.",
           fn=_flag(_q_outer_backward, kv_formula=True)),
]


def _backward_cases(t: Trial) -> list[Case]:
    cases = []
    for kind in CASE_KINDS:  # small n: every case really runs through the counter
        n, d, sram, bq, bk = _one_case(t, "q_outer backward", kind, 120, 4)
        cases.append(Case((n, d, sram, bq, bk), f"{kind}: n={n}, d={d}, sram={sram}, block_q={bq}, block_k={bk}"))
    return cases


@LAB.question("q4", points=3, objects=("q_outer_backward_counts",))
def q4(t: Trial, q_outer_backward_counts) -> None:
    """q_outer_backward_counts(n, d, sram, block_q, block_k): (reads, writes) of the backward, query blocks outside."""
    def counted(case: Case):
        n, d, sram, bq, bk = case.args
        return _rw(count_q_outer_backward(n, d, sram=sram, block_q=bq, block_k=bk, seed=t.seed))

    t.compare("(reads, writes) equal the counter's", 3, student=q_outer_backward_counts, cases=_backward_cases(t),
              reference=counted, mutants=Q_OUTER_BACKWARD_MUTANTS, names=("reads", "writes"), rtol=0, atol=0.5)


# ------------------------------------------------------------------------- q5, q6: the tiles of a block-sparse pattern
def _window_limits(n: int, m: int, left, right) -> tuple[int, int]:
    """The window as bounds on delta; a side of None is a bound beyond any delta (no limit)."""
    return (-(n + m) if left is None else -left), (n + m if right is None else right)


def _kinds(n, m, bq, bk, left, right, stride, *, tile_end=0, left_open=False, no_partial=False, no_edges=False,
           full_right_only=False, full_left_only=False, corners=False, stride_full=True, stride_empty=True,
           tile_stride=None, one_delta_empty=False, swap=False, aligned=True, clip=True, floor=False,
           zero_is_none=False):
    """Tile kinds of the window pattern from each tile's range of delta, with one switch per mistake (defaults =
    right): the grader's own implementation, independent of :mod:`flashlab.blocksparse`."""
    if swap:
        left, right = right, left
    if zero_is_none:
        left, right = left or None, right or None
    offset = m - n if aligned else 0
    t_r, t_c = (n // bq, m // bk) if floor else (math.ceil(n / bq), math.ceil(m / bk))
    q0, k0 = np.arange(t_r)[:, None] * bq, np.arange(t_c)[None, :] * bk
    q1, k1 = (np.minimum(q0 + bq, n), np.minimum(k0 + bk, m)) if clip else (q0 + bq, k0 + bk)
    lo, hi = k0 - (q1 - 1 + tile_end) - offset, (k1 - 1 + tile_end) - q0 - offset
    a, b = _window_limits(n, m, left, right)
    a += 1 if left_open and left is not None else 0
    first, last = np.maximum(lo, a), np.minimum(hi, b)
    step = stride if stride_empty else 1
    empty = (last // step) * step < first
    if one_delta_empty:
        empty |= last == first
    if tile_stride is not None:  # the stride applied to tile indices: a key tile a multiple of it away, or EMPTY
        first_key_tile = np.arange(t_r)[:, None] if tile_stride == "index" else (q0 + offset) // bk
        empty = (last < first) | ((np.arange(t_c)[None, :] - first_key_tile) % stride != 0)
    full = (hi <= b) if full_right_only else (lo >= a) if full_left_only else (lo >= a) & (hi <= b)
    if corners:  # the first query with the first key, the last with the last: the diagonal's deltas
        top, bottom = k0 - q0 - offset, (k1 - 1) - (q1 - 1) - offset
        full = (top >= a) & (top <= b) & (bottom >= a) & (bottom <= b)
    if no_edges:
        full = np.ones_like(empty)
    if stride_full:
        full &= (stride == 1) | ((lo == hi) & (lo % stride == 0))
    if no_partial:
        full = np.ones_like(empty)
    return np.where(empty, blocksparse.EMPTY, np.where(full, blocksparse.FULL, blocksparse.PARTIAL))


def _reduce(seen: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """Tile kinds of an element mask: EMPTY when no pair of the tile is seen, FULL when all are."""
    n, m = seen.shape
    rows, cols = np.arange(0, n, bq), np.arange(0, m, bk)
    count = np.add.reduceat(np.add.reduceat(seen.astype(np.int64), rows, axis=0), cols, axis=1)
    size = np.outer(np.minimum(rows + bq, n) - rows, np.minimum(cols + bk, m) - cols)
    return np.where(count == 0, blocksparse.EMPTY, np.where(count == size, blocksparse.FULL, blocksparse.PARTIAL))


def _stride_on_blocks(n, m, bq, bk, left, right, stride):
    """Dilated over key blocks: key j is seen when its block lies a multiple of the stride (in blocks) away from the
    block of the query's position."""
    position = np.arange(n)[:, None] + m - n
    keys = np.arange(m)[None, :]
    a, b = _window_limits(n, m, left, right)
    seen = (keys - position >= a) & (keys - position <= b) & ((keys // bk - position // bk) % stride == 0)
    return _reduce(seen, bq, bk)


def _switch_kinds(**flags):
    def tile_kinds(n, m, block_q, block_k, left, right, stride):
        return _kinds(n, m, block_q, block_k, left, right, stride, **flags)

    return tile_kinds


_BOUNDARY_FULL = ("a boundary tile is treated as FULL: a tile that the window's edge crosses has hidden pairs, "
                  "and FULL means no mask at all. Which tiles need a mask element by element?")
_STRIDE_ON_BLOCKS = ("the stride counts key blocks instead of tokens: dilated attention keeps every stride-th token, "
                     "delta % stride == 0, whatever the tiles. Look at what one tile's range of delta holds.")

TILE_KIND_MUTANTS = [
    Mutant("the window's left side includes its end: -left <= delta, so sliding window (w, 0) sees the last w + 1 "
           "tokens, its own included. Look at the tiles where delta = -left is the only visible difference.",
           fn=_switch_kinds(left_open=True)),
    Mutant("the window reaches one tile too far: a tile's last query is q1 - 1 and its last key k1 - 1, so its "
           "deltas run from k0 - (q1 - 1) - (m - n) to (k1 - 1) - q0 - (m - n). Look at the tiles just outside the "
           "window's edges.", fn=_switch_kinds(tile_end=1)),
    Mutant(_BOUNDARY_FULL, fn=_switch_kinds(no_partial=True)),
    Mutant(_BOUNDARY_FULL, fn=_switch_kinds(no_edges=True)),
    Mutant("the window's left edge is forgotten when a tile is called FULL: a tile inside the right edge but "
           "crossing the left one still has hidden pairs. Check both ends of the tile's range of delta.",
           fn=_switch_kinds(full_right_only=True)),
    Mutant("the window's right edge is forgotten when a tile is called FULL: a tile inside the left edge but "
           "crossing the right one (the causal diagonal's tiles, for one) still has hidden pairs. Check both ends "
           "of the tile's range of delta.", fn=_switch_kinds(full_left_only=True)),
    Mutant("a tile is called FULL from its diagonal corners (first query with first key, last with last): the "
           "extreme deltas are at the other two, lo = k0 - (q1 - 1) - (m - n) for the last query with the first key "
           "and hi = (k1 - 1) - q0 - (m - n) for the first query with the last key. A tile is FULL when both lie "
           "inside the window.", fn=_switch_kinds(corners=True)),
    Mutant("a tile that sees exactly one delta is called EMPTY: its visible range runs from max(lo, -left) to "
           "min(hi, right), and it holds a pair when that range is not empty, first <= last, a single delta "
           "included. Look at the tiles that a window's edge touches at one corner.",
           fn=_switch_kinds(one_delta_empty=True)),
    *(Mutant(_STRIDE_ON_BLOCKS, fn=fn) for fn in (
        _stride_on_blocks, *(_switch_kinds(tile_stride=how, stride_full=full)
                             for how in ("index", "position") for full in (True, False)))),
    Mutant("a dilated tile is never FULL (unless it holds one pair): the stride hides the pairs between multiples, "
           "so a tile inside the window is PARTIAL. What does the stride do inside one tile?",
           fn=_switch_kinds(stride_full=False)),
    Mutant("a tile narrower than the stride can hold no multiple of it: such a tile is EMPTY even inside the "
           "window. Look at the tiles whose range of delta is shorter than the stride.",
           fn=_switch_kinds(stride_empty=False)),
    Mutant("left and right are swapped: left counts keys before the query's position (delta < 0), right keys "
           "after it (delta > 0).", fn=_switch_kinds(swap=True)),
    Mutant("the causal alignment is ignored when m != n: query i stands at position i + m - n, so delta = "
           "j - (i + m - n), not j - i. Look at the inputs where m != n.", fn=_switch_kinds(aligned=False)),
    Mutant("the ragged last tile is treated as whole: it ends at the last query (n) or key (m), not a block "
           "further. Look at the last row and column of tiles.", fn=_switch_kinds(clip=False)),
    Mutant("n // block_q (or m // block_k) drops the ragged last tile: there are ceil(n / block_q) x "
           "ceil(m / block_k) tiles.", fn=_switch_kinds(floor=True)),
    Mutant("a side of 0 tokens is treated as no limit: `if right:` is False for 0 as for None. A side of 0 is "
           "a limit (causal is (None, 0)); only None means none.", fn=_switch_kinds(zero_is_none=True)),
]


def _truth_kinds(n, m, bq, bk, left, right, stride) -> np.ndarray:
    return blocksparse.Window(left, right, stride).block_mask(n, m, bq, bk).kinds


#: Argument names of a tile-kinds case, shown in feedback.
KIND_ARGS = ("n", "m", "block_q", "block_k", "left", "right", "stride")


def _draw_pattern_case(t: Trial, kind: str) -> tuple[tuple, str]:
    """(n, m, block_q, block_k, left, right, stride) of one kind; block_q != block_k (tiles are not square)."""
    ints = lambda lo, hi: int(t.rng.integers(lo, hi + 1))  # noqa: E731
    while True:
        bq, bk = ints(2, 12), ints(2, 12)
        n, m = ints(3 * max(bq, bk) + 1, 90), ints(3 * max(bq, bk) + 1, 90)
        left, right, stride = None, 0, 1
        if kind == "causal, n = m, last query tile of one row":
            n = m = bq * ints(3, 8) + 1
        elif kind == "causal, m > n":
            m = n + ints(1, 40)
        elif kind == "causal, n > m":
            n = m + ints(1, 40)
        elif kind == "window (left, 0), its edge on a tile's last key":
            i, j = ints(1, math.ceil(n / bq) - 1), ints(0, math.ceil(m / bk) - 1)
            left = i * bq + m - n - min((j + 1) * bk, m) + 1  # the tile's largest delta is -left
        elif kind == "window (left, right), both wider than a tile":
            left, right = ints(max(bq, bk) + 1, m - 1), ints(max(bq, bk) + 1, n - 1)
        elif kind == "window (0, 0): the diagonal only":
            left = 0
        elif kind == "window (None, right): no limit on the left":
            right = ints(1, n - 1)
        elif kind == "window (left, right), n > m":
            n = m + ints(1, 30)
            left, right = ints(0, m - 1), ints(1, min(n - 1, 2 * bk))
        elif kind == "dilated (None, 0), m > n":
            m, stride = n + ints(1, 40), ints(2, 6)
        elif kind == "dilated window (left, 0), n > m":
            n, stride = m + ints(1, 30), ints(2, 6)
            left = ints(2 * max(bq, bk), m - 1)
        elif kind == "dilated, tiles narrower than the stride":
            bq, bk = ((1, 2), (2, 1), (1, 3), (3, 1), (2, 3))[ints(0, 4)]
            n, m, stride = ints(12, 40), ints(12, 40), ints(bq + bk, 9)
            left, right = ints(stride, m - 1), ints(0, min(n - 1, stride))
        else:  # "dilated window (left, right)"
            stride = ints(2, 5)
            left, right = ints(0, m - 1), ints(0, n - 1)
        if bq == bk or left is not None and not 0 <= left <= m - 1 or right is not None and right > n - 1:
            continue
        if left is not None and right is not None and left == right and left != 0:
            continue  # left != right, so that swapping them shows
        if stride == 1 and n % bq == 0 and m % bk == 0:
            continue  # a ragged last tile on one side at least
        if stride > 1:  # the dilated part tests the stride alone: the same wrong code earns the same points
            n, m = n - n % bq, m - m % bk  # no ragged tile (the windows part has them)
            if left is not None and (left > m - 1 or left % stride == 0) or right is not None and right > n - 1:
                continue  # the window's edges hold no multiple of the stride: their off-by-ones do not show here
        args = (n, m, bq, bk, left, right, stride)
        return args, f"{kind}: " + ", ".join(f"{k}={v}" for k, v in zip(KIND_ARGS, args, strict=True))


WINDOW_KINDS = ("causal, n = m, last query tile of one row", "causal, m > n", "causal, n > m",
                "window (left, 0), its edge on a tile's last key", "window (left, right), both wider than a tile",
                "window (0, 0): the diagonal only", "window (None, right): no limit on the left",
                "window (left, right), n > m")
DILATED_KINDS = ("dilated (None, 0), m > n", "dilated window (left, 0), n > m",
                 "dilated, tiles narrower than the stride", "dilated window (left, right)")


def _pattern_cases(t: Trial, kinds: Sequence[str], repeat: int = 1) -> list[Case]:
    cases = []
    for kind in kinds:
        for _ in range(repeat):
            args, label = _draw_pattern_case(t, kind)
            cases.append(Case(args, label, names=KIND_ARGS))
    return cases


@LAB.question("q5", points=3, objects=("tile_kinds",))
def q5(t: Trial, tile_kinds) -> None:
    """tile_kinds(n, m, block_q, block_k, left, right, stride): EMPTY / PARTIAL / FULL of every tile."""
    def truth(case: Case):
        return _truth_kinds(*case.args)

    t.compare("sliding windows and causal", 2, student=tile_kinds, cases=_pattern_cases(t, WINDOW_KINDS),
              reference=truth, mutants=TILE_KIND_MUTANTS, names=("kinds",), rtol=0, atol=0)
    t.compare("dilated", 1, student=tile_kinds, cases=_pattern_cases(t, DILATED_KINDS), reference=truth,
              mutants=TILE_KIND_MUTANTS, names=("kinds",), rtol=0, atol=0)


#: The order of the counts tile_work returns: empty, partial, full.
KIND_ORDER = (blocksparse.EMPTY, blocksparse.PARTIAL, blocksparse.FULL)


def tile_work_of(kinds: np.ndarray, n: int, m: int, d: int, bq: int, bk: int) -> tuple[int, int, int, int]:
    """(empty, partial, full, FLOPs): the tiles of each kind, and 4 r c d for every computed tile of r rows and
    c columns (chapter 3, section 11: what :func:`flashlab.iocount.predict` sums)."""
    rows = np.minimum(np.arange(kinds.shape[0]) * bq + bq, n) - np.arange(kinds.shape[0]) * bq
    cols = np.minimum(np.arange(kinds.shape[1]) * bk + bk, m) - np.arange(kinds.shape[1]) * bk
    flops = 4 * d * int(np.outer(rows, cols)[kinds != blocksparse.EMPTY].sum())
    return tuple(int(np.count_nonzero(kinds == k)) for k in KIND_ORDER) + (flops,)



def _work(n, m, d, bq, bk, left, right, stride, *, by_pairs=False, full_only=False, whole_tiles=False,
          products=2, dense=False):
    """tile_work with one switch per mistake (defaults = right)."""
    kinds = _truth_kinds(n, m, bq, bk, left, right, stride)
    counts = tile_work_of(kinds, n, m, d, bq, bk)[:3]
    if by_pairs:
        flops = 4 * d * int(blocksparse.Window(left, right, stride).mask(n, m).sum())
    elif dense:
        flops = 4 * n * m * d
    else:
        kept = kinds == blocksparse.FULL if full_only else kinds != blocksparse.EMPTY
        if whole_tiles:
            flops = 4 * bq * bk * d * int(np.count_nonzero(kept))
        else:
            flops = tile_work_of(np.where(kept, blocksparse.FULL, blocksparse.EMPTY), n, m, d, bq, bk)[3]
        flops = flops * products // 2
    return (*counts, flops)


def _switch_work(**flags):
    def tile_work(n, m, d, block_q, block_k, left, right, stride):
        return _work(n, m, d, block_q, block_k, left, right, stride, **flags)

    return tile_work


TILE_WORK_MUTANTS = [
    Mutant("FLOPs counted per visible pair instead of per tile: a computed tile is multiplied whole, its hidden "
           "pairs included. What does a PARTIAL tile cost?", fn=_switch_work(by_pairs=True)),
    Mutant("PARTIAL tiles are computed too: only EMPTY tiles are skipped; a PARTIAL tile costs as much as a FULL "
           "one (its mask is applied after the product).", fn=_switch_work(full_only=True)),
    Mutant("a ragged last tile is smaller: it has min(block_q, n - q0) rows and min(block_k, m - k0) columns, and "
           "costs 4 r c d for its own r and c.", fn=_switch_work(whole_tiles=True)),
    Mutant("both products count: S = Q K^T and O = P V are 2 r c d each, 4 r c d per tile.",
           fn=_switch_work(products=1)),
    Mutant("EMPTY tiles are skipped: they cost no FLOPs, so the count is below dense attention's 4 n m d.",
           fn=_switch_work(dense=True)),
]

#: Argument names of a tile-work case.
WORK_ARGS = ("n", "m", "d", "block_q", "block_k", "left", "right", "stride")


@LAB.question("q6", points=1, objects=("tile_work",), uses=("tile_kinds",))
def q6(t: Trial, tile_work) -> None:
    """tile_work(n, m, d, block_q, block_k, left, right, stride): tiles of each kind and the forward's FLOPs."""
    cases = []
    for case in _pattern_cases(t, WINDOW_KINDS[:2] + WINDOW_KINDS[3:5] + DILATED_KINDS[:2]):
        n, m, bq, bk, left, right, stride = case.args
        d = int(t.rng.integers(1, 65))
        args = (n, m, d, bq, bk, left, right, stride)
        label = case.label.split(":")[0] + ": " + ", ".join(f"{k}={v}" for k, v in zip(WORK_ARGS, args, strict=True))
        cases.append(Case(args, label, names=WORK_ARGS))

    def truth(case: Case):
        n, m, d, bq, bk, left, right, stride = case.args
        return tile_work_of(_truth_kinds(n, m, bq, bk, left, right, stride), n, m, d, bq, bk)

    t.compare("tiles of each kind and FLOPs", 1, student=tile_work, cases=cases, reference=truth,
              mutants=TILE_WORK_MUTANTS, names=("empty", "partial", "full", "flops"), rtol=0, atol=0.5)


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _counts_demo(algorithm: str, examples: list[tuple[str, tuple]]) -> Demo:
    return Demo(
        examples=examples,
        right=lambda args: _rw(iocount.predict(algorithm, args[0], args[1], sram=args[2], block_q=args[3],
                                               block_k=args[4])),
        names=("reads", "writes"),
    )


_TILED_COUNT_EXAMPLES = [("n = 1000, d = 64, M = 20000, block_q = 48, block_k = 64", (1000, 64, 20000, 48, 64))]


def _blocks_demo() -> Demo:
    return Demo(
        examples=[("d = 64, M = 1000", (64, 1000)), ("d = 64, M = 116224 (227 KB of bf16)", (64, 116224))],
        right=lambda args: iocount.default_blocks("kv_outer", *args),
        names=("(B_r, B_c)",),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={
        "STANDARD_MUTANTS": lambda: _counts_demo("standard", [
            ("n = 1000 <= M = 20000, block_q = block_k = 96", (1000, 64, 20000, 96, 96)),
            ("n = 5000 > M = 4096 (a row of S does not fit), blocks 32", (5000, 64, 4096, 32, 32))]),
        "KV_OUTER_MUTANTS": lambda: _counts_demo("kv_outer", _TILED_COUNT_EXAMPLES),
        "Q_OUTER_MUTANTS": lambda: _counts_demo("q_outer", _TILED_COUNT_EXAMPLES),
        "BLOCK_MUTANTS": _blocks_demo,
        "RATIO_MUTANTS": lambda: Demo(
            examples=[("n = 65536, d = 64, M = 116224 (H200, bf16)", (65_536, 64, 116_224)),
                      ("n = 4096, d = 128, M = 49152", (4096, 128, 49_152))],
            right=lambda args: _ratio(*args), names=("ratio",)),
        "Q_OUTER_BACKWARD_MUTANTS": lambda: Demo(
            examples=[("n = 300, d = 16, M = 5000, block_q = 48, block_k = 20", (300, 16, 5000, 48, 20))],
            right=lambda args: _rw(count_q_outer_backward(*args[:2], sram=args[2], block_q=args[3],
                                                          block_k=args[4])),
            names=("reads", "writes")),
        "TILE_KIND_MUTANTS": lambda: Demo(
            examples=[("causal, n = 9 queries, m = 14 keys, 3 x 4 tiles", (9, 14, 3, 4, None, 0, 1)),
                      ("window (5, 2), n = m = 13, 3 x 2 tiles", (13, 13, 3, 2, 5, 2, 1)),
                      ("dilated: stride 4, left 6, n = m = 8, 1 x 2 tiles", (8, 8, 1, 2, 6, 0, 4)),
                      ("dilated: stride 3, n = 8, m = 12, 4 x 3 tiles", (8, 12, 4, 3, None, 0, 3))],
            right=lambda args: _truth_kinds(*args), names=("kinds (0 EMPTY, 1 PARTIAL, 2 FULL)",)),
        "TILE_WORK_MUTANTS": lambda: Demo(
            examples=[("window (5, 2), n = m = 13, d = 8, 3 x 2 tiles", (13, 13, 8, 3, 2, 5, 2, 1))],
            right=lambda args: _work(*args), names=("empty", "partial", "full", "flops")),
    },
    other_diagnoses=[
        OtherDiagnosis("q2", "best_q_outer_blocks", "blocks that do not fit in SRAM",
                       HandWritten("B_r = M / d (forgets that K and V tiles need room too)",
                                   lambda: lambda n, d, sram: (sram // d, 1), expect="do not fit")),
        OtherDiagnosis("q2", "best_q_outer_blocks", "the paper's blocks reused for FlashAttention-2's order",
                       HandWritten("the blocks of Algorithm 1 for the q-outer order",
                                   lambda: lambda n, d, sram: iocount.default_blocks("q_outer", d, sram),
                                   expect="is possible")),
    ],
    object_of={"BLOCK_MUTANTS": "paper_blocks"},
)
