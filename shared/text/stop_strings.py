"""Stop strings, matched on the detokenized text as it arrives, across token boundaries.

Text is released as soon as no stop string can still begin in it: only the longest tail that
is a prefix of some stop string is held back. A match ends the output at the match (or after it,
with `include_stop_str_in_output`); the match that completes first in the text wins. The
gateway and the in-process engine share this one matcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.text.detokenize import IncrementalDetokenizer


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], *, include_in_output: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.include_in_output = include_in_output
        self.matched: str | None = None  # the stop string found, once found
        self._held = ""  # text that may be the start of a stop string

    def push(self, text: str) -> str:
        """Take the next text; return what may be released now (nothing after a match)."""
        if self.matched is not None or not text:
            return ""
        buffer = self._held + text
        found = self._earliest(buffer)
        if found is not None:
            start, stop = found
            self.matched, self._held = stop, ""
            return buffer[: start + len(stop) if self.include_in_output else start]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The text held back, at the end of the output (no stop string came)."""
        held, self._held = self._held, ""
        return held

    def _earliest(self, buffer: str) -> tuple[int, str] | None:
        """The match that completes first (ties: the one that starts first), so that how the
        text was split into pushes never changes which stop string wins."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0:
                found = (start + len(stop), start, stop)
                best = found if best is None else min(best, found)
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that a stop string starts with."""
        longest = 0
        end = len(buffer)
        for stop in self.stops:
            # candidate starts: where the stop's first character occurs in its reach
            start = buffer.find(stop[0], max(0, end - len(stop) + 1))
            while start != -1 and end - start > longest:
                if stop.startswith(buffer[start:]):
                    longest = end - start
                    break
                start = buffer.find(stop[0], start + 1)
        return longest


@dataclass(frozen=True)
class TextStep:
    text: str  # text released by these tokens
    num_tokens: int  # how many of the tokens were taken (fewer when a stop string ended it)
    stop: str | None = None  # the stop string that ended the output, if one did


@dataclass
class OutputText:
    """One request's output as text: detokenized a token at a time, cut at a stop string."""

    tokenizer: Any
    stops: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""  # everything released so far
    _detokenizer: IncrementalDetokenizer = field(init=False)
    _matcher: StopStringMatcher = field(init=False)

    def __post_init__(self) -> None:
        self._detokenizer = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=self.skip_special_tokens
        )
        self._matcher = StopStringMatcher(
            self.stops, include_in_output=self.include_stop_str_in_output
        )

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output (None: none did)."""
        return self._matcher.matched

    def push(self, token_ids: Sequence[int]) -> TextStep:
        """Take the next tokens; stops at the token that completes a stop string."""
        pieces: list[str] = []
        for taken, token in enumerate(token_ids, start=1):
            if self.stop_reason is not None:
                return self._step(pieces, taken - 1)
            pieces.append(self._matcher.push(self._detokenizer.step(token)))
        return self._step(pieces, len(token_ids))

    def finish(self) -> str:
        """The rest of the text at the end of the output: what was waiting for more bytes or
        held back as a possible stop string (nothing after a stop string)."""
        if self.stop_reason is not None:
            return ""
        rest = self._matcher.push(self._detokenizer.finish())
        if self.stop_reason is None:
            rest += self._matcher.flush()
        self.text += rest
        return rest

    def _step(self, pieces: list[str], taken: int) -> TextStep:
        released = "".join(pieces)
        self.text += released
        return TextStep(released, taken, self.stop_reason)
