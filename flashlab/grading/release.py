"""``python -m flashlab release``: regenerate ``labs/`` from ``solutions/``.

Each code region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes a stub that raises
``NotImplementedError`` at the marker's indentation (the ``def`` line and anything else outside the region stay);
outputs and execution counts are stripped; the Colab badge is pointed at ``labs/``. :func:`compute_release` does
the same in memory, so a test can prove that the committed ``labs/`` equals the release of ``solutions/``.

Options: ``--solutions DIR`` and ``--labs DIR`` (default: the repository's), ``--check`` (write nothing; exit 1
and name the files that differ).
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = ("# YOUR CODE HERE", 'raise NotImplementedError("write your solution here")')
ROOT = pathlib.Path(__file__).resolve().parents[2]


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace every solution region of one cell's source by the stub; raise ValueError on unbalanced markers."""
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}, line {number}: {BEGIN!r} inside another solution region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in STUB]
        elif marker.startswith(END):
            if not inside:
                raise ValueError(f"{where}, line {number}: {END!r} without a {BEGIN!r} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    return "\n".join(out)


def release_notebook(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The student's copy of a solution notebook (a new object; ``nb`` is not modified)."""
    nb = copy.deepcopy(nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, f"{name}, cell {index}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        elif cell.cell_type == "markdown":
            cell.source = cell.source.replace("/blob/main/solutions/", "/blob/main/labs/")
    return nb


def release_text(path: pathlib.Path | str) -> str:
    """The released notebook for the solution at ``path``, as the exact text written to ``labs/``."""
    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    text = nbformat.writes(release_notebook(nb, path.name))
    return text if text.endswith("\n") else text + "\n"


def compute_release(solutions: pathlib.Path | str = ROOT / "solutions") -> dict[str, str]:
    """{file name: released text} for every ``lab*.ipynb`` in ``solutions``."""
    return {p.name: release_text(p) for p in sorted(pathlib.Path(solutions).glob("lab*.ipynb"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab release", description="regenerate labs/ from solutions/")
    parser.add_argument("--solutions", type=pathlib.Path, default=ROOT / "solutions")
    parser.add_argument("--labs", type=pathlib.Path, default=ROOT / "labs")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if labs/ is out of date")
    args = parser.parse_args(argv)
    if not args.solutions.is_dir():
        print(f"error: solutions directory {args.solutions} does not exist", file=sys.stderr)
        return 2
    try:
        wanted = compute_release(args.solutions)
    except (ValueError, nbformat.ValidationError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    current = {p.name: p.read_text() for p in sorted(args.labs.glob("lab*.ipynb"))} if args.labs.is_dir() else {}
    changed = sorted(n for n, text in wanted.items() if current.get(n) != text)
    stale = sorted(set(current) - set(wanted))
    if args.check:
        for n in changed:
            print(f"out of date: {args.labs / n}")
        for n in stale:
            print(f"no solution for: {args.labs / n}")
        return 1 if changed or stale else 0
    args.labs.mkdir(parents=True, exist_ok=True)
    for n in changed:
        (args.labs / n).write_text(wanted[n])
        print(f"wrote {args.labs / n}")
    for n in stale:
        (args.labs / n).unlink()
        print(f"removed {args.labs / n} (no solution notebook)")
    print(f"{len(wanted)} lab(s) released, {len(changed)} updated, {len(stale)} removed")
    return 0
