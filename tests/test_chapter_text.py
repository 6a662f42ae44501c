"""Chapters 1-5 speak to the student: no references a reader cannot follow, one unit convention, the causal
convention stated where it is first used (and drawn from the reference's own mask), demos whose numbers tell the
mistakes apart, and speed statements computed from the reader's own measurement."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import pathlib
import re

import matplotlib
import numpy as np
import pytest

from flashlab import iocount, reference, tiled, viz

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("0[1-5]_*.ipynb"))
CH1, CH2, CH3, CH4, CH5 = CHAPTERS


def cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def cell_by_id(path: pathlib.Path, cell_id: str) -> dict:
    found = [c for c in cells(path) if c.get("id") == cell_id]
    assert len(found) == 1, f"{path.name}: expected one cell with id {cell_id!r}, found {len(found)}"
    return found[0]


def run_cells(path: pathlib.Path, ids: list[str], namespace: dict) -> dict:
    """Execute the code cells with these ids, in order, in one namespace (their prints are swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        for cell_id in ids:
            exec(compile(text(cell_by_id(path, cell_id)), f"{path.name}:{cell_id}", "exec"), namespace)
    return namespace


def test_chapters_1_to_5_are_the_five_expected():
    assert [p.name[:2] for p in CHAPTERS] == ["01", "02", "03", "04", "05"]


# --- references a student can follow ----------------------------------------------------------------------------

UNFOLLOWABLE = [
    (r"\b(?:our|the course's|private) (?:own )?notes?\b", "notes the reader cannot open"),
    (r"\bseed'?s\b|\bthe seed\b", "'the seed' as a source"),
    (r"""claim\(\s*["'](?:ru|es)\b""", "a cryptic claim tag"),
    (r"\b(?:ru|es) (?:§|P\d|pet project|thesis)", "a cryptic section reference"),
    (r"\bes P\d+", "a cryptic section reference"),
]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_reference_a_student_cannot_follow(path):
    for i, cell in enumerate(cells(path)):
        for pattern, what in UNFOLLOWABLE:
            hit = re.search(pattern, text(cell), flags=re.IGNORECASE)
            assert not hit, f"{path.name} cell {i}: {what}: {hit.group(0)!r}"


def test_every_claim_in_chapter_3_names_a_source_a_reader_can_open_or_none():
    sources = [m.group(1) for c in cells(CH3) for m in re.finditer(r"""claim\(\s*"([^"]*)\"""", text(c))]
    assert len(sources) >= 10, "chapter 3's fact-check table lost its claims"
    for source in sources:
        ok = (source == "commonly said" or re.fullmatch(r"chapter \d+", source)
              or re.search(r"arXiv:\d{4}\.\d{5}", source))
        assert ok, f"chapter 3 claim source {source!r} is neither 'commonly said', a chapter, nor an arXiv paper"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_papers_cited_by_name_are_linked_once(path):
    """A chapter that leans on 'the paper' says which one a reader can open (its arXiv number), at least once."""
    body = "\n".join(text(c) for c in cells(path))
    if re.search(r"\bthe (?:FlashAttention )?paper\b|Algorithm 1", body):
        assert "arXiv:2205.14135" in body or "arxiv.org/abs/2205.14135" in body, path.name


# --- one unit convention: MB = 10^6 bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_sizes_are_decimal(path):
    for i, cell in enumerate(cells(path)):
        source = text(cell)
        for binary in ("MiB", "GiB", "KiB", "2**20", "2**30"):
            assert binary not in source, f"{path.name} cell {i} uses {binary}: sizes are decimal (1 MB = 10^6 bytes)"


def test_chapter_5_memory_axis_is_in_mb():
    source = text(cell_by_id(CH5, "d840a8d0"))
    assert 'ylabel="peak memory (MB)"' in source and "/ 1e6" in source


# --- chapter 1: the three answers of the scalar example ---------------------------------------------------------


@pytest.fixture(scope="module")
def ch1_demo():
    return run_cells(CH1, ["cell-04", "cell-06", "cell-09", "cell-11", "cell-13"], {"np": np, "math": math})


def test_ch1_forgot_the_rescale_is_told_apart_from_averaging(ch1_demo):
    right, averaged, forgot = ch1_demo["answers"][1]
    assert math.isclose(right, 0.75)
    for a, b in ((right, averaged), (right, forgot), (averaged, forgot)):
        assert abs(a - b) > 0.05, ch1_demo["answers"][1]
    # the even split is shown as the case where two mistakes print the same number, which the text explains
    _, averaged_even, forgot_even = ch1_demo["answers"][2]
    assert math.isclose(averaged_even, forgot_even)


def test_ch1_text_states_the_numbers_the_demo_prints(ch1_demo):
    right, averaged, forgot = ch1_demo["answers"][1]
    after = text(cell_by_id(CH1, "cell-13b"))
    assert f"{forgot:g}" in after and "3/7" in after and math.isclose(averaged, 3 / 7)
    assert f"{right:g}" in after


def test_ch1_forgot_the_rescale_function_really_omits_it(ch1_demo):
    """The demo's buggy update differs from the right one only when the max rises: it is the mistake it names."""
    update, buggy, empty = ch1_demo["update"], ch1_demo["update_without_rescale"], ch1_demo["EMPTY"]
    s = np.array([0.5, -1.0])
    state = update(empty, s, np.array([1.0, 2.0]))
    same_max = np.array([0.1, 0.2])  # below 0.5: no rescale needed
    assert buggy(state, same_max, np.ones(2)) == pytest.approx(update(state, same_max, np.ones(2)))
    higher = np.array([3.0])
    assert buggy(state, higher, np.ones(1))[1] > update(state, higher, np.ones(1))[1]


def test_ch1_state_trace_text_matches_the_plot():
    ns = run_cells(CH1, ["cell-04", "cell-06", "cell-32"], {"np": np, "math": math, "viz": viz, "plt": plt})
    plt.close("all")
    states = ns["states"]
    raises = [k for k in range(2, len(states)) if states[k].m > states[k - 1].m]
    assert raises, "the stream no longer raises its max: the text about the dotted lines has nothing to point at"
    words = " ".join(text(cell_by_id(CH1, "cell-31")).split())
    assert "$\\ell$ and $u$ can **fall**" not in words
    assert "falls at both dotted lines" in words and len(raises) == 2
    assert all(float(states[k].l) < float(states[k - 1].l) for k in raises)
    assert "it rises at both dotted lines" in words
    assert all(float(states[k].u) > float(states[k - 1].u) for k in raises)


# --- chapter 2: the causal convention, stated and drawn ---------------------------------------------------------


def test_reference_causal_convention_is_the_one_the_text_states(rng):
    for _ in range(20):
        n, m = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        i, j = np.arange(n)[:, None], np.arange(m)[None, :]
        np.testing.assert_array_equal(reference.causal_mask(n, m), j <= i + m - n)


def section_8_of_chapter_2() -> list[dict]:
    all_cells = cells(CH2)
    start = next(k for k, c in enumerate(all_cells) if text(c).startswith("## 8."))
    end = next(k for k, c in enumerate(all_cells) if k > start and text(c).startswith("## "))
    return all_cells[start:end]


def test_ch2_states_the_convention_where_causal_is_first_used():
    first_causal = next(c for c in cells(CH2) if "causal" in text(c).lower())
    section = section_8_of_chapter_2()
    assert first_causal["id"] == section[0]["id"], "the first cell that speaks of causal masking states the convention"
    words = " ".join(text(section[0]).split())
    assert "j \\le i + m - n" in words and "no key" in words


def test_ch2_causal_picture_is_the_reference_mask_for_every_shape(rng):
    code = [c for c in section_8_of_chapter_2() if c["cell_type"] == "code" and "plot_causal_masks" in text(c)]
    assert len(code) == 1, "chapter 2, section 8 draws the causal masks in one cell"
    ns = {"np": np, "plt": plt, "reference": reference, "tiled": tiled, "viz": viz, "rng": rng}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(text(code[0]), "02:causal masks", "exec"), ns)
    shapes = ns["shapes"]
    assert {(n > m) - (n < m) for n, m in shapes} == {-1, 0, 1}, "n < m, n = m and n > m side by side"
    fig = ns["fig"]
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == len(shapes)
    for ax, (n, m) in zip(panels, shapes, strict=True):
        drawn = np.asarray(ax.images[0].get_array()).astype(bool)
        i, j = np.arange(n)[:, None], np.arange(m)[None, :]
        np.testing.assert_array_equal(drawn, j <= i + m - n)
        hatched = [p for p in ax.patches if p.get_hatch()]
        assert len(hatched) == max(0, n - m), "the rows that see no key are marked"
    plt.close("all")


def test_plot_causal_masks_rejects_bad_shapes():
    for bad in ([], [(0, 3)], [(3,)], [(True, 2)]):
        with pytest.raises(ValueError):
            viz.plot_causal_masks(bad)
    plt.close("all")


def test_ch2_timing_cell_does_what_the_text_says():
    """Cell 3 promises the tiled forward on all cores in section 7; section 7 promises medians and a spread; the
    printed explanation of a speed-up is offered as consistent with a cause, which the timing does not measure."""
    setting = " ".join(text(cell_by_id(CH2, "cell-03")).split())
    timing = text(cell_by_id(CH2, "cell-29"))
    assert "the tiled forward, on all cores" in setting and not re.search(r"\d+.\d+× slower", setting)
    assert re.search(r'"tiled q_outer, all cores"\] = \(\s*lambda: tiled\.forward\(.*?\), cores\)', timing, re.DOTALL)
    assert "np.median(t)" in timing and "min(t)" in timing and "max(t)" in timing
    assert "consistent with" in timing and "because" not in timing


def test_ch4_points_back_to_chapter_2s_convention():
    words = " ".join(text(cell_by_id(CH4, "5fc50ff9")).split())
    assert "chapter 2, section 8" in words and "j \\le i + m - n" in words
    assert "Causal" in text(section_8_of_chapter_2()[0])


# --- chapter 3: answers and formulas agree with the counter --------------------------------------------------------


def answer(path: pathlib.Path, number: int) -> str:
    """The text of answer ``number`` in the chapter's Check yourself section, on one line."""
    body = text(next(c for c in cells(path) if text(c).startswith("## Check yourself")))
    answers = body.split("<summary>Answers</summary>")[1]
    found = re.search(rf"^{number}\. (.*?)(?=^\d+\. |</details>)", answers, flags=re.MULTILINE | re.DOTALL)
    assert found, f"{path.name} has no answer {number}"
    return " ".join(found.group(1).split())


def test_ch3_q5_answer_is_where_the_counter_crosses():
    M, n = 116_224, 65_536
    questions = text(next(c for c in cells(CH3) if text(c).startswith("## Check yourself")))
    assert f"M = {M // 1000}\\,{M % 1000}" in questions

    def ratio(d):
        return iocount.predict("standard", n, d, sram=M).accesses / iocount.predict("kv_outer", n, d, sram=M).accesses

    crossing = next(d for d in range(64, 512) if ratio(d) < 1)
    words = answer(CH3, 5)
    stated = re.search(r"below 1 from \$d = (\d+)\$ at \$n = 65\\,536\$", words)
    assert stated and int(stated.group(1)) == crossing, (crossing, words)
    at_197 = re.search(r"at \$d = 197\$ the ratio is still (\d+\.\d+)", words)
    assert at_197 and at_197.group(1) == f"{ratio(197):.2f}", (ratio(197), words)
    assert round(math.sqrt(M / 3)) == 197 and "\\sqrt{M/3} \\approx 197" in words
    assert round(math.sqrt(M / 2)) == 241 and "\\sqrt{M/2} \\approx 241" in words


def test_ch3_standard_backward_formula_is_the_counters():
    words = " ".join(text(cell_by_id(CH3, "cce0c5b1")).split())
    assert "reads $5n^2 + nd + 4T_r\\,nd$" in words and "$T_r = \\lceil n/B_r \\rceil$" in words
    M, d = 163 * 1024 // 2, 64
    b_r, _ = iocount.default_blocks_backward("standard", d, M)
    for n in (64, 300, 1024):  # 2n <= M: a row of P and one of dP fit together
        stated = 5 * n * n + n * d + 4 * math.ceil(n / b_r) * n * d
        assert iocount.predict_backward("standard", n, d, sram=M).reads == stated


def test_ch3_roofline_text_matches_the_model():
    """Algorithm 1 is below the ridge at the paper's n = 1024 and past it from the n the cell prints; FlashAttention-2's
    order with a tall query block is past it everywhere: what the text after the roofline says."""
    ns = run_cells(CH3, ["ec358706", "087d683c", "32104e68"], {"display": lambda *_: None})
    plt.close("all")
    ridge, kv = ns["ridge"], ns["kv_intensity"]
    assert kv[1024] < ridge <= min(i for n, i in kv.items() if n >= ns["kv_past"])
    assert ns["q_least"] > ridge
    words = " ".join(text(cell_by_id(CH3, "ac71998f")).split())
    assert "still below it at the paper's $n = 1024$" in words and "past it at every $n$ drawn" in words


# --- chapter 5: speed statements follow the measurement ---------------------------------------------------------


def test_ch5_has_no_fixed_verdict_on_who_wins_at_small_n():
    for i, cell in enumerate(cells(CH5)):
        if cell["cell_type"] == "markdown":
            assert not re.search(r"favours naive|small \$?n\$? favours", text(cell), re.IGNORECASE), f"cell {i}"


def compare_with_naive():
    tree = ast.parse(text(cell_by_id(CH5, "7ec1e0b7")))
    fn = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "compare_with_naive"]
    assert len(fn) == 1, "chapter 5's benchmark cell computes its sentences with compare_with_naive"
    ns: dict = {}
    exec(compile(ast.Module(body=fn, type_ignores=[]), "05:compare_with_naive", "exec"), ns)
    return ns["compare_with_naive"]


def test_ch5_speed_sentences_are_computed_from_the_rows():
    rows = [
        {"n": 256, "implementation": "numpy_naive", "median_s": 1.0},
        {"n": 256, "implementation": "numpy_tiled", "median_s": 4.0},
        {"n": 256, "implementation": "numba_tiled", "median_s": 0.5},
        {"n": 512, "implementation": "numpy_naive", "median_s": 1.0},
        {"n": 512, "implementation": "numpy_tiled", "median_s": 0.25},
        {"n": 512, "implementation": "numba_tiled", "median_s": 1.01},
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compare_with_naive()(rows)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("n = 256: NumPy tiled ran at 0.25× the speed of naive (slower); "
                        "Numba tiled ran at 2.00× the speed of naive (faster)")
    assert lines[1].startswith("n = 512: NumPy tiled ran at 4.00× the speed of naive (faster); ")
    assert "0.99× the speed of naive (a tie" in lines[1]


def test_ch5_benchmark_cells_print_the_sentences():
    assert "compare_with_naive(rows)" in text(cell_by_id(CH5, "7ec1e0b7"))
    assert 'compare_with_naive(record["rows"])' in text(cell_by_id(CH5, "9dd59dd6"))
