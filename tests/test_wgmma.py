"""flashlab.wgmma: the layouts the Hopper kernels build, read back through descriptors as wgmma reads them."""

from __future__ import annotations

import numpy as np
import pytest

from flashlab import wgmma


def _tile(rng, rows, cols):
    return rng.standard_normal((rows, cols)).astype(np.float16)


@pytest.mark.parametrize("d,keys", [(64, 128), (128, 64)])
def test_s_equals_q_kt_through_the_kernels_descriptors(rng, d, keys):
    q, k = _tile(rng, 64, d), _tile(rng, keys, d)
    smem = np.concatenate([wgmma.stage(q), wgmma.stage(k)])
    kbase = 64 * d * 2
    s = np.zeros((64, keys))
    for kk in range(d // 16):  # as h1_wgmma.cu: panel kk / 4, 32 bytes per step along the 128-byte rows
        da = wgmma.Descriptor((kk // 4) * 64 * 128 + (kk % 4) * 32, 16, 1024)
        db = wgmma.Descriptor(kbase + (kk // 4) * keys * 128 + (kk % 4) * 32, 16, 1024)
        s += wgmma.product_ss(smem, da, db, keys)
    np.testing.assert_allclose(s, q.astype(np.float64) @ k.astype(np.float64).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,keys", [(64, 128), (128, 64)])
def test_o_equals_p_v_through_the_kernels_descriptors(rng, d, keys):
    p, v = _tile(rng, 64, keys), _tile(rng, keys, d)
    smem = wgmma.stage(v)
    o = np.zeros((64, d))
    for kk in range(keys // 16):  # 16 rows (2048 bytes) down per step; panels of d are keys * 128 bytes apart
        o += wgmma.product_rs(p[:, 16 * kk:16 * kk + 16], smem, wgmma.Descriptor(kk * 2048, keys * 128, 1024), d)
    np.testing.assert_allclose(o, p.astype(np.float64) @ v.astype(np.float64), rtol=1e-12, atol=1e-12)


def test_a_wrong_stride_or_panel_distance_reads_the_wrong_elements(rng):
    v = _tile(rng, 64, 128)
    smem = wgmma.stage(v)
    good = wgmma.read_mnmajor(smem, wgmma.Descriptor(0, 64 * 128, 1024), 128)
    np.testing.assert_array_equal(good, v[:16].astype(np.float64))
    assert not np.array_equal(wgmma.read_mnmajor(smem, wgmma.Descriptor(0, 64 * 64, 1024), 128), good)
    assert not np.array_equal(wgmma.read_mnmajor(smem, wgmma.Descriptor(0, 64 * 128, 512), 128), good)


def test_the_swizzle_is_the_address_xor_and_a_permutation_of_each_atom():
    addrs = np.arange(1024)
    out = wgmma.swizzle(addrs)
    assert sorted(out) == list(addrs)
    assert wgmma.swizzle(128 + 16) == 128  # row 1, chunk 1 -> chunk 0
    for r in range(8):
        for c in range(8):
            assert wgmma.tile_offset(8, r, c) == wgmma.swizzle(128 * r + 16 * c)


def test_descriptor_encodes_and_decodes_and_refuses_bad_fields():
    d = wgmma.Descriptor(0x1230, 8192, 1024)
    value = d.encode()
    assert value >> 62 == 1 and wgmma.Descriptor.decode(value) == d
    with pytest.raises(ValueError, match="multiple of 16"):
        wgmma.Descriptor(8, 16, 1024).encode()
    with pytest.raises(ValueError, match="128-byte"):
        wgmma.Descriptor.decode(value & ~(3 << 62))


@pytest.mark.parametrize("n", [64, 128, 256])
def test_every_accumulator_element_has_one_thread_and_register(n):
    seen = {wgmma.accumulator_owner(r, c)[:2] for r in range(64) for c in range(n)}
    assert len(seen) == 64 * n
    assert seen == {(t, i) for t in range(128) for i in range(n // 2)}


def test_p_stays_with_the_thread_that_computed_s():
    # The reason O += P V takes P from registers: each thread already holds, in S's accumulators, exactly the
    # elements its A fragment of P needs (16 keys a step).
    for row in range(64):
        for key in range(128):
            assert wgmma.accumulator_owner(row, key)[0] == wgmma.a_fragment_owner(row, key % 16)[0]


def test_stage_refuses_a_tile_it_cannot_lay_out():
    with pytest.raises(ValueError, match="64 columns"):
        wgmma.stage(np.zeros((8, 48), np.float16))
