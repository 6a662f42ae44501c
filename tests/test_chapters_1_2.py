"""Chapters 1 and 2: their teaching versions (the notebook cells tagged "teaching") agree with the package, and
the plotting helpers of flashlab.viz draw what the code really does."""

from __future__ import annotations

import json
import math
import pathlib

import matplotlib
import numpy as np
import pytest

from flashlab import online, reference, tiled, viz

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

ROOT = pathlib.Path(__file__).resolve().parent.parent
CH1 = ROOT / "notebooks" / "01_online_softmax.ipynb"
CH2 = ROOT / "notebooks" / "02_numpy_tiling.ipynb"


def teaching_namespace(path: pathlib.Path) -> dict:
    """Execute, in order, the cells of a chapter tagged "teaching" (they need only numpy and math)."""
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and "teaching" in c.get("metadata", {}).get("tags", [])]
    assert cells, f"{path.name} has no cell tagged 'teaching'"
    namespace = {"np": np, "math": math}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{path.name}:teaching", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def ch1():
    return teaching_namespace(CH1)


@pytest.fixture(scope="module")
def ch2():
    return teaching_namespace(CH2)


def random_blocks(rng, k, n_blocks):
    cuts = np.sort(rng.choice(np.arange(1, k), size=min(k - 1, n_blocks - 1), replace=False)) if k > 1 else []
    edges = [0, *cuts.tolist(), k] if k > 1 else [0, k]
    blocks = [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    return [blocks[i] for i in rng.permutation(len(blocks))]


# --- chapter 1 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vector_values", [False, True])
def test_ch1_update_matches_package(ch1, rng, vector_values):
    update, result, empty = ch1["update"], ch1["result"], ch1["EMPTY"]
    for _ in range(50):
        k = int(rng.integers(1, 60))
        s = float(rng.choice([1.0, 30.0, 1000.0])) * rng.standard_normal(k) + float(rng.choice([0.0, 1000.0, -1000.0]))
        v = rng.standard_normal((k, int(rng.integers(1, 5)))) if vector_values else rng.standard_normal(k)
        mine, theirs = empty, online.init((), v.shape[1] if vector_values else None)
        for lo, hi in random_blocks(rng, k, int(rng.integers(1, 8))):
            mine = update(mine, s[lo:hi], v[lo:hi])
            theirs = online.update(theirs, s[lo:hi], v[lo:hi])
        np.testing.assert_allclose(result(mine), theirs.result(), rtol=1e-12, atol=1e-13)
        assert mine[0] == float(theirs.m)
        np.testing.assert_allclose(mine[0] + math.log(mine[1]), theirs.logsumexp(), rtol=1e-13)


def test_ch1_scalar_example_every_split_and_order(ch1):
    update, result, empty = ch1["update"], ch1["result"], ch1["EMPTY"]
    s = np.array([0.0, 0.0, math.log(3), math.log(3)])
    v = np.array([0.0, 0.0, 1.0, 1.0])
    count = 0
    for blocks in ([(0, 4)], [(0, 2), (2, 4)], [(2, 4), (0, 2)], [(3, 4), (0, 1), (2, 3), (1, 2)]):
        state = empty
        for lo, hi in blocks:
            state = update(state, s[lo:hi], v[lo:hi])
        assert result(state) == pytest.approx(0.75, abs=1e-15)
        count += 1
    assert count == 4


def test_ch1_masked_blocks_are_neutral(ch1, rng):
    update, result, empty = ch1["update"], ch1["result"], ch1["EMPTY"]
    s, v = rng.standard_normal(7), rng.standard_normal(7)
    masked = np.full(3, -np.inf)
    state = update(update(empty, masked, v[:3]), s, v)
    state = update(state, masked, v[:3])
    np.testing.assert_allclose(result(state), online.attend(s, v), rtol=1e-13)


def test_ch1_merge_matches_package(ch1, rng):
    update, merge, result, empty = ch1["update"], ch1["merge"], ch1["result"], ch1["EMPTY"]
    for _ in range(30):
        k = int(rng.integers(2, 40))
        s, v = 50 * rng.standard_normal(k), rng.standard_normal(k)
        cut = int(rng.integers(1, k))
        a, b = update(empty, s[:cut], v[:cut]), update(empty, s[cut:], v[cut:])
        pa = online.update(online.init(), s[:cut], v[:cut])
        pb = online.update(online.init(), s[cut:], v[cut:])
        for mine, theirs in ((merge(a, b), online.merge(pa, pb)), (merge(b, a), online.merge(pb, pa))):
            np.testing.assert_allclose(result(mine), theirs.result(), rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(mine[0] + math.log(mine[1]), theirs.logsumexp(), rtol=1e-13)
    assert merge(empty, empty)[0] == -math.inf


def test_trace_states_ends_at_the_one_shot_answer(rng):
    blocks = [rng.standard_normal(int(rng.integers(1, 10))) for _ in range(int(rng.integers(1, 8)))]
    values = [rng.standard_normal(len(b)) for b in blocks]
    states = viz.trace_states(blocks, values)
    assert len(states) == len(blocks) + 1 and states[0].m == -np.inf
    assert all(later.m >= earlier.m for earlier, later in zip(states[:-1], states[1:], strict=True))
    np.testing.assert_allclose(states[-1].result(), online.attend(np.concatenate(blocks), np.concatenate(values)))
    with pytest.raises(ValueError, match="one block of values per block of scores"):
        viz.trace_states(blocks, values[:-1] if len(values) > 1 else values + values)


# --- chapter 2 -------------------------------------------------------------------------------------------------


def random_qkv(rng, dtype=np.float64):
    n, m = int(rng.integers(1, 150)), int(rng.integers(1, 150))
    d, dv = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    Q, K, V = rng.standard_normal((n, d)), rng.standard_normal((m, d)), rng.standard_normal((m, dv))
    return Q.astype(dtype), K.astype(dtype), V.astype(dtype)


def test_ch2_naive_attention_matches_reference(ch2, rng):
    Q, K, V = random_qkv(rng)
    np.testing.assert_allclose(ch2["naive_attention"](Q, K, V), reference.attention(Q, K, V)[0], rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("name, loop_order", [("forward_kv_outer", "kv_outer"), ("forward_q_outer", "q_outer")])
def test_ch2_teaching_forward_matches_package(ch2, rng, name, loop_order):
    for _ in range(10):
        Q, K, V = random_qkv(rng)
        block_q, block_k = int(rng.integers(1, 70)), int(rng.integers(1, 70))
        O, L = ch2[name](Q, K, V, block_q, block_k)
        O_pkg, L_pkg = tiled.forward(Q, K, V, block_q=block_q, block_k=block_k, loop_order=loop_order)
        np.testing.assert_allclose(O, O_pkg, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(L, L_pkg, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("loop_order", tiled.LOOP_ORDERS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_order_is_the_order_tiled_forward_computes(monkeypatch, rng, loop_order, causal):
    n, m = int(rng.integers(1, 300)), int(rng.integers(1, 300))
    block_q, block_k = int(rng.integers(1, 80)), int(rng.integers(1, 80))
    seen = []
    real_tile = tiled._score_tile

    def recording_tile(Qi, Kj, scale, causal_, q0, k0, offset):
        seen.append((q0 // block_q, k0 // block_k))
        return real_tile(Qi, Kj, scale, causal_, q0, k0, offset)

    monkeypatch.setattr(tiled, "_score_tile", recording_tile)
    Q, K, V = rng.standard_normal((n, 4)), rng.standard_normal((m, 4)), rng.standard_normal((m, 3))
    tiled.forward(Q, K, V, block_q=block_q, block_k=block_k, causal=causal, loop_order=loop_order)
    assert viz.tile_order(n, m, block_q, block_k, loop_order, causal=causal) == seen
    if not causal:
        assert len(seen) == len(set(seen)) == math.ceil(n / block_q) * math.ceil(m / block_k)


def test_tile_order_rejects_bad_input():
    with pytest.raises(ValueError, match="loop_order"):
        viz.tile_order(8, 8, 4, 4, "rows_first")
    with pytest.raises(ValueError, match="n must be a positive integer"):
        viz.tile_order(0, 8, 4, 4)
    with pytest.raises(ValueError, match="block_k"):
        viz.tile_order(8, 8, 4, 0)


# --- plots -----------------------------------------------------------------------------------------------------


def labelled(ax) -> bool:
    return bool(ax.get_title() and ax.get_xlabel() and ax.get_ylabel())


def test_plots_are_labelled(rng):
    states = viz.trace_states([rng.standard_normal(5) for _ in range(4)], [rng.standard_normal(5) for _ in range(4)])
    fig = viz.plot_state_trace(states, exact=0.1)
    assert len(fig.axes) == 4 and all(labelled(ax) for ax in fig.axes) and fig.axes[3].get_legend() is not None
    fig = viz.plot_tile_sweep(100, 130, 32, 48, causal=True, snapshots=3)
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == 2 * 4 and all(labelled(ax) for ax in panels) and fig.legends
    fig = viz.plot_memory_vs_n([64, 128], {"naive": [1e5, 4e5], "tiled": [2e4, 3e4]}, s_bytes=[3e4, 1.3e5])
    ax = fig.axes[0]
    assert labelled(ax) and "MB" in ax.get_ylabel() and len(ax.get_legend().get_texts()) == 3
    plt.close("all")


def test_plots_reject_what_they_cannot_draw(rng):
    vector_states = viz.trace_states([rng.standard_normal(3)], [rng.standard_normal((3, 2))])
    with pytest.raises(ValueError, match="scalar states"):
        viz.plot_state_trace(vector_states)
    with pytest.raises(ValueError, match="one peak per n"):
        viz.plot_memory_vs_n([64, 128], {"naive": [1e5]})
    plt.close("all")
