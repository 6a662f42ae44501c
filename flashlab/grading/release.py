"""``python -m flashlab release``: regenerate ``labs/`` from ``solutions/``.

Each code region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes a stub that raises
``NotImplementedError`` at the marker's indentation (the ``def`` line and anything else outside the region stay);
outputs and execution counts are stripped; the Colab badge is pointed at ``labs/``. :func:`compute_release` does
the same in memory, so a test can prove that the committed ``labs/`` equals the release of ``solutions/``.

Options: ``--solutions DIR`` and ``--labs DIR`` (default: the repository's), ``--check`` (write nothing; exit 1
and name the files that differ).

``--student DIR`` writes what a class gets instead (:func:`release_student`): the chapters (``notebooks/``), the
labs released from ``solutions/``, the whole package (the chapters use it), ``data/`` (the chapters read it), the
README, the requirements, ``environment.yml``, the Makefile and ``pyproject.toml`` — and no ``solutions/``, no
tests (they read the solutions), no ``.git``. Chapter 9 runs there too; the mistakes that need the solved labs
are described instead of run.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import shutil
import sys

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = ("# YOUR CODE HERE", 'raise NotImplementedError("write your solution here")')
ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What a student release holds besides ``labs/``: folders, then files (``requirements*.txt`` are added by glob).
STUDENT_DIRS = ("notebooks", "flashlab", "data", "docs")  # the chapters cite docs/ and CONTRIBUTING.md
STUDENT_FILES = ("README.md", "CONTRIBUTING.md", "environment.yml", "Makefile", "pyproject.toml")
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info", ".pytest_cache")


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


def release_student(dest: pathlib.Path | str, root: pathlib.Path | str = ROOT) -> list[str]:
    """Write the student release of the course at ``root`` into ``dest`` (new or empty); return what it wrote.

    The labs are released afresh from ``root/solutions`` (so a stale ``labs/`` cannot leak a solution); every
    released notebook is checked for solution markers before the call returns.
    """
    root, dest = pathlib.Path(root).resolve(), pathlib.Path(dest).resolve()
    sources = [root / d for d in STUDENT_DIRS] + [root / "solutions", root / "labs"]
    if any(dest == s or s in dest.parents for s in sources):
        raise ValueError(f"{dest} lies inside {root}'s course folders: choose a folder outside them")
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty: the student release goes into a new or empty folder")
    missing = [name for name in (*STUDENT_DIRS, *STUDENT_FILES) if not (root / name).exists()]
    if missing or not (root / "solutions").is_dir():
        raise FileNotFoundError(f"{root} is not the instructor's copy of the course: missing "
                                f"{', '.join(missing + ([] if (root / 'solutions').is_dir() else ['solutions']))}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in STUDENT_DIRS:
        shutil.copytree(root / name, dest / name, ignore=_JUNK)
    for path in [*(root / n for n in STUDENT_FILES), *sorted(root.glob("requirements*.txt"))]:
        shutil.copy2(path, dest / path.name)
    (dest / "labs").mkdir()
    for name, text in compute_release(root / "solutions").items():
        (dest / "labs" / name).write_text(text)
    leaks = [str(p.relative_to(dest)) for p in dest.rglob("*.ipynb") if BEGIN in p.read_text()]
    if leaks:
        raise ValueError(f"solution markers in the student release: {', '.join(leaks)}")
    return sorted(p.name for p in dest.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab release", description="regenerate labs/ from solutions/")
    parser.add_argument("--solutions", type=pathlib.Path, default=ROOT / "solutions")
    parser.add_argument("--labs", type=pathlib.Path, default=ROOT / "labs")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if labs/ is out of date")
    parser.add_argument("--student", type=pathlib.Path, metavar="DIR",
                        help="write what a class gets (chapters, labs, package, data; no solutions) into DIR")
    args = parser.parse_args(argv)
    if args.student is not None:
        try:
            wrote = release_student(args.student, args.solutions.resolve().parent)
        except (ValueError, OSError, nbformat.ValidationError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"student release in {args.student}: {', '.join(wrote)} (no solutions/)")
        return 0
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
