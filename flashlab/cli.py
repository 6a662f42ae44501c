"""``python -m flashlab COMMAND ...``: one entry point; each command's module owns its own arguments."""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help). Modules are imported only when their command runs, so that
# `python -m flashlab grade` works without CuPy and `bench` without Jupyter.
COMMANDS = {
    "grade": ("flashlab.grading.batch", "grade lab submissions: grade PATH... [--json] [--csv FILE]"),
    "release": ("flashlab.grading.release", "regenerate labs/ from solutions/"),
    "html": ("flashlab.site", "execute every chapter and write a static HTML course into build/"),
    "slides": ("flashlab.slides", "build offline reveal.js slides from the cells tagged 'slide' into build/slides"),
    "bench": ("flashlab.bench", "run the GPU benchmarks and write data/benchmarks/*.json"),
}


def usage() -> str:
    lines = ["usage: python -m flashlab COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)
