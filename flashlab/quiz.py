"""Auto-checked self-assessment questions for the notebooks.

A question is either multiple choice (answer with a letter) or numeric (a number, checked to a relative
tolerance; "1/3", "0.33", "33%" and "4x" are read as numbers too). ``ask(qid)`` prints the question;
``answer(qid, value)`` says whether the answer is right. A wrong first answer gets feedback on the option or the
number chosen (why that is tempting and where it goes wrong) and a second try; the right answer and the
explanation are shown when the answer is right or after the second wrong try, so that the reader learns from
either outcome. Options carry no verdicts. Plain printing, no widgets: it works in JupyterLab, classic Jupyter,
Colab, and in the rendered HTML course.
"""

from __future__ import annotations

import fractions
import math
import numbers
from dataclasses import dataclass, field

#: Wrong answers a question takes before it shows the right one.
TRIES = 2


def as_number(value) -> float:
    """A numeric answer as a float: numbers, and strings such as "0.75", "3/4", "75%", "4x" or "4×".
    Raises TypeError for anything else."""
    if isinstance(value, bool):
        raise TypeError("a number, not True/False")
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace("×", "x").replace(" ", "")
        scale = 1.0
        if text.endswith("%"):
            text, scale = text[:-1], 0.01
        elif text.lower().endswith("x"):
            text = text[:-1]
        try:
            return float(fractions.Fraction(text)) * scale
        except (ValueError, ZeroDivisionError):
            pass
    raise TypeError(f"a number (e.g. 0.75, 3/4, 75%), not {value!r}")


@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    explanation: str
    choices: dict[str, str] = field(default_factory=dict)  # letter -> text; empty for a numeric question
    correct: str | float = ""
    rel_tol: float = 0.02
    #: Per wrong letter, why it is tempting and where it goes wrong (multiple choice).
    feedback: dict[str, str] = field(default_factory=dict)
    #: (value, why) for tempting wrong numbers (numeric), matched with the same tolerance.
    traps: tuple[tuple[float, str], ...] = ()

    @property
    def numeric(self) -> bool:
        return not self.choices

    def render(self) -> str:
        lines = [f"[{self.qid}] {self.text}"]
        lines += [f"   {letter}) {text}" for letter, text in self.choices.items()]
        if self.numeric:
            lines.append(f"   (answer with a number, e.g. 0.75 or 3/4; within {self.rel_tol:.0%} counts as right)")
        return "\n".join(lines)

    def grade(self, value) -> bool:
        """True if ``value`` is the right answer; raises ValueError/TypeError on an answer of the wrong form."""
        if self.numeric:
            try:
                number = as_number(value)
            except TypeError as e:
                raise TypeError(f"{self.qid} expects {e}, e.g. answer({self.qid!r}, 0.5)") from None
            return math.isclose(number, float(self.correct), rel_tol=self.rel_tol)
        letter = str(value).strip().rstrip(")").upper()
        if letter not in self.choices:
            raise ValueError(f"{self.qid} expects one of {', '.join(self.choices)}; got {value!r}")
        return letter == self.correct

    def hint(self, value) -> str:
        """What to think about after the wrong answer ``value``."""
        if self.numeric:
            number = as_number(value)
            for trap, why in self.traps:
                if math.isclose(number, trap, rel_tol=self.rel_tol):
                    return why
            return "too large" if number > float(self.correct) else "too small"
        letter = str(value).strip().rstrip(")").upper()
        return self.feedback.get(letter, "not this one")


class Quiz:
    """A set of questions, asked and answered by id."""

    def __init__(self, questions: list[Question]):
        self.questions = {q.qid: q for q in questions}
        self.results: dict[str, bool] = {}  # qid -> right (at some try); absent while unanswered or retrying
        self.tries: dict[str, int] = {}

    def _get(self, qid: str) -> Question:
        if qid not in self.questions:
            raise KeyError(f"no question {qid!r}; the questions are {', '.join(self.questions)}")
        return self.questions[qid]

    def ask(self, qid: str) -> None:
        print(self._get(qid).render())

    def answer(self, qid: str, value) -> bool | None:
        """Grade VALUE: right, or wrong with feedback and another try, or (after the last try) the answer and why.
        ``None`` (not answered yet) only says how to answer."""
        q = self._get(qid)
        if value is None:
            form = f"one of {', '.join(q.choices)}" if q.choices else "a number"
            print(f"[{qid}] Not answered yet: replace None with {form} and run the cell again.")
            return None
        ok = q.grade(value)
        if qid in self.results:  # answered before (right, or shown): a later answer is practice, not a new score
            print(f"[{qid}] {'Right' if ok else 'Not quite'} (already counted: "
                  f"{'right' if self.results[qid] else 'not right'}).")
            return ok
        self.tries[qid] = self.tries.get(qid, 0) + 1
        if ok:
            self.results[qid] = True
            print(f"[{qid}] Right{' at the second try' if self.tries[qid] > 1 else ''}.")
            print(f"Why: {q.explanation}")
        elif self.tries[qid] < TRIES:
            print(f"[{qid}] Not quite: {q.hint(value)}. Think again and answer once more.")
        else:
            self.results[qid] = False
            right = f"{q.correct}) {q.choices[q.correct]}" if q.choices else f"{float(q.correct):.4g}"
            print(f"[{qid}] Not quite: {q.hint(value)}. The answer is {right}.")
            print(f"Why: {q.explanation}")
        return ok

    def score(self) -> str:
        right = sum(self.results.values())
        first = sum(1 for qid, ok in self.results.items() if ok and self.tries.get(qid) == 1)
        unanswered = [qid for qid in self.questions if qid not in self.results]
        text = f"{right} of {len(self.questions)} right ({first} at the first try)"
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
                "From 2019 to 2022 most work on faster attention rested on one diagnosis of what made it slow. "
                "Which one?",
                "Approximate attention (sparse, low-rank, linear) cut FLOPs on paper but kept moving an n x n matrix "
                "through slow memory, so many methods did not run faster in wall-clock time: the diagnosis was wrong. "
                "Attention at these sizes is limited by memory traffic (HBM reads and writes), not by arithmetic.",
                choices={
                    "A": "Attention does too many FLOPs, so approximations that cut FLOPs make it faster",
                    "B": "Attention moves too much data between HBM and the chip",
                    "C": "Softmax is numerically unstable at long lengths",
                    "D": "GPUs lack the memory capacity to hold an n x n matrix",
                },
                correct="A",
                feedback={
                    "B": "that is FlashAttention's own diagnosis (2022), the one that turned out right; the work "
                         "before it aimed at something else",
                    "C": "stability was solved long before, by subtracting the max (chapter 1); the methods of those "
                         "years changed how much is computed",
                    "D": "capacity mattered, but those methods were presented as faster, and what they reduced was "
                         "the amount of arithmetic",
                },
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
                feedback={
                    "A": "the tiles add the same numbers in another order, and floating-point addition is not "
                         "associative: the last bits can differ",
                    "C": "nothing is approximated; chapter 2 measured errors at the level of rounding (1e-16 in "
                         "float64), far below 1e-3",
                    "D": "the algebra is exact in any precision; float64 only makes the rounding smaller",
                },
            ),
            Question(
                "q3",
                "Scalar example, blocks [0, 0] then [ln 3, ln 3]. After the first block m = 0 and l = 2. By what "
                "factor must l (and u) be multiplied when the second block arrives?",
                "The second block raises the max from 0 to ln 3, so everything accumulated against the old max is "
                "rescaled by e^(m - m') = e^(0 - ln 3) = 1/3. Then l = 2/3 + 2 = 8/3 and u = 0 + 2 = 2: u/l = 0.75.",
                correct=rescale,
                rel_tol=0.01,
                traps=((1 / rescale, "that is the factor by which the max grew; what was accumulated against the "
                                     "old max must shrink, e^(m - m') with m' > m"),
                       (1.0, "the max changed from 0 to ln 3, so the old terms must be rescaled"),
                       (0.5, "that is what averaging the two blocks gives for the output, not the rescale factor")),
            ),
            Question(
                "q4",
                "Tiled forward, d = 64: how many times more FLOPs does it do at n = 2048 than at n = 1024?",
                f"Counted by flashlab.iocount: {flops[1]:,} vs {flops[0]:,} FLOPs. FlashAttention does not change the "
                "asymptotic cost: compute stays quadratic in n. What changes is the memory traffic (HBM accesses "
                "fall from Theta(n^2) to Theta(n^2 d^2 / M)) and the extra memory (O(n) instead of O(n^2)).",
                correct=flops[1] / flops[0],
                rel_tol=0.01,
                traps=((2.0, "the FLOPs grow with n x m, and both double"),
                       (1.0, "tiling changes the memory traffic, not the arithmetic: S still has n x m entries")),
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
                feedback={
                    "A": "the algorithm is plain arithmetic and memory traffic: any chip with fast on-chip memory can "
                         "run it",
                    "B": "the FLOPs are a property of the algorithm (chapter 3 counts them), the same on every chip",
                    "D": "chapter 3 shows the traffic depends on the on-chip memory M, which differs between chips",
                },
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
                feedback={
                    "A": "the n x n matrix is never stored: that is exactly what FlashAttention removes",
                    "C": "the backward pass recomputes P tile by tile from the saved logsumexp (chapter 4)",
                    "D": "subtracting the running max (chapter 1) keeps every exponent at most 0",
                },
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
                feedback={
                    "A": "FlashAttention does slightly more FLOPs (recomputation) and still wins: FLOPs were not "
                         "the limit",
                    "B": "the approximations of chapter 11's history cut FLOPs and often did not run faster",
                    "D": "chapters 2 and 5 gain from the same idea in NumPy and Numba: the lesson is where the cost "
                         "is, not the language",
                },
            ),
        ]
    )
