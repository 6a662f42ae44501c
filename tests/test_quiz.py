import pytest

from flashlab.quiz import Question, Quiz


def make_quiz():
    return Quiz(
        [
            Question("c", "Pick B.", "Because B.", choices={"A": "no", "B": "yes"}, correct="B"),
            Question("n", "6/8?", "Weights 1,1,3,3.", correct=0.75, rel_tol=0.01),
        ]
    )


def test_choice_and_numeric_answers(capsys):
    quiz = make_quiz()
    assert quiz.answer("c", "b") is True
    assert quiz.answer("n", 0.5) is False
    out = capsys.readouterr().out
    assert "Because B." in out and "Weights 1,1,3,3." in out  # explanation shown right or wrong
    assert quiz.answer("n", 0.7501) is True
    assert quiz.score() == "2 of 2 right"


def test_unanswered_question_hides_the_explanation(capsys):
    quiz = make_quiz()
    assert quiz.answer("c", None) is None
    out = capsys.readouterr().out
    assert "replace None with one of A, B" in out and "Because B." not in out
    assert "not answered yet: c, n" in quiz.score()


def test_malformed_answers_say_what_was_expected():
    quiz = make_quiz()
    with pytest.raises(ValueError, match="one of A, B"):
        quiz.answer("c", "Z")
    with pytest.raises(TypeError, match="expects a number"):
        quiz.answer("n", "0.75")
    with pytest.raises(KeyError, match="no question"):
        quiz.answer("q9", 1)


def test_self_assessment_has_seven_answerable_questions(capsys):
    from flashlab.quiz import self_assessment

    quiz = self_assessment()
    assert list(quiz.questions) == [f"q{i}" for i in range(1, 8)]
    assert quiz.answer("q3", 1 / 3) and not quiz.answer("q3", 0.5)
    assert quiz.answer("q4", 4) and not quiz.answer("q4", 2)
    for q in quiz.questions.values():
        if q.choices:
            assert q.correct in q.choices and quiz.answer(q.qid, q.correct)
