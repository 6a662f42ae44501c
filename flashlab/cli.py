"""``python -m flashlab COMMAND ...``: the course's commands, and every other ``python -m`` entry point, in a table."""

from __future__ import annotations

import importlib
import sys

# One row per entry point: name -> (module, one-line help). A plain name is a command, `python -m flashlab NAME
# ARGS`, which runs MODULE.main(ARGS); a dotted name is a module run on its own, `python -m NAME`, listed so that
# `python -m flashlab --help` shows every way in. Modules are imported only when their command runs, so that
# `python -m flashlab grade` works without CuPy and `bench` without Jupyter.
COMMANDS = {
    "grade": ("flashlab.grading.batch", "grade lab submissions: grade PATH... [--json] [--csv FILE]"),
    "release": ("flashlab.grading.release", "regenerate labs/ from solutions/; release --student DIR: what a class "
                "gets"),
    "html": ("flashlab.site", "execute every chapter and write a static HTML course into build/"),
    "slides": ("flashlab.slides", "build offline reveal.js slides from the cells tagged 'slide' into build/slides"),
    "bench": ("flashlab.bench", "time a result and record it in data/: bench forward|backward|decode|memory|train|"
              "host|cpu|tune|profile|ring|sparse"),
    "selfcheck": ("flashlab.gpu.selfcheck", "every GPU kernel once at small ragged shapes against a reference: the "
                  "run to put under compute-sanitizer"),
    "mistakes": ("flashlab.mistakes", "every mistake the graders know, graded: mistakes [--seeds N] [--labs ...] "
                 "[--simulator] (the seed sweep) | --record (chapter 9's recorded lab 06 reports)"),
    "rungs": ("flashlab.gpu.rungs", "the kernel files side by side: rungs list | diff A B (what rung B changes) | "
              "loop A [B] (a kernel's main loop, or what B changes in it) | helpers"),
    "flashlab.numba_cuda": ("flashlab.numba_cuda", "check chapter 5's Numba CUDA forward in the simulator "
                            "(or --gpu), print JSON"),
}


def usage(commands: dict[str, tuple[str, str]] = COMMANDS, prog: str = "python -m flashlab",
          word: str = "COMMAND") -> str:
    """The help text: one line per row of ``commands``, commands first, then the modules run on their own."""
    width = max(len(name) for name in commands if "." not in name)
    lines = [f"usage: {prog} {word} [ARGS...]  ({prog} {word} --help: its arguments)", "", f"{word.lower()}s:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in commands.items() if "." not in name]
    modules = [(name, text) for name, (_, text) in commands.items() if "." in name]
    if modules:
        lines += ["", "run on their own (python -m MODULE ...):"]
        lines += [f"  {name}\n      {text}" for name, text in modules]
    return "\n".join(lines)


def dispatch(commands: dict[str, tuple[str, str]], argv: list[str], prog: str, word: str = "COMMAND") -> int:
    """Run ``commands[argv[0]]``'s module's ``main(argv[1:])``; print the usage for -h, --help or nothing."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(commands, prog, word))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in commands or "." in command:
        print(f"unknown {word.lower()} {command!r}\n\n{usage(commands, prog, word)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[command][0])
    return int(module.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab COMMAND [ARGS...]``."""
    return dispatch(COMMANDS, sys.argv[1:] if argv is None else list(argv), "python -m flashlab")
