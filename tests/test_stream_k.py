"""Rung H12's deal of the output tiles without a mask (flashlab.gpu.hopper.stream_k_deal), checked on the CPU: every
key tile of every output tile computed once, a tile cut at most once and only between neighbouring blocks, every
block given the same number of key tiles to one. The kernel itself runs in tests/test_gpu_hopper.py (on a GPU, or on
a CPU under tools/hostemu)."""

from __future__ import annotations

import collections

import pytest

from flashlab.gpu import hopper


@pytest.mark.parametrize("tiles,key_tiles,blocks", [(2048, 32, 132), (2048, 8, 132), (2048, 128, 132), (9, 6, 2),
                                                    (9, 6, 9), (10, 1, 3), (7, 5, 7), (1, 3, 1), (500, 4, 132),
                                                    (264, 16, 132), (133, 2, 132)])
def test_each_key_tile_is_computed_once_and_the_blocks_are_balanced(tiles, key_tiles, blocks):
    deal = hopper.stream_k_deal(tiles, key_tiles, blocks)
    assert len(deal) == blocks
    covered = collections.Counter()
    owners = collections.defaultdict(list)
    for k, pieces in enumerate(deal):
        for tile, t0, t1 in pieces:
            assert 0 <= t0 < t1 <= key_tiles, (k, tile, t0, t1)
            covered.update((tile, t) for t in range(t0, t1))
            owners[tile].append((k, t0, t1))
    assert covered == collections.Counter((i, t) for i in range(tiles) for t in range(key_tiles))
    for tile, parts in owners.items():
        assert len(parts) <= 2, (tile, parts)
        if len(parts) == 2:  # the first piece ends block k's run, the second starts block k + 1's
            (k0, a0, b0), (k1, a1, b1) = parts
            assert k1 == k0 + 1 and a0 == 0 and b0 == a1 and b1 == key_tiles, parts
            whole = tiles // blocks - 1  # the rounds dealt a tile a block come first
            assert deal[k0][-1][0] == tile and deal[k1][whole][0] == tile
    work = [sum(t1 - t0 for _, t0, t1 in pieces) for pieces in deal]
    assert max(work) - min(work) <= 1, work
    # against one whole tile a block a round: the longest block's work falls from ceil(tiles / blocks) tiles
    assert max(work) == -(-tiles * key_tiles // blocks)


def test_the_table_s_shapes_gain_what_the_chapter_predicts():
    """2048 output tiles on the H200's 132 SMs, 32 key tiles each (n = 4096 without a mask): 16 rounds of whole
    tiles, 512 key tiles for the longest block, become 14 whole rounds and a run of 49: 497."""
    deal = hopper.stream_k_deal(2048, 32, 132)
    assert max(sum(t1 - t0 for _, t0, t1 in p) for p in deal) == 14 * 32 + 49 == 497
    assert all(p[:14] == [(j * 132 + k, 0, 32) for j in range(14)] for k, p in enumerate(deal))


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="0 < blocks <= tiles"):
        hopper.stream_k_deal(5, 4, 6)
    with pytest.raises(ValueError, match="key_tiles >= 1"):
        hopper.stream_k_deal(5, 0, 2)
