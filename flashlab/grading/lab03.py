"""Lab 03 — counting HBM accesses: the closed forms of chapter 3, block sizes for a given M, the n = 65 536 ratio.

Every formula is graded against :func:`flashlab.iocount.predict`, which chapter 3 and ``tests/test_iocount.py``
check against the access counter itself. The counting model and the default blocks are those of
:mod:`flashlab.iocount`.

q1: ``standard_counts(n, d, sram, block_q, block_k)``, ``kv_outer_counts(...)`` and ``q_outer_counts(...)``
return ``(reads, writes)``; one part each, so a student who has written only the first sees it graded.
q2: ``paper_blocks(d, sram)`` returns ``(B_r, B_c)``; ``best_q_outer_blocks(n, d, sram)`` returns blocks that fit
and move (almost) as little as possible. q3: ``traffic_ratio(n, d, sram)`` is standard's accesses over
Algorithm 1's with default blocks.
"""

from __future__ import annotations

import math

from .. import iocount
from .core import Case, Lab, Mutant, NotImplementedYet, Trial
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis

LAB = Lab("lab03", "Counting memory accesses")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. The counter and its
# closed forms answer every question; iocount.count is fine in the notebook's own comparison cells, not inside a
# graded function.
_COUNTERS = ("flashlab.iocount.predict", "flashlab.iocount.count", "flashlab.iocount.run")
ANSWERS = {
    "q1": (*_COUNTERS, "flashlab.grading.lab03._standard", "flashlab.grading.lab03._kv_outer",
           "flashlab.grading.lab03._q_outer"),
    "q2": (*_COUNTERS, "flashlab.iocount.default_blocks", "flashlab.grading.lab03.best_q_outer"),
    "q3": (*_COUNTERS, "flashlab.iocount.default_blocks"),
}


def _rw(c: iocount.Counts) -> tuple[int, int]:
    return c.reads, c.writes


# ------------------------------------------------------------------------------------- mutants (wrong formulas)
def _standard(n, d, sram, bq, bk, *, rereads=True, second_pass=True, ceil=True):
    t_r = math.ceil(n / bq) if ceil else n / bq
    kv = 2 * t_r * n * d if rereads else 2 * n * d
    s_reads = 2 * n * n if (n > sram and second_pass) else n * n
    return n * d + kv + s_reads + n * n, 2 * n * n + n * d


def _kv_outer(n, d, sram, bq, bk, *, stats=True, init=True, ceil=True, outer="c"):
    b = bk if outer == "c" else bq
    t = math.ceil(n / b) if ceil else n / b
    s = 2 * n if stats else 0
    return 2 * n * d + t * (2 * n * d + s), (n * d + s) * ((1 if init else 0) + t)


def _q_outer(n, d, sram, bq, bk, *, write_l=True, ceil=True, outer="r", reread_q=False):
    b = bq if outer == "r" else bk
    t = math.ceil(n / b) if ceil else n / b
    q_reads = n * d * (t if reread_q else 1)
    return q_reads + 2 * t * n * d, n * d + (n if write_l else 0)


def _flag(fn, **flags):
    def wrong(n, d, sram, bq, bk):
        return fn(n, d, sram, bq, bk, **flags)

    return wrong


CEIL = ("a ragged last block still costs a whole pass: the number of blocks is ceil(n / B), not n / B "
        "(use math.ceil, or -(-n // B)).")

STANDARD_MUTANTS = [
    Mutant("K and V are read once per block of B_r query rows, not once: pass 1 re-reads K and pass 3 re-reads V "
           "ceil(n / B_r) times (the paper's accounting, 2nd instead of 2 T_r nd, is a lower bound).",
           fn=_flag(_standard, rereads=False)),
    Mutant("when a row of S does not fit in SRAM (n > M) the softmax reads S twice: once for the max and sum, "
           "once to normalise.", fn=_flag(_standard, second_pass=False)),
    Mutant(CEIL, fn=_flag(_standard, ceil=False)),
]

KV_OUTER_MUTANTS = [
    Mutant("the statistics travel too: each visit reads l_i and m_i (2 B_r numbers) and writes them back.",
           fn=_flag(_kv_outer, stats=False)),
    Mutant("Algorithm 1 first initialises O, l and m in HBM (line 2): nd + 2n writes before the loops.",
           fn=_flag(_kv_outer, init=False)),
    Mutant("the outer loop runs over K/V blocks, so Q and O are re-read T_c = ceil(n / B_c) times (block_k), "
           "not T_r times.", fn=_flag(_kv_outer, outer="r")),
    Mutant(CEIL, fn=_flag(_kv_outer, ceil=False)),
]

Q_OUTER_MUTANTS = [
    Mutant("L is an output too: n writes besides O's nd.", fn=_flag(_q_outer, write_l=False)),
    Mutant("the outer loop is over Q blocks, so K and V are re-read T_r = ceil(n / B_r) times (block_q).",
           fn=_flag(_q_outer, outer="c")),
    Mutant("Q_i stays in SRAM for the whole inner loop: Q is read once (nd), only K and V are re-read.",
           fn=_flag(_q_outer, reread_q=True)),
    Mutant(CEIL, fn=_flag(_q_outer, ceil=False)),
]


def _cases(t: Trial, algorithm: str, count: int = 10) -> list[Case]:
    cases = []
    while len(cases) < count:
        d = int(t.rng.integers(1, 129))
        n = int(t.rng.integers(1, 5000))
        sram = int(t.rng.integers(4 * d, 4 * d + 60_000))
        if algorithm == "standard" and len(cases) % 3 == 0 and n > 2 * d:
            sram = int(t.rng.integers(2 * d, n))  # rows that do not fit: S is streamed twice
        # blocks that fit: standard holds (B_r + B_c) d, the tiled orders 2 (B_r + B_c) d
        most = max(1, sram // ((2 if algorithm == "standard" else 4) * d))
        bq, bk = (int(x) for x in t.rng.integers(1, most + 1, size=2))
        try:
            iocount.predict(algorithm, n, d, sram=sram, block_q=bq, block_k=bk)
        except iocount.SramOverflow:
            continue
        cases.append(Case((n, d, sram, bq, bk), f"n={n}, d={d}, sram={sram}, block_q={bq}, block_k={bk}"))
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


BLOCK_MUTANTS = [
    Mutant("round down: with ceil(M / 4d) the four tiles 4 B_c d can exceed M (e.g. M = 1000, d = 64 gives "
           "1024 > 1000); the course uses floor(M / 4d).", fn=_blocks_ceil),
    Mutant("B_r = min(B_c, d): the query block is capped at d rows.", fn=_blocks_no_min),
    Mutant("the order is (B_r, B_c) = (block_q, block_k): the K/V block B_c = floor(M / 4d) comes second.",
           fn=_blocks_swapped),
]


def _paper_blocks_part(t: Trial, paper_blocks) -> None:
    cases = []
    for _ in range(10):
        d = int(t.rng.integers(1, 257))
        sram = int(t.rng.integers(4 * d, 300_000))
        if sram % (4 * d) == 0:
            sram += 1
        cases.append(Case((d, sram), f"d={d}, sram={sram}"))
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
@LAB.question("q3", points=1, objects=("traffic_ratio",))
def q3(t: Trial, traffic_ratio) -> None:
    """traffic_ratio(n, d, sram): standard attention's accesses / Algorithm 1's, both with default blocks."""
    cases = [Case((65_536, 64, 227 * 1024 // 2), "n=65536, d=64, M=116224 (H200, bf16)")]
    for _ in range(5):
        d = int(t.rng.choice([32, 64, 128]))
        cases.append(Case((int(t.rng.integers(1000, 200_000)), d, int(t.rng.integers(16 * d, 150_000))), ""))

    def truth(case: Case):
        n, d, sram = case.args
        standard = iocount.predict("standard", n, d, sram=sram).accesses
        return standard / iocount.predict("kv_outer", n, d, sram=sram).accesses

    t.compare("ratio", 1, student=traffic_ratio, cases=cases, reference=truth, names=("ratio",), rtol=1e-9)


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
