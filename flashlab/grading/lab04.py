"""Lab 04 — the tiled backward pass with recomputation, and one step of its derivation.

q1 ``flash_backward(Q, K, V, O, L, dO, block_q, block_k) -> (dQ, dK, dV)`` is compared with
:func:`flashlab.reference.attention_backward`, one part per gradient (a wrong dQ does not cost dV's points), on
inputs of fixed kinds with fresh random values: square tiles that divide n = m (so that a mixed-up transpose
still runs and can be recognised), ragged shapes (n != m, n = 1, a K/V length shorter than its block), and
scores up to 1000. Its memory part (half of the lab's points) is scored on its own, whenever the function returns
arrays of the right shapes: at n = m = 4096 it must not hold an ``n x m`` matrix. Known mistakes are recognised
by running a tiled backward with that one mistake ("mutant") on the failing inputs.

q2 ``backward_flops(n, m, d, dv, recompute)`` counts the backward's matmul FLOPs.

q3 ``softmax_backward(S, dP) -> dS`` is the step the derivation hinges on: the gradient through a row-wise
softmax (its Jacobian), checked against the closed form that central finite differences confirm
(``tests/test_labs34.py``).
"""

from __future__ import annotations

import numpy as np

from .. import reference, tiled
from .core import BadReturn, Case, Lab, Mutant, NotImplementedYet, Trial
from .known import Demo, HandWritten, KnownMistakes, OtherDiagnosis, demo_qkv

LAB = Lab("lab04", "The backward pass with recomputation")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. The tiled backward
# also counts its FLOPs (stats=), so it answers q2 too.
_BACKWARDS = ("flashlab.backward.backward", "flashlab.backward.backward_from_p",
              "flashlab.reference.attention_backward", "flashlab.gpu.backward.numpy_backward",
              "flashlab.grading.lab04._mutant_backward", "flashlab.grading.lab04._truth")
ANSWERS = {
    "q1": _BACKWARDS,
    "q2": ("flashlab.backward.backward", "flashlab.grading.lab04._flops"),
    "q3": ("flashlab.grading.lab04._softmax_backward", "flashlab.grading.lab04._softmax_mutant"),
}

GRADIENTS = ("dQ", "dK", "dV")
#: The memory part's size: an n x m float64 matrix is 134 MB, eight times the limit.
MEMORY_N, MEMORY_D, MEMORY_BLOCKS = 4096, 16, (128, 256)
MEMORY_LIMIT = MEMORY_N * MEMORY_N * 8 // 8
MEMORY_POINTS = 6


def _mutant_backward(Q, K, V, O, L, dO, block_q, block_k, *, use_d=True, d_from_tile=False, grad_scale=1,
                     scale_scores=True, transpose_dk=False, transpose_dv=False, p_from="L", ds_sign=1,
                     scale_dv=False, assign_dq=False, assign_dkv=False, whole_k_tiles=False, whole_q_tiles=False,
                     l_across=False, keep_tiles=False, unscaled=""):
    """The lab's K/V-outer tiled backward with one switch per classic mistake (defaults = correct)."""
    n, m = Q.shape[0], K.shape[0]
    scale = 1.0 / np.sqrt(Q.shape[1])
    D = np.sum(dO * O, axis=1)
    dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    kept = []  # with keep_tiles, every tile of P: together the n x m matrix
    k_end = m // block_k * block_k if whole_k_tiles else m
    q_end = n // block_q * block_q if whole_q_tiles else n
    for k0 in range(0, k_end, block_k):
        k1 = min(k0 + block_k, m)
        Kj, Vj = K[k0:k1], V[k0:k1]
        dKj, dVj = np.zeros(Kj.shape), np.zeros(Vj.shape)
        for q0 in range(0, q_end, block_q):
            q1 = min(q0 + block_q, n)
            Qi, dOi = Q[q0:q1], dO[q0:q1]
            S = (scale if scale_scores else 1.0) * Qi @ Kj.T
            if p_from == "L":
                P = np.exp(S - (L[q0:q1][None, :] if l_across else L[q0:q1, None]))
            elif p_from == "O":
                P = O[q0:q1] @ Vj.T
            elif p_from == "tile max":  # exp(S - max) of the tile, never divided by a sum
                P = np.exp(S - S.max(axis=1, keepdims=True))
            else:  # a softmax of the tile alone
                P = np.exp(S - S.max(axis=1, keepdims=True))
                P /= P.sum(axis=1, keepdims=True)
            if keep_tiles:
                kept.append(P)
            dP = dOi @ Vj.T
            Di = np.sum(P * dP, axis=1) if d_from_tile else D[q0:q1]
            dS = ds_sign * (P * (dP - Di[:, None]) if use_d else P * dP)
            g = scale ** grad_scale
            gq, gk = (1.0 if unscaled == "dQ" else g), (1.0 if unscaled == "dK" else g)
            if assign_dq:
                dQ[q0:q1] = gq * dS @ Kj
            else:
                dQ[q0:q1] += gq * dS @ Kj
            dk_tile = gk * (dS @ Qi if transpose_dk else dS.T @ Qi)  # dS @ Qi runs only when the tile is square
            dv_tile = (scale if scale_dv else 1.0) * (P @ dOi if transpose_dv else P.T @ dOi)
            if assign_dkv:
                dKj, dVj = dk_tile, dv_tile
            else:
                dKj += dk_tile
                dVj += dv_tile
        dK[k0:k1], dV[k0:k1] = dKj, dVj
    return dQ, dK, dV


def _switch(**flags):
    def fn(Q, K, V, O, L, dO, block_q, block_k):
        return _mutant_backward(Q, K, V, O, L, dO, block_q, block_k, **flags)

    return fn


# Each part of q1 judges one gradient: a mutant is recognised there by that gradient alone (a mutant that leaves
# it right never matches a failure of it), so every list below serves all three parts.
MUTANTS = [
    Mutant("D is missing: the softmax backward is dS = P * (dP - D) with D = rowsum(dO * O), one number per query "
           "row computed once before the loops.", fn=_switch(use_d=False)),
    Mutant("D taken from one tile: rowsum(P_ij * dP_ij) over a single K/V tile is only part of the row's sum. Use "
           "D = rowsum(dO * O), which equals the sum over the whole row.", fn=_switch(d_from_tile=True)),
    Mutant("the scale is missing in dQ and dK: S = scale * Q K^T, so dQ = scale * dS K and dK = scale * dS^T Q.",
           fn=_switch(grad_scale=0)),
    Mutant("the scale is missing in dK (dQ has it): S = scale * Q K^T, so dK = scale * dS^T Q too.",
           fn=_switch(unscaled="dK")),
    Mutant("the scale is missing in dQ (dK has it): S = scale * Q K^T, so dQ = scale * dS K too.",
           fn=_switch(unscaled="dQ")),
    Mutant("the scale is applied twice in dQ and dK: once is enough (S = scale * Q K^T has one factor).",
           fn=_switch(grad_scale=2)),
    Mutant("the recomputed scores lack the scale: P_ij = exp(scale * Q_i K_j^T - L_i), exactly as in the forward.",
           fn=_switch(scale_scores=False)),
    Mutant("a transpose is mixed up in dK: dK_j += scale * dS_ij.T @ Q_i (a (block_k, d) block); dS @ Q_i only runs "
           "because your tiles are square.", fn=_switch(transpose_dk=True)),
    Mutant("a transpose is mixed up in dV: dV_j += P_ij.T @ dO_i (a (block_k, dv) block); P @ dO_i only runs "
           "because your tiles are square.", fn=_switch(transpose_dv=True)),
    Mutant("P taken from O: O = P V does not give P = O V^T. Recompute each tile from the saved logsumexp: "
           "P_ij = exp(scale * Q_i K_j^T - L_i).", fn=_switch(p_from="O")),
    Mutant("P normalised tile by tile: a softmax over one K/V tile ignores the rest of the row. exp(S_ij - L_i) "
           "is already normalised over the whole row.", fn=_switch(p_from="tile")),
    Mutant("P recomputed as exp(S_ij - tile max) without L: that is neither normalised nor the forward's P. "
           "Subtract the saved logsumexp instead: P_ij = exp(S_ij - L_i), no max and no sum needed.",
           fn=_switch(p_from="tile max")),
    Mutant("dS has the wrong sign: dS = P * (dP - D), not P * (D - dP) (dQ and dK come out negated).",
           fn=_switch(ds_sign=-1)),
    Mutant("dV is scaled: the scale belongs to S = scale * Q K^T, so only dQ and dK carry it; dV_j = P_ij^T dO_i.",
           fn=_switch(scale_dv=True)),
    Mutant("dQ is overwritten instead of accumulated: dQ_i = ... keeps only the last K/V tile's share; each K/V "
           "tile adds to it (dQ[q0:q1] += scale * dS @ K_j).", fn=_switch(assign_dq=True)),
    Mutant("dK_j and dV_j are overwritten for each query tile instead of accumulated: only the last query tile's "
           "share survives. Add every query tile's dS^T Q_i and P^T dO_i to them (+=).",
           fn=_switch(assign_dkv=True)),
    Mutant("the ragged last K/V tile is dropped: m // block_k tiles miss the last m % block_k keys (their dK and dV "
           "stay 0). Loop over range(0, m, block_k) and cut each tile at m.", fn=_switch(whole_k_tiles=True)),
    Mutant("the ragged last query tile is dropped: n // block_q tiles miss the last n % block_q queries. Loop over "
           "range(0, n, block_q) and cut each tile at n.", fn=_switch(whole_q_tiles=True)),
    Mutant("L is broadcast along the wrong axis: S - L[q0:q1] subtracts L from the columns (it only runs because "
           "your tiles are square). Each query row has its own L_i: S - L[q0:q1, None].",
           fn=_switch(l_across=True)),
]


def _case(t: Trial, n: int, m: int, d: int, dv: int, bq: int, bk: int, label: str = "", big: bool = False) -> Case:
    Q, K = t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d))
    V, dO = t.rng.standard_normal((m, dv)), t.rng.standard_normal((n, dv))
    if big:
        S = Q @ K.T / np.sqrt(d)
        Q = Q * (1000.0 / np.abs(S).max())  # the largest scaled score is exactly +-1000
    tile = 8 if n * m < 10_000 else 512  # small tiles test the forward's ragged paths; big inputs need big ones
    O, L = tiled.forward(Q, K, V, block_q=tile, block_k=tile)
    label = label or f"n={n}, m={m}, d={d}, dv={dv}, block_q={bq}, block_k={bk}"
    return Case((Q, K, V, O, L, dO, bq, bk), label)


def _truth(case: Case):
    Q, K, V, _, _, dO = case.args[:6]
    return reference.attention_backward(Q, K, V, dO)


def _ints(t: Trial, low: int, high: int, size: int = 1) -> list[int]:
    return [int(x) for x in t.rng.integers(low, high + 1, size=size)]


def backward_cases(t: Trial) -> list[Case]:
    """q1's inputs: the same kinds for every seed (so that a mistake fails the same parts), fresh values."""
    cases = []
    for k in (2, 3, 4):  # square tiles that divide n = m, at least two of them each way
        b, d, dv = _ints(t, 2, 5), _ints(t, 2, 8), _ints(t, 2, 8)
        cases.append(_case(t, b[0] * k, b[0] * k, d[0], dv[0], b[0], b[0]))
    cases.append(_case(t, 1, 1, 3, 2, 4, 4, "n=1, m=1 (smaller than a block)"))
    bq, bk = _ints(t, 2, 6, 2)
    cases.append(_case(t, 2 * bq + 1 + _ints(t, 0, bq - 2)[0], 2 * bk + 1 + _ints(t, 0, bk - 2)[0], *_ints(t, 1, 8, 2),
                       bq, bk))  # n > m or not, both ragged, three or more tiles each way
    bq, bk = _ints(t, 2, 6, 2)
    n = 3 * bq + 1 + _ints(t, 0, bq - 2)[0]
    cases.append(_case(t, n, n + 2 + _ints(t, 0, 5)[0], *_ints(t, 1, 8, 2), bq, bk))  # m > n
    bq = _ints(t, 2, 6)[0]
    cases.append(_case(t, 2 * bq + 1, _ints(t, 1, 5)[0], *_ints(t, 1, 8, 2), bq, 6))  # all keys in one short tile
    for _ in range(2):  # scores up to 1000 in size: P = exp(S - L) must not overflow
        n, m, d = _ints(t, 5, 12)[0], _ints(t, 7, 16)[0], _ints(t, 2, 8)[0]
        cases.append(_case(t, n, m, d, 3, 3, 4, f"scores up to 1000 in size, n={n}, m={m}, d={d}", big=True))
    return cases


def _gradient(i: int):
    """Run an implementation and keep gradient ``i`` (a return value that is not three arrays is reported)."""
    def run(fn, case: Case):
        out = fn(*case.args, **case.kwargs)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            size = f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""
            raise BadReturn(f"returned a {type(out).__name__}{size}")
        return out[i]

    return run


def _shapes_problem(t: Trial, flash_backward, case: Case) -> str:
    """Why the memory part cannot be measured (the function does not return three arrays of the right shapes)."""
    Q, K, V = case.args[:3]
    want = (Q.shape, K.shape, V.shape)
    try:
        out = t.call(flash_backward, *(a.copy() if isinstance(a, np.ndarray) else a for a in case.args))
    except NotImplementedYet:
        raise
    except Exception as e:  # the other parts show the error itself
        return f"your code raised {type(e).__name__} on {case.label}"
    try:
        got = tuple(np.shape(x) for x in out)
    except TypeError:
        return f"your code returned {type(out).__name__}, not (dQ, dK, dV)"
    if got != want:
        return f"on {case.label} your (dQ, dK, dV) have shapes {got}, expected {want}"
    return ""


BACKWARD_ARGS = ("Q", "K", "V", "O", "L", "dO", "block_q", "block_k")


@LAB.question("q1", points=3 + MEMORY_POINTS, objects=("flash_backward",))
def q1(t: Trial, flash_backward) -> None:
    """flash_backward(Q, K, V, O, L, dO, block_q, block_k) -> (dQ, dK, dV), recomputing P from L."""
    cases = backward_cases(t)
    for i, name in enumerate(GRADIENTS):
        t.compare(name, 1, student=flash_backward, cases=cases, reference=lambda c, i=i: _truth(c)[i],
                  run=_gradient(i), mutants=MUTANTS, names=(name,), arg_names=BACKWARD_ARGS)

    b = int(t.rng.choice(MEMORY_BLOCKS))
    label = f"memory: never holds an n x m matrix (n = m = {MEMORY_N}, blocks {b} x {b})"
    problem = _shapes_problem(t, flash_backward, cases[0])
    if problem:
        t.expect(label, MEMORY_POINTS, False, f"memory not measured: {problem}")
        return
    case = _case(t, MEMORY_N, MEMORY_N, MEMORY_D, MEMORY_D, b, b)
    t.memory(label, MEMORY_POINTS, flash_backward, case.args, MEMORY_LIMIT,
             computed=(cases[0].args, 5, (0, 1, 2), "dO"),
             hint=f"An n x m float64 matrix (P, S or dS) is {MEMORY_N * MEMORY_N * 8 / 1e6:.0f} MB: recompute each "
             "block_q x block_k tile of P from Q, K and L, use it, and let it go.")


# ------------------------------------------------------------------------------------------------- q2: FLOPs
def _flops(n, m, d, dv, recompute):
    return 2 * n * m * ((3 if recompute else 2) * d + 2 * dv)


FLOP_MUTANTS = [
    Mutant("with recomputation the backward also redoes Q_i K_j^T (2 n m d more FLOPs).",
           fn=lambda n, m, d, dv, r: _flops(n, m, d, dv, False)),
    Mutant("a multiply-add is 2 FLOPs: an (a x b) @ (b x c) product costs 2abc.",
           fn=lambda n, m, d, dv, r: _flops(n, m, d, dv, r) // 2),
    Mutant("d and dv play different parts: Q K^T, dS K and dS^T Q have inner size d; P^T dO and dO V^T have dv.",
           fn=lambda n, m, d, dv, r: 2 * n * m * ((3 if r else 2) * dv + 2 * d)),
    Mutant("10 n m d is the count for d = dv with recomputation, every time: without recomputation Q_i K_j^T is not "
           "redone (2 n m d less), and P^T dO and dO V^T have inner size dv, not d.",
           fn=lambda n, m, d, dv, r: 10 * n * m * d),
    Mutant("dv is ignored: P^T dO and dO V^T have inner size dv (the width of V and dO), so they cost 2 n m dv "
           "each, not 2 n m d.", fn=lambda n, m, d, dv, r: _flops(n, m, d, d, r)),
    Mutant("without recomputation the backward reads the stored P: Q_i K_j^T is not redone (2 n m d less than "
           "with recomputation).", fn=lambda n, m, d, dv, r: _flops(n, m, d, dv, True)),
]


@LAB.question("q2", points=1, objects=("backward_flops",))
def q2(t: Trial, backward_flops) -> None:
    """backward_flops(n, m, d, dv, recompute) -> matmul FLOPs of the backward (2 per multiply-add)."""
    cases = []
    for i in range(8):  # recompute True and False alike, always with n != m and d != dv
        n, m = (int(x) for x in t.rng.choice(np.arange(1, 3000), size=2, replace=False))
        d, dv = (int(x) for x in t.rng.choice(np.arange(1, 300), size=2, replace=False))
        cases.append(Case((n, m, d, dv, bool(i % 2)), f"n={n}, m={m}, d={d}, dv={dv}, recompute={bool(i % 2)}"))
    t.compare("FLOPs", 1, student=backward_flops, cases=cases, reference=lambda c: _flops(*c.args),
              mutants=FLOP_MUTANTS, names=("flops",), rtol=0, atol=0.5)


# ------------------------------------------------------------------------------- q3: through the softmax
def _softmax(S, axis=1):
    P = np.exp(S - S.max(axis=axis, keepdims=True))
    return P / P.sum(axis=axis, keepdims=True)


def _softmax_backward(S, dP):
    """dS for P = softmax(S) row by row: P * (dP - rowsum(P * dP)) (the Jacobian P_j (delta_jk - P_k), applied)."""
    P = _softmax(S)
    return P * (dP - np.sum(P * dP, axis=1, keepdims=True))


def _softmax_mutant(S, dP, *, mistake):
    P = _softmax(S)
    if mistake == "no D":
        return P * dP
    if mistake == "sign":
        return P * (np.sum(P * dP, axis=1, keepdims=True) - dP)
    if mistake == "S for P":
        return S * (dP - np.sum(S * dP, axis=1, keepdims=True))
    if mistake == "diagonal":
        return P * (1 - P) * dP
    if mistake == "unweighted D":
        return P * (dP - np.sum(dP, axis=1, keepdims=True))
    if mistake == "columns":
        P = _softmax(S, axis=0)
        return P * (dP - np.sum(P * dP, axis=0, keepdims=True))
    if mistake == "no max":
        E = np.exp(S)
        P = E / E.sum(axis=1, keepdims=True)
        return P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    if mistake == "unnormalised":
        P = np.exp(S - S.max(axis=1, keepdims=True))
        return P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    if mistake == "whole D":
        return P * (dP - np.sum(P * dP))
    if mistake == "no P factor":
        return dP - np.sum(P * dP, axis=1, keepdims=True)
    if mistake == "D down the columns":
        return P * (dP - np.sum(P * dP, axis=0, keepdims=True))
    if mistake == "no keepdims":
        return P * (dP - np.sum(P * dP, axis=1))
    if mistake == "P on one term":
        return P * dP - np.sum(P * dP, axis=1, keepdims=True)
    raise ValueError(mistake)


def _softmax_switch(mistake: str):
    def fn(S, dP):
        return _softmax_mutant(S, dP, mistake=mistake)

    return fn


SOFTMAX_MUTANTS = [
    Mutant("the row term is missing: dS = P * dP forgets that raising one score lowers every other P of its row. "
           "The Jacobian dP_ij/dS_ik = P_ij (delta_jk - P_ik) gives dS = P * (dP - rowsum(P * dP)).",
           fn=_softmax_switch("no D")),
    Mutant("the sign is flipped: dS = P * (dP - rowsum(P * dP)), not P * (rowsum(P * dP) - dP).",
           fn=_softmax_switch("sign")),
    Mutant("S used where P belongs: the Jacobian of the softmax is written with its output P = softmax(S), not with "
           "the scores. Compute P first (subtract the row max, exponentiate, divide by the row sum).",
           fn=_softmax_switch("S for P")),
    Mutant("only the Jacobian's diagonal: P * (1 - P) * dP keeps dP_ij/dS_ij and drops the off-diagonal terms "
           "-P_ij P_ik. With them, dS = P * (dP - rowsum(P * dP)).", fn=_softmax_switch("diagonal")),
    Mutant("the row term is unweighted: subtract rowsum(P * dP) (the P-weighted mean of dP), not rowsum(dP).",
           fn=_softmax_switch("unweighted D")),
    Mutant("the softmax runs down the columns: P is softmax(S) row by row (each query's weights over the keys sum "
           "to 1), so both the max/sum and rowsum(P * dP) go along axis=1.", fn=_softmax_switch("columns")),
    Mutant("no max subtraction: exp(S) overflows for scores near 1000 (inf / inf = nan). Subtract each row's max "
           "before exponentiating.", fn=_softmax_switch("no max")),
    Mutant("P is not normalised: exp(S - rowmax) is not the softmax until it is divided by its row sum.",
           fn=_softmax_switch("unnormalised")),
    Mutant("the row term is summed over the whole matrix: each row has its own D_i = sum_j P_ij dP_ij "
           "(keepdims=True along axis=1), not one number for all rows.", fn=_softmax_switch("whole D")),
    Mutant("the factor P is missing: dS_ik = P_ik (dP_ik - D_i); without P every score gets the same weight.",
           fn=_softmax_switch("no P factor")),
    Mutant("the row term is summed down the columns: P is right (row by row), but D_i = sum_j P_ij dP_ij sums "
           "along axis=1, over the keys of row i, not along axis=0.", fn=_softmax_switch("D down the columns")),
    Mutant("keepdims is forgotten: np.sum(P * dP, axis=1) has shape (n,), and broadcasting lines it up with the "
           "last axis (the columns), so it is subtracted from the wrong entries or the shapes do not fit. Keep the "
           "row axis: np.sum(..., axis=1, keepdims=True), shape (n, 1).", fn=_softmax_switch("no keepdims")),
    Mutant("P multiplies only the first term: dS = P * (dP - D), so the row term D is weighted by P too, "
           "not P * dP - D.", fn=_softmax_switch("P on one term")),
]


def softmax_cases(t: Trial) -> list[Case]:
    """q3's inputs: the same kinds for every seed, fresh values."""
    shapes = [(1, _ints(t, 3, 9)[0], "one row"), (_ints(t, 3, 9)[0], 1, "one column"),
              (*_ints(t, 2, 9, 2), ""), (*_ints(t, 2, 9, 2), ""), (*_ints(t, 2, 9, 2), "")]
    cases = []
    for n, m, what in shapes:
        S, dP = 2 * t.rng.standard_normal((n, m)), t.rng.standard_normal((n, m))
        cases.append(Case((S, dP), f"S and dP of shape ({n}, {m}){', ' + what if what else ''}"))
    return cases


def huge_softmax_cases(t: Trial) -> list[Case]:
    """q3's scores near 1000, where exp(S) overflows unless the row max is subtracted."""
    cases = []
    for _ in range(2):
        n, m = _ints(t, 2, 6, 2)
        S = 1000.0 + 3 * t.rng.standard_normal((n, m))
        cases.append(Case((S, t.rng.standard_normal((n, m))), f"scores near 1000, shape ({n}, {m})"))
    return cases


@LAB.question("q3", points=2, objects=("softmax_backward",))
def q3(t: Trial, softmax_backward) -> None:
    """softmax_backward(S, dP) -> dS: the gradient through a row-wise softmax."""
    # Forgetting the max subtraction fails only the huge scores: it costs a quarter, not the whole formula.
    t.compare("dS through the softmax's Jacobian", 1.5, student=softmax_backward, cases=softmax_cases(t),
              reference=lambda c: _softmax_backward(*c.args), mutants=SOFTMAX_MUTANTS, names=("dS",))
    t.compare("dS for scores near 1000", 0.5, student=softmax_backward, cases=huge_softmax_cases(t),
              reference=lambda c: _softmax_backward(*c.args), mutants=SOFTMAX_MUTANTS, names=("dS",))


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _stores_p(Q, K, V, O, L, dO, block_q, block_k):
    """Right, but keeps the whole n x m matrix P (the backward without recomputation)."""
    return reference.attention_backward(Q, K, V, dO)


def _backward_demo() -> Demo:
    Q, K, V = demo_qkv(4, 4, 2, 2, seed=3)
    dO = np.random.default_rng(3 + 100).standard_normal((4, 2))
    O, L = tiled.forward(Q, K, V, block_q=8, block_k=8)
    Q5, K7, V7 = demo_qkv(5, 7, 2, 2, seed=4)
    dO5 = np.random.default_rng(4 + 100).standard_normal((5, 2))
    O5, L5 = tiled.forward(Q5, K7, V7, block_q=8, block_k=8)
    return Demo(
        examples=[("random, n = m = 4, d = dv = 2, block_q = block_k = 2", (Q, K, V, O, L, dO, 2, 2)),
                  ("random, n = 5, m = 7, d = dv = 2, block_q = 2, block_k = 3 (ragged)",
                   (Q5, K7, V7, O5, L5, dO5, 2, 3))],
        right=lambda args: reference.attention_backward(args[0], args[1], args[2], args[5]),
        names=("dQ", "dK", "dV"),
    )


def _flops_demo() -> Demo:
    return Demo(
        examples=[("n = m = 1024, d = dv = 64, recompute", (1024, 1024, 64, 64, True)),
                  ("n = 1000, m = 500, d = 64, dv = 32, recompute", (1000, 500, 64, 32, True)),
                  ("n = 1000, m = 500, d = 64, dv = 32, P stored", (1000, 500, 64, 32, False))],
        right=lambda args: _flops(*args),
        names=("FLOPs",),
    )


def _softmax_demo() -> Demo:
    S = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    dP = np.array([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]])
    huge = np.array([[1000.0, 998.0, -1000.0]])
    return Demo(
        examples=[("S, dP of shape (2, 3)", (S, dP)),
                  ("scores near 1000, one row", (huge, np.array([[1.0, -1.0, 0.5]])))],
        right=lambda args: _softmax_backward(*args),
        names=("dS",),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"MUTANTS": _backward_demo, "FLOP_MUTANTS": _flops_demo, "SOFTMAX_MUTANTS": _softmax_demo},
    other_diagnoses=[
        OtherDiagnosis("q1", "flash_backward",
                       "P is stored whole instead of recomputed tile by tile (right answer, too much memory)",
                       HandWritten("the backward of plain attention, keeping P", lambda: _stores_p,
                                   expect="recompute each block_q x block_k tile")),
        OtherDiagnosis("q1", "flash_backward",
                       "P stored tile by tile in a list for later: right gradients, and the whole n x m matrix kept",
                       HandWritten("recomputes each tile, but appends it to a list it keeps",
                                   lambda: _switch(keep_tiles=True), expect="recompute each block_q x block_k tile")),
    ],
)
