"""flashlab.fragments: the fragment emulator of chapter 7 and lab 07 — and the chapter's own cells agree with it."""

from __future__ import annotations

import ast
import json
import pathlib

import numpy as np
import pytest

from flashlab import fragments, reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
CH7 = ROOT / "notebooks" / "07_tensor_cores.ipynb"
MAPS = {"A": fragments.a_positions, "B": fragments.b_positions, "C": fragments.c_positions}


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


# ---------------------------------------------------------------------------------------------- the layouts
@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_every_element_is_held_by_exactly_one_lane(name):
    owners = fragments.owners(MAPS[name], fragments.SHAPES[name])
    assert (owners >= 0).all()
    counts = np.bincount(owners.ravel(), minlength=32)
    assert (counts == counts[0]).all() and counts.sum() == np.prod(fragments.SHAPES[name])


def test_a_quad_holds_two_whole_rows_of_c():
    for g in range(8):
        rows = {r for lane in range(4 * g, 4 * g + 4) for r, _ in fragments.c_positions(lane)}
        cols = sorted(c for lane in range(4 * g, 4 * g + 4) for r, c in fragments.c_positions(lane) if r == g)
        assert rows == {g, g + 8} and cols == list(range(8))


def test_two_c_tiles_of_s_are_the_a_operand_of_p():
    for lane in range(32):
        s = fragments.c_positions(lane) + [(r, c + 8) for r, c in fragments.c_positions(lane)]
        assert s == fragments.a_positions(lane)


def test_gather_and_scatter_are_inverse_and_scatter_shows_holes(rng):
    M = rng.standard_normal((16, 16))
    assert np.array_equal(fragments.scatter(fragments.gather(M, fragments.a_positions), fragments.a_positions,
                                            (16, 16)), M)
    half = fragments.scatter(fragments.gather(M[:, :8], fragments.c_positions), lambda lane: [(0, 0)] * 4, (16, 8))
    assert np.isnan(half).sum() == 127


def test_mma_is_a_matrix_product_through_the_hardware_layout(rng):
    A, B, C = _fp16(rng.standard_normal((16, 16))), _fp16(rng.standard_normal((16, 8))), rng.standard_normal((16, 8))
    D = fragments.mma(fragments.gather(A, fragments.a_positions), fragments.gather(B, fragments.b_positions),
                      fragments.gather(C, fragments.c_positions))
    assert np.allclose(fragments.scatter(D, fragments.c_positions, (16, 8)), A @ B + C, rtol=1e-13, atol=1e-13)
    # Registers loaded with the wrong map are read through the hardware's anyway: the product is wrong.
    wrong = fragments.gather(A.T, fragments.a_positions)
    D = fragments.mma(wrong, fragments.gather(B, fragments.b_positions), fragments.gather(C, fragments.c_positions))
    assert not np.allclose(fragments.scatter(D, fragments.c_positions, (16, 8)), A @ B + C)


def test_ldmatrix_x4_delivers_the_a_fragment_from_the_right_addresses(rng):
    A = rng.standard_normal((16, 16))
    right = np.array([(lane % 16, lane // 16) for lane in range(32)])
    assert np.array_equal(fragments.ldmatrix_x4(A, right), fragments.gather(A, fragments.a_positions))
    # Register j of lane 4g + t holds halves 2t, 2t + 1 of the row lane 8j + g points at: for lane 13 (g = 3,
    # t = 1), register 1 comes from lane 11, which points (reversed addresses) at row 4, chunk 1.
    loaded = fragments.ldmatrix_x4(A, right[::-1])
    assert tuple(right[::-1][11]) == (4, 1) and np.array_equal(loaded[13, 2:4], A[4, 10:12])
    with pytest.raises(IndexError):
        fragments.ldmatrix_x4(A, np.array([(lane, 0) for lane in range(32)]))
    with pytest.raises(ValueError, match="shape"):
        fragments.ldmatrix_x4(A, right[:16])


def test_show_layout_marks_missing_and_shared_elements():
    right = fragments.show_layout(fragments.c_positions, (16, 8))
    assert " ? " not in right and "!!" not in right and "31:3" in right
    doubled = fragments.show_layout(lambda lane: [(lane % 16, 0)] * 4, (16, 8))
    assert "!!" in doubled and " ? " in doubled


def test_mma_through_other_maps_reads_k_from_the_fragments(rng):
    """maps= emulates another m16n8 shape: its k comes from A's fragment width, its layout from the maps given."""
    def a4(lane):  # an A of 16 x 8 (4 values per lane), laid out like C
        return fragments.c_positions(lane)

    def b_cols(lane):  # every element of an 8 x 8 B once: lane 4g + t holds column g, k = 2t and 2t + 1
        return [(2 * (lane % 4), lane // 4), (2 * (lane % 4) + 1, lane // 4)]

    def b_half(lane):  # columns 0..3 only, each element twice: columns 4..7 are held by no lane
        return [(lane % 8, lane // 8)] * 2

    A, B, C = rng.standard_normal((16, 8)), rng.standard_normal((8, 8)), rng.standard_normal((16, 8))
    a, c = fragments.gather(A, a4), fragments.gather(C, fragments.c_positions)
    D = fragments.mma(a, fragments.gather(B, b_cols), c, maps=(a4, b_cols, fragments.c_positions))
    assert np.allclose(fragments.scatter(D, fragments.c_positions, (16, 8)), A @ B + C, rtol=1e-13, atol=1e-13)
    D = fragments.mma(a, fragments.gather(B, b_half), c, maps=(a4, b_half, fragments.c_positions))
    assert np.isnan(fragments.scatter(D, fragments.c_positions, (16, 8))[:, 4:]).all()


def test_plot_fragment_layouts_labels_every_element_with_its_lane_and_value():
    import matplotlib

    matplotlib.use("Agg")
    from flashlab import viz

    lanes, values = viz.fragment_labels(fragments.c_positions, (16, 8))
    assert (lanes[9, 2:4] == 5).all() and values[9, 2:4].tolist() == [2, 3]  # lane 5: g = 1, t = 1: row 9 is g + 8
    lanes, _ = viz.fragment_labels(lambda lane: [(lane % 16, 0)] * 4, (16, 8))
    assert (lanes[:, 0] == -2).all() and (lanes[:, 1:] == -1).all()
    fig = viz.plot_fragment_layouts({"C": (fragments.c_positions, (16, 8)), "A": (fragments.a_positions, (16, 16))})
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert len(texts) == 256 and "31:7" in texts and "?" not in texts
    with pytest.raises(ValueError):
        viz.plot_fragment_layouts({})


# ---------------------------------------------------------------------------------------- shuffles, softmax
def test_shfl_xor_reads_the_partner_lane(rng):
    x = rng.standard_normal((32, 3))
    for offset in (1, 2, 4, 8, 16):
        got = fragments.shfl_xor(x, offset)
        assert all(np.array_equal(got[i], x[i ^ offset]) for i in range(32))
    with pytest.raises(ValueError, match="shape"):
        fragments.shfl_xor(np.zeros(16), 1)
    with pytest.raises(ValueError, match="offset"):
        fragments.shfl_xor(np.zeros(32), 32)


def _fold(S: np.ndarray, V: np.ndarray, tile: int):
    """Attention of 16 rows over S's keys, tile by tile through softmax_tile (P V done in matrix form)."""
    m, l = np.full((32, 2), -np.inf), np.zeros((32, 2))
    o = np.zeros((32, V.shape[1] // 8, 4))
    for k0 in range(0, S.shape[1], tile):
        s = np.stack([fragments.gather(S[:, k:k + 8], fragments.c_positions) for k in range(k0, k0 + tile, 8)], axis=1)
        p, m, l, o = fragments.softmax_tile(s, m, l, o)
        P = np.concatenate([fragments.scatter(p[:, j], fragments.c_positions, (16, 8)) for j in range(p.shape[1])], 1)
        PV = P @ V[k0:k0 + tile]
        o = o + np.stack([fragments.gather(PV[:, 8 * j:8 * j + 8], fragments.c_positions)
                          for j in range(V.shape[1] // 8)], axis=1)
    O = np.concatenate([fragments.scatter(o[:, j], fragments.c_positions, (16, 8)) for j in range(o.shape[1])], 1)
    rows_l = np.concatenate([l[0::4, 0], l[0::4, 1]])
    return O, rows_l, np.concatenate([m[0::4, 0], m[0::4, 1]])


@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_softmax_tile_folded_over_tiles_is_attention(rng, shift):
    S = rng.standard_normal((16, 64)) * 3 + shift
    S[3, :40] = -np.inf  # a row whose first tiles are fully masked
    S[5] = -np.inf       # a row that sees no key at all
    V = rng.standard_normal((64, 16))
    O, l, m = _fold(S, V, 16)
    with np.errstate(invalid="ignore"):
        O_ref = np.where(np.isneginf(S).all(1, keepdims=True), 0.0,
                         np.exp(S - S.max(1, keepdims=True)) @ V / np.exp(S - S.max(1, keepdims=True)).sum(1)[:, None])
    assert np.isfinite(O).all()
    live = ~np.isneginf(S).all(1)
    assert np.allclose(O[live] / l[live, None], O_ref[live], rtol=1e-10, atol=1e-12)
    assert np.array_equal(O[5], np.zeros(16)) and l[5] == 0 and np.isneginf(m[5])
    assert np.allclose(m[live], S[live].max(1))


def test_softmax_tile_keeps_the_state_of_a_quad_equal(rng):
    S = rng.standard_normal((16, 16))
    s = np.stack([fragments.gather(S[:, k:k + 8], fragments.c_positions) for k in (0, 8)], axis=1)
    _, m, l, _ = fragments.softmax_tile(s, np.full((32, 2), -np.inf), np.zeros((32, 2)), np.zeros((32, 1, 4)))
    for x in (m, l):
        assert all(np.array_equal(x[4 * g], x[4 * g + t]) for g in range(8) for t in range(4))


def test_warp_tile_is_attention_up_to_fp16_p(rng):
    Q, K, V = (_fp16(rng.standard_normal(shape)) for shape in ((16, 64), (64, 64), (64, 64)))
    O = fragments.warp_tile(Q, K, V, 1 / 8)
    O_ref, _ = reference.attention(Q, K, V)
    assert np.abs(O - O_ref).max() < 2e-3  # P rounded to fp16 (relative 2^-11), everything else float64


# -------------------------------------------------------------------------------------------------- banks
def test_passes():
    assert fragments.passes([4 * lane for lane in range(32)]) == 1  # 32 consecutive words
    assert fragments.passes([0] * 32) == 1  # one word, broadcast
    assert fragments.passes([128 * lane for lane in range(32)]) == 32  # one bank, 32 words
    assert fragments.passes([256 * r for r in range(8)], width=16) == 8  # rung 4's unswizzled phase


@pytest.mark.parametrize("d", [64, 128])
def test_the_xor_swizzle_makes_every_phase_one_pass(d):
    assert (fragments.phase_passes(None, rows=32, d=d) == 8).all()
    assert (fragments.phase_passes(fragments.swizzle, rows=32, d=d) == 1).all()
    chunks = d * 2 // 16
    for row in range(32):
        stored = sorted(fragments.swizzle(row, c) for c in range(chunks))
        assert stored == list(range(chunks))


def test_swizzle_and_chunk_address_work_on_arrays():
    R, C = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    assert np.array_equal(fragments.swizzle(R, C), C ^ (R % 8))
    assert fragments.chunk_address(3, 5) == 3 * 256 + 5 * 16
    assert fragments.chunk_address(3, 5, fragments.swizzle) == 3 * 256 + (5 ^ 3) * 16


# ------------------------------------------------------------------------- chapter 7's cells, as they are
@pytest.fixture(scope="module")
def ch7() -> dict:
    """The definitions of chapter 7's code cells (functions and assignments of literals), executed in order."""
    namespace: dict = {"np": np, "reference": reference, "frag": fragments}
    for cell in json.loads(CH7.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = ast.parse(source)
        for node in tree.body:
            literal = (ast.Constant, ast.Tuple, ast.BinOp, ast.operator, ast.Load)
            constant = isinstance(node, ast.Assign) and all(isinstance(n, literal) for n in ast.walk(node.value))
            if isinstance(node, ast.FunctionDef) or constant:
                exec(compile(ast.Module([node], []), CH7.name, "exec"), namespace)  # noqa: S102 - the course's own
    return namespace


def test_chapter_7_draws_the_package_s_maps_and_writes_none_of_its_own():
    """The maps are lab 07's kind of answer: the chapter shows them as a figure of the package's, not as code."""
    code = [("".join(c["source"])) for c in json.loads(CH7.read_text())["cells"] if c["cell_type"] == "code"]
    defined = {node.name for source in code for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.FunctionDef)}
    assert not defined & {"a_positions", "b_positions", "c_positions"}, defined
    drawing = next(source for source in code if "plot_fragment_layouts" in source)
    assert all(f"frag.{name.lower()}_positions" in drawing for name in MAPS)


def test_chapter_7_mma_and_fragments_are_the_package_s(ch7, rng):
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    a, b, c = (ch7["fragments"](M, MAPS[x]) for M, x in ((A, "A"), (B, "B"), (C, "C")))
    assert np.array_equal(np.array(a), fragments.gather(A, fragments.a_positions))
    assert np.allclose(np.array(ch7["mma"](a, b, c)), fragments.mma(np.array(a), np.array(b), np.array(c)),
                       rtol=1e-14, atol=1e-14)


def test_chapter_7_warp_tile_is_the_package_s(ch7, rng):
    Q, K, V = (_fp16(rng.standard_normal(shape)) for shape in ((16, 32), (32, 32), (32, 32)))
    assert np.allclose(ch7["warp_tile"](Q, K, V, 0.3), fragments.warp_tile(Q, K, V, 0.3), rtol=1e-12, atol=1e-12)


def test_chapter_7_passes_and_swizzle_are_the_package_s(ch7, rng):
    for width in (4, 16):
        for _ in range(20):
            addresses = (rng.integers(0, 4096, 32) // width * width).tolist()
            assert ch7["passes"](addresses, width=width) == fragments.passes(addresses, width=width)
    D = ch7["D"]
    for row in range(32):
        for chunk in range(D // 8):
            assert ch7["chunk_address"](row, chunk, False) == fragments.chunk_address(row, chunk, None, d=D)
            assert ch7["chunk_address"](row, chunk, True) == fragments.chunk_address(row, chunk, fragments.swizzle, d=D)


def test_show_layout_draws_a_map_that_points_outside_the_operand():
    def transposed_b(lane):  # a natural mistake: B's (row, column) written as (column, row)
        g, t = lane // 4, lane % 4
        return [(g, 2 * t), (g, 2 * t + 1), (g, 2 * t + 8), (g, 2 * t + 9)]

    text = fragments.show_layout(transposed_b, fragments.SHAPES["B"])
    assert "outside the 16 x 8 operand: lane 0 value 2 at (0, 8)" in text, text
    assert " ?  " in text  # the elements no lane holds are still marked
