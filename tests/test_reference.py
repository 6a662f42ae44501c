import numpy as np
import pytest

from flashlab import reference


def test_scalar_example_is_three_quarters():
    Q = np.array([[1.0]])
    K = np.array([[0.0], [0.0], [np.log(3)], [np.log(3)]])
    V = np.array([[0.0], [0.0], [1.0], [1.0]])
    O, L = reference.attention(Q, K, V, scale=1.0)
    assert O[0, 0] == pytest.approx(0.75, abs=1e-15)
    assert L[0] == pytest.approx(np.log(8), abs=1e-15)


def test_matches_direct_softmax(rng):
    n, m, d = rng.integers(1, 40, size=3)
    Q, K, V = rng.standard_normal((n, d)), rng.standard_normal((m, d)), rng.standard_normal((m, d))
    S = Q @ K.T / np.sqrt(d)
    P = np.exp(S) / np.exp(S).sum(axis=1, keepdims=True)
    O, L = reference.attention(Q, K, V)
    np.testing.assert_allclose(O, P @ V, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L, np.log(np.exp(S).sum(axis=1)), rtol=1e-12)


@pytest.mark.parametrize("n,m", [(4, 4), (3, 7), (7, 3)])
def test_causal_alignment_last_query_sees_last_key(n, m):
    mask = reference.causal_mask(n, m)
    assert mask[-1].all()
    for i in range(n):
        assert mask[i].sum() == max(0, min(m, i + 1 + m - n))


def test_fully_masked_rows_give_zero_and_minus_inf(rng):
    Q, K, V = rng.standard_normal((5, 4)), rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    O, L = reference.attention(Q, K, V, causal=True)
    assert np.all(O[:3] == 0) and np.all(np.isneginf(L[:3]))
    assert np.all(np.isfinite(O)) and np.all(np.isfinite(L[3:]))


def test_huge_logits_do_not_overflow(rng):
    Q = np.full((3, 2), 1000.0)
    K = rng.choice([-1.0, 1.0], size=(6, 2))
    O, L = reference.attention(Q, K, rng.standard_normal((6, 3)), scale=1.0)
    assert np.all(np.isfinite(O)) and np.all(np.isfinite(L))


def test_gqa_repeats_kv_heads(rng):
    Q = rng.standard_normal((2, 4, 5, 8))
    K, V = rng.standard_normal((2, 2, 6, 8)), rng.standard_normal((2, 2, 6, 8))
    O, _ = reference.attention(Q, K, V)
    O_full, _ = reference.attention(Q, np.repeat(K, 2, axis=1), np.repeat(V, 2, axis=1))
    np.testing.assert_array_equal(O, O_full)


@pytest.mark.parametrize(
    "shapes,exc",
    [
        (((4, 8), (4, 7), (4, 7)), ValueError),  # head dims differ
        (((4, 8), (5, 8), (4, 8)), ValueError),  # K and V lengths differ
        (((8,), (8,), (8,)), ValueError),  # 1-D
        (((2, 3, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8)), ValueError),  # 2 KV heads do not divide 3
    ],
)
def test_bad_shapes_raise_clear_errors(shapes, exc):
    arrays = [np.zeros(s) for s in shapes]
    with pytest.raises(exc, match="expected|must"):
        reference.attention(*arrays)


@pytest.mark.parametrize("dtype", [np.int64, np.complex128, object])
def test_bad_dtypes_raise_type_error(dtype):
    x = np.ones((3, 4), dtype=dtype)
    with pytest.raises(TypeError, match="floating"):
        reference.attention(x, x, x)
