"""Hostile submissions for the batch grader: a generator of one notebook per attack, built from a lab's solution
and its released stub (see :mod:`redteam.attacks`). Used by ``tests/test_redteam.py`` and
``tools/grading_benchmark.py``."""
