import tracemalloc

import numpy as np
import pytest

from flashlab import reference, tiled


def _random_case(rng):
    batch = tuple(int(x) for x in rng.integers(1, 3, size=int(rng.integers(0, 3))))
    n, m = (int(x) for x in rng.integers(1, 150, size=2))
    d, dv = (int(x) for x in rng.integers(1, 40, size=2))
    return [rng.standard_normal(batch + s) for s in ((n, d), (m, d), (m, dv))]


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_random_shapes_and_blocks(rng, loop_order, causal):
    for _ in range(5):
        Q, K, V = _random_case(rng)
        bq, bk = (int(x) for x in rng.integers(1, 80, size=2))
        O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
        O, L = tiled.forward(Q, K, V, block_q=bq, block_k=bk, causal=causal, loop_order=loop_order)
        np.testing.assert_allclose(O, O_ref, rtol=1e-12, atol=1e-12, err_msg=f"blocks {bq}x{bk}")
        np.testing.assert_allclose(L, L_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
def test_seed_pet_project_precision(rng, loop_order):
    n, d = 1024, 64
    Q, K, V = (rng.standard_normal((n, d)) for _ in range(3))
    O_ref, L_ref = reference.attention(Q, K, V)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        args = [x.astype(dtype) for x in (Q, K, V)]
        O, L = tiled.forward(*args, block_q=128, block_k=128, loop_order=loop_order)
        assert O.dtype == dtype and L.dtype == dtype
        assert np.linalg.norm(O - O_ref) / np.linalg.norm(O_ref) <= tol
        assert np.abs(L - L_ref).max() / np.abs(L_ref).max() <= tol


def test_one_row_one_key_and_huge_logits(rng):
    Q, K, V = (rng.standard_normal((1, 3)) for _ in range(3))
    O, L = tiled.forward(Q, K, V)
    np.testing.assert_allclose(O, V)
    Q = 1000 * rng.standard_normal((9, 4))
    K, V = rng.standard_normal((11, 4)), rng.standard_normal((11, 4))
    O, L = tiled.forward(Q, K, V, block_q=4, block_k=3, scale=1.0)
    O_ref, L_ref = reference.attention(Q, K, V, scale=1.0)
    np.testing.assert_allclose(O, O_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(L, L_ref, rtol=1e-12)


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
def test_peak_memory_is_a_tile_not_the_matrix(rng, loop_order):
    n, d, b = 2048, 32, 64
    Q, K, V = (rng.standard_normal((n, d)) for _ in range(3))
    tracemalloc.start()
    tiled.forward(Q, K, V, block_q=b, block_k=b, loop_order=loop_order)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    S_bytes = n * n * 8
    outputs = n * (d + 3) * 8  # O, L and the kv_outer l, m
    assert peak < outputs + 20 * b * b * 8, f"peak {peak} bytes; S alone would be {S_bytes}"


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({"block_q": 0}, ValueError),
        ({"block_k": -3}, ValueError),
        ({"block_q": 2.5}, TypeError),
        ({"loop_order": "sideways"}, ValueError),
    ],
)
def test_bad_arguments(kwargs, exc):
    x = np.ones((4, 4))
    with pytest.raises(exc, match="must"):
        tiled.forward(x, x, x, **kwargs)


def test_float16_and_integer_inputs_are_rejected():
    with pytest.raises(TypeError, match="float32"):
        tiled.forward(*(np.ones((4, 4), np.float16) for _ in range(3)))
    with pytest.raises(TypeError, match="floating"):
        tiled.forward(*(np.ones((4, 4), np.int32) for _ in range(3)))
