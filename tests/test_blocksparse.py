"""Block-sparse attention: the patterns' masks, their tiles against brute force, the reference and the tiled forward
with masks, and the access counter's skipped tiles (predicted == counted)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashlab import blocksparse, iocount, reference, tiled

EMPTY, PARTIAL, FULL = blocksparse.EMPTY, blocksparse.PARTIAL, blocksparse.FULL


def _by_formula(n, m, sees):
    """The mask written out pair by pair: sees(delta, query position, key) with delta = key - (i + m - n)."""
    return np.array([[bool(sees(j - (i + m - n), i + m - n, j)) for j in range(m)] for i in range(n)], dtype=bool)


def _kinds_by_hand(mask, block_q, block_k):
    n, m = mask.shape
    kinds = np.empty((math.ceil(n / block_q), math.ceil(m / block_k)), dtype=int)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            tile = mask[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
            kinds[i, j] = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
    return kinds


def _draw_patterns(rng, n, m):
    """Every kind of pattern, with random parameters that fit (n, m), and the formula each one means."""
    left, right = int(rng.integers(0, m)), int(rng.integers(0, n))
    stride = int(rng.integers(1, 6))
    tokens = sorted({int(t) for t in rng.integers(0, m, size=int(rng.integers(1, 4)))})
    user = rng.random((n, m)) < rng.random()
    tq, tk = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    blocks = rng.random((math.ceil(n / tq), math.ceil(m / tk))) < 0.5
    return {
        "causal": (blocksparse.causal(), lambda dl, p, j: dl <= 0),
        "window": (blocksparse.sliding_window(left, right), lambda dl, p, j: -left <= dl <= right),
        "dilated": (blocksparse.dilated(stride), lambda dl, p, j: dl <= 0 and dl % stride == 0),
        "dilated window": (blocksparse.dilated(stride, left=left, right=right),
                           lambda dl, p, j: -left <= dl <= right and dl % stride == 0),
        "local + global": (blocksparse.local_global(left, right, tokens),
                           lambda dl, p, j: -left <= dl <= right or j in tokens or p in tokens),
        "local + global, causal": (blocksparse.local_global(left, right, tokens) & blocksparse.causal(),
                                   lambda dl, p, j: (-left <= dl <= right or j in tokens or p in tokens) and dl <= 0),
        "user mask": (blocksparse.from_mask(user), lambda dl, p, j: user[p - (m - n), j]),
        "user tiles": (blocksparse.from_blocks(blocks, tq, tk), lambda dl, p, j: blocks[(p - (m - n)) // tq, j // tk]),
    }


def test_masks_are_the_formulas(rng):
    for _ in range(15):
        n, m = (int(x) for x in rng.integers(1, 50, size=2))
        for name, (pattern, sees) in _draw_patterns(rng, n, m).items():
            np.testing.assert_array_equal(pattern.mask(n, m), _by_formula(n, m, sees), err_msg=f"{name}, n={n}, m={m}")
    for n, m in ((5, 9), (9, 5), (7, 7)):
        np.testing.assert_array_equal(blocksparse.causal().mask(n, m), reference.causal_mask(n, m))


def test_tiles_are_classified_as_brute_force_does(rng):
    seen = {EMPTY: 0, PARTIAL: 0, FULL: 0}
    for _ in range(40):
        n, m = (int(x) for x in rng.integers(1, 90, size=2))
        block_q, block_k = (int(x) for x in rng.integers(1, 25, size=2))
        for name, (pattern, _) in _draw_patterns(rng, n, m).items():
            tiles = pattern.block_mask(n, m, block_q, block_k)
            want = _kinds_by_hand(pattern.mask(n, m), block_q, block_k)
            np.testing.assert_array_equal(tiles.kinds, want, err_msg=f"{name}, n={n}, m={m}, {block_q}x{block_k}")
            assert sum(tiles.counts().values()) == tiles.kinds.size
            assert tiles.density == pytest.approx(np.mean(want != EMPTY))
            for kind in seen:
                seen[kind] += int(np.sum(want == kind))
    assert min(seen.values()) > 100  # the draws exercise every kind of tile


def test_a_wide_dilated_stride_leaves_no_tile_empty_within_its_window():
    """The stride counts tokens: every tile at least `stride` keys wide holds a visible key on every diagonal, so
    dilation thins the elements, not the tiles."""
    n = 256
    dense_window = blocksparse.sliding_window(128).block_mask(n, n, 32, 32)
    dilated = blocksparse.dilated(4, left=128).block_mask(n, n, 32, 32)
    np.testing.assert_array_equal(dilated.computed, dense_window.computed)
    assert dilated.counts()["full"] == 0
    assert blocksparse.dilated(4, left=128).mask(n, n).sum() < dense_window.pattern.mask(n, n).sum() / 3


def test_reference_with_a_mask_is_softmax_over_the_visible_keys(rng):
    for _ in range(10):
        n, m, d = (int(x) for x in rng.integers(1, 30, size=3))
        Q, K, V = rng.standard_normal((n, d)), rng.standard_normal((m, d)), rng.standard_normal((m, d + 2))
        mask = rng.random((n, m)) < 0.5
        O, L = reference.attention(Q, K, V, mask=mask)
        S = Q @ K.T / np.sqrt(d)
        for i in range(n):
            if not mask[i].any():
                assert np.all(O[i] == 0) and L[i] == -np.inf
                continue
            w = np.exp(S[i, mask[i]])
            np.testing.assert_allclose(O[i], w @ V[mask[i]] / w.sum(), rtol=1e-12, atol=1e-13)
            assert L[i] == pytest.approx(np.log(w.sum()), rel=1e-12, abs=1e-13)
        # with causal as well, a pair must pass both; a pattern means its mask
        both = reference.attention(Q, K, V, causal=True, mask=mask)
        by_hand = reference.attention(Q, K, V, mask=mask & reference.causal_mask(n, m))
        for got, want in zip(both, by_hand, strict=True):
            np.testing.assert_array_equal(got, want)
        window = blocksparse.sliding_window(min(3, m - 1), 0)
        for got, want in zip(reference.attention(Q, K, V, mask=window),
                             reference.attention(Q, K, V, mask=window.mask(n, m)), strict=True):
            np.testing.assert_array_equal(got, want)


def test_reference_applies_one_mask_to_every_head_and_group(rng):
    Q, K, V = rng.standard_normal((2, 4, 7, 5)), rng.standard_normal((2, 2, 9, 5)), rng.standard_normal((2, 2, 9, 3))
    mask = rng.random((7, 9)) < 0.6
    O, L = reference.attention(Q, K, V, mask=mask)
    for b in range(2):
        for h in range(4):
            o, lse = reference.attention(Q[b, h], K[b, h // 2], V[b, h // 2], mask=mask)
            np.testing.assert_allclose(O[b, h], o, rtol=1e-13, atol=1e-14)
            np.testing.assert_allclose(L[b, h], lse, rtol=1e-13)


def _relative(out, ref):
    norm = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (norm if norm > 0 else 1.0)


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
def test_tiled_forward_is_exact_for_every_pattern(rng, loop_order):
    """CONTRIBUTING.md, Correctness: float64 code within 1e-12 of the reference, -inf rows in the same places."""
    for _ in range(6):
        batch = tuple(int(x) for x in rng.integers(1, 3, size=int(rng.integers(0, 2))))
        n, m = (int(x) for x in rng.integers(1, 120, size=2))
        d, dv = (int(x) for x in rng.integers(1, 17, size=2))
        Q, K, V = (rng.standard_normal(batch + s) for s in ((n, d), (m, d), (m, dv)))
        block_q, block_k = (int(x) for x in rng.integers(1, 40, size=2))
        for name, (pattern, _) in _draw_patterns(rng, n, m).items():
            for causal in (False, True):
                O_ref, L_ref = reference.attention(Q, K, V, causal=causal, mask=pattern)
                O, L = tiled.forward(Q, K, V, block_q=block_q, block_k=block_k, causal=causal, mask=pattern,
                                     loop_order=loop_order)
                where = f"{name}, causal={causal}, n={n}, m={m}, blocks {block_q}x{block_k}"
                assert not np.isnan(O).any() and not np.isnan(L).any(), where
                assert _relative(O, O_ref) <= 1e-12, where
                np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref), err_msg=where)
                seen = np.isfinite(L_ref)
                assert _relative(L[seen], L_ref[seen]) <= 1e-12, where


def test_tiled_forward_in_float32_with_a_window(rng):
    Q, K, V = (rng.standard_normal((300, 32)) for _ in range(3))
    window = blocksparse.sliding_window(50, 10)
    O_ref, _ = reference.attention(Q, K, V, mask=window)
    for loop_order in tiled.LOOP_ORDERS:
        O, L = tiled.forward(*(x.astype(np.float32) for x in (Q, K, V)), block_q=32, block_k=16, mask=window,
                             loop_order=loop_order)
        assert O.dtype == L.dtype == np.float32 and _relative(O, O_ref) <= 1e-5


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
def test_tiled_forward_skips_empty_tiles_and_masks_only_partial_ones(monkeypatch, rng, loop_order):
    n, m, block_q, block_k = 150, 170, 16, 24
    pattern = blocksparse.local_global(30, 5, [0, 77])
    tiles = pattern.block_mask(n, m, block_q, block_k)
    computed, masked = [], []
    real_tile, real_mask = tiled._score_tile, blocksparse.BlockMask.tile_mask

    def recording_tile(Qi, Kj, scale, causal, q0, k0, offset):
        computed.append((q0 // block_q, k0 // block_k))
        return real_tile(Qi, Kj, scale, causal, q0, k0, offset)

    def recording_mask(self, i, j):
        masked.append((i, j))
        return real_mask(self, i, j)

    monkeypatch.setattr(tiled, "_score_tile", recording_tile)
    monkeypatch.setattr(blocksparse.BlockMask, "tile_mask", recording_mask)
    Q, K, V = rng.standard_normal((n, 8)), rng.standard_normal((m, 8)), rng.standard_normal((m, 8))
    tiled.forward(Q, K, V, block_q=block_q, block_k=block_k, mask=pattern, loop_order=loop_order)
    assert sorted(computed) == sorted(zip(*np.nonzero(tiles.kinds != EMPTY), strict=True))
    assert sorted(masked) == sorted(zip(*np.nonzero(tiles.kinds == PARTIAL), strict=True))
    assert min(tiles.counts().values()) > 0


def _count_both(algorithm, n, d, sram, block_q, block_k, mask):
    try:
        predicted = iocount.predict(algorithm, n, d, sram=sram, block_q=block_q, block_k=block_k, mask=mask)
    except iocount.SramOverflow:
        with pytest.raises(iocount.SramOverflow):
            iocount.count(algorithm, n, d, sram=sram, block_q=block_q, block_k=block_k, mask=mask)
        return None
    return iocount.count(algorithm, n, d, sram=sram, block_q=block_q, block_k=block_k, mask=mask), predicted


@pytest.mark.parametrize("algorithm", ["kv_outer", "q_outer"])
def test_counted_equals_predicted_for_every_pattern(rng, algorithm):
    agreed = 0
    for _ in range(8):
        n, d = int(rng.integers(1, 100)), int(rng.integers(1, 9))
        sram = int(rng.integers(4 * d, 4 * d + 2000))
        block_q = None if rng.random() < 0.3 else int(rng.integers(1, 40))
        block_k = None if rng.random() < 0.3 else int(rng.integers(1, 40))
        patterns = {name: p for name, (p, _) in _draw_patterns(rng, n, n).items()}
        patterns["nothing visible"] = np.zeros((n, n), dtype=bool)
        for name, pattern in patterns.items():
            pair = _count_both(algorithm, n, d, sram, block_q, block_k, pattern)
            if pair is not None:
                counted, predicted = pair
                assert counted == predicted, (name, n, d, sram, block_q, block_k)
                agreed += 1
    assert agreed >= 30


@pytest.mark.parametrize("algorithm", ["kv_outer", "q_outer"])
def test_skipped_tiles_save_exactly_their_cost(algorithm):
    n, d, sram, b = 256, 16, 4096, 32
    dense = iocount.count(algorithm, n, d, sram=sram, block_q=b, block_k=b)
    everything = iocount.count(algorithm, n, d, sram=sram, block_q=b, block_k=b, mask=np.ones((n, n), dtype=bool))
    assert everything == dense == iocount.predict(algorithm, n, d, sram=sram, block_q=b, block_k=b)
    for pattern in (blocksparse.causal(), blocksparse.sliding_window(40), blocksparse.dilated(3, left=64)):
        tiles = pattern.block_mask(n, n, b, b)
        computed = int(tiles.computed.sum())
        sparse = iocount.count(algorithm, n, d, sram=sram, block_q=b, block_k=b, mask=pattern)
        # every tile is b x b here: each computed one costs 4 b^2 d FLOPs, partial or full alike
        assert sparse.flops == computed * 4 * b * b * d
        assert sparse.exps == computed * (b * b + b)
        assert sparse.accesses < dense.accesses and sparse.flops < dense.flops


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="larger than the sequence"):
        blocksparse.sliding_window(64).mask(32, 32)
    with pytest.raises(ValueError, match="larger than the sequence"):
        blocksparse.sliding_window(4, 40).block_mask(16, 64, 8, 8)
    with pytest.raises(ValueError, match="larger than the sequence"):
        tiled.forward(np.ones((8, 2)), np.ones((8, 2)), np.ones((8, 2)), mask=blocksparse.dilated(2, left=8))
    with pytest.raises(ValueError, match="must be >= 0"):
        blocksparse.sliding_window(-1)
    with pytest.raises(TypeError, match="integer"):
        blocksparse.sliding_window(2.5)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        blocksparse.dilated(0)
    with pytest.raises(ValueError, match="block mask has shape"):
        blocksparse.from_blocks(np.ones((3, 3), dtype=bool), 8, 8).mask(32, 24)
    with pytest.raises(ValueError, match=r"needs an \(n, m\) = \(4, 6\) mask"):
        reference.attention(np.ones((4, 2)), np.ones((6, 2)), np.ones((6, 2)), mask=np.ones((6, 4), dtype=bool))
    with pytest.raises(TypeError, match="boolean"):
        tiled.forward(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), mask=np.ones((4, 4)))
    with pytest.raises(ValueError, match="past the last key"):
        blocksparse.local_global(2, 2, [0, 20]).mask(16, 16)
    with pytest.raises(ValueError, match="distinct"):
        blocksparse.local_global(2, 2, [3, 3])
    with pytest.raises(TypeError, match="not its BlockMask"):
        reference.attention(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)),
                            mask=blocksparse.causal().block_mask(4, 4, 2, 2))
    with pytest.raises(ValueError, match="tiled orders"):
        iocount.predict("standard", 16, 4, sram=256, mask=blocksparse.causal())
    # the class itself, built directly, checks what the constructors check
    with pytest.raises(ValueError, match="stride must be >= 1"):
        blocksparse.Window(4, 0, 0)
    with pytest.raises(ValueError, match="left must be >= 0"):
        blocksparse.Window(-3, 0)
    with pytest.raises(TypeError, match="integer"):
        blocksparse.Window(2.5, 0)
    # a tile outside the sequence, or outside the tiles, is refused rather than cut short
    with pytest.raises(ValueError, match=r"queries 5:20 are not a non-empty range within 0:10"):
        blocksparse.causal().tile(10, 10, 5, 20, 0, 10)
    with pytest.raises(ValueError, match="mask has shape"):
        blocksparse.from_mask(np.ones((4, 4), dtype=bool)).tile(10, 10, 0, 10, 0, 10)
    with pytest.raises(ValueError, match=r"tile \(99, 0\) is outside the 2 x 2 tiles"):
        blocksparse.causal().block_mask(8, 8, 4, 4).tile_mask(99, 0)
    with pytest.raises(ValueError, match="outside"):
        blocksparse.causal().block_mask(8, 8, 4, 4).tile_mask(-1, 0)


def test_plot_block_masks_draws_the_tiles_of_each_kind():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashlab import viz

    patterns = {"causal": blocksparse.causal(), "window": blocksparse.sliding_window(20, 0)}
    fig = viz.plot_block_masks(patterns, 64, 80, 16, 16)
    for ax, pattern in zip(fig.axes, patterns.values(), strict=True):
        counts = pattern.block_mask(64, 80, 16, 16).counts()
        hatched = [p for p in ax.patches if p.get_hatch() == "//"]
        framed = [p for p in ax.patches if not p.get_fill()]
        assert len(hatched) == counts["empty"] and len(framed) == counts["partial"]
        assert len(ax.patches) == sum(counts.values())
    plt.close(fig)
    with pytest.raises(ValueError, match="one axes per pattern"):
        viz.plot_block_masks(patterns, 8, 8, 4, 4, axes=[None])


def test_tile_list_and_partial_masks_are_what_a_kernel_reads(rng):
    """The compressed form a block-sparse kernel walks: each query tile's computed key tiles in order (the empty
    ones nowhere), and the element masks of the partial ones, padded with False past n and m."""
    for _ in range(10):
        n, m = (int(x) for x in rng.integers(1, 60, size=2))
        bq, bk = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        for name, (pattern, _) in _draw_patterns(rng, n, m).items():
            bm = pattern.block_mask(n, m, bq, bk)
            row_ptr, cols = bm.tile_list()
            assert row_ptr.dtype == cols.dtype == np.int32 and row_ptr[0] == 0
            masks = bm.partial_masks()
            assert masks.shape == (bm.counts()["partial"], bq, bk)
            slot = 0
            for i in range(bm.shape[0]):
                listed = cols[row_ptr[i]:row_ptr[i + 1]]
                np.testing.assert_array_equal(listed, np.nonzero(bm.kinds[i] != EMPTY)[0], err_msg=name)
                for j in listed:
                    if bm.kinds[i, j] == PARTIAL:
                        q0, q1, k0, k1 = bm.bounds(i, j)
                        padded = np.zeros((bq, bk), bool)
                        padded[: q1 - q0, : k1 - k0] = pattern.mask(n, m)[q0:q1, k0:k1]
                        np.testing.assert_array_equal(masks[slot], padded, err_msg=f"{name} tile {i}, {j}")
                        slot += 1
            assert slot == len(masks)
