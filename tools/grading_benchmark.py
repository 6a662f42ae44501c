"""What the grading sandbox costs: grade one class of N notebooks sandboxed and with ``--no-sandbox``.

    PYTHONPATH=. python tools/grading_benchmark.py [--n 100] [--lab lab01] [--jobs 2] [--timeout 300]

Builds N submissions of one lab in a temporary folder (honest and wrong ones mixed: for lab 01 the solution and
the solution without the rescale; for the other labs the solution and the released stub), grades the folder
with ``python -m flashlab grade DIR --json --jobs J`` once sandboxed (the default) and once with
``--no-sandbox``, and prints both wall times and their ratio (CONTRIBUTING.md, "Labs and grading", sets the
budget: the sandboxed run at most 20% slower). Both runs use the same ``--seed`` when the grader has it, and
must give the same scores. Writes nothing into the repository.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from redteam import attacks as A  # noqa: E402
from redteam import harness as H  # noqa: E402


def build(folder: pathlib.Path, n: int, lab: str) -> None:
    """N notebooks ``student001.ipynb``..., every third one wrong; each differs by a comment line."""
    folder.mkdir(parents=True)
    if lab == A.LAB:
        ctx = A.Context(folder=folder, outside=folder.parent, decoy_pid=0, marker="bench", port=0)
        kinds = [A.honest(ctx), A.wrong(ctx)]
    else:
        kinds = [json.loads(next((ROOT / top).glob(f"{lab}_*.ipynb")).read_text()) for top in ("solutions", "labs")]
    for i in range(n):
        nb = json.loads(json.dumps(kinds[1 if i % 3 == 2 else 0]))
        nb["cells"][0]["source"] = f"<!-- student {i + 1:03d} -->\n" + "".join(nb["cells"][0]["source"])
        (folder / f"student{i + 1:03d}.ipynb").write_text(json.dumps(nb, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="notebooks in the class (100)")
    parser.add_argument("--lab", default=A.LAB, help="the lab (lab01)")
    parser.add_argument("--jobs", type=int, default=2, help="--jobs of both runs (2)")
    parser.add_argument("--timeout", type=float, default=300, help="--timeout per submission (300)")
    parser.add_argument("--seed", type=int, default=1, help="--seed of both runs, where the grader has it (1)")
    args = parser.parse_args(argv)

    helptext = H.grader_options()
    options = ["--lab", args.lab, "--jobs", str(args.jobs), "--timeout", str(args.timeout)]
    if "--seed" in helptext:
        options += ["--seed", str(args.seed)]
    else:
        print("note: this grader has no --seed: partial credit may differ between the runs", flush=True)
    with tempfile.TemporaryDirectory(prefix="flashlab-bench-") as tmp:
        folder = pathlib.Path(tmp) / "class"
        build(folder, args.n, args.lab)
        print(f"{args.n} notebooks of {args.lab}, --jobs {args.jobs}", flush=True)
        runs: dict[str, H.Graded] = {}
        if "--no-sandbox" in helptext:
            modes = {"sandboxed": [], "--no-sandbox": ["--no-sandbox"]}
        else:
            modes = {"default": []}
            print("this grader has no --no-sandbox option: only its default run is timed (no ratio)", flush=True)
        for mode, extra in modes.items():
            runs[mode] = graded = H.grade(folder, options + extra, cwd=pathlib.Path(tmp), timeout=args.n * 600)
            errors = sum(1 for r in graded.rows.values() if r.get("error"))
            print(f"{mode:>13}: {graded.seconds:8.1f} s  ({len(graded.rows)} rows, {errors} errors, "
                  f"exit {graded.returncode})", flush=True)
            if graded.returncode != 0 or len(graded.rows) != args.n:
                print(graded.stderr[-2000:], file=sys.stderr)
                return 1
    if len(runs) == 2:
        boxed, plain = runs["sandboxed"], runs["--no-sandbox"]
        ratio = boxed.seconds / plain.seconds
        print(f"ratio sandboxed / --no-sandbox: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
        same = all(H.scores(boxed.rows[k]) == H.scores(plain.rows.get(k, {})) for k in boxed.rows)
        print("scores identical in both runs" if same else "scores differ between the runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
