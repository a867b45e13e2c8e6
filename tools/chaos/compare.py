"""A streamed answer against its reference token ids, in tokens lost, repeated and wrong.

The API streams text, not token ids, so the comparison is on text: the reference is decoded
with the gateway's tokenizer (special tokens skipped, as the gateway does) and the two texts are
aligned with difflib. Identical text with the reference's token count is 0 lost, 0 repeated.
Otherwise, for each place where they differ: text the answer has and the reference has
elsewhere counts as repeated (a chunk sent twice), in the reference tokens that spell it;
reference text the answer lacks there counts as lost, in the reference tokens it covers,
unless other text stands in its place: that is wrong output (a diverged decode), counted in
the larger of the tokens it replaced and its length over the reference's mean characters per
token. With equal text and unequal counts (tokens that decode to nothing, such as an ignored
EOS), the difference in count is lost or repeated. A failed request is compared to the
reference's first tokens, as many as its usage reported, so an answer cut by a dead gateway
loses nothing by being cut.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]
REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to; the gateway holds it back


@dataclass(frozen=True)
class Comparison:
    identical: bool
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0


class Reference:
    """One request's reference ids, their text and where each token's text starts in it."""

    def __init__(self, ids: Sequence[int], decode: Decode) -> None:
        self.ids = list(ids)
        self.decode = decode
        self.offsets = [len(decode(self.ids[:i])) for i in range(len(self.ids) + 1)]

    def text(self, num_tokens: int) -> str:
        return self.decode(self.ids[:num_tokens])

    def tokens_in(self, start: int, end: int, num_tokens: int) -> int:
        """How many of the first `num_tokens` tokens have most of their text in [start, end)
        (a character diff need not cut where tokens do)."""
        count = 0
        for i in range(min(num_tokens, len(self.ids))):
            first, last = self.offsets[i], self.offsets[i + 1]
            inside = min(end, last) - max(start, first)
            count += last > first and 2 * inside > last - first
        return count

    def chars_per_token(self) -> float:
        return max(1.0, self.offsets[-1] / max(1, len(self.ids)))


def compare(text: str, num_tokens: int, reference: Reference, *, complete: bool) -> Comparison:
    """`text` in `num_tokens` tokens, against the whole reference when the request completed,
    else against as many of its first tokens."""
    expected_n = len(reference.ids) if complete else min(num_tokens, len(reference.ids))
    expected = reference.text(expected_n)
    if not complete and expected.startswith(text) and not expected[len(text) :].strip(REPLACEMENT):
        expected = text  # a cut answer: the gateway had held back an incomplete character
    if text == expected:
        if num_tokens == expected_n:
            return Comparison(identical=True)
        return Comparison(
            identical=False,
            lost=max(0, expected_n - num_tokens),
            duplicated=max(0, num_tokens - expected_n),
        )
    lost = duplicated = wrong = 0
    matcher = difflib.SequenceMatcher(None, expected, text, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        missing = max(1, reference.tokens_in(i1, i2, expected_n)) if i2 > i1 else 0
        extra = text[j1:j2]
        found = expected.find(extra) if extra else -1
        if found >= 0:  # text the reference has elsewhere: a repeat (of what was missing here)
            duplicated += max(1, reference.tokens_in(found, found + len(extra), expected_n))
            lost += missing
        elif extra:  # other text in place of (or beside) the reference's: wrong tokens
            wrong += max(missing, round(len(extra) / reference.chars_per_token()), 1)
        else:
            lost += missing
    return Comparison(identical=False, lost=lost, duplicated=duplicated, wrong=wrong)
