"""Incremental detokenization and stop strings (shared/text/), on the real SmolLM2 tokenizer:
streamed pieces concatenate to the full decode (emoji, CJK, byte tokens, random ids), and a stop
string is found across token boundaries with only a possible match's tail held back."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model.smollm2 import ensure_smollm2
from shared.text.detokenize import IncrementalDetokenizer
from shared.text.stop_strings import OutputText, StopStringMatcher

TEXTS = [
    "Hello 😀 world 你好，世界 🇫🇷 naïve café",
    "👩‍👩‍👧‍👦 family, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ∑ x² ≤ 3",
    " spaces  and\ttabs\n\nnew lines",
    "日本語のテキストと한국어 텍스트",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def streamed(tokenizer: Any, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.step(token) for token in ids] + [detokenizer.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = streamed(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "\ufffd" not in "".join(pieces)  # no half characters on the way


def test_multi_byte_characters_split_over_byte_tokens(tokenizer: Any) -> None:
    # a character the vocabulary has no token for comes as byte tokens: nothing until complete
    ids = tokenizer.encode("𝔘", add_special_tokens=False)
    assert len(ids) > 1
    pieces = streamed(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "𝔘"


def test_random_ids_including_dangling_bytes(tokenizer: Any) -> None:
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.2:
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
        assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_matcher_holds_back_only_a_possible_stop() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("abc S") == "abc "  # "S" may start STOP
    assert matcher.push("T") == ""
    assert matcher.push("x\n") == "STx"  # no longer a match; "\n" may start "\n\n"
    assert matcher.push("ab") == "\nab"
    assert matcher.push("cSTO") == "c"
    assert matcher.push("P and more") == "" and matcher.matched == "STOP"
    assert matcher.push("later") == ""


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The output and stop string, from the whole text: the match that completes first."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_matcher_equals_matching_the_whole_text(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    matcher = StopStringMatcher(stops, include_in_output=include)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    released = "".join(matcher.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    if matcher.matched is None:
        released += matcher.flush()
    assert (released, matcher.matched) == reference_cut(text, stops, include)


def test_matcher_first_completed_match_and_include() -> None:
    matcher = StopStringMatcher(["world", "lo w"], include_in_output=True)
    assert matcher.push("hello world") == "hello w" and matcher.matched == "lo w"
    nested = StopStringMatcher(["abcd", "bc"])
    assert nested.push("abcd") == "a" and nested.matched == "bc"  # "bc" completes first
    plain = StopStringMatcher(["lo"])
    assert plain.push("hello") == "hel" and plain.flush() == ""
    unmatched = StopStringMatcher(["xyz"])
    assert unmatched.push("abcx") == "abc" and unmatched.flush() == "x"
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@pytest.mark.parametrize("include", [False, True])
def test_output_text_stops_inside_a_step_across_tokens(tokenizer: Any, include: bool) -> None:
    text = "The answer is 42. 你好世界 and then some more words follow here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "好世界 an"  # spans several tokens, multi-byte ones among them
    output = OutputText(tokenizer, [stop], include_stop_str_in_output=include)
    released = []
    taken = 0
    for start in range(0, len(ids), 5):  # steps of 5 accepted tokens
        step = output.push(ids[start : start + 5])
        released.append(step.text)
        taken += step.num_tokens
        if step.stop is not None:
            break
    released.append(output.finish())
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(released) == output.text == text[:cut]
    assert output.stop_reason == stop
    # the tokens taken end with the one that completed the stop string
    assert stop in tokenizer.decode(ids[:taken]) and stop not in tokenizer.decode(ids[: taken - 1])


def test_output_text_without_a_match_releases_everything(tokenizer: Any) -> None:
    text = "no stop here, but it ends with S"
    ids = tokenizer.encode(text, add_special_tokens=False)
    output = OutputText(tokenizer, ["STOP"])
    released = [output.push([token]).text for token in ids] + [output.finish()]
    assert "".join(released) == text and output.stop_reason is None
