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

    def answer(self, qid: str, value) -> bool | None:
        """Grade VALUE and show the explanation; ``None`` (not answered yet) only says how to answer."""
        q = self._get(qid)
        if value is None:
            form = f"one of {', '.join(q.choices)}" if q.choices else "a number"
            print(f"[{qid}] Not answered yet: replace None with {form} and run the cell again.")
            return None
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


def self_assessment() -> Quiz:
    """The closing chapter's seven questions. Numeric answers are computed by the course's own code."""
    import numpy as np

    from . import iocount, online

    # q3: the factor that rescales l and u when the second block of the scalar example raises the max.
    first = online.update(online.init(), np.array([0.0, 0.0]), np.array([0.0, 0.0]))
    second = online.update(first, np.array([np.log(3), np.log(3)]), np.array([1.0, 1.0]))
    rescale = float(np.exp(first.m - second.m))
    # q4: counted FLOPs of the tiled forward when n doubles (d and the SRAM fixed).
    flops = [iocount.predict("q_outer", n, 64, sram=16384).flops for n in (1024, 2048)]

    return Quiz(
        [
            Question(
                "q1",
                "From 2019 to 2022 most work on faster attention rested on one diagnosis. Which, and was it right?",
                "Approximate attention (sparse, low-rank, linear) cut FLOPs on paper but kept moving an n x n matrix "
                "through slow memory, so many methods did not run faster in wall-clock time. Attention at these sizes "
                "is limited by memory traffic (HBM reads and writes), not by arithmetic.",
                choices={
                    "A": "Attention is limited by FLOPs, so cut FLOPs with approximations: wrong, it is memory-bound",
                    "B": "Attention is limited by memory traffic: right, and the approximations fixed it",
                    "C": "Softmax is numerically unstable, so approximate it: wrong, it is limited by FLOPs",
                    "D": "GPUs lacked memory capacity for n x n: right, so approximations were needed",
                },
                correct="A",
            ),
            Question(
                "q2",
                "FlashAttention is called exact. What does that mean?",
                "It computes the same function as standard attention; the only differences come from floating-point "
                "rounding in a different order of operations (chapter 2 measured ~1e-16 relative error in float64). "
                "It is not bit-identical in general, and it trades no accuracy for speed.",
                choices={
                    "A": "Bit-identical output to standard attention on every input",
                    "B": "The same function, up to floating-point rounding from a different order of operations",
                    "C": "An approximation whose error is below 1e-3",
                    "D": "Exact only in float64",
                },
                correct="B",
            ),
            Question(
                "q3",
                "Scalar example, blocks [0, 0] then [ln 3, ln 3]. After the first block m = 0 and l = 2. By what "
                "factor must l (and u) be multiplied when the second block arrives?",
                "The second block raises the max from 0 to ln 3, so everything accumulated against the old max is "
                "rescaled by e^(m - m') = e^(0 - ln 3) = 1/3. Then l = 2/3 + 2 = 8/3 and u = 0 + 2 = 2: u/l = 0.75.",
                correct=rescale,
                rel_tol=0.01,
            ),
            Question(
                "q4",
                "Tiled forward, d = 64: how many times more FLOPs does it do at n = 2048 than at n = 1024?",
                f"Counted by flashlab.iocount: {flops[1]:,} vs {flops[0]:,} FLOPs. FlashAttention does not change the "
                "asymptotic cost: compute stays quadratic in n. What changes is the memory traffic (HBM accesses "
                "fall from Theta(n^2) to Theta(n^2 d^2 / M)) and the extra memory (O(n) instead of O(n^2)).",
                correct=flops[1] / flops[0],
                rel_tol=0.01,
            ),
            Question(
                "q5",
                "Why does the gain of FlashAttention depend on the hardware?",
                "The HBM traffic of the tiled algorithm is Theta(n^2 d^2 / M): it depends on the on-chip memory M, and "
                "whether traffic or arithmetic limits the run depends on the ratio of compute rate to memory bandwidth "
                "(the roofline's ridge point). Another chip moves that balance.",
                choices={
                    "A": "Because only NVIDIA GPUs can run it",
                    "B": "Because the number of FLOPs depends on the GPU",
                    "C": "Because the traffic depends on the SRAM size M, and the benefit on compute rate vs bandwidth",
                    "D": "It does not: the speed-up is the same everywhere",
                },
                correct="C",
            ),
            Question(
                "q6",
                "Which long-context problem does FlashAttention not solve?",
                "It makes long contexts affordable to run, but says nothing about whether a model uses information in "
                "the middle of a long context well (Liu et al., 2023, 'Lost in the Middle').",
                choices={
                    "A": "Fitting the attention matrix of a long sequence in GPU memory",
                    "B": "Whether the model actually uses the information in a long context well",
                    "C": "The quadratic memory of storing P for the backward pass",
                    "D": "Numerical overflow of exp at large scores",
                },
                correct="B",
            ),
            Question(
                "q7",
                "What is the general lesson, beyond attention?",
                "On modern hardware moving data often costs more than computing; measure where the limit is (FLOPs or "
                "bytes, against the roofline) before optimising, or you may cut the wrong cost.",
                choices={
                    "A": "Always reduce FLOPs first",
                    "B": "Approximations are always faster than exact methods",
                    "C": "Measure where the bottleneck is: moving data often costs more than arithmetic",
                    "D": "Write everything in CUDA",
                },
                correct="C",
            ),
        ]
    )
