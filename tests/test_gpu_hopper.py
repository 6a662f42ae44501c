"""The Hopper kernels (kernels/hopper/, sm_90a): the two wgmma forms against NumPy, the peak kernel, and the wgmma
rung of the forward against the float64 reference by the project's rule (CONTRIBUTING.md, Correctness).

The compilations (registers, spills, ptxas's notes) are checked without a GPU in tests/test_hopper_compile.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashlab.gpu as fgpu

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_sm90():
    problem = fgpu.hopper_problem()
    if problem:
        pytest.skip(problem)


def _bits(x: np.ndarray, dt: str) -> np.ndarray:
    """16-bit patterns of x (already representable in dt)."""
    if dt == "f16":
        return x.astype(np.float16).view(np.uint16)
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("form", ["ss", "rs"])
@pytest.mark.parametrize("k,n", [(64, 128), (128, 64), (128, 128), (64, 64)])
def test_each_wgmma_form_computes_the_product(rng, dt, form, k, n):
    import cupy as cp
    import test_gpu_attention as tga

    a = tga._round(rng.standard_normal((64, k)), dt)
    # ss: C = A B^T with B (n x k), both K-major; rs: C = A B with B (k x n), read transposed
    b = tga._round(rng.standard_normal((n, k) if form == "ss" else (k, n)), dt)
    ref = a.astype(np.float64) @ (b.T if form == "ss" else b).astype(np.float64)
    kern = fgpu.kernel_function("hopper/peak_wgmma.cu", f"wgmma_check_{form}_{dt}_k{k}_n{n}",
                                shared_bytes=(64 + n) * k * 2 + 1024)
    c = cp.full((64, n), np.nan, cp.float32)
    kern((1,), (128,), (cp.asarray(_bits(a, dt)), cp.asarray(_bits(b, dt)), c), shared_mem=(64 + n) * k * 2 + 1024)
    got = c.get().astype(np.float64)
    assert np.isfinite(got).all(), "unwritten accumulators"
    # Products of 16-bit numbers are exact in fp32; only the fp32 sums round.
    bound = 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(b.T if form == "ss" else b).astype(np.float64))
    bad = np.abs(got - ref) > bound + 1e-6
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements wrong; first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_peak_kernel_runs_and_sums_are_finite(dtype):
    import cupy as cp

    from flashlab.bench import peak

    suffix = "bf16" if dtype == "bfloat16" else "f16"
    kern = fgpu.kernel_function("hopper/peak_wgmma.cu", "wgmma_peak_" + suffix, shared_bytes=peak.WGMMA_SMEM)
    out = cp.full(4 * 128, np.nan, cp.float32)
    kern((4,), (128,), (out, np.int32(8), np.uint32(7)), shared_mem=peak.WGMMA_SMEM)
    got = out.get()
    # every accumulator gets 8 batches x 64 products of numbers in [0.5, 1): a sum of 128 of them per thread
    assert np.isfinite(got).all() and (got >= 0.99 * 128 * 8 * 64 * 0.25).all()


RUNGS = list(fgpu.HOPPER_RUNGS)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_rung_matches_reference_on_random_shapes(rng, rung, dt):
    import test_gpu_attention as tga

    for trial in range(10):
        d = int(rng.choice(fgpu.HEAD_DIMS))
        n, m = tga._random_length(rng, 64), tga._random_length(rng, 128)
        causal = bool(trial % 2)
        if trial % 5 == 4:
            tga._check(rng, rung, dt, 0, 0, 0, n, m, d, causal)
        else:
            Hk = int(rng.integers(1, 3))
            tga._check(rng, rung, dt, int(rng.integers(1, 3)), Hk * int(rng.integers(1, 4)), Hk, n, m, d, causal)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_rung_exact_tiles_masked_rows_and_huge_logits(rng, rung, dt):
    import test_gpu_attention as tga

    for d in fgpu.HEAD_DIMS:
        tga._check(rng, rung, dt, 1, 2, 2, 256, 256, d, True)
        tga._check(rng, rung, dt, 1, 2, 1, 128, 640, d, False)
        tga._check(rng, rung, dt, 1, 1, 1, 70, 90, d, d == 128, scale=1.0, magnitude=1000.0 / np.sqrt(d))
    O, L = tga._check(rng, rung, dt, 1, 2, 1, 150, 37, 64, True)  # the first 113 rows see no key
    assert (O[..., :113, :] == 0).all() and np.isneginf(L[..., :113]).all()


@pytest.mark.parametrize("rung", RUNGS)
def test_rung_takes_a_negative_scale_or_refuses_it(rng, rung):
    import cupy as cp
    import test_gpu_attention as tga

    if fgpu.HOPPER_RUNGS[rung].file in fgpu.HOPPER_POSITIVE_SCALE_ONLY:
        q = cp.zeros((1, 2, 40, 64), cp.float16)
        with pytest.raises(ValueError, match=rf"'{rung}' needs scale > 0"):
            fgpu.attention(q, q, q, kernel=rung, scale=-0.125)
        return
    tga._check(rng, rung, "f16", 1, 2, 1, 40, 70, 64, True, scale=-0.125)


@pytest.mark.parametrize("rung", RUNGS)
def test_rung_writes_only_the_rows_of_its_output(rung):
    """Given out=, a rung writes o and lse and nothing past them: the words after each array (a sentinel the call
    must leave as it is) and the rows of a ragged last tile (n = 70 and 200: 58 and 56 rows past n in the tile)."""
    import cupy as cp

    rng = np.random.default_rng(5)
    for n, d in ((70, 64), (200, 128)):
        q = cp.asarray(rng.standard_normal((1, 2, n, d)), cp.float16)
        size = q.size
        obuf = cp.full(size + 64 * d, 12345.0, cp.float16)
        lbuf = cp.full(2 * n + 64, 12345.0, cp.float32)
        o, lse = obuf[:size].reshape(q.shape), lbuf[:2 * n].reshape(q.shape[:-1])
        fgpu.attention(q, q, q, causal=True, kernel=rung, out=(o, lse))
        assert bool((obuf[size:] == 12345.0).all()) and bool((lbuf[2 * n:] == 12345.0).all()), (rung, n, d)
        assert bool(cp.isfinite(o).all()) and bool(cp.isfinite(lse).all())


@pytest.mark.parametrize("rung", RUNGS)
def test_rung_refuses_float32(rung):
    import cupy as cp

    with pytest.raises(ValueError, match="supports"):
        fgpu.attention(*(cp.zeros((8, 64), cp.float32),) * 3, kernel=rung)


def test_tensor_maps_are_built_once_per_array():
    import cupy as cp

    from flashlab.gpu import hopper

    x = cp.zeros((1, 2, 100, 64), cp.float16)
    first = hopper.tensor_map(x, "f16", 64)
    assert hopper.tensor_map(x, "f16", 64) is first  # found, not built again
    assert hopper.tensor_map(x, "f16", 128) is not first  # another box is another map
    assert first.dtype.itemsize == 128


@pytest.mark.parametrize("rung", ["persistent", "balanced", "merged", "staged", "stream_k"])
@pytest.mark.parametrize("blocks", [1, 2, 5, None])
def test_persistent_rung_walks_several_tiles_per_block(rng, monkeypatch, blocks, rung):
    """The persistent rungs with fewer blocks than output tiles: each block walks several tiles, so the ring's
    stages and phases, the Q barriers and the consumers' turns carry over from one tile to the next (causal tiles
    of different lengths, one with no key at all, GQA, ragged n and m). None: one block per SM, as called. H9's
    snake leaves some blocks without a tile in a last, odd round: 9 tiles on 5 blocks, 512 on 132."""
    import test_gpu_attention as tga

    from flashlab.gpu import hopper

    monkeypatch.setattr(hopper, "PERSISTENT_BLOCKS", blocks)
    for dt in ("f16", "bf16"):
        for d in fgpu.HEAD_DIMS:
            tga._check(rng, rung, dt, 2, 4, 2, 300, 300, d, True)
            tga._check(rng, rung, dt, 2, 2, 1, 333, 129, d, False)
            # the first 263 rows see no key: tiles 0 and 1 have no key tile at all
            O, L = tga._check(rng, rung, dt, 1, 3, 3, 300, 37, d, True)
            # m - n = 64: the lower consumer's causal end is a key tile short of the upper one's
            tga._check(rng, rung, dt, 1, 2, 1, 270, 334, d, True)
            assert (O[..., :263, :] == 0).all() and np.isneginf(L[..., :263]).all()
    if blocks is None:  # more tiles than SMs: 4 * 16 * 8 = 512
        tga._check(rng, rung, "f16", 8, 16, 4, 500, 500, 128, True)
        tga._check(rng, rung, "bf16", 8, 16, 4, 500, 500, 128, False)


def test_persistent_grid_is_one_block_per_sm_at_most():
    from flashlab.gpu import hopper

    assert hopper.persistent_grid((32, 16, 4), 132) == (132, 1, 1)
    assert hopper.persistent_grid((3, 2, 1), 132) == (6, 1, 1)
    assert hopper.persistent_grid((0, 2, 1), 132) == (1, 1, 1)
    for file in hopper.PERSISTENT_FILES - hopper.STREAM_K_FILES:
        grid, more = hopper.launch_shape(file, (32, 16, 4), 132)
        assert grid == (132, 1, 1) and [int(x) for x in more] == [4]
    for file in hopper.STREAM_K_FILES:  # and the workspace of 131 boundaries, from scratch=
        with pytest.raises(ValueError, match="workspace"):
            hopper.launch_shape(file, (32, 16, 4), 132)
        grid, more = hopper.launch_shape(file, (32, 16, 4), 132, 128, lambda f, c: (f, c))
        assert grid == (132, 1, 1) and [int(x) for x in more] == [4, 131 * 2 * 8 * 32 * 68, 131 * 8]
    assert hopper.launch_shape("hopper/h7_rescale_under_s.cu", (32, 16, 4), 132) == ((32, 16, 4), ())


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 7, None])
def test_stream_k_rung_cuts_the_last_tiles_and_merges_the_pieces(rng, monkeypatch, blocks):
    """Rung H12 without a mask: the tiles past the last whole round are shared out by key tiles, so tiles are cut in
    two pieces computed by two blocks and merged by whichever finishes second. Shapes where the runs end inside a tile
    (9 tiles of 6 key tiles on 2 blocks: tile 7 cut after its third key tile), GQA, ragged n and m, d 64 and 128; the
    counters are back at zero after each call, so a second call gives the same bits."""
    import cupy as cp
    import test_gpu_attention as tga

    from flashlab.gpu import hopper

    monkeypatch.setattr(hopper, "PERSISTENT_BLOCKS", blocks)
    for dt in ("f16", "bf16"):
        for d in fgpu.HEAD_DIMS:
            tga._check(rng, "stream_k", dt, 1, 3, 3, 300, 700, d, False)
            tga._check(rng, "stream_k", dt, 2, 4, 2, 200, 333, d, False)
            tga._check(rng, "stream_k", dt, 1, 2, 1, 129, 1000, d, False)
    q = cp.asarray(rng.standard_normal((1, 3, 300, 128)), cp.float16)
    k = cp.asarray(rng.standard_normal((1, 3, 700, 128)), cp.float16)
    first = [x.copy() for x in fgpu.attention(q, k, k, kernel="stream_k")]
    for _ws, cnt in hopper._SCRATCH.values():
        assert int((cnt != 0).sum()) == 0
    again = fgpu.attention(q, k, k, kernel="stream_k")
    for a, b in zip(first, again, strict=True):
        assert bool((a == b).all())
