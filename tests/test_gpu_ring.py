"""Ring attention on GPUs (flashlab.gpu.ring through flashlab.ring.attention(..., backend="gpu")): needs two GPUs.

Rule (CONTRIBUTING.md, Correctness): the error against float64 may be at most twice the error of naive attention
in the same precision (``flashlab.gpu.naive_attention``, fp16 inputs) on the same inputs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from flashlab import reference, ring

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import cupy as cp

    return cp.cuda.runtime.getDeviceCount()


@pytest.fixture
def two_gpus():
    if _gpus() < 2:
        pytest.skip("ring attention on GPUs needs at least two GPUs")


def _naive_err(q, k, v, causal, O_ref, L_ref):
    """Max errors of naive fp16 attention (O, L) against float64, over the rows that see a key."""
    import cupy as cp

    import flashlab.gpu as fgpu

    o, lse = fgpu.naive_attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal)
    fin = np.isfinite(L_ref)
    return (np.abs(o.get().astype(np.float64)[fin] - O_ref[fin]).max(),
            np.abs(lse.get().astype(np.float64)[fin] - L_ref[fin]).max())


CASES = [(layout, causal, n, m, d) for layout in ring.LAYOUTS for causal in (False, True)
         for n, m, d in ((333, 333, 128), (257, 129, 64))] + [
    ("contiguous", False, 512, 512, 64), ("zigzag", True, 100, 300, 128), ("contiguous", True, 1, 7, 64)]


@pytest.mark.parametrize("layout,causal,n,m,d", CASES)
def test_gpu_ring_matches_float64_within_twice_naive(two_gpus, rng, layout, causal, n, m, d):
    q = rng.standard_normal((1, 2, n, d)).astype(np.float16)
    k = rng.standard_normal((1, 2, m, d)).astype(np.float16)
    v = rng.standard_normal((1, 2, m, d)).astype(np.float16)
    O, L = ring.attention(q, k, v, world=2, causal=causal, layout=layout, backend="gpu", timeout=300)
    O_ref, L_ref = reference.attention(q, k, v, causal=causal)
    err_o_naive, err_l_naive = _naive_err(q, k, v, causal, O_ref, L_ref)
    fin = np.isfinite(L_ref)
    assert np.array_equal(np.isneginf(L), ~fin)
    assert not np.isnan(O).any() and np.all(O[~fin] == 0)
    assert np.abs(O[fin] - O_ref[fin]).max() <= 2 * err_o_naive
    assert np.abs(L[fin] - L_ref[fin]).max() <= 2 * err_l_naive + 1e-6


def test_gpu_ring_raises_within_its_timeout_and_the_gpus_stay_usable(two_gpus, rng):
    q = rng.standard_normal((4096, 64)).astype(np.float16)
    t0 = time.monotonic()
    with pytest.raises(ring.RingError, match="timed out"):
        ring.attention(q, q, q, world=2, backend="gpu", timeout=0.5)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ring.RingError, match="failed"):
        ring.attention(q, q, q, world=2, backend="gpu", kernel="no_such_rung", timeout=120)
    O, L = ring.attention(q[:64], q[:64], q[:64], world=2, backend="gpu", timeout=300)
    assert np.abs(O - reference.attention(q[:64], q[:64], q[:64])[0]).max() < 1e-2
