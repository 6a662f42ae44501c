import pytest

from flashlab.quiz import Question, Quiz, as_number, self_assessment


def make_quiz():
    return Quiz(
        [
            Question("c", "Pick B.", "Because B.", choices={"A": "no", "B": "yes", "C": "maybe"}, correct="B",
                     feedback={"A": "A is tempting because", "C": "C misses"}),
            Question("n", "6/8?", "Weights 1,1,3,3.", correct=0.75, rel_tol=0.01,
                     traps=((0.5, "that is the average of the blocks"),)),
        ]
    )


def test_a_wrong_answer_gets_feedback_on_that_option_and_a_second_try(capsys):
    quiz = make_quiz()
    assert quiz.answer("c", "a") is False
    out = capsys.readouterr().out
    assert "A is tempting because" in out and "Because B." not in out and "B)" not in out  # nothing revealed
    assert quiz.answer("c", "B") is True
    out = capsys.readouterr().out
    assert "Right at the second try" in out and "Because B." in out
    assert quiz.score().startswith("1 of 2 right (0 at the first try)")


def test_the_answer_is_shown_after_the_last_wrong_try(capsys):
    quiz = make_quiz()
    quiz.answer("c", "C")
    quiz.answer("c", "A")
    out = capsys.readouterr().out
    assert "C misses" in out and "A is tempting because" in out and "The answer is B) yes" in out
    assert "Because B." in out
    assert quiz.answer("c", "B") is True  # practice after the reveal does not change the score
    assert quiz.score().startswith("0 of 2 right")


def test_numbers_in_natural_forms_and_tempting_wrong_numbers(capsys):
    quiz = make_quiz()
    assert quiz.answer("n", 0.5) is False
    assert "that is the average of the blocks" in capsys.readouterr().out
    assert quiz.answer("n", "3/4") is True
    assert [as_number(x) for x in ("0.75", "3/4", "75%", "4x", "4×", " 1/3 ")] == pytest.approx(
        [0.75, 0.75, 0.75, 4, 4, 1 / 3])


def test_unanswered_question_hides_the_explanation(capsys):
    quiz = make_quiz()
    assert quiz.answer("c", None) is None
    out = capsys.readouterr().out
    assert "replace None with one of A, B, C" in out and "Because B." not in out
    assert "not answered yet: c, n" in quiz.score()


def test_malformed_answers_say_what_was_expected():
    quiz = make_quiz()
    with pytest.raises(ValueError, match="one of A, B, C"):
        quiz.answer("c", "Z")
    with pytest.raises(TypeError, match="expects a number"):
        quiz.answer("n", "three quarters")
    with pytest.raises(KeyError, match="no question"):
        quiz.answer("q9", 1)


def test_self_assessment_has_seven_answerable_questions():
    quiz = self_assessment()
    assert list(quiz.questions) == [f"q{i}" for i in range(1, 8)]
    assert quiz.answer("q3", "1/3") and quiz.answer("q4", 4)
    retry = self_assessment()
    assert not retry.answer("q3", 3) and not retry.answer("q4", 2)
    for q in quiz.questions.values():
        if q.choices:
            assert q.correct in q.choices and quiz.answer(q.qid, q.correct)


def test_options_carry_no_verdict_and_every_wrong_option_its_own_feedback():
    for q in self_assessment().questions.values():
        for letter, text in q.choices.items():
            assert not any(word in text.lower() for word in ("wrong", "right", "correct")), (q.qid, text)
            if letter != q.correct:
                assert len(q.feedback.get(letter, "")) > 20, (q.qid, letter)
