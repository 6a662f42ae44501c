"""The common-mistakes catalogue (flashlab.mistakes, chapter 9): complete, runnable, and named by its graders.

If a test here fails after you added a mutant or a lab, its message says what to add to the lab's grading module
(``KNOWN_MISTAKES`` in flashlab/grading/labNN.py); flashlab/mistakes.py itself knows no lab.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flashlab import mistakes
from flashlab.grading import core, get_lab
from flashlab.grading.known import Demo, HandWritten, KnownMistakes, OtherDiagnosis, demo_qkv

LABS = mistakes.labs()


def _fix(lab_id: str) -> str:
    return f"KNOWN_MISTAKES in flashlab/grading/{lab_id}.py"


def _module_mutants(module) -> list[tuple[str, object]]:
    """(where, mutant) for every mutant reachable from a lab module's globals: alone, or in a list/tuple/dict."""
    found = []
    for name, value in vars(module).items():
        if mistakes.is_mutant(value):
            found.append((name, value))
        elif isinstance(value, (list, tuple)):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(value) if mistakes.is_mutant(v)]
        elif isinstance(value, dict):
            found += [(f"{name}[{k!r}]", v) for k, v in value.items() if mistakes.is_mutant(v)]
    return found


# --------------------------------------------------------------------------------------------- completeness
@pytest.mark.parametrize("lab_id", LABS)
def test_every_module_level_mutant_is_in_the_catalogue(lab_id):
    module = mistakes.lab_module(lab_id)
    listed = {id(m.mutant) for m in mistakes.catalogue([lab_id]) if m.mutant is not None}
    for where, mutant in _module_mutants(module):
        assert id(mutant) in listed, (
            f"{lab_id}.{where} ({mutant.message[:70]!r}) is missing from flashlab.mistakes.catalogue(). A mutant "
            f"belongs to the question whose function uses its module-level list (directly or through the lab "
            f"module's own helper functions). Keep it in a module-level list or tuple that exactly one question uses, "
            f"or add question_of={{'<LIST NAME>': '<question>'}} to {_fix(lab_id)}. "
            f"Unmapped lists: {mistakes.unmapped_groups(lab_id)}"
        )


@pytest.mark.parametrize("lab_id", LABS)
def test_every_declared_mutant_is_in_the_catalogue(lab_id):
    """Mutant(...) calls written inside question functions (lab 05) are found in the source, by their message."""
    messages = {m.message for m in mistakes.catalogue([lab_id])}
    questions = {q.run.__name__ for q in get_lab(lab_id).questions.values()}
    for owner, message in mistakes.declared_mutants(lab_id):
        if owner in questions:
            assert message is not None, (
                f"{lab_id}: a Mutant inside {owner}() has a message that is not a string literal or a module "
                f"constant, so flashlab/mistakes.py cannot read it: write it as a literal (or a module-level str "
                f"constant)"
            )
        if message is not None:
            assert message in messages, f"{lab_id}: {message[:70]!r} (in {owner or 'module'}) is not catalogued"


@pytest.mark.parametrize("lab_id", LABS)
def test_every_mutant_list_belongs_to_one_question(lab_id):
    unmapped = mistakes.unmapped_groups(lab_id)
    assert not unmapped, (
        f"{lab_id}: these mutant lists are used by no question function, or by several: {unmapped}. Add "
        f"question_of={{'<LIST NAME>': '<question>'}} to {_fix(lab_id)}."
    )


def test_every_mistake_has_an_implementation_to_run():
    missing = [m for m in mistakes.catalogue() if m.fn is None]
    assert not missing, (
        f"no wrong implementation for {missing}. A Mutant with fn=None (recognised by a predicate) needs a "
        f"HandWritten entry in KNOWN_MISTAKES.hand_written, keyed (question, start of its message); a lab whose "
        f"mutants are not Python functions (like lab 06's CUDA loop bodies) needs KNOWN_MISTAKES.submission, in "
        f"its module flashlab/grading/labNN.py."
    )


@pytest.mark.parametrize("lab_id", LABS)
def test_known_mistakes_name_things_that_exist(lab_id):
    book = mistakes.known(lab_id)
    assert isinstance(book, KnownMistakes)
    found = mistakes.catalogue([lab_id])
    for question, start in [*book.hand_written, *book.expect]:
        assert any(m.question == question and m.message.startswith(start) for m in found), (
            f"stale entry in {_fix(lab_id)}: no mutant of {lab_id} {question} starts with {start!r}")
    for group, question in book.question_of.items():
        assert group in mistakes.mutant_groups(lab_id) and question in get_lab(lab_id).questions, (lab_id, group)
    for group, obj in book.object_of.items():
        questions = mistakes.group_questions(lab_id).get(group)
        assert questions and obj in get_lab(lab_id).questions[questions[0]].objects, (lab_id, group, obj)
    for key in book.demos:
        assert key in mistakes.mutant_groups(lab_id) or key in get_lab(lab_id).questions, (lab_id, key)
    for other in book.other_diagnoses:
        assert other.obj in get_lab(lab_id).questions[other.question].objects, (lab_id, other)


def test_mistakes_module_knows_no_lab():
    """Everything about one lab lives in its grading module: flashlab/mistakes.py names none."""
    import re

    text = (mistakes.ROOT / "flashlab" / "mistakes.py").read_text()
    named = sorted(set(re.findall(r"lab[ _]?\d\d", text)))
    assert not named, f"flashlab/mistakes.py names {named}: move that knowledge to the lab's {_fix('labNN')}"


def test_multi_object_questions_replace_the_right_object():
    # lab 03 q1 grades three formulas at once: each list's mutants stand for one of them
    objs = {m.group: m.obj for m in mistakes.catalogue(["lab03"])}
    assert objs["STANDARD_MUTANTS"] == "standard_counts" and objs["KV_OUTER_MUTANTS"] == "kv_outer_counts"
    assert objs["Q_OUTER_MUTANTS"] == "q_outer_counts" and objs["BLOCK_MUTANTS"] == "paper_blocks"


def test_find_is_unambiguous_and_explains_itself():
    assert mistakes.find("lab01", "averaging block results", question="q3").question == "q3"
    with pytest.raises(LookupError, match="2 mistakes of lab01"):
        mistakes.find("lab01", "averaging block results")
    with pytest.raises(LookupError, match="its mistakes are"):
        mistakes.find("lab01", "no such mistake")


# ------------------------------------------------------------------------------- the graders name each one
def _cpu_cases():
    for m in mistakes.catalogue():
        if mistakes.needs_gpu(m.lab_id) or mistakes.needs_simulator(m.lab_id):
            continue
        yield pytest.param(m, id=f"{m.lab_id}-{m.question}-{m.title[:40]}-{m.variant[:20]}")


@pytest.mark.parametrize("mistake", list(_cpu_cases()))
def test_each_mistake_is_named_by_its_grader(mistake):
    """What chapter 9 shows: graded with the chapter's seed, the mistake loses points and is named."""
    result = mistakes.grade(mistake)
    assert result.score < result.max_score, f"{mistake!r} scored full marks:\n{result.feedback}"
    assert mistakes.diagnosed(mistake, result), (
        f"{mistake!r} is not named ({mistake.expect!r} not in the feedback, seed {result.seed}):\n{result.feedback}\n"
        f"If the grader names it in other words on purpose, add the phrase to expect= in {_fix(mistake.lab_id)}."
    )


def _in_simulator(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh Python with the CUDA simulator chosen first; it must print one JSON line last."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = "import json\nfrom flashlab import numba_cuda\nnumba_cuda.use_simulator()\n"
    script += "from flashlab import mistakes\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=mistakes.ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_simulator_mistakes_are_named_and_their_demos_show_them():
    """Lab 05 (and any lab graded in the CUDA simulator), in a subprocess: the simulator is chosen per process."""
    labs = [lab for lab in LABS if mistakes.needs_simulator(lab) and not mistakes.needs_gpu(lab)]
    assert labs, "no lab runs in the simulator any more: drop this test"
    res = _in_simulator(f"""
        out = []
        for m in mistakes.catalogue({labs!r}):
            r = mistakes.grade(m)
            rows = mistakes.demo(m)
            out.append([repr(m), r.score, r.max_score, mistakes.diagnosed(m, r), r.feedback,
                        None if rows is None else any(row.differs for row in rows)])
        print(json.dumps(out))
    """)
    assert len(res) >= 9
    for name, score, max_score, named, feedback, demo_differs in res:
        assert score < max_score and named, f"{name} not named:\n{feedback}"
        assert demo_differs in (None, True), f"{name}: its demo inputs do not show it"
        assert "arg1 = " not in feedback, f"{name}: the failing input is shown without its argument names"


@pytest.mark.gpu
def test_gpu_mistakes_are_named_on_a_gpu():
    from flashlab.grading import batch

    found = [m for m in mistakes.catalogue() if m.lab_id in batch.GPU_LABS]  # graded on the GPU where there is one
    assert found
    for m in found:
        result = mistakes.grade(m)
        assert result.score < result.max_score and mistakes.diagnosed(m, result), f"{m!r}:\n{result.feedback}"
        rows = mistakes.demo(m)
        assert rows is None or any(row.differs for row in rows), f"{m!r}: its demo inputs do not show it"


def test_without_a_gpu_gpu_mistakes_are_listed_not_run(monkeypatch):
    found = [m for m in mistakes.catalogue() if mistakes.needs_gpu(m.lab_id)]
    if not found:
        pytest.skip("no lab needs a GPU")
    monkeypatch.setattr(mistakes, "gpu_here", lambda: False)
    text = mistakes.report(found[0])
    assert "needs a GPU" in text and found[0].message in text
    if mistakes.source_diff(found[0]) is not None:
        assert "\n-" in text and "\n+" in text  # the right and the wrong code, as a diff


# ------------------------------------------------------------------------------------------------- the demos
def _softmax_average(scores, values):
    w = np.exp(scores - scores.max())
    return float(w @ values / w.sum())


def test_scalar_example_right_and_averaged():
    """The chapter's headline numbers, recomputed here independently of the package."""
    scores, values = np.array([0, 0, np.log(3), np.log(3)]), np.array([0.0, 0, 1, 1])
    right = _softmax_average(scores, values)
    averaged = (_softmax_average(scores[:2], values[:2]) + _softmax_average(scores[2:], values[2:])) / 2
    assert right == pytest.approx(0.75) and averaged == pytest.approx(0.5)
    for phrase, question, expected in (("averaging block results", "q1", averaged), ("not rescaled", "q1", averaged),
                                       ("averaging block results", "q3", averaged)):
        row = mistakes.demo(mistakes.find("lab01", phrase, question=question))[0]
        assert "scalar example" in row.label
        assert float(np.ravel(row.right[0])[0]) == pytest.approx(right, abs=1e-12)
        assert float(np.ravel(row.wrong[0])[0]) == pytest.approx(expected, abs=1e-12), phrase


def test_overflow_and_masked_block_give_nan_where_the_answer_is_a_number():
    for phrase, input_kind in (("no max subtraction", "logits near 1000"), ("fully masked block", "masked")):
        rows = {row.label: row for row in mistakes.demo(mistakes.find("lab01", phrase))}
        row = next(r for label, r in rows.items() if input_kind in label)
        assert np.isfinite(row.right[0]).all() and np.isnan(row.wrong[0]).any(), phrase


def test_demo_rights_are_the_truth():
    """The 'right' column comes from flashlab.reference / online / iocount, not from the mistake's own module."""
    from flashlab import online, reference

    row = mistakes.demo(mistakes.find("lab01", "last ragged block is dropped"))[1]
    scores, values = np.array([0, 0, np.log(3), np.log(3), 2.0]), np.array([0.0, 0, 1, 1, 4])
    assert float(row.right[0]) == pytest.approx(_softmax_average(scores, values), abs=1e-12)
    assert float(row.right[0]) == pytest.approx(float(online.attend(scores, values)), abs=1e-12)
    rows = mistakes.demo(mistakes.find("lab02", "ragged K/V tile", question="q2"))
    O, L = reference.attention(*demo_qkv(3, 5, 2, 1, seed=1))
    assert np.allclose(rows[0].right[0], O, atol=1e-14) and np.allclose(rows[0].right[1], L, atol=1e-14)


@pytest.mark.parametrize("mistake", [m for m in mistakes.catalogue()
                                     if not mistakes.needs_gpu(m.lab_id) and not mistakes.needs_simulator(m.lab_id)
                                     and mistakes.demo_for(m) is not None],
                         ids=lambda m: f"{m.lab_id}-{m.title[:40]}-{m.variant[:20]}")
def test_each_demo_shows_its_mistake(mistake):
    rows = mistakes.demo(mistake)
    assert any(row.differs for row in rows), f"{mistake!r}: right and wrong agree on every demo input"
    text = mistakes.format_rows(rows, mistakes.demo_for(mistake).names)
    assert "wrong" in text and "right" in text


def test_report_holds_demo_and_grader_message():
    m = mistakes.find("lab01", "not rescaled")
    text = mistakes.report(m)
    assert "the scalar example" in text and "wrong 0.5" in text
    assert "(recognised)" in text and m.message in text and "points (seed 0)" in text


# ----------------------------------------------------------------------------------- a lab added later
NEW_LAB = '''
from .core import Case, Lab, Mutant, Trial

LAB = Lab("lab98", "A lab written after chapter 9")


def _twice(x):
    return 2 * x


def _plus_one(x):
    return x + 1


DOUBLE_MUTANTS = [Mutant("doubled: return x itself, not 2 x.", fn=_twice)]
HELPER_MUTANTS = (Mutant("off by one: no + 1.", fn=_plus_one),)


def _part(t, ident):
    t.compare("through a helper", 1, student=ident, cases=[Case((3.0,))], reference=lambda c: c.args[0],
              mutants=HELPER_MUTANTS)


@LAB.question("q1", points=2, objects=("ident",))
def q1(t: Trial, ident):
    """ident(x) returns x."""
    cases = [Case((float(x),)) for x in t.rng.integers(1, 9, size=3)]
    t.compare("identity", 1, student=ident, cases=cases, reference=lambda c: c.args[0], mutants=DOUBLE_MUTANTS)
    _part(t, ident)


@LAB.question("q2", points=1, objects=("ident",))
def q2(t: Trial, ident):
    """Nothing to see."""
    inline = [Mutant("negated: -x.", explains=lambda case, got, want: bool(got[0] == -want[0]))]
    t.compare("sign", 1, student=ident, cases=[Case((2.0,))], reference=lambda c: c.args[0], mutants=inline)
'''


@pytest.fixture
def new_lab(tmp_path):
    name = "flashlab.grading.lab98"
    path = tmp_path / "lab98.py"
    path.write_text(NEW_LAB)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)
    core._REGISTRY.pop("lab98", None)
    mistakes._catalogue.cache_clear()


def test_a_new_lab_is_picked_up_without_editing_the_catalogue(new_lab):
    found = mistakes.catalogue(["lab98"])
    by_group = {m.group: m for m in found}
    assert by_group["DOUBLE_MUTANTS"].question == "q1"
    assert by_group["HELPER_MUTANTS"].question == "q1"  # found through the helper _part()
    inline = by_group["inside q2"]
    assert inline.message == "negated: -x." and inline.fn is None  # no implementation: the tests above would ask
    text = mistakes.report(by_group["DOUBLE_MUTANTS"])
    assert "(recognised)" in text and "no hand-picked input" in text and "doubled" in text
    book = mistakes.Showcase()
    assert {m.message for m in book.remaining(["lab98"])} == {m.message for m in found}


def test_a_new_labs_known_mistakes_are_picked_up_from_its_module(new_lab):
    """The recipe for a mistake that no module-level list holds: declare it in the lab's KNOWN_MISTAKES."""
    new_lab.KNOWN_MISTAKES = KnownMistakes(
        demos={"DOUBLE_MUTANTS": lambda: Demo([("x = 3", (3.0,))], right=lambda args: args[0], names=("x",))},
        hand_written={("q2", "negated"): [HandWritten("returns -x", lambda: lambda x: -x)]},
        other_diagnoses=[OtherDiagnosis("q1", "ident", "zero everywhere",
                                        HandWritten("returns 0", lambda: lambda x: 0.0 * x, expect="identity"))],
    )
    mistakes._catalogue.cache_clear()
    by_group = {m.group: m for m in mistakes.catalogue(["lab98"])}
    negated = by_group["inside q2"]
    assert negated.variant == "returns -x" and mistakes.diagnosed(negated, mistakes.grade(negated))
    other = by_group["other diagnoses"]
    assert other.obj == "ident" and mistakes.diagnosed(other, mistakes.grade(other))
    rows = mistakes.demo(by_group["DOUBLE_MUTANTS"])
    assert rows[0].differs and float(rows[0].wrong[0]) == 6.0 and float(rows[0].right[0]) == 3.0


def test_a_list_no_question_uses_is_reported(new_lab):
    new_lab.ORPHAN_MUTANTS = [core.Mutant("never used", fn=lambda x: x)]
    mistakes._catalogue.cache_clear()
    assert mistakes.unmapped_groups("lab98") == {"ORPHAN_MUTANTS": []}
    assert all(m.group != "ORPHAN_MUTANTS" for m in mistakes.catalogue(["lab98"]))


def test_demo_rows_compare_with_the_demo_tolerance_and_name_infinities():
    right = (np.array([-np.inf, 1.0]),)
    fp32 = mistakes.Row("fp32 rounding", right, (np.array([-np.inf, 1.0 + 3e-7]),), rtol=1e-4, atol=1e-5)
    assert not fp32.differs
    assert mistakes.Row("float64", right, (np.array([-np.inf, 1.0 + 3e-7]),)).differs
    assert "inf where" in mistakes._diff(right[0], np.array([0.5, 1.0]))
    assert "nan where" in mistakes._diff(right[0], np.array([-np.inf, np.nan]))
    assert mistakes._diff(right[0], np.array([-np.inf, 1.25])) == "max |wrong - right| = 0.25"


def test_seed_sweep_grades_each_mistake_with_every_seed(capsys):
    misses = mistakes.seed_sweep([7, 8], ["lab01"], progress=print)
    assert misses == []
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(mistakes.runnable_here(m) for m in mistakes.catalogue(["lab01"]))
    assert all(line.startswith("ok   Mistake(lab01") for line in lines)
    assert mistakes.main(["--seeds", "1", "--labs", "lab02"]) == 0
    summary = capsys.readouterr().out
    assert "lab02: " in summary and "named correctly 100.0%" in summary and "meets both targets" in summary


def test_seed_sweep_in_worker_processes_grades_the_same():
    alone = mistakes.sweep([5], ["lab01"])
    together = mistakes.sweep([5], ["lab01"], jobs=2)
    assert [(repr(o.mistake), o.seed, o.named, o.result.score, o.result.feedback) for o in alone] == [
        (repr(o.mistake), o.seed, o.named, o.result.score, o.result.feedback) for o in together]
    per_lab = mistakes.rates(together)
    assert per_lab["lab01"].gradings == len(alone) and per_lab["lab01"].meets_targets


def test_seed_sweep_cli_chooses_the_simulator_itself():
    """`--simulator` works from a plain shell: the CLI picks the simulator before numba.cuda is imported."""
    labs = [lab for lab in LABS if mistakes.needs_simulator(lab) and not mistakes.needs_gpu(lab)]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-m", "flashlab.mistakes", "--simulator", "--seeds", "1", "--labs", *labs],
                         env=env, capture_output=True, text=True, timeout=600, cwd=mistakes.ROOT)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("0 misses"), out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count("ok   Mistake(") == len(mistakes.catalogue(labs))


# ------------------------------------------------------------------ chapter 9's record of the slow labs' mistakes
def _stale(reason: str) -> str:
    return f"data/mistakes/chapter9.jsonl is out of date ({reason}); regenerate it: {mistakes.RECORD_COMMAND}"


def test_the_record_holds_every_mistake_of_the_slow_labs_and_no_other():
    provenance, reports = mistakes.read_record()
    assert provenance["command"] == mistakes.RECORD_COMMAND and provenance["seed"] == mistakes.SEED
    want = {mistakes.record_key(m) for m in mistakes.recorded_mistakes()}
    missing = sorted(k.replace("\x1f", " | ")[:120] for k in want - set(reports))
    extra = sorted(k.replace("\x1f", " | ")[:120] for k in set(reports) - want)
    assert not missing and not extra, _stale(f"missing: {missing}; no longer known: {extra}")
    assert {m.lab_id for m in mistakes.recorded_mistakes()} == {"lab06", "lab07"}


def test_the_record_command_writes_what_the_showcase_reads(tmp_path, monkeypatch, capsys):
    command, _, target = mistakes.RECORD_COMMAND.partition(" > ")
    assert (mistakes.ROOT / target) == mistakes.RECORD and command == "python -m flashlab mistakes --record"
    monkeypatch.setattr(mistakes, "slow_to_grade", lambda lab_id: "slow here" if lab_id == "lab07" else "")
    monkeypatch.setattr(mistakes, "recorded_mistakes", lambda lab_ids=None: mistakes.catalogue(["lab07"])[:2])
    monkeypatch.setattr("flashlab.numba_cuda.use_simulator", lambda: None)  # lab 07 needs no simulator
    assert mistakes.main(["--record"]) == 0
    path = tmp_path / "chapter9.jsonl"
    path.write_text(capsys.readouterr().out)
    provenance, reports = mistakes.read_record(path)
    assert provenance["command"] == mistakes.RECORD_COMMAND and provenance["seed"] == mistakes.SEED
    first, second = mistakes.catalogue(["lab07"])[:2]
    assert list(reports) == [mistakes.record_key(first), mistakes.record_key(second)]
    assert reports[mistakes.record_key(second)] == mistakes.report(second)


@pytest.mark.slow
def test_the_recorded_reports_are_what_the_graders_print_today():
    """Every recorded report is what chapter 9 would print if it graded the mistake live (with the record's seed)."""
    provenance, reports = mistakes.read_record()
    if provenance["gpu"] != mistakes.gpu_here():
        pytest.skip("the record was made on a machine " + ("with" if provenance["gpu"] else "without") + " a GPU")
    stale = [repr(m) for m in mistakes.recorded_mistakes()
             if reports.get(mistakes.record_key(m)) != mistakes.report(m, mistakes.SEED)]
    assert not stale, _stale(f"these report otherwise today: {stale}")


def test_the_showcase_grades_one_mistake_of_a_slow_lab_live_and_prints_the_others_recorded(tmp_path, monkeypatch,
                                                                                            capsys):
    found = mistakes.catalogue(["lab07"])[:4]
    record = tmp_path / "record.jsonl"
    lines = [json.dumps({"provenance": {"command": mistakes.RECORD_COMMAND, "date_utc": "2026-01-02T03:04:05+00:00",
                                        "seed": mistakes.SEED}})]
    lines += [json.dumps({"lab": m.lab_id, "question": m.question, "group": m.group, "message": m.message,
                          "variant": m.variant, "report": f"HEAD {i}\nRECORDED BODY {i}"})
              for i, m in enumerate(found[:3])]
    record.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(mistakes, "RECORD", record)
    monkeypatch.setattr(mistakes, "slow_to_grade", lambda lab_id: "slow here" if lab_id == "lab07" else "")
    monkeypatch.setattr(mistakes, "catalogue", lambda lab_ids=None: found)
    book = mistakes.Showcase()
    book.rest(["lab07"])
    out = capsys.readouterr().out
    assert "RECORDED BODY 0" not in out and "(recognised)" in out  # the first is graded live
    assert "HEAD 1\n[recorded on 2026-01-02 by `python -m flashlab mistakes --record`" in out
    assert "RECORDED BODY 1" in out and "RECORDED BODY 2" in out and "slow here" in out
    assert out.count("(recognised)") == 2  # the fourth is not in the record: graded live too
    everything_live = mistakes.Showcase(recorded=False)
    assert "RECORDED" not in everything_live.report(found[1]) and mistakes.Showcase(seed=7).recorded == {}
