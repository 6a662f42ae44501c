"""Grading for FlashLab's labs: check cells with points and diagnoses, the release step, the batch grader.

How to add a lab (e.g. lab 03, the lab of chapter 03) — two files to write
=========================================================================

1. ``solutions/lab03_<topic>.ipynb`` — the solved lab, the single source. Student code sits between
   ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines (inside a function body, so the ``def`` line stays in
   the student's copy); ``python -m flashlab release`` turns each region into ``raise NotImplementedError``
   and writes ``labs/lab03_<topic>.ipynb``. After the setup cell, one line picks the lab::

       from flashlab.grading import lab; check = lab("lab03")

   and a check cell follows each task: ``check("q1", flash_backward)`` (or ``check("q1")``: the objects are then
   looked up by name in the notebook's globals; ``seed=N`` replays a run). The batch grader finds the lab from
   that ``lab("lab03")`` call (or the ``labNN`` file-name prefix) and grades the objects named below.

2. ``flashlab/grading/lab03.py`` — found by its name (``labNN``), no central list::

       import numpy as np
       from flashlab import reference
       from flashlab.grading.core import Case, Lab, Mutant

       LAB = Lab("lab03", "Tiled backward")

       def _no_scale(Q, K, V, dO):                 # a known-wrong implementation: a "mutant"
           ...

       MUTANTS = [Mutant("missing the 1/sqrt(d) scale", fn=_no_scale)]   # module level: chapter 9 finds it

       @LAB.question("q1", points=4, objects=("flash_backward",))
       def q1(t, flash_backward):
           "flash_backward matches the reference gradients."
           cases = []
           for _ in range(10):                    # fresh shapes and values every run (t.rng is seeded, seed printed)
               n, m, d = t.rng.integers(1, 20, size=3)
               cases.append(Case((t.rng.standard_normal((n, d)), ...), label=f"n={n}"))
           t.compare("random shapes", 3, student=flash_backward, cases=cases,
                     reference=lambda c: my_reference(*c.args), names=("dQ", "dK", "dV"),
                     mutants=MUTANTS)
           t.memory("never builds the n x m matrix", 1, flash_backward, big_args, limit_bytes=n * m * 2,
                    reference=my_reference(*big_args))

   A question function receives a :class:`~flashlab.grading.core.Trial` ``t`` and the student's objects. Each
   ``t.compare`` / ``t.memory`` / ``t.expect(label, points, ok, hint)`` call is a part that earns all its points
   or none; the question's score is the sum (or return ``(points, feedback)`` yourself). A NotImplementedError
   from the student's code gives 0 with "not implemented yet"; any other exception is feedback, never a crash.
   Feedback names the mutant whose output matches the student's on failing inputs (use ``Mutant(msg,
   explains=predicate)`` when a mistake leaves garbage instead of a reproducible output), else shows the
   smallest failing input. ``t.compare(..., run=lambda fn, case: ...)`` applies student and mutants alike when
   one case means many calls (e.g. folding blocks through an update). See ``lab01.py`` and ``lab02.py``.

   Add your lab's notebooks to the tests by nothing more than committing them: ``tests/test_labs.py`` grades
   every ``solutions/lab*.ipynb`` (must score full marks) and every released ``labs/lab*.ipynb`` (must score 0).
   Test your mutants' diagnoses directly: ``run_question("lab03", "q1", [mutant_fn]).feedback``.

   Chapter 9 (:mod:`flashlab.mistakes`) lists, runs and grades every mutant of the module by itself: keep them in
   module-level lists (``MUTANTS = [...]``) that one question uses. What it cannot find, the same module
   declares in ``KNOWN_MISTAKES = KnownMistakes(...)`` (:mod:`flashlab.grading.known`): small telling inputs per
   list (``demos``), wrong implementations for mutants without ``fn`` (``hand_written``), diagnoses that are not
   mutants (``other_diagnoses``). ``tests/test_mistakes.py`` says what is missing; ``python -m flashlab.mistakes
   --labs lab03 --seeds 40`` checks that every diagnosis holds whatever the random draw.

The lab carries its chapter's number: chapter ``03_*.ipynb`` and the README's map link ``labs/lab03_<topic>.ipynb``
(``tests/test_layout.py`` checks every such pointer).
"""

from .core import Case, Checker, Lab, Mutant, Result, Trial, available_labs, get_lab, grade_namespace, lab, run_question

__all__ = [
    "Case",
    "Checker",
    "Lab",
    "Mutant",
    "Result",
    "Trial",
    "available_labs",
    "get_lab",
    "grade_namespace",
    "lab",
    "run_question",
]
