"""Lab 02 — the tiled forward pass: ``tiles`` (the block schedule) and the forward pass in both loop orders:
``flash_forward`` (FlashAttention-2: queries outer) and ``flash_forward_kv_outer`` (the paper's Algorithm 1:
keys and values outer), each returning O and L tile by tile.

Memory is the chapter's central idea, so it carries more than half of the lab's points and is scored on its own:
whatever the outputs' values, a function that returns arrays of the right shapes at n = m = 4096 is measured.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .. import reference, tiled
from .core import Case, Lab, Mutant, Trial, allclose
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis, demo_qkv

LAB = Lab("lab02", "The tiled forward pass")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. Lab 01's update for
# many rows is part of the forward's task (the notebook spells it out), so flashlab.online.update counts as its
# answer too.
_FORWARD_ANSWERS = ("flashlab.tiled.forward", "flashlab.reference.attention", "flashlab.numba_cpu.tiled_forward",
                    "flashlab.numba_cpu.fast_forward",
                    "flashlab.numba_cuda.cuda_forward", "flashlab.cpu_bench.naive_attention",
                    "flashlab.online.update", "flashlab.gpu.decoding.decode_numpy",
                    "flashlab.grading.lab02._mutant_forward", "flashlab.grading.lab02._ref_forward")
ANSWERS = {
    "q1": ("flashlab.iocount._ranges", "flashlab.grading.lab02._tiles_ref"),
    "q2": _FORWARD_ANSWERS,
    "q3": _FORWARD_ANSWERS,
}

FORWARD_ARGS = ("Q", "K", "V", "block_q", "block_k")
#: The memory parts' size: n = m = 4096, d = 16; an n x m float64 matrix is 134 MB, the limit an eighth of it.
MEMORY_N, MEMORY_D = 4096, 16
MEMORY_LIMIT = MEMORY_N * MEMORY_N * 8 // 8
#: Points of each forward question: correctness (three parts of one point) and memory (one part, scored alone).
CORRECTNESS_POINTS, MEMORY_POINTS = 3, 4


# --------------------------------------------------------------------------------------------------- q1: tiles
def _tiles_ref(n: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, n)) for lo in range(0, n, block)]


def _tiles_drop(n, block):
    return [(lo, lo + block) for lo in range(0, n - n % block, block)]


def _tiles_overrun(n, block):
    return [(lo, lo + block) for lo in range(0, n, block)]


def _tiles_inclusive_stop(n, block):
    return [(lo, min(lo + block, n) - 1) for lo in range(0, n, block)]


def _tiles_one_too_many(n, block):
    count = n // block + 1  # the ceiling only when block does not divide n
    return [(i * block, min((i + 1) * block, n)) for i in range(count)]


def _tiles_run(fn, case: Case):
    return (np.array([tuple(t) for t in fn(*case.args)], dtype=float).reshape(-1, 2),)


TILES_MUTANTS = [
    Mutant(
        "the last ragged tile is dropped: when n is not a multiple of block, the rows after the last full tile "
        "still need a (shorter) tile; loop over range(0, n, block) (T = ceil(n / block) tiles, not n // block).",
        fn=_tiles_drop,
    ),
    Mutant(
        "the last tile runs past n: stop at min(start + block, n), so the last tile is shorter.",
        fn=_tiles_overrun,
    ),
    Mutant(
        "the stops are one short: a tile (start, stop) is a Python slice, so stop is exclusive; the tile after "
        "start is (start, min(start + block, n)), with no - 1.",
        fn=_tiles_inclusive_stop,
    ),
    Mutant(
        "one tile too many when block divides n: n // block + 1 is the ceiling only when block does not divide "
        "n, and the extra tile (n, n) is empty; use ceil(n / block) = (n + block - 1) // block tiles.",
        fn=_tiles_one_too_many,
    ),
]


@LAB.question("q1", points=1, objects=("tiles",))
def q1(t: Trial, tiles) -> None:
    """tiles(n, block) lists the (start, stop) of every tile, the last one possibly shorter."""
    cases = [Case((7, 3), "n=7, block=3"), Case((6, 3), "n=6, block=3 (divides n)"), Case((2, 5), "n=2, block=5"),
             Case((5, 1), "n=5, block=1")]
    for _ in range(6):
        block = int(t.rng.integers(1, 17))
        n = int(t.rng.integers(1, 60))
        cases.append(Case((n, block), f"n={n}, block={block}"))
    t.compare("covers 0..n exactly", 1, student=tiles, cases=cases, reference=lambda c: _tiles_run(_tiles_ref, c),
              run=_tiles_run, mutants=TILES_MUTANTS, names=("tiles",), arg_names=("n", "block"))


# ------------------------------------------------------------------------------------------- the forward passes
_LSE = {
    "m + log l": lambda m, l: m + np.log(l),
    "m": lambda m, l: m,
    "m + l": lambda m, l: m + l,
    "m + log2 l": lambda m, l: m + np.log2(l),
    "log l": lambda m, l: np.log(l),
}


def _mutant_forward(
    Q,
    K,
    V,
    block_q,
    block_k,
    *,
    scale="1/sqrt(d)",
    rescale_l=True,
    rescale_acc=True,
    flip_alpha=False,
    update_max=True,
    subtract_max=True,
    max_init=-np.inf,
    normalise_in_loop=False,
    final_divide=True,
    drop_ragged_k=False,
    reset_per_tile=False,
    lse="m + log l",
    average=False,
):
    """A q-outer tiled forward with one switch per classic mistake (the defaults compute attention).

    Each row's result depends only on the order in which it sees the K/V tiles, the same in both loop orders, so
    these switches stand for the K/V-outer order's mistakes too.
    """
    n, d = Q.shape
    n_keys, dv = V.shape
    sc = {"1/sqrt(d)": 1.0 / np.sqrt(d), "none": 1.0, "1/d": 1.0 / d}[scale]
    O = np.zeros((n, dv))
    L = np.zeros(n)
    k_end = n_keys - n_keys % block_k if drop_ragged_k else n_keys
    for q0 in range(0, n, block_q):
        Qi = Q[q0 : q0 + block_q]
        rows = Qi.shape[0]
        mi, li, acc = np.full(rows, max_init), np.zeros(rows), np.zeros((rows, dv))
        results = []
        for k0 in range(0, k_end, block_k):
            if reset_per_tile:
                mi, li, acc = np.full(rows, max_init), np.zeros(rows), np.zeros((rows, dv))
            S = sc * Qi @ K[k0 : k0 + block_k].T
            Vj = V[k0 : k0 + block_k]
            if subtract_max:
                m_new = np.maximum(mi, S.max(axis=1))
                alpha = np.exp(m_new - mi) if flip_alpha else np.exp(mi - m_new)
            else:
                m_new, alpha = np.zeros(rows), np.ones(rows)
            P = np.exp(S - m_new[:, None])
            l_new = (alpha if rescale_l else 1.0) * li + P.sum(axis=1)
            a_acc = (alpha if rescale_acc else np.ones(rows))[:, None]
            acc = (a_acc * acc + P @ Vj) / l_new[:, None] if normalise_in_loop else a_acc * acc + P @ Vj
            if average:
                results.append((P @ Vj) / P.sum(axis=1)[:, None])
            li = l_new
            if update_max:
                mi = m_new
        if average:
            O[q0 : q0 + rows] = np.mean(results, axis=0)
        else:
            O[q0 : q0 + rows] = acc / li[:, None] if final_divide and not normalise_in_loop else acc
        L[q0 : q0 + rows] = _LSE[lse](mi, li)
    return O, L


def _switch(**flags):
    # The first switches were booleans: scale=False, lse=False, rescale=False still mean what they meant.
    if isinstance(flags.get("scale"), bool):
        flags["scale"] = "1/sqrt(d)" if flags["scale"] else "none"
    if isinstance(flags.get("lse"), bool):
        flags["lse"] = "m + log l" if flags["lse"] else "m"
    if flags.pop("rescale", True) is False:
        flags.update(rescale_l=False, rescale_acc=False)

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


# Mistakes that look the same in both loop orders: one message each, shared by the two questions' lists.
SCALE = ("missing the 1/sqrt(d) scale: the scores are S = Q K^T / sqrt(d) (d = Q.shape[1]).")
LSE_IS_MAX = "L is the running max m, not the logsumexp: L = m + log(l) for each row."
NO_RESCALE = ("no rescale when the max grows: multiply l and the accumulated output by exp(m_old - m_new) before "
              "adding the new tile's contribution.")
L_ONLY = ("l is rescaled but the accumulated output is not: the output summed so far was measured against the old "
          "max too; multiply it by alpha = exp(m_old - m_new) (alpha[:, None] * acc) before adding P @ V_j.")
ACC_ONLY = ("the accumulated output is rescaled but l is not: l was summed against the old max too; "
            "l = alpha * l + rowsum(P) with alpha = exp(m_old - m_new).")
FLIPPED = ("the rescale factor is upside down: alpha = exp(m_old - m_new) is at most 1 (and 0 while a row has seen "
           "nothing); exp(m_new - m_old) is inf on the first tile, and inf * 0 = nan.")
MAX_NOT_UPDATED = ("the running max is never updated: after the tile, m = m_new; with m stuck at -inf every tile "
                   "rescales the earlier ones by exp(-inf) = 0 and L = -inf.")
NO_MAX = ("no max subtraction: exp of raw scores overflows to inf (inf/inf = nan) when scores reach ~1000; "
          "exponentiate S - m_new with the running row max.")
NO_FINAL_DIVIDE = ("the output is not divided by l: the accumulator holds sum exp(S - m) V; "
                   "O = acc / l[:, None] after the last K/V tile.")
RAGGED_K = ("the last ragged K/V tile is dropped: when the key count is not a multiple of block_k the remaining "
            "keys still form a (shorter) tile; loop over range(0, n_keys, block_k) and slice up to n_keys.")
RAGGED_Q = ("the last ragged query tile is dropped: the rows after the last full block_q tile are never computed; "
            "loop over range(0, n, block_q).")
L_FORMULAS = {
    "m + l": "L adds l itself: L = m + log(l), the logsumexp of the row, not m + l.",
    "m + log2 l": "L uses log2: the logsumexp is m + log(l) with the natural log (np.log), the inverse of np.exp.",
    "log l": "L leaves out the max: l was summed against m (l = sum exp(S - m)), so L = m + log(l), not log(l).",
}

FORWARD_MUTANTS = [
    Mutant(SCALE, fn=_switch(scale="none")),
    Mutant(
        "the scores are divided by d, not sqrt(d): S = Q K^T / sqrt(d).",
        fn=_switch(scale="1/d"),
    ),
    Mutant(LSE_IS_MAX, fn=_switch(lse="m")),
    *[Mutant(msg, fn=_switch(lse=formula)) for formula, msg in L_FORMULAS.items()],
    Mutant(NO_RESCALE, fn=_switch(rescale_l=False, rescale_acc=False), key=_only_O),
    Mutant(L_ONLY, fn=_switch(rescale_acc=False)),
    Mutant(ACC_ONLY, fn=_switch(rescale_l=False)),
    Mutant(FLIPPED, fn=_switch(flip_alpha=True)),
    Mutant(MAX_NOT_UPDATED, fn=_switch(update_max=False)),
    Mutant(NO_MAX, fn=_switch(subtract_max=False), key=_only_O),
    Mutant(
        "the running max starts at 0 instead of -inf: a row whose scores are all far below 0 (about -745 or less) "
        "then underflows to l = 0 and O = 0/0 = nan; start every row at m = -inf.",
        fn=_switch(max_init=0.0),
    ),
    Mutant(
        "normalising inside the loop: the accumulated output was already divided by the old l, so it must be "
        "multiplied back by l_old * exp(m_old - m_new) before dividing by l_new — or, simpler, accumulate the "
        "unnormalised sum and divide by l once, after the last K/V tile.",
        fn=_switch(normalise_in_loop=True),
        key=_only_O,
    ),
    Mutant(NO_FINAL_DIVIDE, fn=_switch(final_divide=False), key=_only_O),
    Mutant(
        "averaging block results: the plain mean of each K/V tile's softmax average ignores that tiles carry "
        "different masses (l). Accumulate with the online-softmax update instead.",
        fn=_switch(average=True),
        key=_only_O,
    ),
    Mutant(
        "the state is reset inside the K/V loop: in the query-outer order a query tile's m, l and accumulator start "
        "once, before its loop over K/V tiles, so only the last tile is left otherwise.",
        fn=_switch(reset_per_tile=True),
    ),
    Mutant(RAGGED_K, fn=_switch(drop_ragged_k=True), key=_only_O),
    Mutant(RAGGED_Q, explains=_dropped_last_q_tile),
]

# The K/V-outer list words the shared mistakes its own way: chapter 9 finds each mistake by a phrase of its message.
KV_OUTER_MUTANTS = [
    Mutant("the scores lack the 1/sqrt(d) scale: S_ij = Q_i K_j^T / sqrt(d) (d = Q.shape[1]).",
           fn=_switch(scale="none")),
    Mutant("L is taken from m alone: after the outer loop, L = m + log(l) for each row.", fn=_switch(lse="m")),
    Mutant(
        "a visit does not rescale when the max grows: the restored sum l * O and l itself are multiplied by "
        "exp(m_old - m_new) before the tile's P V_j and rowsum(P) are added.",
        fn=_switch(rescale_l=False, rescale_acc=False),
        key=_only_O,
    ),
    Mutant(L_ONLY, fn=_switch(rescale_acc=False)),
    Mutant(ACC_ONLY, fn=_switch(rescale_l=False)),
    Mutant(FLIPPED, fn=_switch(flip_alpha=True)),
    Mutant(MAX_NOT_UPDATED, fn=_switch(update_max=False)),
    Mutant(
        "exp of raw scores: without the running max subtracted, exp overflows to inf (inf/inf = nan) when scores "
        "reach ~1000; exponentiate S - m_new.",
        fn=_switch(subtract_max=False),
        key=_only_O,
    ),
    Mutant(
        "O is read back normalised but not multiplied by its l: the paper keeps O = acc / l in HBM, so a visit "
        "first restores acc = l_old * O (then rescales by exp(m_old - m_new), adds P V_j and divides by l_new).",
        fn=_switch(normalise_in_loop=True),
        key=_only_O,
    ),
    Mutant(NO_FINAL_DIVIDE, fn=_switch(final_divide=False), key=_only_O),
    Mutant(
        "the state is reset for every K/V tile: in the K/V-outer order O, l and m are full-size arrays (HBM) set "
        "once, before the outer loop; each visit of a query tile reads them, updates them and writes them back.",
        fn=_switch(reset_per_tile=True),
    ),
    Mutant(
        "the outer loop skips the last ragged K/V tile: when the key count is not a multiple of block_k the "
        "remaining keys still form a (shorter) tile; loop over range(0, n_keys, block_k) and slice up to n_keys.",
        fn=_switch(drop_ragged_k=True),
        key=_only_O,
    ),
    Mutant(
        "the inner loop skips the last ragged query tile: its rows are never visited; loop over "
        "range(0, n, block_q) (or your tiles(n, block_q)).",
        explains=_dropped_last_q_tile,
    ),
]


def _ref_forward(case: Case):
    Q, K, V = case.args[:3]
    return reference.attention(Q, K, V)


def _qkv(t: Trial, n: int, m: int, d: int, dv: int):
    return t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d)), t.rng.standard_normal((m, dv))


def _case(Q, K, V, bq, bk, label: str = "") -> Case:
    n, d = Q.shape
    text = f"n={n}, n_keys={K.shape[0]}, d={d}, block_q={bq}, block_k={bk}"
    return Case((Q, K, V, bq, bk), f"{label}: {text}" if label else text, names=FORWARD_ARGS)


def _growing(n: int, n_keys: int, bq: int, bk: int, label: str) -> Case:
    """Every row's max grows with every K/V tile (scores rise with the key index): every rescale shows."""
    rows = np.arange(n)
    Q = np.stack([1.0 + 0.25 * (rows % 3), 0.5 + 0.2 * rows], axis=1)
    K = 0.6 * np.arange(n_keys)[:, None] * np.array([1.0, 1.0])
    keys = np.arange(n_keys)
    V = np.stack([np.cos(keys), np.sin(1.7 * keys) + 0.5, (keys % 3) - 1.0], axis=1)
    return _case(Q, K, V, bq, bk, label)


def _extremes() -> Case:
    """Row 0 sees scores from -1000 down, row 1 scores rising to 1000, row 2 ordinary ones; ragged in both."""
    n_keys, d = 5, 2
    K = np.stack([1.0 + 0.5 * np.arange(n_keys), np.zeros(n_keys)], axis=1)
    Q = np.array([[-1000.0 * np.sqrt(d), 0.0], [1000.0 * np.sqrt(d) / K[:, 0].max(), 0.0], [0.7, -0.4]])
    V = np.stack([np.arange(n_keys) - 2.0, np.cos(np.arange(n_keys))], axis=1)
    return _case(Q, K, V, 2, 2, "scores from -1000 up to 1000")


def _forward_question(t: Trial, student, mutants) -> None:
    """The parts of both forward questions: three of correctness, one of memory (scored on its own)."""
    names = ("O", "L")
    even = [_growing(4, 6, 2, 2, "the max grows with every tile")]
    for _ in range(4):
        bq, bk = (int(x) for x in t.rng.integers(1, 9, size=2))
        n, m = bq * int(t.rng.integers(1, 5)), bk * int(t.rng.integers(2, 5))
        d, dv = (int(x) for x in t.rng.integers(2, 9, size=2))
        even.append(_case(*_qkv(t, n, m, d, dv), bq, bk))
    t.compare("tiles that divide n and n_keys", 1, student=student, cases=even, reference=_ref_forward,
              mutants=mutants, names=names)

    ragged = [_case(*_qkv(t, 1, 1, 3, 2), 4, 4, "smaller than a block"),
              _growing(5, 7, 2, 3, "the max grows with every tile, both last tiles ragged")]
    for i in range(5):
        bq, bk = (int(x) for x in t.rng.integers(2, 9, size=2))
        n = int(t.rng.choice([1, 2, 3, 5, 7, 11, 13, 17, 19, 23])) if i % 2 else bq * int(t.rng.integers(1, 4)) + 1
        m = bk * int(t.rng.integers(1, 4)) + int(t.rng.integers(1, bk))
        d, dv = (int(x) for x in t.rng.integers(2, 9, size=2))
        ragged.append(_case(*_qkv(t, n, m, d, dv), bq, bk))
    t.compare("ragged tiles (n or n_keys not a multiple of the block, n = 1, primes)", 1, student=student,
              cases=ragged, reference=_ref_forward, mutants=mutants, names=names)

    huge = [_extremes()]
    for _ in range(3):
        bq, bk = (int(x) for x in t.rng.integers(2, 6, size=2))
        n, m, d = int(t.rng.integers(2, 12)), int(t.rng.integers(bk + 1, 16)), int(t.rng.integers(2, 9))
        Q, K, V = _qkv(t, n, m, d, int(t.rng.integers(1, 5)))
        S = Q @ K.T / np.sqrt(d)
        Q = Q * (1000.0 / S.max())  # the largest scaled score is exactly 1000: exp(1000) overflows
        huge.append(_case(Q, K, V, bq, bk, "scores up to 1000"))
    t.compare("huge scores (|S| up to 1000)", 1, student=student, cases=huge, reference=_ref_forward,
              mutants=mutants, names=names)

    n = MEMORY_N
    bq, bk = (int(x) for x in t.rng.choice([128, 256], size=2))
    Q, K, V = _qkv(t, n, n, MEMORY_D, MEMORY_D)
    t.memory(
        f"memory: never holds the n x n_keys score matrix (n = n_keys = {n}, d = {MEMORY_D}, blocks {bq} x {bk}; "
        "scored on its own, right or wrong)",
        MEMORY_POINTS,
        student,
        (Q, K, V, bq, bk),
        MEMORY_LIMIT,
        shapes=[(n, MEMORY_D), (n,)],
        computed=(even[1].args, 2, (0,), "V"),
        hint=f"An n x n_keys float64 matrix is {n * n * 8 / 1e6:.1f} MB: build scores one block_q x block_k tile at "
             "a time.",
    )


@LAB.question("q2", points=CORRECTNESS_POINTS + MEMORY_POINTS, objects=("flash_forward",), uses=("tiles",))
def q2(t: Trial, flash_forward) -> None:
    """flash_forward(Q, K, V, block_q, block_k), queries outer (FlashAttention-2): O and L, one tile at a time."""
    _forward_question(t, flash_forward, FORWARD_MUTANTS)


@LAB.question("q3", points=CORRECTNESS_POINTS + MEMORY_POINTS, objects=("flash_forward_kv_outer",), uses=("tiles",))
def q3(t: Trial, flash_forward_kv_outer) -> None:
    """flash_forward_kv_outer(Q, K, V, block_q, block_k), keys and values outer (the paper's Algorithm 1)."""
    _forward_question(t, flash_forward_kv_outer, KV_OUTER_MUTANTS)


# ------------------------------------------------------------------------------------------------ the traffic
class _Counted(np.ndarray):
    """An array that counts the elements read from it: by indexing, or whole when an operation uses all of it."""

    _tally: Counter
    _name: str

    def __array_finalize__(self, obj):
        self._tally = getattr(obj, "_tally", Counter())
        self._name = getattr(obj, "_name", "")

    def __getitem__(self, index):
        tile = np.asarray(self.view(np.ndarray)[index])
        self._tally[self._name] += tile.size
        return tile.copy() if isinstance(tile, np.ndarray) else tile

    def _plain(self) -> np.ndarray:
        self._tally[self._name] += self.size
        return self.view(np.ndarray)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(x._plain() if isinstance(x, _Counted) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        def plain(x):
            if isinstance(x, _Counted):
                return x._plain()
            if isinstance(x, (list, tuple)):
                return type(x)(plain(v) for v in x)
            return x

        return func(*plain(args), **{k: plain(v) for k, v in kwargs.items()})


def count_reads(fn, Q, K, V, block_q: int, block_k: int) -> dict[str, int]:
    """Elements of Q, K and V that ``fn(Q, K, V, block_q, block_k)`` reads: each tile it slices counts its size, an
    operation on a whole array counts the whole array. What the loop order changes: Q is read once and K, V once per
    query tile in the query-outer order; K, V once and Q once per K/V tile in the K/V-outer order."""
    tally: Counter = Counter()
    wrapped = []
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        arr = np.array(x, dtype=np.float64).view(_Counted)
        arr._tally, arr._name = tally, name
        wrapped.append(arr)
    fn(*wrapped, block_q, block_k)
    return {name: int(tally[name]) for name in ("Q", "K", "V")}


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _drop_last_query_tile(Q, K, V, block_q, block_k):
    """The tile loop stops at the last full query tile: ``range(0, n - n % block_q, block_q)``."""
    n = Q.shape[0]
    O, L = np.zeros((n, V.shape[1])), np.zeros(n)
    for q0 in range(0, n - n % block_q, block_q):
        O[q0:q0 + block_q], L[q0:q0 + block_q] = tiled.forward(Q[q0:q0 + block_q], K, V, block_q=block_q,
                                                               block_k=block_k)
    return O, L


def _kv_outer_drop_last_query_tile(Q, K, V, block_q, block_k):
    """K/V outer, the inner loop over query tiles stopping at the last full one; O, l, m kept in full arrays."""
    n, d = Q.shape
    n_keys, dv = V.shape
    O, l, m = np.zeros((n, dv)), np.zeros(n), np.full(n, -np.inf)
    for k0 in range(0, n_keys, block_k):
        Kj, Vj = K[k0:k0 + block_k], V[k0:k0 + block_k]
        for q0 in range(0, n - n % block_q, block_q):
            rows = slice(q0, q0 + block_q)
            S = Q[rows] @ Kj.T / np.sqrt(d)
            m_new = np.maximum(m[rows], S.max(axis=1))
            alpha, P = np.exp(m[rows] - m_new), np.exp(S - m_new[:, None])
            l_new = alpha * l[rows] + P.sum(axis=1)
            O[rows] = ((alpha * l[rows])[:, None] * O[rows] + P @ Vj) / l_new[:, None]
            l[rows], m[rows] = l_new, m_new
    with np.errstate(divide="ignore"):
        return O, m + np.log(l)


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
            ("row 0's scores from -1000 down, row 1's rising to 1000", _extremes().args),
        ],
        right=lambda args: reference.attention(*args[:3]),
        names=("O", "L"),
    )


_NAIVE = HandWritten("plain softmax attention, S = Q K^T / sqrt(d) in one piece", lambda: _whole_score_matrix,
                     expect="one block_q x block_k tile at a time")
KNOWN_MISTAKES = KnownMistakes(
    demos={"TILES_MUTANTS": _tiles_demo, "FORWARD_MUTANTS": _forward_demo, "KV_OUTER_MUTANTS": _forward_demo},
    hand_written={
        ("q2", "the last ragged query tile is dropped"): [
            HandWritten("the query loop is range(0, n - n % block_q, block_q)", lambda: _drop_last_query_tile),
        ],
        ("q3", "the inner loop skips the last ragged query tile"): [
            HandWritten("the inner query loop is range(0, n - n % block_q, block_q)",
                        lambda: _kv_outer_drop_last_query_tile),
        ],
    },
    other_diagnoses=[
        OtherDiagnosis("q2", "flash_forward", "the whole n x m score matrix is built (right answer, too much memory)",
                       _NAIVE),
        OtherDiagnosis("q3", "flash_forward_kv_outer",
                       "it builds the whole n x m score matrix (right answer, too much memory)", _NAIVE),
    ],
)
