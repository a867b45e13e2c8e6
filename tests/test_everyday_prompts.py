"""The "everyday" kind of `shared.datasets`: short everyday questions written for the project, in
two separate sets, one for evaluation (`eval_prompts`) and one the target answers for distillation
(`distill_prompts`); no evaluation question reaches any distillation source."""

from __future__ import annotations

import re

import pytest

from shared import datasets

MIN_WORDS = 4
MAX_WORDS = 25


RUN = 6  # words: a shared run this long means one question was written from the other


def test_everyday_kinds() -> None:
    assert datasets.KINDS == ("chat", "code", "math")
    assert datasets.EVAL_KINDS == ("chat", "code", "math", "everyday")
    assert datasets.DISTILL_KINDS == ("chat", "code", "math", "everyday")
    assert len(datasets.EVERYDAY_QUESTIONS) == 120
    assert len(datasets.everyday_distill_questions()) == 273


def _runs(text: str) -> set[tuple[str, ...]]:
    words = re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()
    return {tuple(words[i : i + RUN]) for i in range(len(words) - RUN + 1)}


def test_everyday_distillation_questions_are_distinct_short_strings() -> None:
    questions = datasets.distill_prompts("everyday", 273)
    assert questions == list(datasets.everyday_distill_questions())
    assert len({" ".join(q.lower().split()) for q in questions}) == len(questions)
    for q in questions:
        assert q == q.strip() and "\n" not in q, q
        assert MIN_WORDS <= len(q.split()) <= MAX_WORDS, q
    assert datasets.distill_prompts("everyday", 7) == questions[:7]


def test_everyday_evaluation_and_distillation_sets_share_no_six_word_run() -> None:
    held_out = set().union(*(_runs(q) for q in datasets.EVERYDAY_QUESTIONS))
    assert held_out, "no evaluation runs to compare with"
    evaluation = {" ".join(q.lower().split()) for q in datasets.EVERYDAY_QUESTIONS}
    for q in datasets.everyday_distill_questions():
        assert " ".join(q.lower().split()) not in evaluation, q
        assert not _runs(q) & held_out, q


def test_six_word_run_check_catches_a_copied_question() -> None:
    copied = "Quick one: " + datasets.EVERYDAY_QUESTIONS[3]
    held_out = set().union(*(_runs(q) for q in datasets.EVERYDAY_QUESTIONS))
    assert _runs(copied) & held_out


def test_everyday_eval_prompts_are_distinct_short_strings() -> None:
    n = len(datasets.EVERYDAY_QUESTIONS)
    prompts = datasets.eval_prompts("everyday", n)
    assert len(prompts) == n
    assert all(isinstance(p, str) for p in prompts)
    assert len(set(prompts)) == n
    assert len({" ".join(p.lower().split()) for p in prompts}) == n  # no near-duplicate spellings
    for p in prompts:
        assert p == p.strip() and "\n" not in p, p
        assert MIN_WORDS <= len(p.split()) <= MAX_WORDS, p


@pytest.mark.parametrize("n", [0, 1, 5, 60])
def test_everyday_eval_prompts_are_the_first_n(n: int) -> None:
    prompts = datasets.eval_prompts("everyday", n)
    assert prompts == list(datasets.EVERYDAY_QUESTIONS[:n])


def test_everyday_prompts_absent_from_chat_distillation() -> None:
    everyday = datasets.eval_prompts("everyday", len(datasets.EVERYDAY_QUESTIONS))
    distill = datasets.distill_prompts("chat", 2000)
    assert distill, "no chat distillation prompts to compare with"
    assert not set(everyday) & set(distill)
    lowered = [d.lower() for d in distill]
    inside = [q for q in everyday if any(q.lower() in d for d in lowered)]
    assert not inside, inside


@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("everyday", len(datasets.EVERYDAY_QUESTIONS) + 1),
        ("everyday", -1),
        ("Everyday", 1),
        ("poetry", 1),
    ],
)
def test_eval_prompts_refuses_bad_kind_or_n(kind: str, n: int) -> None:
    with pytest.raises(ValueError):
        datasets.eval_prompts(kind, n)


def test_everyday_has_no_documents() -> None:
    with pytest.raises(ValueError):
        datasets.distill_documents("everyday", 1)
