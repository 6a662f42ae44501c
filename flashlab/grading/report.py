"""What ``python -m flashlab grade`` reports: the table it prints, ``--csv FILE``, ``--json``, and a gradebook folder.

The grader (:mod:`flashlab.grading.batch`) turns each submission into a *row*: ``{"path", "lab", "score",
"max_score", "questions": [{"name", "score", "max_score", "feedback", "seed", "diagnoses"}], "error"}``, plus
``"seed"`` and ``"sandboxed"`` where the grader records them. This module only reads rows.

``--out DIR`` writes a gradebook folder:

* ``DIR/labNN.csv`` — one row per student: ``id``, one column per question, ``total``, ``max_score``, ``seed``,
  ``sandboxed``, ``grader_version`` (package version + a hash of the grader's source: a regrade by a changed grader
  shows), ``graded_at``, ``error``, ``submission``. A submission that could not be graded keeps its lab and maximum;
  a student of the roster without a submission gets a row with the error ``no submission``;
* ``DIR/feedback/<id>.md`` — what the student gets back: per lab the score, each question's points and feedback,
  the seed and the ``check(...)`` line that replays it, the error if any;
* ``DIR/summary.md`` and ``DIR/summary.json`` — per lab and question the mean and a histogram of the points, how
  many students made each diagnosed mistake, and every problem met while matching submissions to students.

A student's id comes from the submission's file name through ``--id-pattern REGEX`` (the group named ``id``, else
the first group, else the whole match; a pattern containing ``/`` is matched against the whole path, so that
``submissions/alice/lab01.ipynb`` can give ``alice``), or from ``--roster FILE``: a CSV with a column ``id`` and,
per student, a ``file`` (the submission's file name, or a path ending) or a ``pattern`` (a regular expression
searched in the file name); a roster row with neither matches the submission whose id (by ``--id-pattern``, else
the file name without ``.ipynb``) is its id. Without either, the id is the file name without ``.ipynb``. Two
submissions with one id for one lab are an error, never an overwrite: the student's row says so and keeps no score.
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import functools
import hashlib
import importlib.util
import json
import pathlib
import re
import sys
from dataclasses import dataclass, field

from .. import __version__
from .core import available_labs, get_lab

NO_SUBMISSION = "no submission"
_LAB_PREFIX = re.compile(r"^(lab\d{2,})")
HISTOGRAM_WIDTH = 40  # characters of the longest bar in summary.md


def utc_now() -> str:
    """The time a grading run is stamped with, e.g. ``2026-11-30T21:50:00Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------- the console
def _question_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(lab, question) pairs in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        for q in row["questions"]:
            seen[(row["lab"], q["name"])] = None
    return list(seen)


def summary(rows: list[dict]) -> str:
    """Mean score per question and of the total, per lab (the last lines ``grade`` prints)."""
    lines = []
    by_lab: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_lab[row["lab"] or "(no lab)"].append(row)
    for lab_id, group in by_lab.items():
        parts = []
        for _, name in _question_columns(group):
            scores = [q for r in group for q in r["questions"] if q["name"] == name]
            mean = sum(q["score"] for q in scores) / len(scores)
            parts.append(f"{name} {mean:.2f}/{scores[0]['max_score']:g}")
        total = sum(r["score"] for r in group) / len(group)
        errors = sum(1 for r in group if r["error"])
        unsandboxed = sum(1 for r in group if r.get("sandboxed") is False)
        top = max((r["max_score"] for r in group), default=0)
        note = f", {unsandboxed} graded without the sandbox" if unsandboxed else ""
        lines.append(
            f"{lab_id}: {len(group)} submission(s), {errors} with errors{note}; mean "
            + ", ".join(parts + [f"total {total:.2f}/{top:g}"])
        )
    return "\n".join(lines)


def table(rows: list[dict], feedback: bool = False) -> str:
    """One line per submission (path, lab, score, points per question); ``feedback`` adds what was lost."""
    width = max([len("submission")] + [len(r["path"]) for r in rows])
    lines = [f"{'submission':<{width}}  {'lab':<6} {'score':>11}  questions"]
    for r in rows:
        qs = "  ".join(f"{q['name']} {q['score']:g}/{q['max_score']:g}" for q in r["questions"])
        lines.append(f"{r['path']:<{width}}  {r['lab'] or '-':<6} {r['score']:>5g}/{r['max_score']:<5g}  {qs}")
        if r["error"]:
            lines.append(f"{'':<{width}}  error: {r['error']}")
        elif feedback:
            for q in r["questions"]:
                if q["score"] < q["max_score"]:
                    indented = q["feedback"].replace("\n", "\n" + " " * (width + 6))
                    lines.append(f"{'':<{width}}  {q['name']}: {indented}")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    """``--csv FILE``: one row per submission (student = file stem), a column per question, and the total."""
    columns = _question_columns(rows)
    one_lab = len({lab for lab, _ in columns}) <= 1
    heads = [name if one_lab else f"{lab}.{name}" for lab, name in columns]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "path", "lab", *heads, "total", "max_score", "error"])
        for r in rows:
            got = {(r["lab"], q["name"]): q["score"] for q in r["questions"]}
            w.writerow([pathlib.Path(r["path"]).stem, r["path"], r["lab"] or "",
                        *[got.get(c, "") for c in columns], r["score"], r["max_score"], r["error"] or ""])


def seed_text(row: dict) -> str:
    """The seed a row was graded with: the run's, else the questions' (``q1=5 q2=9`` when they differ)."""
    if row.get("seed") is not None:
        return str(row["seed"])
    seeds = {q["name"]: q.get("seed") for q in row.get("questions", []) if q.get("seed") is not None}
    if len(set(seeds.values())) == 1:
        return str(next(iter(seeds.values())))
    return " ".join(f"{name}={seed}" for name, seed in seeds.items())


def _yes_no(flag: bool | None) -> str:
    return "" if flag is None else ("yes" if flag else "no")


# ------------------------------------------------------------------------------------------- who is who
@dataclass
class RosterEntry:
    """One student of a roster: ``file`` or ``pattern`` finds their submission; neither means "by id"."""

    id: str
    file: str = ""
    pattern: re.Pattern | None = None


def compile_id_pattern(text: str) -> re.Pattern:
    """``--id-pattern``: a regular expression; raises ValueError with a readable reason."""
    try:
        pattern = re.compile(text)
    except re.error as e:
        raise ValueError(f"--id-pattern {text!r} is not a regular expression: {e}") from e
    if pattern.groups > 1 and "id" not in pattern.groupindex:
        raise ValueError(f"--id-pattern {text!r} has {pattern.groups} groups: name the id's group (?P<id>...)")
    return pattern


def id_from_path(path: str, pattern: re.Pattern | None) -> str | None:
    """The student id in a submission's path: the file stem without a pattern, else the pattern's id (or None)."""
    p = pathlib.PurePath(path)
    if pattern is None:
        return p.stem
    match = pattern.search(p.as_posix() if "/" in pattern.pattern else p.name)
    if match is None:
        return None
    found = match.group("id") if "id" in pattern.groupindex else match.group(1 if pattern.groups else 0)
    return found or None


def read_roster(path: str | pathlib.Path) -> list[RosterEntry]:
    """A roster CSV: a column ``id``, and ``file`` and/or ``pattern`` (optional). Raises ValueError on any doubt."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            heads = {(h or "").strip().lower(): h for h in reader.fieldnames or []}
            if "id" not in heads:
                raise ValueError(f"roster {path}: no column 'id' (columns: {', '.join(heads) or 'none'})")
            entries, seen = [], set()
            for line, rec in enumerate(reader, start=2):
                value = {k: (rec.get(h) or "").strip() for k, h in heads.items()}
                if not any(value.values()):
                    continue
                sid = value["id"]
                if not sid:
                    raise ValueError(f"roster {path}, line {line}: empty id")
                if sid in seen:
                    raise ValueError(f"roster {path}, line {line}: id {sid!r} appears twice")
                seen.add(sid)
                try:
                    pattern = re.compile(value["pattern"]) if value.get("pattern") else None
                except re.error as e:
                    raise ValueError(f"roster {path}, line {line}: pattern {value['pattern']!r}: {e}") from e
                entries.append(RosterEntry(sid, value.get("file", ""), pattern))
    except OSError as e:
        raise ValueError(f"cannot read the roster {path}: {e.strerror or e}") from e
    return entries


def _roster_matches(entry: RosterEntry, path: str, derived_id: str | None) -> bool:
    p = pathlib.PurePath(path)
    if entry.file:
        wanted = pathlib.PurePath(entry.file)
        return p.parts[-len(wanted.parts):] == wanted.parts
    if entry.pattern is not None:
        return entry.pattern.search(p.name) is not None
    return derived_id == entry.id


def identify(path: str, *, id_pattern: re.Pattern | None = None,
             roster: list[RosterEntry] | None = None) -> tuple[str | None, str]:
    """(student id, "") for a submission's path, or (None, why it belongs to no student)."""
    derived = id_from_path(path, id_pattern)
    if roster is None:
        return (derived, "") if derived else (None, "its file name does not match --id-pattern")
    found = [e.id for e in roster if _roster_matches(e, path, derived)]
    if len(found) == 1:
        return found[0], ""
    if found:
        return None, f"it matches several students of the roster: {', '.join(found)}"
    return None, "not in the roster" + (f" (id {derived!r})" if derived else "")


# ------------------------------------------------------------------------------------------- the gradebook
@functools.lru_cache(maxsize=None)
def grader_version(lab_id: str) -> str:
    """``<package version>+<hash>``: the hash covers the lab's grader module and the grading core."""
    digest = hashlib.sha256()
    for module in (f"flashlab.grading.{lab_id}", "flashlab.grading.core"):
        spec = importlib.util.find_spec(module)
        digest.update(pathlib.Path(spec.origin).read_bytes() if spec and spec.origin else module.encode())
    return f"{__version__}+{digest.hexdigest()[:12]}"


@dataclass
class Student:
    """One gradebook row: a student of one lab and the submissions that carry their id (normally exactly one)."""

    id: str
    lab: str
    rows: list[dict] = field(default_factory=list)

    @property
    def row(self) -> dict | None:
        """The graded row, or None for no submission or several."""
        return self.rows[0] if len(self.rows) == 1 else None

    @property
    def error(self) -> str:
        if not self.rows:
            return NO_SUBMISSION
        if len(self.rows) > 1:
            names = ", ".join(r["path"] for r in self.rows)
            return f"{len(self.rows)} submissions carry this id ({names}): none is counted; rename or fix the roster"
        return self.rows[0]["error"] or ""


@dataclass
class Gradebook:
    """Rows sorted into labs and students, and what could not be sorted (reported, never dropped silently)."""

    students: dict[str, list[Student]]  # lab -> students, in id order
    unmatched: list[tuple[dict, str]]  # (row, why) of submissions that belong to no student or no lab
    duplicates: list[Student]
    graded_at: str

    @property
    def problems(self) -> list[str]:
        out = [f"{s.lab} {s.id}: {s.error}" for s in self.duplicates]
        out += [f"{r['path']} ({r['lab'] or 'no lab'}, {r['score']:g}/{r['max_score']:g}): {why}"
                for r, why in self.unmatched]
        return out


def _placed(row: dict, lab_id: str) -> dict:
    """An error row that had no lab, put into ``lab_id`` with its questions at 0 and the lab's maximum."""
    lab = get_lab(lab_id)
    questions = [{"name": q.name, "score": 0.0, "max_score": q.points, "feedback": row["error"] or ""}
                 for q in lab.questions.values()]
    return {**row, "lab": lab_id, "score": 0.0, "max_score": lab.max_score, "questions": questions}


def _lab_of_unreadable(row: dict, labs: set[str], known: set[str]) -> str | None:
    # An unreadable notebook has no lab: its name prefix, or the only lab of the run, still tells it.
    prefix = _LAB_PREFIX.match(pathlib.PurePath(row["path"]).name)
    if prefix and prefix.group(1) in known:
        return prefix.group(1)
    return next(iter(labs)) if len(labs) == 1 else None


def build(rows: list[dict], *, id_pattern: re.Pattern | None = None, roster: list[RosterEntry] | None = None,
          lab_id: str | None = None, graded_at: str | None = None) -> Gradebook:
    """Sort graded rows into labs and students (see the module docstring for how ids are found)."""
    graded_at = graded_at or utc_now()
    known = set(available_labs())
    labs = {r["lab"] for r in rows if r["lab"] in known} | ({lab_id} if lab_id else set())
    by_lab: dict[str, dict[str, Student]] = collections.defaultdict(dict)
    unmatched: list[tuple[dict, str]] = []
    for row in rows:
        if row["lab"] not in known:
            guess = _lab_of_unreadable(row, labs, known)
            if guess is None:
                unmatched.append((row, "cannot tell which lab it belongs to: " + (row["error"] or "")))
                continue
            row = _placed(row, guess)
        sid, why = identify(row["path"], id_pattern=id_pattern, roster=roster)
        if sid is None:
            unmatched.append((row, why))
            continue
        by_lab[row["lab"]].setdefault(sid, Student(sid, row["lab"])).rows.append(row)
    for lab in labs | set(by_lab):
        for entry in roster or []:
            by_lab[lab].setdefault(entry.id, Student(entry.id, lab))
    students = {lab: [by_lab[lab][sid] for sid in sorted(by_lab[lab])] for lab in sorted(by_lab)}
    duplicates = [s for group in students.values() for s in group if len(s.rows) > 1]
    return Gradebook(students, unmatched, duplicates, graded_at)


def lab_table(book: Gradebook, lab_id: str) -> tuple[list[str], list[list]]:
    """The header and rows of ``labNN.csv``."""
    questions = list(get_lab(lab_id).questions)
    head = ["id", *questions, "total", "max_score", "seed", "sandboxed", "grader_version", "graded_at", "error",
            "submission"]
    version, maximum = grader_version(lab_id), get_lab(lab_id).max_score
    out = []
    for s in book.students[lab_id]:
        row = s.row
        if row is None and s.rows:  # several submissions: no score is the student's
            cells = [s.id, *[""] * len(questions), "", maximum, "", "", version, book.graded_at, s.error,
                     " ".join(r["path"] for r in s.rows)]
        elif row is None:
            cells = [s.id, *[0] * len(questions), 0, maximum, "", "", version, book.graded_at, s.error, ""]
        else:
            got = {q["name"]: q["score"] for q in row["questions"]}
            cells = [s.id, *[got.get(q, "") for q in questions], row["score"], row["max_score"], seed_text(row),
                     _yes_no(row.get("sandboxed")), version, book.graded_at, s.error, row["path"]]
        out.append(cells)
    return head, out


def _replay(lab_id: str, question: dict, row: dict) -> str:
    seed = question.get("seed", row.get("seed"))
    if seed is None:
        return ""
    q = get_lab(lab_id).questions.get(question["name"])
    objects = ", ".join(q.objects) if q else "..."
    return f'Replay it in your notebook: `check("{question["name"]}", {objects}, seed={seed})`'


def feedback_markdown(student_id: str, students: list[Student], graded_at: str) -> str:
    """The file a student gets back: per lab, the score, each question's points and feedback, how to replay."""
    lines = [f"# Feedback for {student_id}", ""]
    for s in students:
        lab = get_lab(s.lab)
        lines += [f"## {s.lab} — {lab.title}".rstrip(" —"), ""]
        stamp = f"Graded {graded_at} by flashlab {grader_version(s.lab)}."
        if not s.rows:
            lines += [f"No submission was received for {s.lab}: 0 / {lab.max_score:g} points.", "", stamp, ""]
            continue
        if s.row is None:
            lines += [f"Not counted: {s.error}", "", stamp, ""]
        for row in s.rows:
            seed = seed_text(row)
            lines += [f"**Score: {row['score']:g} / {row['max_score']:g} points** "
                      f"(submission `{pathlib.PurePath(row['path']).name}`)", "",
                      stamp[:-1] + (f", with seed {seed} (each question's inputs come from a seed of its own, "
                                    "derived from it: the one its replay line gives)." if seed else "."), ""]
            if row["error"]:
                lines += ["Your notebook could not be graded completely:", "", "```text", row["error"], "```", ""]
            elif row.get("notebook_error"):  # graded, but a cell failed: worth knowing even at full marks
                lines += ["A cell of your notebook failed (its first error):", "", "```text", row["notebook_error"],
                          "```", ""]
            for q in row["questions"]:
                lines += [f"### {q['name']}: {q['score']:g} / {q['max_score']:g} points", ""]
                if q["feedback"] and q["feedback"] != row["error"]:
                    lines += ["```text", q["feedback"], "```", ""]
                replay = _replay(s.lab, q, row)
                if replay and not row["error"] and q["score"] < q["max_score"]:
                    lines += [replay, ""]
    return "\n".join(lines).rstrip() + "\n"


def _file_name(student_id: str, taken: set[str]) -> str:
    # Ids come from file names and rosters: keep them from naming a path outside feedback/.
    base = re.sub(r"[^\w.-]", "_", student_id).lstrip(".") or "student"
    name, n = base, 1
    while name.lower() in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name.lower())
    return name + ".md"


# ----------------------------------------------------------------------------------------- the class summary
def histogram(points: list[float], max_score: float, bins: int = 10) -> list[dict]:
    """Counts of points: one bar per value when there are few distinct values, else ``bins`` equal ranges."""
    values = sorted(set(points))
    if len(values) <= bins + 1:
        return [{"from": v, "to": v, "count": points.count(v)} for v in values]
    width = max_score / bins if max_score > 0 else 1.0
    out = []
    for i in range(bins):
        lo, hi = i * width, (i + 1) * width
        last = i == bins - 1
        count = sum(1 for p in points if lo <= p < hi or (last and p >= hi))
        out.append({"from": round(lo, 3), "to": round(hi, 3), "count": count})
    return out


def class_summary(book: Gradebook) -> dict:
    """Per lab: counts, mean total, and per question mean, histogram and diagnosed mistakes (students per title)."""
    labs = {}
    for lab_id, students in book.students.items():
        graded = [s.row for s in students if s.row is not None]
        lab = get_lab(lab_id)
        questions = {}
        for name, q in lab.questions.items():
            results = [r for row in graded for r in row["questions"] if r["name"] == name]
            points = [r["score"] for r in results]
            mistakes = collections.Counter(t for r in results for t in set(r.get("diagnoses") or ()))
            questions[name] = {
                "max_score": q.points,
                # lost points with no mistake named: the feedback says what is known; a teacher should read it
                "undiagnosed": sum(1 for row in graded if not row["error"] for r in row["questions"]
                                   if r["name"] == name and r["score"] < r["max_score"] and not r.get("diagnoses")),
                "mean": round(sum(points) / len(points), 3) if points else None,
                "histogram": histogram(points, q.points),
                "mistakes": dict(mistakes.most_common()),
            }
        totals = [row["score"] for row in graded]
        labs[lab_id] = {
            "title": lab.title,
            "grader_version": grader_version(lab_id),
            "max_score": lab.max_score,
            "students": len(students),
            "graded": len(graded),
            "errors": sum(1 for row in graded if row["error"]),
            "no_submission": sum(1 for s in students if not s.rows),
            "duplicates": sum(1 for s in students if len(s.rows) > 1),
            "unsandboxed": sum(1 for row in graded if row.get("sandboxed") is False),
            "mean_total": round(sum(totals) / len(totals), 3) if totals else None,
            "total_histogram": histogram(totals, lab.max_score),
            "questions": questions,
        }
    return {"graded_at": book.graded_at, "labs": labs, "problems": book.problems}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _bars(hist: list[dict]) -> list[str]:
    top = max((h["count"] for h in hist), default=0) or 1
    labels = [f"{h['from']:g}" if h["from"] == h["to"] else f"{h['from']:g}-{h['to']:g}" for h in hist]
    width = max((len(label) for label in labels), default=0)
    return [f"  {label:>{width}} | {'#' * round(HISTOGRAM_WIDTH * h['count'] / top)} {h['count']}"
            for label, h in zip(labels, hist, strict=True)]


def summary_markdown(data: dict) -> str:
    """``summary.md``: :func:`class_summary` for a reader."""
    lines = ["# Class summary", "", f"Graded {data['graded_at']}.", ""]
    for lab_id, lab in data["labs"].items():
        mean = "-" if lab["mean_total"] is None else f"{lab['mean_total']:g}"
        lines += [f"## {lab_id} — {lab['title']}".rstrip(" —"), "",
                  f"{_count(lab['students'], 'student')}, {lab['graded']} graded ({lab['errors']} with errors), "
                  f"{lab['no_submission']} without a submission, {lab['duplicates']} with several; "
                  f"mean {mean} / {lab['max_score']:g}. Grader {lab['grader_version']}.", ""]
        if lab["unsandboxed"]:
            lines += [f"**{lab['unsandboxed']} submission(s) were graded without the sandbox.**", ""]
        lines += ["Means and histograms count graded submissions (one that failed to run scores 0); students "
                  "without a submission are left out.", "", "Total:", "", "```text", *_bars(lab["total_histogram"]),
                  "```", ""]
        for name, q in lab["questions"].items():
            qmean = "-" if q["mean"] is None else f"{q['mean']:g}"
            lines += [f"### {name}: mean {qmean} / {q['max_score']:g}", "", "```text", *_bars(q["histogram"]),
                      "```", ""]
            if q["mistakes"] or q.get("undiagnosed"):
                lines += ["Diagnosed mistakes (students):", ""]
                lines += [f"- {count} × {title}" for title, count in q["mistakes"].items()]
                if q.get("undiagnosed"):
                    lines.append(f"- {q['undiagnosed']} × lost points with no mistake named (their feedback says "
                                 "what is known)")
                lines.append("")
    if data["problems"]:
        lines += ["## Problems", "", *[f"- {p}" for p in data["problems"]], ""]
    return "\n".join(lines).rstrip() + "\n"


def write_gradebook(book: Gradebook, out: str | pathlib.Path) -> list[pathlib.Path]:
    """Write ``labNN.csv`` per lab, ``feedback/<id>.md`` per student, ``summary.md`` and ``summary.json``."""
    out = pathlib.Path(out)
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    written = []
    for lab_id in book.students:
        head, cells = lab_table(book, lab_id)
        path = out / f"{lab_id}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(head)
            w.writerows(cells)
        written.append(path)
    per_student: dict[str, list[Student]] = collections.defaultdict(list)
    for group in book.students.values():
        for s in group:
            per_student[s.id].append(s)
    taken: set[str] = set()
    for sid in sorted(per_student):
        path = out / "feedback" / _file_name(sid, taken)
        path.write_text(feedback_markdown(sid, per_student[sid], book.graded_at), encoding="utf-8")
        written.append(path)
    data = class_summary(book)
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(summary_markdown(data), encoding="utf-8")
    return [*written, out / "summary.json", out / "summary.md"]


# ------------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The output flags of ``python -m flashlab grade``."""
    parser.add_argument("--json", action="store_true", help="one JSON object per submission per line")
    parser.add_argument("--csv", metavar="FILE", help="also write one row per submission to FILE")
    parser.add_argument("--feedback", action="store_true", help="table: show feedback of questions not at full marks")
    parser.add_argument("--out", metavar="DIR", help="write a gradebook: DIR/labNN.csv, DIR/feedback/, DIR/summary.md")
    parser.add_argument("--id-pattern", metavar="REGEX",
                        help="student id from the file name: group 'id', else the first group (with --out)")
    parser.add_argument("--roster", metavar="FILE",
                        help="CSV with columns id and file or pattern: students without a submission get a row")


@dataclass
class Options:
    """The output flags, checked before any grading starts (a bad roster must not cost a grading run)."""

    id_pattern: re.Pattern | None = None
    roster: list[RosterEntry] | None = None


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    """Validate ``--id-pattern`` and ``--roster`` (``parser.error`` on a problem)."""
    if (args.id_pattern or args.roster) and not args.out:
        parser.error("--id-pattern and --roster name students in a gradebook: add --out DIR")
    try:
        pattern = compile_id_pattern(args.id_pattern) if args.id_pattern else None
        roster = read_roster(args.roster) if args.roster else None
    except ValueError as e:
        parser.error(str(e))
    return Options(pattern, roster)


def emit(rows: list[dict], args: argparse.Namespace, options: Options, *, lab_id: str | None = None,
         graded_at: str | None = None, err=None) -> int:
    """Print and write what the flags ask for; 1 when submissions share an id (reported, none counted)."""
    err = err or sys.stderr
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(summary(rows), file=err)
    else:
        print(table(rows, args.feedback))
        print()
        print(summary(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}", file=err)
    if not args.out:
        return 0
    book = build(rows, id_pattern=options.id_pattern, roster=options.roster, lab_id=lab_id, graded_at=graded_at)
    write_gradebook(book, args.out)
    counts = ", ".join(f"{lab}.csv ({len(s)} students)" for lab, s in book.students.items()) or "no lab"
    print(f"wrote the gradebook {args.out}: {counts}, feedback/, summary.md, summary.json", file=err)
    for s in book.duplicates:
        print(f"error: {s.lab} {s.id}: {s.error}", file=err)
    for row, why in book.unmatched:
        print(f"warning: {row['path']} is in no lab file: {why}", file=err)
    return 1 if book.duplicates else 0
