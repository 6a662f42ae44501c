"""Lab 08 — split-KV decoding: the partials of each key split and their merge.

q1 ``merge_partials(o_parts, lse_parts) -> (o, lse)``: rows x splits partials (each o_s normalised over its own
keys, lse_s its logsumexp) merged into the attention of the whole row. Checked on partials made from real splits
of random scores, with lse up to 1000 in size, empty splits (lse = -inf) and rows where every split is empty.

q2 ``split_partials(q, k, v, num_splits) -> (o_parts, lse_parts)``: what each block of the split kernel computes,
in NumPy: split s covers keys [s L, min((s + 1) L, m)) with L = ceil(m / num_splits).

q3 ``kv_cache_bytes(batch, kv_heads, m, d, bytes_per_value)``: what one decoding step must read.

Everything is graded on the CPU; the solution notebook also runs the student's merge on the GPU kernel's partials
when a GPU is present.
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference
from .core import Case, Lab, Mutant, Trial
from .known import Demo, KnownMistakes

LAB = Lab("lab08", "Split-KV decoding: partials and their merge")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. A split's partial is
# the reference attention of its keys, so the reference and the tiled forward answer q2.
ANSWERS = {
    "q1": ("flashlab.gpu.decoding.merge_partials", "flashlab.online.merge", "flashlab.grading.lab08._merge"),
    "q2": ("flashlab.reference.attention", "flashlab.tiled.forward", "flashlab.numba_cpu.tiled_forward",
           "flashlab.numba_cpu.fast_forward",
           "flashlab.gpu.decoding.split_ranges", "flashlab.gpu.decoding.decode_numpy",
           "flashlab.grading.lab08._split_truth", "flashlab.grading.lab08._ranges"),
    "q3": ("flashlab.grading.lab08._bytes", "flashlab.ring.block_bytes"),
}


# ------------------------------------------------------------------------------------------- truth and helpers
def _merge(o_parts, lse_parts):
    o_parts, lse_parts = np.asarray(o_parts, float), np.asarray(lse_parts, float)
    mx = lse_parts.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    w = np.exp(lse_parts - safe)
    tot = w.sum(axis=-1, keepdims=True)
    o = (w[..., None] * o_parts).sum(axis=-2) / np.where(tot > 0, tot, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(tot[..., 0] > 0, safe[..., 0] + np.log(np.where(tot > 0, tot, 1.0))[..., 0], -np.inf)
    return o, lse


def _ranges(m: int, num_splits: int) -> list[tuple[int, int]]:
    step = math.ceil(m / num_splits)
    return [(min(s * step, m), min((s + 1) * step, m)) for s in range(num_splits)]


def _split_truth(q, k, v, num_splits):
    n, d = q.shape
    o_parts = np.zeros((n, num_splits, v.shape[1]))
    lse_parts = np.full((n, num_splits), -np.inf)
    for s, (lo, hi) in enumerate(_ranges(k.shape[0], num_splits)):
        if hi > lo:
            o_parts[:, s], lse_parts[:, s] = reference.attention(q, k[lo:hi], v[lo:hi])
    return o_parts, lse_parts


def _partials_case(t: Trial, rows: int, splits: int, dv: int, magnitude: float, empty: float, label: str) -> Case:
    """Partials of real splits of random score rows; each split empty with probability ``empty``."""
    o_parts = np.zeros((rows, splits, dv))
    lse_parts = np.full((rows, splits), -np.inf)
    for r in range(rows):
        for s in range(splits):
            if t.rng.random() < empty:
                continue
            k = int(t.rng.integers(1, 9))
            scores = magnitude * t.rng.uniform(-1, 1, k)
            values = t.rng.standard_normal((k, dv))
            mx = scores.max()
            p = np.exp(scores - mx)
            o_parts[r, s] = p @ values / p.sum()
            lse_parts[r, s] = mx + np.log(p.sum())
    return Case((o_parts, lse_parts), label or f"rows={rows}, splits={splits}, dv={dv}")


# --------------------------------------------------------------------------------------------------- mutants
def _merge_average(o_parts, lse_parts):
    return np.asarray(o_parts).mean(axis=-2), _merge(o_parts, lse_parts)[1]


def _merge_no_max(o_parts, lse_parts):
    with np.errstate(all="ignore"):
        w = np.exp(np.asarray(lse_parts, float))
        tot = w.sum(axis=-1)
        return (w[..., None] * o_parts).sum(axis=-2) / tot[..., None], np.log(tot)


def _merge_unguarded(o_parts, lse_parts):
    with np.errstate(all="ignore"):
        mx = np.asarray(lse_parts, float).max(axis=-1, keepdims=True)
        w = np.exp(lse_parts - mx)
        tot = w.sum(axis=-1, keepdims=True)
        return (w[..., None] * o_parts).sum(axis=-2) / tot, (mx + np.log(tot))[..., 0]


def _merge_not_normalised(o_parts, lse_parts):
    lse_parts = np.asarray(lse_parts, float)
    mx = lse_parts.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    w = np.exp(lse_parts - safe)
    return (w[..., None] * o_parts).sum(axis=-2), _merge(o_parts, lse_parts)[1]


def _merge_lse_is_max(o_parts, lse_parts):
    return _merge(o_parts, lse_parts)[0], np.asarray(lse_parts, float).max(axis=-1)


def _merge_lse_is_sum(o_parts, lse_parts):
    lse = np.asarray(lse_parts, float)
    return _merge(o_parts, lse_parts)[0], np.where(np.isfinite(lse), lse, 0.0).sum(axis=-1)


def _merge_lse_no_max(o_parts, lse_parts):
    with np.errstate(over="ignore", divide="ignore"):
        return _merge(o_parts, lse_parts)[0], np.log(np.exp(np.asarray(lse_parts, float)).sum(axis=-1))


def _merge_weights_inverted(o_parts, lse_parts):
    lse = np.asarray(lse_parts, float)
    with np.errstate(all="ignore"):
        mx = lse.max(axis=-1, keepdims=True)
        w = np.where(np.isfinite(lse), np.exp(mx - lse), 0.0)
        tot = w.sum(axis=-1, keepdims=True)
        return (w[..., None] * o_parts).sum(axis=-2) / np.where(tot > 0, tot, 1.0), _merge(o_parts, lse_parts)[1]


def _merge_max_over_rows(o_parts, lse_parts):
    lse = np.asarray(lse_parts, float)
    with np.errstate(all="ignore"):
        mx = lse.max(axis=0, keepdims=True)
        safe = np.where(np.isfinite(mx), mx, 0.0)
        w = np.exp(lse - safe)
        tot = w.sum(axis=-1, keepdims=True)
        return (w[..., None] * o_parts).sum(axis=-2) / np.where(tot > 0, tot, 1.0), _merge(o_parts, lse_parts)[1]


def _merge_empty_lse_zero(o_parts, lse_parts):
    o, lse = _merge(o_parts, lse_parts)
    return o, np.where(np.isfinite(lse), lse, 0.0)


def _merge_lse_base2(o_parts, lse_parts):
    lse = np.asarray(lse_parts, float)
    mx = lse.max(axis=-1)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    tot = np.exp(lse - safe[..., None]).sum(axis=-1)
    with np.errstate(divide="ignore"):
        return _merge(o_parts, lse_parts)[0], np.where(tot > 0, safe + np.log2(np.where(tot > 0, tot, 1.0)), -np.inf)


def _o_only(out):
    return out[:1]


def _lse_only(out):
    return out[1:2]


MERGE_MUTANTS = [
    Mutant("averaging the partial outputs: each split carries a different mass e^(lse_s), so the merged output is "
           "the weighted mean sum_s e^(lse_s - lse) o_s, not the plain mean.", fn=_merge_average, key=_o_only),
    Mutant("the weights are not normalised: after sum_s e^(lse_s - M) o_s divide by sum_s e^(lse_s - M) (each "
           "o_s is already an average, so the weights must add up to 1).", fn=_merge_not_normalised, key=_o_only),
    Mutant("no max subtraction: e^(lse_s) overflows to inf for lse near 1000 (and inf / inf = nan). Subtract "
           "M = max_s lse_s before exponentiating and add it back to the lse.", fn=_merge_no_max),
    Mutant("a row whose splits are all empty (every lse_s = -inf) gives nan: M = -inf and e^(-inf - (-inf)) is "
           "nan. Such a row's result is o = 0 and lse = -inf.", fn=_merge_unguarded),
    Mutant("lse is not the max of the partial lse: it is log sum_s e^(lse_s) = M + log sum_s e^(lse_s - M), "
           "larger than the max whenever two splits contribute.", fn=_merge_lse_is_max, key=_lse_only),
    Mutant("the partial lse are added: logsumexp of a union is log(sum of exps), not a sum of logs.",
           fn=_merge_lse_is_sum, key=_lse_only),
    Mutant("the merged lse is computed without subtracting the max: log sum_s e^(lse_s) overflows to inf for lse "
           "near 1000. Compute it as M + log sum_s e^(lse_s - M), with the M the weights already use.",
           fn=_merge_lse_no_max, key=_lse_only),
    Mutant("the weights are inverted: split s weighs e^(lse_s - M) (the splits with more mass count more), not "
           "e^(M - lse_s).", fn=_merge_weights_inverted, key=_o_only),
    Mutant("the max is taken over the rows, not over each row's splits: M must be max_s lse_s of that row "
           "(axis=-1), so that one common factor cancels in the weights.", fn=_merge_max_over_rows, key=_o_only),
    Mutant("a row whose splits are all empty gets lse = 0: it saw no key, so its lse is -inf (and its o is 0).",
           fn=_merge_empty_lse_zero, key=_lse_only),
    Mutant("the lse is in base 2: the partial lse are natural logarithms, so the merged one is M + ln sum_s "
           "e^(lse_s - M) (np.log, not np.log2).", fn=_merge_lse_base2, key=_lse_only),
]


@LAB.question("q1", points=4, objects=("merge_partials",))
def q1(t: Trial, merge_partials) -> None:
    """merge_partials(o_parts (rows, S, dv), lse_parts (rows, S)) -> (o (rows, dv), lse (rows,))."""
    names = ("o", "lse")
    plain = [_partials_case(t, int(t.rng.integers(1, 5)), int(t.rng.integers(1, 7)), int(t.rng.integers(1, 6)),
                            3.0, 0.0, "") for _ in range(6)]
    t.compare("partials of ordinary scores", 2, student=merge_partials, cases=plain,
              reference=lambda c: _merge(*c.args), mutants=MERGE_MUTANTS, names=names)
    huge = [_partials_case(t, 3, int(t.rng.integers(2, 6)), 2, 1000.0, 0.0, "scores up to 1000 in size")
            for _ in range(3)]
    t.compare("huge scores (lse near +-1000)", 1, student=merge_partials, cases=huge,
              reference=lambda c: _merge(*c.args), mutants=MERGE_MUTANTS, names=names, rtol=1e-9, atol=1e-9)
    empty = [_partials_case(t, 4, int(t.rng.integers(2, 6)), 3, 3.0, 0.5, "some splits empty (lse = -inf)")
             for _ in range(3)]
    all_empty = np.full((2, 3), -np.inf)
    all_empty[1, 1] = 0.5
    o_parts = np.zeros((2, 3, 2))
    o_parts[1, 1] = [1.0, -2.0]
    empty.append(Case((o_parts, all_empty), "row 0: every split empty"))
    t.compare("empty splits and rows that see no key", 1, student=merge_partials, cases=empty,
              reference=lambda c: _merge(*c.args), mutants=MERGE_MUTANTS, names=names)


# ------------------------------------------------------------------------------------------------------ q2
def _split_unnormalised(q, k, v, num_splits):
    o, lse = _split_truth(q, k, v, num_splits)
    with np.errstate(over="ignore"):
        return o * np.where(np.isfinite(lse), np.exp(lse), 0)[..., None], lse


def _split_per_split(q, k, v, num_splits, ranges, partial):
    n = q.shape[0]
    o_parts = np.zeros((n, num_splits, v.shape[1]))
    lse_parts = np.full((n, num_splits), -np.inf)
    for s, (lo, hi) in enumerate(ranges):
        if hi > lo:
            scores = (q @ k[lo:hi].T) / math.sqrt(q.shape[1])
            mx = scores.max(axis=1, keepdims=True)
            p = np.exp(scores - mx)
            o_parts[:, s], lse_parts[:, s] = partial(p, v[lo:hi], mx[:, 0])
    return o_parts, lse_parts


def _split_unnormalised_max(q, k, v, num_splits):
    return _split_per_split(q, k, v, num_splits, _ranges(k.shape[0], num_splits),
                            lambda p, vs, mx: (p @ vs, mx + np.log(p.sum(axis=1))))


def _split_lse_is_max(q, k, v, num_splits):
    return _split_per_split(q, k, v, num_splits, _ranges(k.shape[0], num_splits),
                            lambda p, vs, mx: (p @ vs / p.sum(axis=1, keepdims=True), mx))


def _split_floor_length(q, k, v, num_splits):
    m = k.shape[0]
    step = max(m // num_splits, 1)
    ranges = [(min(s * step, m), m if s == num_splits - 1 else min((s + 1) * step, m)) for s in range(num_splits)]
    return _split_per_split(q, k, v, num_splits, ranges,
                            lambda p, vs, mx: (p @ vs / p.sum(axis=1, keepdims=True), mx + np.log(p.sum(axis=1))))


def _split_floor_dropped(q, k, v, num_splits):
    m = k.shape[0]
    step = m // num_splits  # 0 when m < num_splits: every split is then empty
    ranges = [(min(s * step, m), min((s + 1) * step, m)) for s in range(num_splits)]
    return _split_per_split(q, k, v, num_splits, ranges,
                            lambda p, vs, mx: (p @ vs / p.sum(axis=1, keepdims=True), mx + np.log(p.sum(axis=1))))


def _split_overlap(q, k, v, num_splits):
    m = k.shape[0]
    ranges = [(lo, min(hi + 1, m)) if hi > lo else (lo, hi) for lo, hi in _ranges(m, num_splits)]
    return _split_per_split(q, k, v, num_splits, ranges,
                            lambda p, vs, mx: (p @ vs / p.sum(axis=1, keepdims=True), mx + np.log(p.sum(axis=1))))


def _split_drop_tail(q, k, v, num_splits):
    m = k.shape[0]
    step = math.ceil(m / num_splits)
    keep = (m // step) * step if m % step else m
    o, lse = _split_truth(q, k[:keep], v[:keep], num_splits)
    return o, lse


def _split_array_split(q, k, v, num_splits):
    n = q.shape[0]
    o_parts = np.zeros((n, num_splits, v.shape[1]))
    lse_parts = np.full((n, num_splits), -np.inf)
    for s, idx in enumerate(np.array_split(np.arange(k.shape[0]), num_splits)):
        if idx.size:
            o_parts[:, s], lse_parts[:, s] = reference.attention(q, k[idx], v[idx])
    return o_parts, lse_parts


def _split_no_scale(q, k, v, num_splits):
    return _split_truth(q * np.sqrt(q.shape[1]), k, v, num_splits)


SPLIT_MUTANTS = [
    Mutant("the partial outputs are not normalised: o_s must be the softmax-weighted average over the split's "
           "keys (divide by the split's sum l_s), because the merge weighs each o_s by e^(lse_s - lse).",
           fn=_split_unnormalised, key=_o_only),
    Mutant("the keys of the last, shorter split are dropped: when m is not a multiple of L = ceil(m / num_splits) "
           "the last split is partial, but still counts.", fn=_split_drop_tail),
    Mutant("the split boundaries differ: use L = ceil(m / num_splits) keys per split (split s covers [s L, "
           "min((s + 1) L, m)); trailing splits may be empty), as the kernel does — not np.array_split's.",
           fn=_split_array_split),
    Mutant("the scale 1/sqrt(d) is missing: scores are scale * q k^T.", fn=_split_no_scale),
    Mutant("the partial outputs are not divided by their own l: with the max subtracted, o_s = sum_j "
           "e^(s_j - m_s) v_j / l_s with l_s = sum_j e^(s_j - m_s); the merge expects each o_s normalised.",
           fn=_split_unnormalised_max, key=_o_only),
    Mutant("a split's lse is its max alone: lse_s = m_s + log l_s (the max plus the log of the split's sum).",
           fn=_split_lse_is_max, key=_lse_only),
    Mutant("the split length is rounded down: L = ceil(m / num_splits), as the kernel computes it (with "
           "L = m // num_splits the boundaries move and the last split takes the rest).", fn=_split_floor_length),
    Mutant("the last keys fall in no split (the split length rounded down): with L = m // num_splits the splits "
           "[s L, (s + 1) L) end before m; L = ceil(m / num_splits) covers every key.",
           fn=_split_floor_dropped),
    Mutant("neighbouring splits overlap by one key: split s covers [s L, (s + 1) L), the end excluded.",
           fn=_split_overlap),
]


@LAB.question("q2", points=3, objects=("split_partials",))
def q2(t: Trial, split_partials) -> None:
    """split_partials(q (n, d), k (m, d), v (m, dv), num_splits) -> (o_parts (n, S, dv), lse_parts (n, S))."""
    names = ("o_parts", "lse_parts")
    cases = []
    for _ in range(6):
        n, d, dv = int(t.rng.integers(1, 4)), int(t.rng.integers(1, 9)), int(t.rng.integers(1, 5))
        s = int(t.rng.integers(1, 6))
        m = int(t.rng.integers(s, 60))
        q, k, v = t.rng.standard_normal((n, d)), t.rng.standard_normal((m, d)), t.rng.standard_normal((m, dv))
        cases.append(Case((q, k, v, s), f"n={n}, m={m}, d={d}, dv={dv}, num_splits={s}"))
    t.compare("partials of random splits", 2, student=split_partials, cases=cases,
              reference=lambda c: _split_truth(*c.args), mutants=SPLIT_MUTANTS, names=names)
    ragged = []
    for m, s in ((10, 4), (7, 3), (5, 4), (1, 3)):  # ragged last split, and splits with no key at all
        q, k, v = t.rng.standard_normal((2, 4)), t.rng.standard_normal((m, 4)), t.rng.standard_normal((m, 3))
        ragged.append(Case((q, k, v, s), f"m={m}, num_splits={s}"))
    t.compare("ragged and empty splits", 1, student=split_partials, cases=ragged,
              reference=lambda c: _split_truth(*c.args), mutants=SPLIT_MUTANTS, names=names)


# ------------------------------------------------------------------------------------------------------ q3
def _bytes(batch, kv_heads, m, d, bpv):
    return 2 * batch * kv_heads * m * d * bpv


BYTES_MUTANTS = [
    Mutant("the cache holds K and V: two tensors of batch x kv_heads x m x d values.",
           fn=lambda b, h, m, d, bpv: _bytes(b, h, m, d, bpv) // 2),
    Mutant("bytes_per_value is missing: the count is in bytes, not values.",
           fn=lambda b, h, m, d, bpv: _bytes(b, h, m, d, 1)),
]


@LAB.question("q3", points=1, objects=("kv_cache_bytes",))
def q3(t: Trial, kv_cache_bytes) -> None:
    """kv_cache_bytes(batch, kv_heads, m, d, bytes_per_value) -> bytes of K and V one decoding step reads."""
    cases = []
    for _ in range(6):
        b, h = int(t.rng.integers(1, 9)), int(t.rng.integers(1, 33))
        m, d = int(t.rng.integers(1, 200_000)), int(t.rng.choice([64, 128]))
        bpv = int(t.rng.choice([1, 2, 4]))
        cases.append(Case((b, h, m, d, bpv), f"batch={b}, kv_heads={h}, m={m}, d={d}, bytes_per_value={bpv}"))
    t.compare("cache bytes", 1, student=kv_cache_bytes, cases=cases, reference=lambda c: _bytes(*c.args),
              mutants=BYTES_MUTANTS, names=("bytes",), rtol=0, atol=0.5)


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _partials_demo() -> Demo:
    ln2, ln6 = float(np.log(2.0)), float(np.log(6.0))
    return Demo(
        examples=[
            ("the scalar example as two splits: o = (0, 1), lse = (ln 2, ln 6)",
             (np.array([[[0.0], [1.0]]]), np.array([[ln2, ln6]]))),
            ("lse near 1000: o = (1, 0), lse = (1000, 998)", (np.array([[[1.0], [0.0]]]), np.array([[1000.0, 998.0]]))),
            ("a row whose splits are all empty: lse = (-inf, -inf)",
             (np.zeros((1, 2, 1)), np.array([[-np.inf, -np.inf]]))),
        ],
        right=lambda args: _merge(*args),
        names=("o", "lse"),
    )


def _splits_demo() -> Demo:
    def qkv(m, seed):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((1, 2)), rng.standard_normal((m, 2)), rng.standard_normal((m, 1))

    return Demo(
        examples=[("n = 1, m = 10 keys, d = 2, 4 splits (L = 3: the last split holds 1 key)", (*qkv(10, 9), 4)),
                  ("n = 1, m = 5 keys, 4 splits (L = 2: the last split is empty)", (*qkv(5, 10), 4))],
        right=lambda args: _split_truth(*args),
        names=("o_parts", "lse_parts"),
    )


def _cache_bytes_demo() -> Demo:
    return Demo(
        examples=[("batch = 1, kv_heads = 8, m = 128000, d = 128, bf16 (2 bytes)", (1, 8, 128_000, 128, 2))],
        right=lambda args: _bytes(*args),
        names=("bytes",),
    )


KNOWN_MISTAKES = KnownMistakes(
    demos={"MERGE_MUTANTS": _partials_demo, "SPLIT_MUTANTS": _splits_demo, "BYTES_MUTANTS": _cache_bytes_demo},
)
