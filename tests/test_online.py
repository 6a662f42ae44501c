import itertools

import numpy as np
import pytest

from flashlab import online

SCORES = np.array([0.0, 0.0, np.log(3), np.log(3)])
VALUES = np.array([0.0, 0.0, 1.0, 1.0])


@pytest.mark.parametrize("splits", [[], [1], [2], [3], [1, 2], [1, 3], [2, 3], [1, 2, 3]])
def test_scalar_example_every_split(splits):
    assert online.attend(SCORES, VALUES, splits) == pytest.approx(0.75, abs=1e-15)


def test_scalar_example_every_order_of_blocks():
    blocks = [(SCORES[i : i + 1], VALUES[i : i + 1]) for i in range(4)]
    for order in itertools.permutations(blocks):
        state = online.init()
        for s, v in order:
            state = online.update(state, s, v)
        assert state.result() == pytest.approx(0.75, abs=1e-15)
        assert state.logsumexp() == pytest.approx(np.log(8), abs=1e-15)


def test_averaging_block_results_is_wrong():
    a = online.attend(SCORES[:2], VALUES[:2])
    b = online.attend(SCORES[2:], VALUES[2:])
    assert (a + b) / 2 == pytest.approx(0.5)


def test_merge_any_tree_equals_sequential(rng):
    k, dv = int(rng.integers(2, 50)), int(rng.integers(1, 6))
    s, v = 30 * rng.standard_normal((3, k)), rng.standard_normal((k, dv))
    cut = int(rng.integers(1, k))
    left = online.update(online.init((3,), dv), s[:, :cut], v[:cut])
    right = online.update(online.init((3,), dv), s[:, cut:], v[cut:])
    whole = online.update(online.init((3,), dv), s, v)
    for merged in (online.merge(left, right), online.merge(right, left)):
        np.testing.assert_allclose(merged.result(), whole.result(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(merged.logsumexp(), whole.logsumexp(), rtol=1e-12)


def test_masked_blocks_are_neutral_and_empty_rows_give_zero(rng):
    s, v = rng.standard_normal(6), rng.standard_normal((6, 2))
    masked = np.full(3, -np.inf)
    state = online.update(online.init(dv=2), masked, v[:3])
    assert state.result().tolist() == [0.0, 0.0] and np.isneginf(state.logsumexp())
    state = online.update(state, s, v)
    state = online.update(state, masked, v[:3])
    ref = online.update(online.init(dv=2), s, v)
    np.testing.assert_allclose(state.result(), ref.result(), rtol=1e-15)
    merged = online.merge(online.init(dv=2), ref)
    np.testing.assert_allclose(merged.result(), ref.result(), rtol=1e-15)


@pytest.mark.parametrize("big", [1000.0, -1000.0])
def test_huge_scores(big):
    s = np.array([big, big - 1.0, big - 2.0, big])
    v = np.array([1.0, 2.0, 3.0, 4.0])
    w = np.exp(s - s.max())
    expected = (w @ v) / w.sum()
    for splits in ([], [1], [2, 3]):
        assert online.attend(s, v, splits) == pytest.approx(expected, rel=1e-14)
    with np.errstate(over="ignore", invalid="ignore"):
        naive = (np.exp(s) @ v) / np.exp(s).sum()
    assert not np.isfinite(naive) or naive == 0 or big < 0
