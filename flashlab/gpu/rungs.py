"""The kernel files side by side: what each rung changes, the device helpers they copy, and diffs between rungs.

Every ``.cu`` file in ``kernels/`` is self-contained on purpose. A reader reads one rung as one file, top to
bottom; and CuPy's compile cache keys on the source string it is given, not on the files that string
``#include``s, so an edit to a shared header would not recompile the kernels that include it. The price is that
small device helpers (the 16-bit conversions, ``mma``, ``ldmatrix``, ``cp.async``, quad reductions, ...) are copied
from file to file. Copies that differ are listed in :data:`KNOWN_VARIANTS`, each with the reason; tests/test_rungs.py
fails on any other difference, so an edit to one copy must be mirrored in the others or explained there.

A *helper* is a ``__device__ __forceinline__`` function, free or a static member of a conversion struct (named
``F16::mma``). The ``__device__`` function that holds a rung's main loop is the rung itself, not a helper. Copies
are compared as C++ tokens: comments, line breaks and spacing do not count, adjacent string literals are joined.

Command line (rungs by number, file name, stem, a unique stem prefix such as ``bwd_r2``, or name in
``flashlab.gpu.RUNGS``)::

    python -m flashlab.gpu.rungs list           # every kernel file and the one line of what it changes
    python -m flashlab.gpu.rungs diff 8 9       # unified diff between two files (-U N lines of context)
    python -m flashlab.gpu.rungs loop bwd_r3    # a file's main loop; with a second file, the diff of that loop
    python -m flashlab.gpu.rungs helpers        # which files share each helper, and where copies differ
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator

from . import HOPPER_RUNGS, KERNEL_DIR, RUNGS

# Listed by hand, like every group below: a new file's copies are placed in a version on purpose.
CH8 = ("bwd_r1_smem", "bwd_r2_mma", "bwd_r3_pipelined", "decode_r1_split", "decode_r2_warp_keys", "decode_r3_mma")


@dataclasses.dataclass(frozen=True)
class KnownVariant:
    """Helpers whose copies come in more than one version, on purpose: which files hold which version, and why.

    ``groups`` lists the files (stems) of each version; for one helper, only the files that define it count."""

    helpers: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]
    why: str


KNOWN_VARIANTS: tuple[KnownVariant, ...] = (
    KnownVariant(
        helpers=("F16::mma", "BF16::mma"),
        groups=(("r3_mma", "r4_ldmatrix", "r5_cp_async", "r6_exp2_tiles"),
                ("r7_warp32", "r8_lean_softmax", "r9_addressing", "r10_one_barrier", "r11_k_lanes", "r12_three_blocks",
                 "bwd_r2_mma", "bwd_r3_pipelined", "sparse_r9_window", "decode_r3_mma")),
        why="`asm volatile` in rungs 3-6, plain `asm` from rung 7 on (rung 7 was written without it; the files "
            "written after it followed). volatile forbids the compiler to delete the statement (an mma's outputs "
            "are always used, so there is nothing to delete) or to move it across other volatile asm (ldmatrix, "
            "cp.async); the instruction scheduler after it does not see the keyword. Measured: nvcc 13.0 and NVRTC "
            "13.0 give byte-identical cubins with either form, for every one of these files, at sm_80 and sm_90. "
            "Left as is: the recorded timings were measured with these bytes.",
    ),
    KnownVariant(
        helpers=("F16::load", "F16::store", "BF16::load"),
        groups=(("r1_scalar", "r2_smem_tiles"), CH8),
        why="Rungs 1-2 also run fp32, so their structs convert a storage type `T` (fp32, fp16 or bf16 bits); "
            "chapter 8's kernels are 16-bit only (`u16`).",
    ),
    KnownVariant(
        helpers=("BF16::store",),
        groups=(("r1_scalar", "r2_smem_tiles"), ("bwd_r1_smem", "decode_r1_split"), ("bwd_r2_mma", "bwd_r3_pipelined")),
        why="sm_75 (T4) has no bf16 conversion instruction. Rungs 1-2 (storage type `T`) always round to nearest "
            "even with integer arithmetic; the scalar backward and the decoding file run on sm_75 too and do so "
            "below sm_80 only (`cvt.rn.bf16.f32` above); the tensor-core backward kernels need sm_80 and use the "
            "instruction alone.",
    ),
    KnownVariant(
        helpers=("load_tile",),
        groups=(("r5_cp_async", "r6_exp2_tiles"), ("r7_warp32", "r8_lean_softmax")),
        why="From rung 7 the keys per tile depend on the head dimension (BC_D64, BC_D128), so BC is a template "
            "parameter instead of the file-wide macro of rungs 5-6.",
    ),
    KnownVariant(
        helpers=("unpack8",),
        groups=(("bwd_r1_smem",), ("decode_r2_warp_keys",)),
        why="The 16-byte word is taken by value in bwd_r1_smem.cu and by const reference in decode_r2_warp_keys.cu: "
            "the same computation once inlined (either form compiles decode_r2_warp_keys.cu for sm_90 to 58384 "
            "instructions, differing only in register assignment and a handful of equivalent instructions). Left "
            "as is: the recorded timings were measured with these bytes.",
    ),
)


# ------------------------------------------------------------------------------------------------- the files
def kernel_files() -> list[pathlib.Path]:
    """Every kernel file: the forward ladder in the order of ``RUNGS``, then the others (chapter 8) by name, then
    chapter 11's Hopper files (``hopper/``): its rungs in the order of ``HOPPER_RUNGS`` (h10 after h9), then the
    others by name. The Hopper rungs share their helpers through two headers
    (``wgmma.cuh``, ``tma.cuh``) instead of copying them: NVRTC is given those headers' text with every build
    (:func:`flashlab.gpu.hopper.inlined_source`), so an edit to one does recompile them."""
    forward = [KERNEL_DIR / r.file for r in RUNGS.values()]
    rest = sorted(p for p in KERNEL_DIR.glob("*.cu") if p not in forward)
    hopper = [KERNEL_DIR / r.file for r in HOPPER_RUNGS.values()]
    return forward + rest + hopper + sorted(p for p in KERNEL_DIR.glob("hopper/*.cu") if p not in hopper)


def copying_files() -> list[pathlib.Path]:
    """The kernel files that copy their device helpers: all but the Hopper ones (whose headers hold theirs)."""
    return [p for p in kernel_files() if p.parent == KERNEL_DIR]


def _shown(p: pathlib.Path) -> str:
    """A kernel file as the listing names it, relative to ``kernels/`` (``hopper/h1_wgmma.cu``)."""
    return p.relative_to(KERNEL_DIR).as_posix()


def summary(text: str) -> str:
    """The first sentence of a kernel file's header comment, without its "Rung N --" prefix."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("//") or not line[2:].strip():
            break  # the first paragraph ends at an empty comment line or at the code
        lines.append(line[2:].strip())
    paragraph = " ".join(lines)
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return re.sub(r"^(Hopper )?[Rr]ung \d+ -- ", "", sentence)


def listing() -> list[tuple[str, str, str]]:
    """(file name, name in RUNGS or "", summary) for every kernel file, in :func:`kernel_files` order."""
    names = {r.file: name for name, r in (*RUNGS.items(), *HOPPER_RUNGS.items())}
    return [(_shown(p), names.get(_shown(p), ""), summary(p.read_text())) for p in kernel_files()]


def resolve(spec: str) -> pathlib.Path:
    """The kernel file a command-line argument names: a rung number ("8"), a file name (``hopper/`` optional), a
    stem, a unique stem prefix ("bwd_r2", "h4") or a name in ``RUNGS`` or ``HOPPER_RUNGS`` ("lean", "tma")."""
    files = kernel_files()
    stems = {p.stem: p for p in files}
    spec = spec.strip()
    bare = spec.removeprefix("hopper/").removesuffix(".cu")
    if spec.isdigit():
        found = [p for p in files if re.fullmatch(rf"r{int(spec)}_\w+", p.stem)]
    elif spec in RUNGS or spec in HOPPER_RUNGS:
        found = [KERNEL_DIR / (RUNGS.get(spec) or HOPPER_RUNGS[spec]).file]
    elif bare in stems:
        found = [stems[bare]]
    else:
        found = [p for p in files if p.stem.startswith(spec + "_")]
    if len(found) != 1:
        raise ValueError(f"{spec!r} names {len(found)} kernel files; use a rung number (1-{len(RUNGS)}), a name "
                         f"in RUNGS ({', '.join(RUNGS)}) or one of {', '.join(stems)}")
    return found[0]


def rung_diff(a: str, b: str, context: int = 3) -> str:
    """Unified diff from kernel file ``a`` to kernel file ``b`` (anything :func:`resolve` accepts)."""
    pa, pb = resolve(a), resolve(b)
    lines = difflib.unified_diff(pa.read_text().splitlines(keepends=True), pb.read_text().splitlines(keepends=True),
                                 fromfile=pa.name, tofile=pb.name, n=context)
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


# ------------------------------------------------------------------------------------------------ main loops
# A loop at the top level of a function body (four spaces in): the kernels are written so, and nothing else is.
_TOP_FOR = re.compile(r"^    for \(.*\{\s*(//.*)?$")


def main_loop(spec: str) -> tuple[int, int]:
    """First and last line (1-based) of a kernel file's main loop: the longest loop at the top level of a function
    body. For the forward rungs it is the loop over key tiles; for the backward, the loop over the query tiles of a
    block's keys (over the heads of its group first, in ``bwd_r1`` and ``bwd_r2``); for decoding, over a split's
    keys."""
    lines = resolve(spec).read_text().splitlines()
    loops = []
    for i, line in enumerate(lines):
        if _TOP_FOR.match(line):
            end = lines.index("    }", i)  # the body is indented further: the first brace back at four spaces
            loops.append((end - i, i + 1, end + 1))
    if not loops:
        raise ValueError(f"{resolve(spec).name} has no loop at the top level of a function")
    return max(loops)[1:]


def loop_source(spec: str) -> str:
    """The text of a kernel file's main loop (:func:`main_loop`)."""
    first, last = main_loop(spec)
    return "\n".join(resolve(spec).read_text().splitlines()[first - 1:last]) + "\n"


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def _hunks(a: list[str], b: list[str], context: int, same: Callable[[str], str]) -> Iterator[str]:
    """Unified-diff hunks (no file lines) from lines ``a`` to lines ``b``, lines compared as ``same(line)``; an
    unchanged line is printed as ``b`` has it."""
    matcher = difflib.SequenceMatcher(None, [same(x) for x in a], [same(x) for x in b], autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        yield f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@"
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                yield from (" " + x for x in b[b1:b2])
            else:
                yield from ("-" + x for x in a[a1:a2])
                yield from ("+" + x for x in b[b1:b2])


def loop_hunks(a: str, b: str, context: int = 1, ignore_indent: bool = False) -> list[str]:
    """The lines of :func:`rung_diff` from ``a`` to ``b`` in the hunks that touch ``b``'s main loop: what a rung
    changes in the loop, without its header comment or helpers. ``ignore_indent``: lines that differ only in their
    indentation count as unchanged (a loop nest flattened into one loop then shows only what it changed)."""
    first, last = main_loop(b)
    if ignore_indent:
        old, new = (resolve(x).read_text().splitlines() for x in (a, b))
        diff: Iterable[str] = _hunks(old, new, context, str.strip)
    else:
        diff = rung_diff(a, b, context=context).splitlines()
    kept, keep = [], False
    for line in diff:
        if h := _HUNK.match(line):
            start = int(h[1])
            keep = start <= last and start + int(h[2] or 1) - 1 >= first
        if keep:
            kept.append(line)
    return kept


# ----------------------------------------------------------------------------------------------- the helpers
_STRUCT = re.compile(r"^struct (\w+) \{", re.M)
_HELPER = re.compile(r"^(?:template <[^>\n]*>\n)?[ \t]*(?:static )?__device__ __forceinline__ [\w:<>*& ]*?\b(\w+)\(",
                     re.M)
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\w+|\S')
_COMMENT = re.compile(r'("(?:\\.|[^"\\])*")|//[^\n]*|/\*.*?\*/', re.S)


def _block_end(text: str, start: int) -> int:
    """Index just past the brace that closes the first ``{`` at or after ``start``."""
    depth = 0
    for i in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unbalanced braces")


def device_helpers(text: str) -> dict[str, str]:
    """The helpers a kernel file's text defines: name (``F16::mma`` inside a struct) -> its definition's text."""
    structs = [(m.start(), _block_end(text, m.start()), m.group(1)) for m in _STRUCT.finditer(text)]
    out = {}
    for m in _HELPER.finditer(text):
        owner = next((name for a, b, name in structs if a < m.start() < b), None)
        out[f"{owner}::{m.group(1)}" if owner else m.group(1)] = text[m.start():_block_end(text, m.start())]
    return out


def tokens(code: str) -> tuple[str, ...]:
    """C++ tokens of ``code``: comments and layout dropped, adjacent string literals joined into one."""
    out: list[str] = []
    for tok in _TOKEN.findall(_COMMENT.sub(lambda m: m.group(1) or " ", code)):
        if tok.startswith('"') and out and out[-1].startswith('"'):
            out[-1] = out[-1][:-1] + tok[1:]
        else:
            out.append(tok)
    return tuple(out)


def helper_copies(sources: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Helper name -> {file stem: its definition there}, over ``sources`` (stem -> text; default: the files that
    copy helpers, :func:`copying_files`)."""
    if sources is None:
        sources = {p.stem: p.read_text() for p in copying_files()}
    copies: dict[str, dict[str, str]] = {}
    for stem, text in sources.items():
        for name, definition in device_helpers(text).items():
            copies.setdefault(name, {})[stem] = definition
    return dict(sorted(copies.items()))


def versions(copies: dict[str, str]) -> list[tuple[str, ...]]:
    """The stems of one helper's copies, grouped by equal tokens, in order of first appearance."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for stem, definition in copies.items():
        groups.setdefault(tokens(definition), []).append(stem)
    return [tuple(g) for g in groups.values()]


def known_variant(helper: str) -> KnownVariant | None:
    """The entry of :data:`KNOWN_VARIANTS` that lists ``helper``, if any."""
    return next((v for v in KNOWN_VARIANTS if helper in v.helpers), None)


def unexplained(sources: dict[str, str] | None = None) -> list[str]:
    """Why the helpers' copies do not match :data:`KNOWN_VARIANTS` (empty when they do).

    A helper with one version needs no entry; a helper with more must have exactly the listed versions (each
    group of files restricted to the files defining it), and an entry whose helper has one version is stale."""
    problems = []
    copies = helper_copies(sources)
    for helper, where in copies.items():
        found = {frozenset(g) for g in versions(where)}
        variant = known_variant(helper)
        if variant is None:
            if len(found) > 1:
                problems.append(f"{helper}: {len(found)} different versions ({_groups(found)}) and no entry in "
                                f"KNOWN_VARIANTS; mirror the edit in every copy, or add an entry saying why")
            continue
        expected = {frozenset(g).intersection(where) for g in variant.groups} - {frozenset()}
        if len(found) == 1:
            problems.append(f"{helper}: every copy is the same now; drop it from its KNOWN_VARIANTS entry")
        elif found != expected:
            problems.append(f"{helper}: versions {_groups(found)}, but KNOWN_VARIANTS lists {_groups(expected)}")
    for variant in KNOWN_VARIANTS:
        problems += [f"{h}: in KNOWN_VARIANTS but defined in no kernel file" for h in variant.helpers
                     if h not in copies]
    return problems


def _groups(groups: set[frozenset[str]]) -> str:
    return " | ".join(", ".join(sorted(g)) for g in sorted(groups, key=sorted))


def helpers_report() -> str:
    """Which files share each helper; for a helper with several versions, each version's files, why (from
    :data:`KNOWN_VARIANTS`) and a diff of each version against the first."""
    out = []
    for helper, where in helper_copies().items():
        groups = versions(where)
        if len(groups) == 1:
            out.append(f"{helper}: " + ("1 copy" if len(where) == 1 else f"{len(where)} identical copies")
                       + f" ({', '.join(where)})")
            continue
        variant = known_variant(helper)
        out.append(f"{helper}: {len(groups)} versions")
        for i, g in enumerate(groups):
            out.append(f"  version {i + 1}: {', '.join(g)}")
        out.append("  why: " + (variant.why if variant else "NOT EXPLAINED (see KNOWN_VARIANTS)"))
        first = where[groups[0][0]].splitlines(keepends=True)
        for i, g in enumerate(groups[1:], start=2):
            diff = difflib.unified_diff(first, where[g[0]].splitlines(keepends=True),
                                        fromfile=f"version 1 ({groups[0][0]})", tofile=f"version {i} ({g[0]})", n=1)
            out.extend("    " + line.rstrip("\n") for line in diff)
    problems = unexplained()
    out.append("")
    out.append("unexplained differences: " + ("none" if not problems else f"{len(problems)}"))
    out.extend("  " + p for p in problems)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab.gpu.rungs list | diff A B [-U N] | loop A [B] | helpers``; ``helpers`` exits 1 on a
    difference that KNOWN_VARIANTS does not explain."""
    parser = argparse.ArgumentParser(prog="python -m flashlab.gpu.rungs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every kernel file and what it changes")
    d = sub.add_parser("diff", help="unified diff between two kernel files")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("-U", "--context", type=int, default=3, help="lines of context (default 3)")
    lp = sub.add_parser("loop", help="a kernel file's main loop, or (two files) the diff hunks that touch it")
    lp.add_argument("a")
    lp.add_argument("b", nargs="?")
    sub.add_parser("helpers", help="which files share each device helper, and where copies differ")
    args = parser.parse_args(argv)
    if args.command == "list":
        rows = listing()
        width, named = max(len(f) for f, _, _ in rows), max(len(n) for _, n, _ in rows)
        for file, name, text in rows:
            print(f"{file:<{width}}  {name:<{named}}  {text}")
        return 0
    if args.command == "loop":
        try:
            if args.b is None:
                text = loop_source(args.a)
            else:
                text = "\n".join(loop_hunks(args.a, args.b)) + "\n"
        except ValueError as e:
            parser.error(str(e))
        sys.stdout.write(text)
        return 0
    if args.command == "diff":
        try:
            sys.stdout.write(rung_diff(args.a, args.b, args.context))
        except ValueError as e:
            parser.error(str(e))
        return 0
    sys.stdout.write(helpers_report())
    return 1 if unexplained() else 0


if __name__ == "__main__":
    sys.exit(main())
