"""data/README.md indexes data/: exactly the files there, who reads each, and what regenerates it.

Readers are chapters, tests, package modules and the notes in docs/. A reader listed for a file must name it (its
path under data/, with or without the extension); a chapter, test or doc that names a file must be listed as its
reader. The make target listed for a file must write it (read from ``make -n``, whose `python -m flashlab bench`
commands are parsed by the benchmarks' own parsers); a file no target makes is regenerated "by hand" by the
commands the index quotes, which must parse and write it the same way. The command recorded in each file's
provenance must still parse, translated to today's entry point.
"""

from __future__ import annotations

import functools
import importlib
import json
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

import flashlab.gpu as fgpu
from flashlab import records
from flashlab.bench import KINDS
from flashlab.bench import profile as bench_profile
from flashlab.gpu import selfcheck

DATA = records.DATA_DIR
ROOT = records.ROOT
ROW = re.compile(r"^\| `([^`]+)` \| (.*) \| (.*) \|$")
# where a reader may live: the chapters, the tests, the package, the notes for readers
READER_DIRS = ("notebooks/", "tests/", "flashlab/", "docs/")
# the modules that made today's records, before `python -m flashlab bench KIND`
EARLIER = {
    "flashlab.gpu.bench8 bwd": "backward",
    "flashlab.gpu.bench8 decode": "decode",
    "flashlab.gpu.bench8 memory": "memory",
    "flashlab.gpu.bench8 train": "train",
    "flashlab.cpu_bench": "cpu",
    "flashlab.gpu.tune": "tune",
    "flashlab.gpu.profile": "profile",
}


@functools.cache
def index() -> dict[str, tuple[tuple[str, ...], str]]:
    """file (relative to data/) -> (its readers, relative to the repository; how it is regenerated)."""
    rows = {}
    for line in (DATA / "README.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            readers = tuple(r for r in re.findall(r"`([^`]+)`", m[2]) if "/" in r and "(" not in r)
            rows[m[1]] = (readers, m[3])
    return rows


def text_of(path: pathlib.Path, code_only: bool = False) -> str:
    """A file's text; for a notebook, the source of its cells (code cells only if ``code_only``)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if not code_only or c["cell_type"] == "code")


def names(name: str, text: str) -> bool:
    """Whether ``text`` names the data file ``name`` (e.g. "benchmarks/ladder" or "benchmarks/ladder.json")."""
    stem = name.rsplit(".", 1)[0]
    return re.search(re.escape(stem) + r"(\.\w+)?(?![\w-])", text) is not None


def test_index_lists_exactly_the_files_in_data():
    files = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file() and p.name != "README.md"}
    assert set(index()) == files


@pytest.mark.parametrize("name", sorted(index()))
def test_every_listed_reader_names_the_file(name):
    readers, _ = index()[name]
    assert readers, f"{name}: nothing reads it"
    for reader in readers:
        assert reader.startswith(READER_DIRS), f"{name}: {reader} is not a chapter, test, module or doc"
        path = ROOT / reader
        assert path.is_file(), (name, reader)
        assert names(name, text_of(path)), f"{reader} does not name {name}"


def test_every_chapter_test_and_doc_that_names_a_file_is_listed_as_its_reader():
    sources = (sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "tests").glob("test_*.py"))
               + sorted((ROOT / "docs").rglob("*.md")))
    sources.remove(pathlib.Path(__file__))  # this file names no record: it reads the index
    missing = [(src.relative_to(ROOT).as_posix(), name) for src in sources for name in index()
               if names(name, text_of(src, code_only=True))
               and src.relative_to(ROOT).as_posix() not in index()[name][0]]
    assert not missing


# --------------------------------------------------------------------------------- what regenerates each file
def parse(kind: str, argv: list[str]):
    """``python -m flashlab bench KIND ARGV``'s arguments, parsed as the benchmark parses them (an option it no
    longer takes fails here); None for ``profile summarize`` and ``profile provenance``."""
    if kind == "profile" and argv[:1] in (["summarize"], ["provenance"]):
        return None
    return importlib.import_module(KINDS[kind][0]).parser().parse_args(argv)


def written_by(kind: str, argv: list[str]) -> list[str]:
    """The files under data/ that ``python -m flashlab bench KIND ARGV`` writes."""
    args = parse(kind, argv)
    if args is None:
        return []  # printed to standard output
    if kind == "cpu":
        out = [importlib.import_module(KINDS[kind][0]).OUT_DIR / f"{args.record}.json"] if args.record else []
    elif kind == "tune":
        out = [] if args.no_write else [pathlib.Path(args.out) / f"tune_{args.rung}.json"]
    elif kind == "profile":
        out = []
    else:
        out = [] if args.no_write or args.table else [pathlib.Path(args.out) / f"{args.name}.json"]
    return [p.resolve().relative_to(DATA).as_posix() for p in out]


def invocations(command: str, prefix: str = "-m flashlab bench ") -> list[list[str]]:
    """The words after each ``PREFIX`` in a shell command line, up to the end of that command."""
    return [shlex.split(re.split(r";|\|\||&&|>|\|", part, maxsplit=1)[0]) for part in command.split(prefix)[1:]]


def check_selfcheck(argv: list[str]) -> None:
    """Fail unless ``python -m flashlab selfcheck ARGV`` names a part it has, and rungs and options that exist."""
    words = [w for w in argv if not w.startswith("-")]
    assert not words or words[0] in selfcheck.PARTS, argv
    assert set(words[1:]) <= {*fgpu.RUNGS, *fgpu.HOPPER_RUNGS}, argv  # the forward rungs selfcheck takes
    assert set(argv) - set(words) <= {"--quick"}, argv


def command_writes(command: str) -> set[str]:
    """The files under data/ that one shell command line writes: its benchmarks' outputs and its redirections.
    Its `python -m flashlab bench` and `python -m flashlab selfcheck` invocations must parse."""
    written = {m[1] for m in re.finditer(r">\s*data/(\S+)", command)}
    for kind, *argv in invocations(command):
        written.update(written_by(kind, argv))
    for argv in invocations(command, prefix="-m flashlab selfcheck"):
        check_selfcheck(argv)
    return written


@functools.cache
def make_writes(target: str) -> frozenset[str]:
    """The files under data/ that ``make TARGET`` writes."""
    res = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    written = set()
    for line in res.stdout.replace("\\\n", " ").splitlines():
        written.update(command_writes(line))
    return frozenset(written)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("name", sorted(index()))
def test_the_listed_make_target_regenerates_the_file(name):
    _, how = index()[name]
    targets = re.findall(r"`make ([\w-]+)`", how)
    if how.startswith("by hand"):
        # the package's own commands, or its GPU tests run under a tool (a sanitizer log of the tests that reach a
        # path the selfcheck's shapes do not); the test files named must exist
        commands = [c for c in re.findall(r"`([^`]+)`", how) if "-m flashlab " in c or "-m pytest " in c]
        assert commands and not targets, how
        for test_file in (f for c in commands for f in re.findall(r"tests/test_\w+\.py", c)):
            assert (ROOT / test_file).is_file(), (name, test_file)
        assert name in set().union(*map(command_writes, commands)), (name, commands)
        return
    if not targets:
        assert how.startswith("not generated") and "source" in records.read_record(name), how
        return
    assert len(targets) == 1, how
    assert name in make_writes(targets[0]), (name, targets[0], sorted(make_writes(targets[0])))


@pytest.mark.parametrize("name", sorted(n for n in index() if n.endswith(".json")))
def test_recorded_commands_still_parse(name):
    prov = records.read_record(name).get("provenance", {})
    commands = [prov.get("command", "")] + list(prov.get("commands", {}).values())
    parsed = 0
    for command in filter(None, commands):
        for earlier, kind in EARLIER.items():
            for argv in invocations(command, prefix=f"-m {earlier} "):
                parse(kind, argv)
                parsed += 1
        for argv in invocations(command):
            # `python -m flashlab bench --repeat ...` (no kind) ran the forward benchmark
            kind, argv = ("forward", argv) if argv[0].startswith("-") else (argv[0], argv[1:])
            parse(kind, argv)
            parsed += 1
    for target in (m[1] for c in commands if (m := re.fullmatch(r"make ([\w-]+)", c))):
        # a record made by a make target (its own provenance says which): that target, as make -n prints it today,
        # must be the one the index lists and write the file
        assert f"`make {target}`" in index()[name][1], (name, target)
        assert name in make_writes(target), (name, target)
        parsed += 1
    assert parsed or index()[name][1].startswith("not generated"), f"{name}: no benchmark command in its provenance"


def test_profile_parser_takes_the_recorded_ncu_arguments():
    args = bench_profile.parser().parse_args(["--impl", "lean", "--d", "128", "--n", "2048", "--batch", "8"])
    assert (args.impl, args.d, args.n, args.batch, args.heads, args.causal) == ("lean", 128, 2048, 8, 16, False)
