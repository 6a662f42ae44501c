"""Lab 04 — the tiled backward pass with recomputation.

q1 ``flash_backward(Q, K, V, O, L, dO, block_q, block_k) -> (dQ, dK, dV)`` is compared with
:func:`flashlab.reference.attention_backward` on fresh random shapes (square ones, so that a mixed-up transpose
still runs and can be recognised; ragged ones; scores up to 1000), and must not hold an ``n x m`` matrix: an
answer that stores P fails the memory part. Known mistakes are recognised by running a tiled backward with that
one mistake ("mutant") on the failing inputs: D forgotten or taken from one tile; the scale missing, doubled or
left out of the recomputed scores; a transpose mixed up in dK or dV; P taken from O (``O V^T``) or normalised
tile by tile instead of recomputed from L.

q2 ``backward_flops(n, m, d, dv, recompute)`` counts the backward's matmul FLOPs.
"""

from __future__ import annotations

import numpy as np

from .. import reference, tiled
from .core import Case, Lab, Mutant, Trial
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
}


def _mutant_backward(Q, K, V, O, L, dO, block_q, block_k, *, use_d=True, d_from_tile=False, grad_scale=1,
                     scale_scores=True, transpose_dk=False, transpose_dv=False, p_from="L"):
    """A K/V-outer tiled backward with one switch per classic mistake (defaults = correct)."""
    n, m = Q.shape[0], K.shape[0]
    scale = 1.0 / np.sqrt(Q.shape[1])
    D = np.sum(dO * O, axis=1)
    dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    for k0 in range(0, m, block_k):
        Kj, Vj = K[k0:k0 + block_k], V[k0:k0 + block_k]
        for q0 in range(0, n, block_q):
            Qi, dOi = Q[q0:q0 + block_q], dO[q0:q0 + block_q]
            S = (scale if scale_scores else 1.0) * Qi @ Kj.T
            if p_from == "L":
                P = np.exp(S - L[q0:q0 + block_q, None])
            elif p_from == "O":
                P = O[q0:q0 + block_q] @ Vj.T
            else:  # a softmax of the tile alone
                P = np.exp(S - S.max(axis=1, keepdims=True))
                P /= P.sum(axis=1, keepdims=True)
            dP = dOi @ Vj.T
            Di = np.sum(P * dP, axis=1) if d_from_tile else D[q0:q0 + block_q]
            dS = P * (dP - Di[:, None]) if use_d else P * dP
            g = scale ** grad_scale
            dQ[q0:q0 + block_q] += g * dS @ Kj
            if transpose_dk:
                dK[q0:q0 + block_q] += g * dS @ Qi  # wrong: needs dS^T
            else:
                dK[k0:k0 + block_k] += g * dS.T @ Qi
            if transpose_dv:
                dV[q0:q0 + block_q] += P @ dOi  # wrong: needs P^T
            else:
                dV[k0:k0 + block_k] += P.T @ dOi
    return dQ, dK, dV


def _switch(**flags):
    def fn(Q, K, V, O, L, dO, block_q, block_k):
        return _mutant_backward(Q, K, V, O, L, dO, block_q, block_k, **flags)

    return fn


def _dq_dk(out):
    return out[:2]


def _dk(out):
    return out[1:2]


def _dv(out):
    return out[2:3]


MUTANTS = [
    Mutant("D is missing: the softmax backward is dS = P * (dP - D) with D = rowsum(dO * O), one number per query "
           "row computed once before the loops.", fn=_switch(use_d=False), key=_dq_dk),
    Mutant("D taken from one tile: rowsum(P_ij * dP_ij) over a single K/V tile is only part of the row's sum. Use "
           "D = rowsum(dO * O), which equals the sum over the whole row.", fn=_switch(d_from_tile=True), key=_dq_dk),
    Mutant("the scale is missing in dQ and dK: S = scale * Q K^T, so dQ = scale * dS K and dK = scale * dS^T Q.",
           fn=_switch(grad_scale=0), key=_dq_dk),
    Mutant("the scale is applied twice in dQ and dK: once is enough (S = scale * Q K^T has one factor).",
           fn=_switch(grad_scale=2), key=_dq_dk),
    Mutant("the recomputed scores lack the scale: P_ij = exp(scale * Q_i K_j^T - L_i), exactly as in the forward.",
           fn=_switch(scale_scores=False)),
    Mutant("a transpose is mixed up in dK: dK_j = scale * dS_ij^T Q_i (a (block_k, d) block), not dS_ij Q_i.",
           fn=_switch(transpose_dk=True), key=_dk),
    Mutant("a transpose is mixed up in dV: dV_j = P_ij^T dO_i (a (block_k, dv) block), not P_ij dO_i.",
           fn=_switch(transpose_dv=True), key=_dv),
    Mutant("P taken from O: O = P V does not give P = O V^T. Recompute each tile from the saved logsumexp: "
           "P_ij = exp(scale * Q_i K_j^T - L_i).", fn=_switch(p_from="O")),
    Mutant("P normalised tile by tile: a softmax over one K/V tile ignores the rest of the row. exp(S_ij - L_i) "
           "is already normalised over the whole row.", fn=_switch(p_from="tile")),
]


def _case(t: Trial, n: int, m: int, d: int, dv: int, bq: int, bk: int, label: str = "", big: bool = False) -> Case:
    Q, K = t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d))
    V, dO = t.rng.standard_normal((m, dv)), t.rng.standard_normal((n, dv))
    if big:
        S = Q @ K.T / np.sqrt(d)
        Q = Q * (1000.0 / np.abs(S).max())  # the largest scaled score is exactly +-1000
    O, L = tiled.forward(Q, K, V, block_q=8, block_k=8)
    label = label or f"n={n}, m={m}, d={d}, dv={dv}, block_q={bq}, block_k={bk}"
    return Case((Q, K, V, O, L, dO, bq, bk), label)


def _truth(case: Case):
    Q, K, V, _, _, dO = case.args[:6]
    return reference.attention_backward(Q, K, V, dO)


@LAB.question("q1", points=6, objects=("flash_backward",))
def q1(t: Trial, flash_backward) -> None:
    """flash_backward(Q, K, V, O, L, dO, block_q, block_k) -> (dQ, dK, dV), recomputing P from L."""
    names = ("dQ", "dK", "dV")
    square = []
    for _ in range(5):  # square tiles too, so that a mixed-up transpose runs and can be recognised
        b = int(t.rng.integers(2, 7))
        n = b * int(t.rng.integers(1, 5))
        d, dv = (int(x) for x in t.rng.integers(2, 9, size=2))
        square.append(_case(t, n, n, d, dv, b, b))
    t.compare("n = m, square blocks that divide them", 2, student=flash_backward, cases=square, reference=_truth,
              mutants=MUTANTS, names=names)

    ragged = [_case(t, 1, 1, 3, 2, 4, 4, "n=1, m=1 (smaller than a block)")]
    for _ in range(5):
        bq, bk = (int(x) for x in t.rng.integers(2, 9, size=2))
        n, m = (int(x) for x in t.rng.integers(1, 40, size=2))
        d, dv = (int(x) for x in t.rng.integers(1, 9, size=2))
        ragged.append(_case(t, n, m, d, dv, bq, bk))
    t.compare("ragged shapes (n != m, not multiples of the blocks)", 2, student=flash_backward, cases=ragged,
              reference=_truth, mutants=MUTANTS, names=names)

    huge = []
    for _ in range(3):
        n, m, d = int(t.rng.integers(2, 12)), int(t.rng.integers(2, 16)), int(t.rng.integers(2, 9))
        huge.append(_case(t, n, m, d, 3, 3, 4, f"scores up to 1000 in size, n={n}, m={m}", big=True))
    t.compare("huge scores (|S| up to 1000)", 1, student=flash_backward, cases=huge, reference=_truth,
              mutants=MUTANTS, names=names, rtol=1e-7, atol=1e-9)

    n = m = int(t.rng.integers(900, 1100))
    bq, bk = (int(x) for x in t.rng.choice([32, 64], size=2))
    case = _case(t, n, m, 16, 16, bq, bk)
    t.memory(
        f"memory: never holds an n x m matrix (n = m = {n}, blocks {bq} x {bk})",
        1,
        flash_backward,
        case.args,
        n * m * 8 // 4,
        reference=_truth(case),
        hint=f"An n x m float64 matrix (P, S or dS) is {n * m * 8 / 1e6:.1f} MB: recompute each block_q x block_k "
        "tile of P from Q, K and L, use it, and let it go.",
    )


def _flops(n, m, d, dv, recompute):
    return 2 * n * m * ((3 if recompute else 2) * d + 2 * dv)


FLOP_MUTANTS = [
    Mutant("with recomputation the backward also redoes Q_i K_j^T (2 n m d more FLOPs).",
           fn=lambda n, m, d, dv, r: _flops(n, m, d, dv, False)),
    Mutant("a multiply-add is 2 FLOPs: an (a x b) @ (b x c) product costs 2abc.",
           fn=lambda n, m, d, dv, r: _flops(n, m, d, dv, r) // 2),
    Mutant("d and dv play different parts: Q K^T, dS K and dS^T Q have inner size d; P^T dO and dO V^T have dv.",
           fn=lambda n, m, d, dv, r: 2 * n * m * ((3 if r else 2) * dv + 2 * d)),
]


@LAB.question("q2", points=1, objects=("backward_flops",))
def q2(t: Trial, backward_flops) -> None:
    """backward_flops(n, m, d, dv, recompute) -> matmul FLOPs of the backward (2 per multiply-add)."""
    cases = []
    for i in range(8):
        n, m, d, dv = (int(x) for x in t.rng.integers(1, 3000, size=4))
        cases.append(Case((n, m, d, dv, bool(i % 2)), f"n={n}, m={m}, d={d}, dv={dv}, recompute={bool(i % 2)}"))
    t.compare("FLOPs", 1, student=backward_flops, cases=cases, reference=lambda c: _flops(*c.args),
              mutants=FLOP_MUTANTS, names=("flops",), rtol=0, atol=0.5)


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _stores_p(Q, K, V, O, L, dO, block_q, block_k):
    """Right, but keeps the whole n x m matrix P (the backward without recomputation)."""
    return reference.attention_backward(Q, K, V, dO)


def _backward_demo() -> Demo:
    Q, K, V = demo_qkv(4, 4, 2, 2, seed=3)
    dO = np.random.default_rng(3 + 100).standard_normal((4, 2))
    O, L = tiled.forward(Q, K, V, block_q=8, block_k=8)
    return Demo(
        examples=[("random, n = m = 4, d = dv = 2, block_q = block_k = 2", (Q, K, V, O, L, dO, 2, 2))],
        right=lambda args: reference.attention_backward(args[0], args[1], args[2], args[5]),
        names=("dQ", "dK", "dV"),
    )


def _flops_demo() -> Demo:
    return Demo(
        examples=[("n = m = 1024, d = dv = 64, recompute", (1024, 1024, 64, 64, True)),
                  ("n = 1000, m = 500, d = 64, dv = 32, recompute", (1000, 500, 64, 32, True))],
        right=lambda args: _flops(*args),
        names=("FLOPs",),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"MUTANTS": _backward_demo, "FLOP_MUTANTS": _flops_demo},
    other_diagnoses=[
        OtherDiagnosis("q1", "flash_backward",
                       "P is stored whole instead of recomputed tile by tile (right answer, too much memory)",
                       HandWritten("the backward of plain attention, keeping P", lambda: _stores_p,
                                   expect="recompute each block_q x block_k tile")),
    ],
)
