"""Lab 02 — the tiled forward pass: ``tiles`` (the block schedule) and ``flash_forward`` (O and L, tile by tile)."""

from __future__ import annotations

import numpy as np

from .. import reference, tiled
from .core import Case, Lab, Mutant, Trial, allclose
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis, demo_qkv

LAB = Lab("lab02", "The tiled forward pass")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. Lab 01's update for
# many rows is part of q2's task (the notebook spells it out), so flashlab.online.update counts as its answer too.
ANSWERS = {
    "q1": ("flashlab.iocount._ranges", "flashlab.grading.lab02._tiles_ref"),
    "q2": ("flashlab.tiled.forward", "flashlab.reference.attention", "flashlab.numba_cpu.tiled_forward",
           "flashlab.numba_cuda.cuda_forward", "flashlab.cpu_bench.naive_attention", "flashlab.online.update",
           "flashlab.gpu.decoding.decode_numpy", "flashlab.grading.lab02._mutant_forward",
           "flashlab.grading.lab02._ref_forward"),
}


# --------------------------------------------------------------------------------------------------- q1: tiles
def _tiles_ref(n: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, n)) for lo in range(0, n, block)]


def _tiles_drop(n, block):
    return [(lo, lo + block) for lo in range(0, n - n % block, block)]


def _tiles_overrun(n, block):
    return [(lo, lo + block) for lo in range(0, n, block)]


def _tiles_run(fn, case: Case):
    return (np.array([tuple(t) for t in fn(*case.args)], dtype=float).reshape(-1, 2),)


TILES_MUTANTS = [
    Mutant(
        "the last ragged tile is dropped: when n is not a multiple of block, the rows after the last full tile "
        "still need a (shorter) tile; loop over range(0, n, block).",
        fn=_tiles_drop,
    ),
    Mutant(
        "the last tile runs past n: stop at min(start + block, n), so the last tile is shorter.",
        fn=_tiles_overrun,
    ),
]


@LAB.question("q1", points=1, objects=("tiles",))
def q1(t: Trial, tiles) -> None:
    """tiles(n, block) lists the (start, stop) of every tile, the last one possibly shorter."""
    cases = [Case((7, 3), "n=7, block=3"), Case((2, 5), "n=2, block=5")]
    for _ in range(8):
        block = int(t.rng.integers(1, 17))
        n = int(t.rng.integers(1, 60))
        cases.append(Case((n, block), f"n={n}, block={block}"))
    t.compare("covers 0..n exactly", 1, student=tiles, cases=cases, reference=lambda c: _tiles_run(_tiles_ref, c),
              run=_tiles_run, mutants=TILES_MUTANTS, names=("tiles",))


# ------------------------------------------------------------------------------------------- q2: flash_forward
def _mutant_forward(
    Q,
    K,
    V,
    block_q,
    block_k,
    *,
    scale=True,
    rescale=True,
    subtract_max=True,
    normalise_in_loop=False,
    drop_ragged_k=False,
    lse=True,
    average=False,
):
    """A q-outer tiled forward with one switch per classic mistake (all switches off = correct)."""
    n, m = Q.shape[0], K.shape[0]
    sc = 1.0 / np.sqrt(Q.shape[1]) if scale else 1.0
    O = np.zeros((n, V.shape[1]))
    L = np.zeros(n)
    k_end = m - m % block_k if drop_ragged_k else m
    for q0 in range(0, n, block_q):
        Qi = Q[q0 : q0 + block_q]
        rows = Qi.shape[0]
        mi, li, acc = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, V.shape[1]))
        results = []
        for k0 in range(0, k_end, block_k):
            S = sc * Qi @ K[k0 : k0 + block_k].T
            Vj = V[k0 : k0 + block_k]
            m_new = np.maximum(mi, S.max(axis=1)) if subtract_max else np.zeros(rows)
            alpha = np.exp(mi - m_new) if (rescale and subtract_max) else np.ones(rows)
            P = np.exp(S - m_new[:, None])
            l_new = alpha * li + P.sum(axis=1)
            if normalise_in_loop:
                acc = (alpha[:, None] * acc + P @ Vj) / l_new[:, None]
            else:
                acc = alpha[:, None] * acc + P @ Vj
            results.append((P @ Vj) / P.sum(axis=1)[:, None])
            mi, li = m_new, l_new
        if average:
            O[q0 : q0 + rows] = np.mean(results, axis=0)
        else:
            O[q0 : q0 + rows] = acc if normalise_in_loop else acc / li[:, None]
        L[q0 : q0 + rows] = mi + np.log(li) if lse else mi
    return O, L


def _switch(**flags):
    def fn(Q, K, V, block_q, block_k):
        return _mutant_forward(Q, K, V, block_q, block_k, **flags)

    return fn


def _only_O(out: tuple) -> tuple:
    return out[:1]


def _dropped_last_q_tile(case: Case, got: tuple, expected: tuple) -> bool:
    Q, _, _, block_q, _ = case.args
    n = Q.shape[0]
    full = n - n % block_q
    if full == n or len(got) < 1 or got[0].shape != expected[0].shape:
        return False
    head_ok = allclose((got[0][:full],), (expected[0][:full],))
    tail_ok = allclose((got[0][full:],), (expected[0][full:],))
    return head_ok and not tail_ok


FORWARD_MUTANTS = [
    Mutant(
        "missing the 1/sqrt(d) scale: the scores are S = Q K^T / sqrt(d) (d = Q.shape[1]).",
        fn=_switch(scale=False),
    ),
    Mutant(
        "L is the running max m, not the logsumexp: L = m + log(l) for each row.",
        fn=_switch(lse=False),
    ),
    Mutant(
        "no rescale when the max grows: multiply l and the accumulated output by exp(m_old - m_new) before adding "
        "the new tile's contribution.",
        fn=_switch(rescale=False),
        key=_only_O,
    ),
    Mutant(
        "no max subtraction: exp of raw scores overflows to inf (inf/inf = nan) when scores reach ~1000; "
        "exponentiate S - m_new with the running row max.",
        fn=_switch(subtract_max=False),
        key=_only_O,
    ),
    Mutant(
        "normalising inside the loop: the accumulated output was already divided by the old l, so it must be "
        "multiplied back by l_old * exp(m_old - m_new) before dividing by l_new — or, simpler, accumulate the "
        "unnormalised sum and divide by l once, after the last K/V tile.",
        fn=_switch(normalise_in_loop=True),
        key=_only_O,
    ),
    Mutant(
        "averaging block results: the plain mean of each K/V tile's softmax average ignores that tiles carry "
        "different masses (l). Accumulate with the online-softmax update instead.",
        fn=_switch(average=True),
        key=_only_O,
    ),
    Mutant(
        "the last ragged K/V tile is dropped: when m is not a multiple of block_k the remaining keys still form "
        "a (shorter) tile; loop over range(0, m, block_k) and slice up to m.",
        fn=_switch(drop_ragged_k=True),
        key=_only_O,
    ),
    Mutant(
        "the last ragged query tile is dropped: the rows after the last full block_q tile are never computed; "
        "loop over range(0, n, block_q).",
        explains=_dropped_last_q_tile,
    ),
]


def _ref_forward(case: Case):
    Q, K, V = case.args[:3]
    return reference.attention(Q, K, V)


def _qkv(t: Trial, n: int, m: int, d: int, dv: int):
    return t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d)), t.rng.standard_normal((m, dv))


@LAB.question("q2", points=6, objects=("flash_forward",), uses=("tiles",))
def q2(t: Trial, flash_forward) -> None:
    """flash_forward(Q, K, V, block_q, block_k) returns O and L = logsumexp, one tile of scores at a time."""
    names = ("O", "L")
    even = []
    for _ in range(5):
        bq, bk = (int(x) for x in t.rng.integers(1, 9, size=2))
        n, m = bq * int(t.rng.integers(1, 5)), bk * int(t.rng.integers(2, 5))
        d, dv = (int(x) for x in t.rng.integers(2, 9, size=2))
        even.append(Case((*_qkv(t, n, m, d, dv), bq, bk), f"n={n}, m={m}, d={d}, block_q={bq}, block_k={bk}"))
    t.compare("tiles that divide n and m", 2, student=flash_forward, cases=even, reference=_ref_forward,
              mutants=FORWARD_MUTANTS, names=names)

    ragged = [Case((*_qkv(t, 1, 1, 3, 2), 4, 4), "n=1, m=1 (smaller than a block)")]
    for i in range(6):
        bq, bk = (int(x) for x in t.rng.integers(2, 9, size=2))
        n = int(t.rng.choice([1, 2, 3, 5, 7, 11, 13, 17, 19, 23])) if i % 2 else bq * int(t.rng.integers(1, 4)) + 1
        m = bk * int(t.rng.integers(1, 4)) + int(t.rng.integers(1, bk))
        d, dv = (int(x) for x in t.rng.integers(2, 9, size=2))
        ragged.append(Case((*_qkv(t, n, m, d, dv), bq, bk), f"n={n}, m={m}, d={d}, block_q={bq}, block_k={bk}"))
    t.compare("ragged tiles (n or m not a multiple of the block, n = 1, primes)", 2, student=flash_forward,
              cases=ragged, reference=_ref_forward, mutants=FORWARD_MUTANTS, names=names)

    huge = []
    for _ in range(3):
        bq, bk = (int(x) for x in t.rng.integers(2, 6, size=2))
        n, m, d = int(t.rng.integers(2, 12)), int(t.rng.integers(bk + 1, 16)), int(t.rng.integers(2, 9))
        Q, K, V = _qkv(t, n, m, d, int(t.rng.integers(1, 5)))
        S = Q @ K.T / np.sqrt(d)
        Q = Q * (1000.0 / S.max())  # the largest scaled score is exactly 1000: exp(1000) overflows
        huge.append(Case((Q, K, V, bq, bk), f"scores up to 1000, n={n}, m={m}"))
    t.compare("huge scores (|S| up to 1000)", 1, student=flash_forward, cases=huge, reference=_ref_forward,
              mutants=FORWARD_MUTANTS, names=names)

    n = m = int(t.rng.integers(900, 1100))
    d = 16
    bq, bk = (int(x) for x in t.rng.choice([32, 64], size=2))
    Q, K, V = _qkv(t, n, m, d, d)
    limit = n * m * 8 // 4
    t.memory(
        f"memory: never holds the n x m score matrix (n = m = {n}, blocks {bq} x {bk})",
        1,
        flash_forward,
        (Q, K, V, bq, bk),
        limit,
        reference=reference.attention(Q, K, V),
        hint=f"An n x m float64 matrix is {n * m * 8 / 1e6:.1f} MB: build scores one block_q x block_k tile at a time.",
    )


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _drop_last_query_tile(Q, K, V, block_q, block_k):
    """The tile loop stops at the last full query tile: ``range(0, n - n % block_q, block_q)``."""
    n = Q.shape[0]
    O, L = np.zeros((n, V.shape[1])), np.zeros(n)
    for q0 in range(0, n - n % block_q, block_q):
        O[q0:q0 + block_q], L[q0:q0 + block_q] = tiled.forward(Q[q0:q0 + block_q], K, V, block_q=block_q,
                                                               block_k=block_k)
    return O, L


def _whole_score_matrix(Q, K, V, block_q, block_k):
    """Right, but builds the whole n x m score matrix (plain softmax attention)."""
    S = Q @ K.T / np.sqrt(Q.shape[1])
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    return (P @ V) / l, (m + np.log(l))[:, 0]


def _tiles_demo() -> Demo:
    return Demo(
        examples=[("n = 7, block = 3", (7, 3)), ("n = 6, block = 3", (6, 3)), ("n = 2, block = 5", (2, 5))],
        run=lambda fn, args: _tiles_run(fn, Case(args)),
        right=lambda args: _tiles_run(_tiles_ref, Case(args)),
        names=("tiles (start, stop)",),
    )


def _forward_demo() -> Demo:
    return Demo(
        examples=[
            ("random, n = 3, m = 5, d = 2, dv = 1, block_q = block_k = 2 (both last tiles ragged)",
             (*demo_qkv(3, 5, 2, 1, seed=1), 2, 2)),
            ("the same shapes with scores up to 1000", (*demo_qkv(3, 5, 2, 1, seed=1, top=1000.0), 2, 2)),
        ],
        right=lambda args: reference.attention(*args[:3]),
        names=("O", "L"),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"TILES_MUTANTS": _tiles_demo, "FORWARD_MUTANTS": _forward_demo},
    hand_written={
        ("q2", "the last ragged query tile is dropped"): [
            HandWritten("the query loop is range(0, n - n % block_q, block_q)", lambda: _drop_last_query_tile),
        ],
    },
    other_diagnoses=[
        OtherDiagnosis("q2", "flash_forward", "the whole n x m score matrix is built (right answer, too much memory)",
                       HandWritten("plain softmax attention, S = Q K^T / sqrt(d) in one piece",
                                   lambda: _whole_score_matrix, expect="one block_q x block_k tile at a time")),
    ],
)
