"""flashlab.gpu.rungs: the kernel files' copied device helpers differ only as KNOWN_VARIANTS explains, and the
listing and diff commands say what each rung changes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import rungs


def _sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in rungs.copying_files()}


# ---------------------------------------------------------------------------------------------- helper copies
def test_helper_copies_differ_only_as_explained():
    problems = rungs.unexplained()
    assert not problems, "\n".join(problems)


def test_an_edit_to_one_copy_is_caught():
    src = _sources()
    quad_max = rungs.device_helpers(src["r5_cp_async"])["quad_max"]
    src["r5_cp_async"] = src["r5_cp_async"].replace(quad_max, quad_max.replace("x, 2)", "x, 3)"))
    problems = rungs.unexplained(src)
    assert len(problems) == 1 and problems[0].startswith("quad_max: 2 different versions"), problems
    assert "r5_cp_async" in problems[0] and "no entry in KNOWN_VARIANTS" in problems[0]


def test_an_explained_variant_must_keep_its_files():
    src = _sources()
    src["r6_exp2_tiles"] = src["r6_exp2_tiles"].replace("        asm volatile(\n", "        asm(\n")  # F16 and BF16
    problems = rungs.unexplained(src)
    assert sorted(p.split(": ")[0] for p in problems) == ["BF16::mma", "F16::mma"], problems
    assert all("but KNOWN_VARIANTS lists" in p for p in problems)


def test_a_copy_in_a_new_file_must_be_listed():
    src = _sources()
    src["r10_next"] = src["r3_mma"]  # a new rung starting from rung 3: only the helpers with variants need a word
    problems = rungs.unexplained(src)
    assert sorted(p.split(": ")[0] for p in problems) == ["BF16::mma", "F16::mma"], problems
    assert all("r10_next" in p for p in problems)


def test_a_difference_that_is_gone_leaves_no_stale_entry():
    src = {stem: text.replace("        asm(\n            \"mma", "        asm volatile(\n            \"mma")
           .replace('asm("mma', 'asm volatile("mma') for stem, text in _sources().items()}
    problems = rungs.unexplained(src)
    assert sorted(problems) == [f"{h}: every copy is the same now; drop it from its KNOWN_VARIANTS entry"
                                for h in ("BF16::mma", "F16::mma")]


def test_known_variants_name_existing_files_and_give_reasons():
    stems = set(_sources())
    for variant in rungs.KNOWN_VARIANTS:
        for group in variant.groups:
            assert set(group) <= stems, (variant.helpers, set(group) - stems)
        assert len(variant.why) > 80, variant.helpers


def test_helpers_are_found_as_written():
    text = """struct F16 {
    static __device__ __forceinline__ u32 pack(float lo, float hi) { return 0; }
};
// a comment
template <int N>
__device__ __forceinline__ void wait() {
    asm volatile("x" : : "n"(N));
}
template <class Ty, int D>
__device__ void attn_main(const u16* q) {
    if (q) { wait<0>(); }
}
"""
    found = rungs.device_helpers(text)
    assert list(found) == ["F16::pack", "wait"]  # the rung's own __device__ body is no helper
    assert found["wait"].startswith("template <int N>\n") and found["wait"].endswith('"n"(N));\n}')
    assert rungs.tokens('asm("a, "\n    "b"); // why') == rungs.tokens('asm( "a, b" ) ;')
    assert rungs.tokens('asm("a, b");') != rungs.tokens('asm("a,b");')


def test_helpers_command_reports_versions_and_exits_zero():
    out = subprocess.run([sys.executable, "-m", "flashlab.gpu.rungs", "helpers"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "unexplained differences: none" in out.stdout
    block = out.stdout.split("F16::mma: 2 versions\n")[1].split("\nF16::pack")[0]
    assert "version 1: r3_mma, r4_ldmatrix, r5_cp_async, r6_exp2_tiles" in block
    assert "-        asm volatile(" in block and "+        asm(" in block
    assert re.search(r"^quad_max: 13 identical copies \(r3_mma, .*r9_addressing, r10_one_barrier, r11_k_lanes, "
                     r"r12_three_blocks, r3t_mma_m16n8k8, decode_r3_mma, sparse_r9_window\)$", out.stdout, re.M)


# ---------------------------------------------------------------------------------------- listing and diffs
def test_listing_has_every_file_and_its_one_line():
    rows = rungs.listing()
    files = [p.name for p in fgpu.KERNEL_DIR.glob("*.cu")]
    files += [f"hopper/{p.name}" for p in fgpu.KERNEL_DIR.glob("hopper/*.cu")]
    assert sorted(f for f, _, _ in rows) == sorted(files)
    assert [name for _, name, _ in rows[:len(fgpu.RUNGS)]] == list(fgpu.RUNGS)  # the ladder first, in order
    hopper = {f: name for f, name, _ in rows if f.startswith("hopper/h")}
    assert list(hopper.values()) == list(fgpu.HOPPER_RUNGS)  # chapter 11's rungs last, in their order
    for file, _, text in rows:
        assert text.endswith(".") and "\n" not in text and not re.match("(Hopper )?[Rr]ung", text), (file, text)
    assert dict((f, t) for f, _, t in rows)["r8_lean_softmax.cu"] == (
        "a leaner softmax: one FFMA per exponent and O rescaled only when a row's max moved.")
    assert dict((f, t) for f, _, t in rows)["hopper/h8_persistent.cu"] == "a persistent grid."


@pytest.mark.parametrize("spec", ["8", "lean", "r8_lean_softmax", "r8_lean_softmax.cu", "r8"])
def test_rungs_are_named_many_ways(spec):
    assert rungs.resolve(spec).name == "r8_lean_softmax.cu"


@pytest.mark.parametrize("spec", ["tma", "h2", "h2_tma", "hopper/h2_tma.cu", "h2_tma.cu"])
def test_hopper_rungs_are_named_many_ways(spec):
    assert rungs.resolve(spec).relative_to(fgpu.KERNEL_DIR).as_posix() == "hopper/h2_tma.cu"


@pytest.mark.parametrize("spec", ["99", "r", "bwd", "nonsense"])
def test_an_unclear_name_is_refused(spec):
    with pytest.raises(ValueError, match="names [02-9]+ kernel files"):
        rungs.resolve(spec)


def _apply(old: list[str], diff: str) -> list[str]:
    """Apply a unified diff to ``old`` (lines), checking every context and removed line against it."""
    new, pos = [], 0
    for hunk in re.split(r"^(?=@@ )", diff, flags=re.M)[1:]:
        header, *body = hunk.splitlines()
        start = int(re.match(r"@@ -(\d+)", header).group(1)) - 1
        start = max(start, 0)
        new += old[pos:start]
        pos = start
        for line in body:
            tag, text = line[:1], line[1:]
            if tag in " -":
                assert old[pos] == text, (header, pos, text)
                pos += 1
            if tag in " +":
                new.append(text)
    return new + old[pos:]


def test_diff_8_9_has_the_expected_hunks():
    out = subprocess.run([sys.executable, "-m", "flashlab.gpu.rungs", "diff", "8", "9"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    diff = out.stdout
    assert diff == rungs.rung_diff("lean", "r9_addressing.cu")
    assert diff.startswith("--- r8_lean_softmax.cu\n+++ r9_addressing.cu\n@@ -1,")
    r8, r9 = (rungs.resolve(s).read_text().splitlines() for s in ("8", "9"))
    assert _apply(r8, diff.split("\n", 2)[2]) == r9  # the hunks turn rung 8 into rung 9, line for line

    hunks = re.split(r"^(?=@@ )", diff, flags=re.M)[1:]
    changed = [[line for line in h.splitlines()[1:] if line[:1] in "+-"] for h in hunks]
    assert "-// Rung 8 -- a leaner softmax" in changed[0][0] and changed[0][1].startswith("+// Rung 9 -- index")
    helper_lines = [line for c in changed for line in c if "__device__ __forceinline__" in line]
    assert sorted(re.search(r"(\w+)\(", line.split("__forceinline__")[1]).group(1) + line[0]
                  for line in helper_lines) == ["copy_rows+", "load_tile-", "swz-"]  # the helpers rung 9 swaps
    assert not any("mma.sync" in line or "ldmatrix.sync" in line for c in changed for line in c)  # shared, unchanged
    no_context = rungs.rung_diff("8", "9", context=0)
    assert all(line[:1] in "+-@" for line in no_context.splitlines()) and len(no_context) < len(diff)


def test_diff_of_an_unknown_rung_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "flashlab.gpu.rungs", "diff", "8", "nonsense"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "names 0 kernel files" in out.stderr


# ----------------------------------------------------------------------------------------------- main loops
def test_the_main_loop_of_every_forward_rung_is_its_loop_over_key_tiles():
    tile_loop = re.compile(r"^    for \(int (?:j|k0|t) = 0; .*\{$")  # how each rung writes it
    for name, rung in fgpu.RUNGS.items():
        lines = rung.source().splitlines()
        first, last = rungs.main_loop(name)
        assert tile_loop.match(lines[first - 1]), (name, lines[first - 1])
        assert sum(bool(tile_loop.match(line)) for line in lines) == 1, name
        assert lines[last - 1] == "    }" and all(line.startswith(("     ", "#")) or not line.strip()
                                                  for line in lines[first:last - 1]), name


@pytest.mark.parametrize("stem, head", [
    ("bwd_r1_smem", "for (int g = 0; g < G; ++g) {"),
    ("bwd_r2_mma", "for (int gi = 0; gi < G; ++gi) {"),
    ("bwd_r3_pipelined", "for (int i = 0; i < steps; ++i) {"),
    ("decode_r1_split", "for (int k0 = kbeg; k0 < kend; k0 += BC) {"),
    ("decode_r2_warp_keys", "for (int c0 = kbeg + warp * KW; c0 < kend; c0 += NW * KW) {"),
])
def test_the_backward_and_decoding_kernels_main_loops_are_found(stem, head):
    loop = rungs.loop_source(stem)
    assert loop.splitlines()[0] == "    " + head and loop.endswith("\n    }\n")
    assert loop.count("{") == loop.count("}")  # a whole loop, braces balanced
    text = rungs.resolve(stem).read_text()
    assert loop in text
    lengths = []  # every top-level loop's lines, by counting braces from its head
    for m in re.finditer(r"^    for \(.*\{", text, re.M):
        depth, i = 0, m.start()
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0 and text[i - 1] == "}":
                break
        lengths.append(text[m.start():i].count("\n") + 1)
    assert len(loop.splitlines()) == max(lengths)  # the longest loop at the top level of a function


def test_loop_hunks_keep_only_what_touches_the_loop():
    whole = rungs.rung_diff("bwd_r2", "bwd_r3", context=1)
    kept = rungs.loop_hunks("bwd_r2", "bwd_r3")
    first, last = rungs.main_loop("bwd_r3")
    assert kept and len(kept) < whole.count("\n") and kept[0].startswith("@@ ")
    for line in kept:
        if h := re.match(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", line):
            start, size = int(h[1]), int(h[2] or 1)
            assert start <= last and start + size - 1 >= first, line
    assert not any("// Backward" in line or "// Rung" in line for line in kept)  # no header comment


def test_loop_command_prints_the_loop_or_its_diff():
    out = subprocess.run([sys.executable, "-m", "flashlab.gpu.rungs", "loop", "decode_r2"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == rungs.loop_source("decode_r2_warp_keys")
    out = subprocess.run([sys.executable, "-m", "flashlab.gpu.rungs", "loop", "4", "turing"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "\n".join(rungs.loop_hunks("4", "turing")) + "\n"
