"""The "everyday" evaluation kind of `shared.datasets`: short everyday questions written for the
project, served by `eval_prompts` only and held out of every distillation source."""

from __future__ import annotations

import pytest

from shared import datasets

MIN_WORDS = 4
MAX_WORDS = 25


def test_everyday_kind_is_evaluation_only_and_kinds_unchanged() -> None:
    assert datasets.KINDS == ("chat", "code", "math")
    assert datasets.EVAL_KINDS == ("chat", "code", "math", "everyday")
    assert len(datasets.EVERYDAY_QUESTIONS) == 120


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


def test_distillation_refuses_everyday() -> None:
    with pytest.raises(ValueError):
        datasets.distill_prompts("everyday", 1)
    with pytest.raises(ValueError):
        datasets.distill_documents("everyday", 1)
