"""Split-KV decoding (flashlab.gpu.decode) against the float64 reference, and its merge rule on the CPU.

CPU tests check the math without a GPU: ``merge_partials`` against ``flashlab.online.merge`` and the reference,
and the whole split scheme (``decode_numpy``) with ragged cache lengths, GQA and causal masks. GPU tests use the
rule of CONTRIBUTING.md, Correctness (error against float64 at most twice that of naive attention in the same
precision), for both the merged output and each split's partial.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashlab import online, reference
from flashlab.gpu import decoding

PRIMES = (2, 3, 5, 7, 13, 31, 61, 67, 127, 131, 257)


# ----------------------------------------------------------------------------------------------- CPU: the math
def _partial(scores, values):
    """(o, lse) of one split from online.update: o normalised, lse = m + log l (an empty split: 0, -inf)."""
    if scores.shape[-1] == 0:
        st = online.init(scores.shape[:-1], values.shape[-1])
        return st.result(), st.logsumexp(), st
    st = online.update(online.init(scores.shape[:-1], values.shape[-1]), scores, values)
    return st.result(), st.logsumexp(), st


def test_merge_partials_equals_online_merge_and_the_reference(rng):
    for _ in range(20):
        rows, k, dv = int(rng.integers(1, 5)), int(rng.integers(1, 300)), int(rng.integers(1, 9))
        scores = rng.standard_normal((rows, k)) * rng.choice([1.0, 30.0, 1000.0])
        values = rng.standard_normal((k, dv))
        cuts = sorted(set(int(x) for x in rng.integers(0, k + 1, size=int(rng.integers(0, 6)))))
        edges = [0, *cuts, k]
        parts = [_partial(scores[:, lo:hi], values[lo:hi]) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
        o, lse = decoding.merge_partials(np.stack([p[0] for p in parts], axis=-2), np.stack([p[1] for p in parts], -1))
        state = parts[0][2]
        for p in parts[1:]:
            state = online.merge(state, p[2])
        np.testing.assert_allclose(o, state.result(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, state.logsumexp(), rtol=1e-12, atol=1e-12)
        mx = scores.max(axis=-1, keepdims=True)
        p = np.exp(scores - mx)
        np.testing.assert_allclose(o, (p @ values) / p.sum(-1, keepdims=True), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, mx[:, 0] + np.log(p.sum(-1)), rtol=1e-12, atol=1e-9)


def test_merge_partials_empty_splits_and_huge_lse():
    o_parts = np.array([[[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]]])
    lse_parts = np.array([[1000.0, -np.inf, 999.0]])
    o, lse = decoding.merge_partials(o_parts, lse_parts)
    w = np.array([1.0, np.exp(-1.0)])
    np.testing.assert_allclose(o[0], (w[0] * o_parts[0, 0] + w[1] * o_parts[0, 2]) / w.sum(), rtol=1e-14)
    np.testing.assert_allclose(lse[0], 1000.0 + np.log(w.sum()), rtol=1e-15)
    o, lse = decoding.merge_partials(np.zeros((2, 3, 4)), np.full((2, 3), -np.inf))
    assert (o == 0).all() and np.isneginf(lse).all()
    with pytest.raises(ValueError, match="disagree"):
        decoding.merge_partials(np.zeros((2, 3, 4)), np.zeros((2, 4)))


def test_the_fused_kernels_merge_tree_is_one_merge_and_its_sizes_count_its_levels(rng):
    """The "fused" kernel merges runs of MERGE_FAN partials level by level: the same result as one merge (the rule
    is associative), with empty splits anywhere and huge lse; and merge_tree_sizes counts what the kernel walks:
    the nodes above level 0 short of the root, and one counter per run of every level."""
    for S in (1, 2, 15, 16, 17, 66, 255, 256, 257, 300, 4097):
        levels = [S]
        while levels[-1] > 1:
            levels.append(-(-levels[-1] // decoding.MERGE_FAN))
        counters = sum(levels[1:]) if S > 1 else 1
        assert decoding.merge_tree_sizes(S) == (sum(levels[1:-1]), counters), S
    for S in (1, 5, 16, 17, 66, 300):
        o_parts = rng.standard_normal((3, 2, S, 8))
        lse_parts = rng.standard_normal((3, 2, S)) * rng.choice([1.0, 1000.0], size=(3, 2, S))
        lse_parts[0, 1, rng.random(S) < 0.5] = -np.inf  # some splits saw no key
        o_parts[0, 1][np.isneginf(lse_parts[0, 1])] = 0
        lse_parts[1, 0] = -np.inf  # a row that saw no key at all
        o_parts[1, 0] = 0
        o, lse = decoding.merge_tree_numpy(o_parts, lse_parts)
        o1, lse1 = decoding.merge_partials(o_parts, lse_parts)
        np.testing.assert_allclose(o, o1, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse1))
        np.testing.assert_allclose(lse[np.isfinite(lse1)], lse1[np.isfinite(lse1)], rtol=1e-14)
        assert (o[1, 0] == 0).all()


def test_split_ranges_cover_the_keys_in_whole_tiles(rng):
    for _ in range(200):
        m, s = int(rng.integers(1, 100_000)), int(rng.integers(1, 300))
        ranges = decoding.split_ranges(m, s)
        assert len(ranges) == s and ranges[0][0] == 0 and ranges[-1][1] == m
        for (lo, hi), (lo2, _) in zip(ranges[:-1], ranges[1:], strict=True):
            assert hi == lo2 and lo <= hi
        step = decoding.split_length(m, s)
        assert step % decoding.BLOCK_KEYS == 0 and step * s >= m
        assert step < decoding.BLOCK_KEYS + -(-m // s)  # never more than one tile past an even share


def test_default_num_splits_fills_the_gpu_with_one_wave_without_tiny_splits():
    assert decoding.default_num_splits(1, 32, 1, 65536, 132) == 16  # 4 * 132 // 32 blocks per head: one wave
    assert decoding.default_num_splits(1, 32, 1, 65536, 132, blocks_per_sm=5) == 20
    assert 32 * decoding.default_num_splits(1, 32, 1, 65536, 132, blocks_per_sm=5) <= 5 * 132  # no second wave
    assert decoding.default_num_splits(64, 32, 1, 65536, 132) == 1  # batch already fills the GPU
    assert decoding.default_num_splits(1, 1, 1, 300, 132) == 2  # ceil(300 / 256): no split under 256 keys
    assert decoding.default_num_splits(1, 1, 1, 1, 132) == 1


def test_keys_kernel_takes_the_smallest_row_count_that_fits():
    assert [decoding.block_rows("keys", r) for r in (1, 2, 3, 4, 5, 8, 9, 72)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert decoding.block_rows("rows", 1) == decoding.BLOCK_ROWS
    # batch 1, 32 heads, one token: one block per head and split, one wave of the kernel's blocks per SM as built
    # for sm_90 ("keys" at R = 1: 5; "rows": 4)
    assert decoding.resolve_num_splits(1, 32, 32, 1, 65536, None, 132, "keys") == 20
    assert decoding.resolve_num_splits(1, 32, 32, 1, 65536, None, 132, "rows") == 16
    # GQA 32/8 at n = 1: a group of 4 rows, R = 4, 4 blocks per SM: 4 * 132 // 8
    assert decoding.resolve_num_splits(1, 32, 8, 1, 131072, None, 132, "keys") == 66
    assert decoding.resolve_num_splits(1, 32, 4, 9, 65536, None, 132, "keys") == 7  # 72 rows: 9 chunks of 8
    assert decoding.resolve_num_splits(1, 32, 32, 1, 65536, 5, 132, "keys") == 5
    assert decoding.resolve_num_splits(1, 32, 32, 1, 65536, None, 132, "keys", blocks_per_sm=2) == 8


def _ref_decode(q, k, v, lengths, causal, scale=None):
    """float64 truth per batch element (each with its own cache length); a length-0 cache gives 0 and -inf."""
    B, H, n, d = q.shape
    O = np.zeros((B, H, n, v.shape[-1]))
    L = np.full((B, H, n), -np.inf)
    for b in range(B):
        if lengths[b] > 0:
            O[b], L[b] = reference.attention(q[b], k[b, :, : lengths[b]], v[b, :, : lengths[b]], causal=causal,
                                             scale=scale)
    return O, L


def test_decode_numpy_matches_the_reference_with_ragged_lengths_gqa_and_causal(rng):
    for trial in range(12):
        B, Hk, G = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
        n, d, m = int(rng.choice([1, 2, 5])), int(rng.integers(1, 9)), int(rng.choice([1, *PRIMES, 700]))
        q = rng.standard_normal((B, Hk * G, n, d))
        k, v = rng.standard_normal((B, Hk, m, d)), rng.standard_normal((B, Hk, m, d))
        lengths = rng.integers(0 if trial % 3 == 0 else 1, m + 1, size=B)
        causal = bool(trial % 2)
        for s in (1, 2, 3, 7, 40):
            o, lse = decoding.decode_numpy(q, k, v, num_splits=s, lengths=lengths, causal=causal)
            O, L = _ref_decode(q, k, v, lengths, causal)
            np.testing.assert_allclose(o, O, rtol=1e-10, atol=1e-12, err_msg=f"splits={s}")
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(L))
            fin = np.isfinite(L)
            np.testing.assert_allclose(lse[fin], L[fin], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ GPU checks
def _gpu_helpers():
    # The forward's test module holds the same-precision naive attention and the dtype round trips.
    import test_gpu_attention as tga

    return tga


# Split kernels that round P to the input type before P V, as the forward kernels do (the mma takes 16-bit inputs);
# the others keep P in fp32.
P_ROUNDED = ("mma", "fused")


def _check_decode(rng, dt, B, H, Hk, n, m, d, causal, num_splits, lengths, magnitude=1.0, scale=None,
                  kernel="keys"):
    # lengths of m for every batch element are passed as the default (None: a null pointer in the kernels)
    import cupy as cp

    import flashlab.gpu as fgpu

    tga = _gpu_helpers()
    q = tga._round(magnitude * rng.standard_normal((B, H, n, d)), dt)
    k = tga._round(rng.standard_normal((B, Hk, m, d)), dt)
    v = tga._round(rng.standard_normal((B, Hk, m, d)), dt)
    sc = fgpu.check_scale(scale, d)
    O_ref, L_ref = _ref_decode(q, k, v, lengths, causal, sc)
    O_nv = np.zeros_like(O_ref)
    L_nv = np.full_like(L_ref, -np.inf)
    for b in range(B):
        if lengths[b] > 0:
            o_b, l_b = tga._naive_same_precision(q[b:b + 1], k[b:b + 1, :, : lengths[b]],
                                                 v[b:b + 1, :, : lengths[b]], causal, sc, dt)
            O_nv[b], L_nv[b] = o_b[0], l_b[0]
    qg, kg, vg = (tga._to_gpu(x, dt) for x in (q, k, v))
    given = None if all(int(x) == m for x in lengths) else lengths
    o, lse, o_parts, lse_parts = fgpu.decode(qg, kg, vg, num_splits=num_splits, lengths=given, causal=causal,
                                             scale=scale, bf16=dt == "bf16", return_partials=True, kernel=kernel)
    cp.cuda.Device().synchronize()
    O, L = tga._from_gpu(o, dt), lse.get().astype(np.float64)
    what = (f"{kernel} {dt} B={B} H={H} Hk={Hk} n={n} m={m} d={d} causal={causal} splits={num_splits} "
            f"lengths={lengths}")
    assert np.isfinite(O).all(), f"nan/inf outputs: {what}"
    assert not np.isnan(L).any(), f"nan lse: {what}"
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref), err_msg=f"-inf rows differ: {what}")
    assert tga._err(O, O_ref) <= 2 * tga._err(O_nv, O_ref) + 1e-6, (what, tga._err(O, O_ref), tga._err(O_nv, O_ref))
    fin = np.isfinite(L_ref)
    scale_l = max(1.0, float(np.abs(L_ref[fin]).max(initial=0)))
    assert tga._err(L[fin], L_ref[fin]) <= 2 * tga._err(L_nv[fin], L_ref[fin]) + 1e-5 * scale_l, what
    # Kernel 1 alone: every split's partial against the float64 partial on its key range.
    S = o_parts.shape[3]
    ranges = decoding.split_ranges(m, S)
    op, lp = o_parts.get().astype(np.float64), lse_parts.get().astype(np.float64)
    for s, (lo, hi) in enumerate(ranges):
        lens_s = [max(0, min(hi, int(x)) - lo) for x in lengths]
        # keys lo..hi of cache b, with the causal limit measured from the full length
        for b in range(B):
            if lens_s[b] == 0:
                assert np.isneginf(lp[b, :, :, s]).all() and (op[b, :, :, s] == 0).all(), (what, "empty split", s)
                continue
            sco = reference.scores(q[b], np.repeat(k[b, :, lo:lo + lens_s[b]], H // Hk, axis=0), scale=sc)
            if causal:
                j = np.arange(lo, lo + lens_s[b])[None, :]
                sco = np.where(j <= np.arange(n)[:, None] + int(lengths[b]) - n, sco, -np.inf)
            mx = sco.max(-1, keepdims=True)
            safe = np.where(np.isfinite(mx), mx, 0)
            p = np.exp(sco - safe)
            tot = p.sum(-1, keepdims=True)
            o_true = (p @ np.repeat(v[b, :, lo:lo + lens_s[b]], H // Hk, axis=0)) / np.where(tot > 0, tot, 1)
            tol = 1e-3 if magnitude == 1.0 else 2e-2  # fp32 scores of size 1000 carry ~1e-4 absolute error
            if kernel in P_ROUNDED:  # P rounded to dt before P V: each weight off by a unit roundoff u at most, so
                # o by u * max |v| at most (o is a weighted mean of v's rows)
                u = 2.0**-8 if dt == "bf16" else 2.0**-11
                tol += u * float(np.abs(v[b, :, lo:lo + lens_s[b]]).max())
            assert np.abs(op[b, :, :, s] - o_true).max() <= tol * max(1.0, np.abs(o_true).max()), (what, s)
            with np.errstate(divide="ignore"):
                l_true = np.where(tot[..., 0] > 0, safe[..., 0] + np.log(np.maximum(tot[..., 0], 1e-300)), -np.inf)
            np.testing.assert_array_equal(np.isneginf(lp[b, :, :, s]), np.isneginf(l_true))
            f = np.isfinite(l_true)
            assert np.abs(lp[b, :, :, s][f] - l_true[f]).max(initial=0) <= 1e-4 * max(1.0, np.abs(l_true).max()), what
    # The merge kernel against the CPU merge of the same partials.
    o_cpu, l_cpu = decoding.merge_partials(op, lp)
    ulp = 2.0**-7 if dt == "bf16" else 2.0**-10  # one rounding of the fp32 result to the output type, with margin
    assert np.abs(O - o_cpu).max() <= ulp * max(1.0, np.abs(o_cpu).max()), what
    return O, L


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", decoding.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_decode_matches_reference_on_random_shapes(rng, dt, kernel):
    for trial in range(10):
        d = int(rng.choice([64, 128]))
        B, Hk, G = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2, 4, 8]))
        n = int(rng.choice([1, 2, 3, 8]))
        m = int(rng.choice([1, *PRIMES, int(rng.integers(1, 33)), int(rng.integers(1000, 5000))]))
        lengths = [int(x) for x in rng.integers(1, m + 1, size=B)]
        splits = rng.choice([None, 1, 2, 3, 7, 64])
        _check_decode(rng, dt, B, Hk * G, Hk, n, m, d, bool(trial % 2), None if splits is None else int(splits),
                      lengths, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", decoding.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_many_rows_per_group_span_several_row_chunks(rng, dt, kernel):
    # group 8 x 9 tokens = 72 rows: three blocks of 32 rows ("rows") or nine of 8 ("keys") per K/V head
    _check_decode(rng, dt, 1, 16, 2, 9, 517, 128, True, 5, [517], kernel=kernel)
    _check_decode(rng, dt, 2, 8, 1, 5, 300, 64, False, 3, [300, 123], kernel=kernel)
    _check_decode(rng, dt, 1, 16, 4, 16, 2000, 128, True, None, [1999], kernel=kernel)  # default splits
    _check_decode(rng, dt, 1, 6, 2, 1, 777, 64, True, 4, [777], kernel=kernel)  # 3 rows: the "keys" R = 4 kernel


@pytest.mark.gpu
def test_default_splits_are_one_wave_of_the_compiled_kernels_occupancy(rng):
    """decode's default split count is resolve_num_splits with the driver's resident blocks of the kernel it
    launches (batch 1, GQA 32/8 and MHA); on sm_90 those are the blocks the kernels are built for."""
    import cupy as cp

    import flashlab.gpu as fgpu

    sms, cc = fgpu.sm_count(), fgpu.device_limits().cc
    for H, Hk, m in ((32, 8, 8192), (32, 32, 8192), (8, 4, 4096)):
        q = cp.asarray(rng.standard_normal((1, H, 1, 128)).astype(np.float16))
        k, v = (cp.asarray(rng.standard_normal((1, Hk, m, 128)).astype(np.float16)) for _ in range(2))
        rows = decoding.block_rows("keys", H // Hk)
        kern = fgpu.kernel_function(decoding.KEYS_FILE, f"decode_keys_f16_d128_r{rows}")
        resident = decoding.resident_blocks(kern, decoding.built_blocks_per_sm("keys", rows))
        if cc == 90:
            assert resident == decoding.KEYS_BLOCKS_PER_SM[rows], (rows, resident)
        used = fgpu.decode(q, k, v, kernel="keys", return_partials=True)[2].shape[-2]
        assert used == decoding.resolve_num_splits(1, H, Hk, 1, m, None, sms, "keys", resident)
        assert Hk * used <= resident * sms or used == 1  # one wave


@pytest.mark.gpu
def test_num_splits_one_is_the_unsplit_kernel_and_splits_agree_with_it(rng):
    import cupy as cp

    import flashlab.gpu as fgpu

    q = cp.asarray(rng.standard_normal((1, 8, 1, 128)).astype(np.float16))
    k, v = (cp.asarray(rng.standard_normal((1, 2, 4099, 128)).astype(np.float16)) for _ in range(2))
    o1, l1, op1, lp1 = fgpu.decode(q, k, v, num_splits=1, return_partials=True, kernel="rows")
    assert op1.shape[3] == 1
    # One split: the merge kernel copies (weight e^0 = 1), so o is the partial rounded once to fp16.
    np.testing.assert_array_equal(o1.get(), op1[:, :, :, 0].astype(cp.float16).get())
    np.testing.assert_array_equal(l1.get(), lp1[..., 0].get())
    # 300: more splits than the merge kernel's 256 threads (each thread reduces several lse values), most empty
    for s, kernel in [(s, kernel) for s in (1, 2, 5, 16, 129, 300) for kernel in decoding.KERNELS]:
        o, lse = fgpu.decode(q, k, v, num_splits=s, kernel=kernel)
        diff = float(cp.abs(o.astype(cp.float32) - o1.astype(cp.float32)).max())
        assert diff <= 2e-3, (s, kernel, diff)  # one fp16 rounding step of values below 1
        assert float(cp.abs(lse - l1).max()) <= 1e-5, (s, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", decoding.KERNELS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_empty_caches_fully_masked_rows_and_huge_logits(rng, dt, kernel):
    # length 0 and causal with n > length: those rows see no key -> o = 0, lse = -inf
    O, L = _check_decode(rng, dt, 3, 4, 2, 4, 40, 64, True, 3, [0, 2, 40], kernel=kernel)
    assert (O[0] == 0).all() and np.isneginf(L[0]).all()
    assert (O[1, :, :2] == 0).all() and np.isneginf(L[1, :, :2]).all() and np.isfinite(L[1, :, 2:]).all()
    _check_decode(rng, dt, 1, 2, 1, 2, 333, 128, False, 4, [333], magnitude=1000.0 / np.sqrt(128), scale=1.0,
                  kernel=kernel)


@pytest.mark.gpu
def test_two_dimensional_inputs(rng):
    _check_decode(rng, "f16", 1, 1, 1, 3, 200, 64, True, 2, [200])  # 4-D path
    import cupy as cp

    import flashlab.gpu as fgpu

    q = cp.asarray(rng.standard_normal((3, 64)).astype(np.float16))
    k, v = (cp.asarray(rng.standard_normal((200, 64)).astype(np.float16)) for _ in range(2))
    o2, l2 = fgpu.decode(q, k, v, num_splits=2)
    o4, l4 = fgpu.decode(q[None, None], k[None, None], v[None, None], num_splits=2)
    assert o2.shape == (3, 64) and l2.shape == (3,)
    np.testing.assert_array_equal(o2.get(), o4[0, 0].get())


@pytest.mark.gpu
def test_decode_bad_inputs_get_clear_errors():
    import cupy as cp

    import flashlab.gpu as fgpu

    x = cp.zeros((1, 2, 8, 64), dtype=cp.float16)
    with pytest.raises(TypeError, match="float32"):
        fgpu.decode(*(x.astype(cp.float32),) * 3)
    with pytest.raises(TypeError, match="CuPy"):
        fgpu.decode(x.get(), x, x)
    with pytest.raises(ValueError, match="lengths"):
        fgpu.decode(x, x, x, lengths=[9])
    with pytest.raises(ValueError, match="lengths"):
        fgpu.decode(x, x, x, lengths=[1, 2])
    with pytest.raises(ValueError, match="num_splits"):
        fgpu.decode(x, x, x, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        fgpu.decode(x, x, x, num_splits=2.5)
    with pytest.raises(ValueError, match="head dimension"):
        fgpu.decode(*(cp.zeros((1, 2, 8, 96), cp.float16),) * 3)
    with pytest.raises(ValueError, match="kernel must be one of"):
        fgpu.decode(x, x, x, kernel="fast")
    with pytest.raises(ValueError, match="divide"):
        fgpu.decode(x, x[:, :1].repeat(3, axis=1), x[:, :1].repeat(3, axis=1))
    shifted = cp.zeros(x.size + 1, dtype=cp.float16)[1:].reshape(x.shape)  # C-contiguous, 2 bytes off
    with pytest.raises(ValueError, match="16-byte boundary for kernel='fused'"):
        fgpu.decode(x, x, x, kernel="fused", out=(shifted, cp.empty(x.shape[:-1], dtype=cp.float32)))


@pytest.mark.gpu
def test_fused_kernel_equals_split_then_merge_and_leaves_its_counters_at_zero(rng):
    """kernel="fused" writes the same level-0 partials as "mma" (bit for bit: the same loop), merges them as
    merge_tree_numpy does (to fp32 rounding, then one rounding to the output type), and leaves every counter of
    its tree at zero, so that the next call through the same workspace (with fewer or more splits, one to three
    levels) merges correctly again."""
    import cupy as cp

    import flashlab.gpu as fgpu

    ws = fgpu.Workspace()
    for B, H, Hk, n, m, d, causal, splits in ((1, 8, 2, 1, 3000, 128, False, 66), (2, 4, 1, 3, 1000, 64, True, 20),
                                               (1, 4, 2, 2, 9000, 128, True, 300), (1, 2, 2, 1, 40, 64, False, 1),
                                               (1, 8, 2, 1, 3000, 128, False, None)):
        q = cp.asarray(rng.standard_normal((B, H, n, d)).astype(np.float16))
        k, v = (cp.asarray(rng.standard_normal((B, Hk, m, d)).astype(np.float16)) for _ in range(2))
        o_m, l_m, op_m, lp_m = fgpu.decode(q, k, v, num_splits=splits, causal=causal, kernel="mma",
                                           return_partials=True)
        for _ in range(2):
            o, lse, op, lp = fgpu.decode(q, k, v, num_splits=splits, causal=causal, kernel="fused",
                                         return_partials=True, workspace=ws)
            what = (B, H, Hk, n, m, d, causal, splits)
            np.testing.assert_array_equal(op.get(), op_m.get(), err_msg=str(what))
            np.testing.assert_array_equal(lp.get(), lp_m.get(), err_msg=str(what))
            o_tree, l_tree = decoding.merge_tree_numpy(op.get(), lp.get())
            assert np.abs(o.get().astype(np.float64) - o_tree).max() <= 2.0**-10 * max(1.0, np.abs(o_tree).max()), what
            assert np.abs(lse.get() - l_tree).max() <= 1e-5 * max(1.0, np.abs(l_tree).max()), what
            assert np.abs(o.astype(cp.float32) - o_m.astype(cp.float32)).max() <= 2.0**-10, what
            chunks = -(-(H // Hk * n) // decoding.MMA_ROWS)
            shape = (B * Hk * chunks * decoding.merge_tree_sizes(op.shape[3])[1],)
            assert not ws.get("decode_counters", shape, cp.int32, zero=True).any(), what


# ------------------------------------------------------------------------------------ lab 08: grading diagnoses
@pytest.mark.parametrize("question,mutants", [("q1", "MERGE_MUTANTS"), ("q2", "SPLIT_MUTANTS"),
                                              ("q3", "BYTES_MUTANTS")])
def test_lab08_mutants_lose_points_and_are_named(question, mutants):
    from flashlab.grading import lab08, run_question

    full = lab08.LAB.questions[question].points
    for mutant in getattr(lab08, mutants):
        result = run_question("lab08", question, [mutant.fn])
        assert result.score < full, mutant.message
        assert mutant.message[:60] in result.feedback, (mutant.message, result.feedback)


def test_lab08_package_merge_is_right_but_not_a_student_s_answer():
    from flashlab.grading import answers, run_question

    def merge(o_parts, lse_parts):
        return decoding.merge_partials(o_parts, lse_parts)

    with answers.trusted():
        assert run_question("lab08", "q1", [merge]).score == 4
    result = run_question("lab08", "q1", [merge])
    assert result.score == 0 and "calls flashlab.gpu.decoding.merge_partials" in result.feedback


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", decoding.KERNELS)
def test_default_lengths_out_and_workspace_give_the_same_result(rng, kernel):
    """lengths=None reaches the kernels as a null pointer ("all m keys"): the same bits as lengths=[m] * B, also
    written into poisoned out= arrays through a workspace that an earlier call with other splits left dirty."""
    import cupy as cp

    import flashlab.gpu as fgpu

    ws = fgpu.Workspace()
    for B, H, Hk, n, m, d, causal in ((2, 8, 2, 1, 1031, 128, False), (1, 4, 4, 3, 77, 64, True),
                                      (3, 2, 1, 2, 4099, 64, True)):
        q = cp.asarray(rng.standard_normal((B, H, n, d)).astype(np.float16))
        k, v = (cp.asarray(rng.standard_normal((B, Hk, m, d)).astype(np.float16)) for _ in range(2))
        for splits in (None, 1, 5, 37):
            want_o, want_l = fgpu.decode(q, k, v, num_splits=splits, lengths=[m] * B, causal=causal, kernel=kernel)
            out = (cp.full(q.shape, np.nan, dtype=cp.float16), cp.full(q.shape[:-1], np.nan, dtype=cp.float32))
            S = decoding.resolve_num_splits(B, H, Hk, n, m, splits, fgpu.sm_count(), kernel)
            ws.get("decode_o_parts", (B, H, n, S, d), cp.float32).fill(np.nan)  # whatever an earlier call left
            ws.get("decode_lse_parts", (B, H, n, S), cp.float32).fill(np.nan)
            o, lse = fgpu.decode(q, k, v, num_splits=splits, causal=causal, kernel=kernel, out=out, workspace=ws)
            assert o is out[0] and lse is out[1]
            np.testing.assert_array_equal(o.get(), want_o.get())
            np.testing.assert_array_equal(lse.get(), want_l.get())
    # The default lengths against float64, through the reference check of every split.
    _check_decode(rng, "f16", 2, 4, 2, 2, 700, 128, True, 3, [700, 700], kernel=kernel)


# ------------------------------------------------------------------------- the merge as a dependent launch
def test_dependent_merge_is_taken_where_it_can_run_and_refused_with_the_reason():
    merge = object()  # no .kernel: not compiled by CuPy, so nothing to launch through the driver
    assert decoding._merge_launch(merge, (4,), None, 80) is None
    assert decoding._merge_launch(merge, (4,), False, 90) is None
    assert decoding._merge_launch(None, (4,), None, 90) is None  # "fused": no merge kernel
    assert decoding._merge_launch(merge, (4,), None, 90) is None
    with pytest.raises(ValueError, match="sm_90 or later; this GPU is sm_80"):
        decoding._merge_launch(merge, (4,), True, 80)
    with pytest.raises(ValueError, match="not a CuPy RawKernel"):
        decoding._merge_launch(merge, (4,), True, 90)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "keys", "rows"])
def test_a_dependent_merge_gives_the_ordinary_launch_s_bits_back_to_back_on_any_stream(rng, kernel):
    """The merge launched as a programmatic dependent waits for the split grid: steps launched back to back through
    one workspace, with different inputs each, so that a merge that read early would read another step's partials,
    give the bits of ordinary launches, on the default stream and on a stream of their own."""
    import cupy as cp

    import flashlab.gpu as fgpu

    if fgpu.compute_capability() < decoding.DEPENDENT_MERGE_MIN_CC:
        with pytest.raises(ValueError, match="sm_90 or later"):
            x = cp.zeros((1, 2, 1, 64), dtype=cp.float16)
            fgpu.decode(x, x, x, dependent_merge=True)
        pytest.skip("programmatic dependent launch needs sm_90")
    pytest.importorskip("cuda.bindings")
    B, H, Hk, n, m, d = 1, 32, 8, 1, 20000, 128
    steps = [tuple(cp.asarray(rng.standard_normal(shape).astype(np.float16))
                   for shape in ((B, H, n, d), (B, Hk, m, d), (B, Hk, m, d))) for _ in range(3)]
    want = [fgpu.decode(*s, kernel=kernel, dependent_merge=False) for s in steps]
    plain = fgpu.decode(*steps[0], kernel=kernel, dependent_merge=None)  # None takes the dependent launch here
    np.testing.assert_array_equal(plain[0].get(), want[0][0].get())
    for stream in (cp.cuda.Stream.null, cp.cuda.Stream(non_blocking=True)):
        with stream:
            ws = fgpu.Workspace()
            outs = [(cp.empty_like(s[0]), cp.empty(s[0].shape[:-1], dtype=cp.float32)) for s in steps * 10]
            for s, out in zip(steps * 10, outs, strict=True):
                fgpu.decode(*s, kernel=kernel, dependent_merge=True, out=out, workspace=ws)
            stream.synchronize()
        for i, (o, lse) in enumerate(outs):
            np.testing.assert_array_equal(o.get(), want[i % 3][0].get(), err_msg=f"step {i}")
            np.testing.assert_array_equal(lse.get(), want[i % 3][1].get(), err_msg=f"step {i}")
    key = next(k for k in decoding._steps() if k[10] == kernel and k[12] is True)
    assert decoding._steps()[key].merge_launch.dependent is True


@pytest.mark.gpu
def test_dependent_merge_bad_values_get_clear_errors():
    import cupy as cp

    import flashlab.gpu as fgpu

    x = cp.zeros((1, 2, 8, 64), dtype=cp.float16)
    with pytest.raises(TypeError, match="dependent_merge must be True, False or None"):
        fgpu.decode(x, x, x, dependent_merge="yes")
    with pytest.raises(ValueError, match="kernel='fused' merges inside its own launch"):
        fgpu.decode(x, x, x, kernel="fused", dependent_merge=True)


# ------------------------------------------------------------------------- launches through the driver
@pytest.mark.gpu
def test_steps_launched_through_the_driver_give_cupys_bits_from_threads_on_their_own_streams(rng, monkeypatch):
    """Where cuda-bindings is installed, a step launches its kernels through the driver from per-thread argument
    blocks. Steps of several signatures (default and given scale, causal, lengths), run by four threads at once,
    each on a stream of its own, give the bits of the same steps launched by CuPy."""
    import threading

    import cupy as cp

    import flashlab.gpu as fgpu

    pytest.importorskip("cuda.bindings")
    cases = []
    for H, Hk, n, m, d in ((32, 8, 1, 20000, 128), (8, 8, 3, 5000, 64)):
        arrays = tuple(cp.asarray(rng.standard_normal(s).astype(np.float16))
                       for s in ((2, H, n, d), (2, Hk, m, d), (2, Hk, m, d)))
        for kw in ({}, {"scale": 0.3, "causal": True}, {"lengths": [m // 3, m]}):
            cases.append((arrays, kw))
    fgpu._FUNCTIONS.pop("decode steps", None)
    with monkeypatch.context() as m:
        m.setattr(decoding, "cuda_driver", lambda purpose: (_ for _ in ()).throw(ImportError(purpose)))
        want = [fgpu.decode(*a, kernel="mma", **kw) for a, kw in cases]
        assert all(s.split_launch is None for s in decoding._steps().values())
    fgpu._FUNCTIONS.pop("decode steps", None)
    got: dict[int, list] = {}

    def worker(t: int) -> None:
        with cp.cuda.Stream(non_blocking=True) as stream:
            ws = fgpu.Workspace()
            outs = []
            for _ in range(5):
                for a, kw in cases:
                    out = (cp.empty_like(a[0]), cp.empty(a[0].shape[:-1], dtype=cp.float32))
                    outs.append(fgpu.decode(*a, kernel="mma", out=out, workspace=ws, **kw))
            stream.synchronize()
        got[t] = outs

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s.split_launch is not None and s.merge_launch is not None for s in decoding._steps().values())
    assert sorted(got) == [0, 1, 2, 3]
    # A thread that makes no CUDA call of its own before the step: its inputs, outputs and workspace come from this
    # thread, on the default stream, so the launch through the driver must make the context current itself.
    a, kw = cases[0]
    out = (cp.empty_like(a[0]), cp.empty(a[0].shape[:-1], dtype=cp.float32))
    ws = fgpu.Workspace()
    fgpu.decode(*a, kernel="mma", out=out, workspace=ws, **kw)
    out[0].fill(0)
    cp.cuda.Device().synchronize()
    cold: list = []
    thread = threading.Thread(target=lambda: cold.append(fgpu.decode(*a, kernel="mma", out=out, workspace=ws, **kw)))
    thread.start()
    thread.join()
    cp.cuda.Device().synchronize()
    assert cold, "the step raised in a thread that had made no CUDA call"
    np.testing.assert_array_equal(out[0].get(), want[0][0].get())
    for t, outs in got.items():
        for i, (o, lse) in enumerate(outs):
            np.testing.assert_array_equal(o.get(), want[i % len(cases)][0].get(), err_msg=f"thread {t} step {i}")
            np.testing.assert_array_equal(lse.get(), want[i % len(cases)][1].get(), err_msg=f"thread {t} step {i}")
