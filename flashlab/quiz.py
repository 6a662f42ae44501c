"""Auto-checked self-assessment questions for the notebooks.

A question is either multiple choice (answer with a letter) or numeric (answer with a number, checked to a
relative tolerance). ``ask(qid)`` prints the question; ``answer(qid, value)`` says whether the answer is right
and then shows the explanation, right or wrong, so that the reader learns from either outcome. Plain printing,
no widgets: it works in JupyterLab, classic Jupyter, Colab, and in the rendered HTML course.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    explanation: str
    choices: dict[str, str] = field(default_factory=dict)  # letter -> text; empty for a numeric question
    correct: str | float = ""
    rel_tol: float = 0.02

    @property
    def numeric(self) -> bool:
        return not self.choices

    def render(self) -> str:
        lines = [f"[{self.qid}] {self.text}"]
        lines += [f"   {letter}) {text}" for letter, text in self.choices.items()]
        if self.numeric:
            lines.append(f"   (answer with a number; within {self.rel_tol:.0%} counts as right)")
        return "\n".join(lines)

    def grade(self, value) -> bool:
        """True if ``value`` is the right answer; raises ValueError/TypeError on an answer of the wrong form."""
        if self.numeric:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{self.qid} expects a number, e.g. answer({self.qid!r}, 4); got {value!r}")
            return math.isclose(float(value), float(self.correct), rel_tol=self.rel_tol)
        letter = str(value).strip().upper()
        if letter not in self.choices:
            raise ValueError(f"{self.qid} expects one of {', '.join(self.choices)}; got {value!r}")
        return letter == self.correct


class Quiz:
    """A set of questions, asked and answered by id."""

    def __init__(self, questions: list[Question]):
        self.questions = {q.qid: q for q in questions}
        self.results: dict[str, bool] = {}

    def _get(self, qid: str) -> Question:
        if qid not in self.questions:
            raise KeyError(f"no question {qid!r}; the questions are {', '.join(self.questions)}")
        return self.questions[qid]

    def ask(self, qid: str) -> None:
        print(self._get(qid).render())

    def answer(self, qid: str, value) -> bool:
        q = self._get(qid)
        ok = q.grade(value)
        self.results[qid] = ok
        if ok:
            print(f"[{qid}] Right.")
        elif q.numeric:
            print(f"[{qid}] Not quite: {value} is not within {q.rel_tol:.0%} of the expected value.")
        else:
            print(f"[{qid}] Not quite: the answer is {q.correct}) {q.choices[q.correct]}")
        print(f"Why: {q.explanation}")
        return ok

    def score(self) -> str:
        right = sum(self.results.values())
        unanswered = [qid for qid in self.questions if qid not in self.results]
        text = f"{right} of {len(self.questions)} right"
        return text + (f"; not answered yet: {', '.join(unanswered)}" if unanswered else "")
