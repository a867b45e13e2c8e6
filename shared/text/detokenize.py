"""Incremental detokenization: each new token's text, in time linear in the output.

Decoding a request's whole output at every step costs O(n^2) over its length, and taking the
new text as the tail of the longer decode assumes the old text is a prefix of the new one, which
fails where tokens merge (a UTF-8 character split over byte tokens, SentencePiece's leading
space). `tokenizers`' `DecodeStream` decodes a short window of the previous tokens plus the new
one and emits the difference once it is valid UTF-8; we add what it lacks: `finish` flushes the
bytes still waiting at the end (as the replacement characters a full decode shows), so that the
pieces always concatenate to `decode(all ids)`.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 4  # tokens kept before the waiting ones, for `finish`'s window


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or that one itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend")
    return backend


class IncrementalDetokenizer:
    """One request's output text, a token at a time."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # the last tokens that made text
        self._waiting: list[int] = []  # tokens since, that made none yet

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still incomplete)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._waiting.append(token_id)
            return ""
        self._context = [*self._context, *self._waiting, token_id][-CONTEXT_TOKENS:]
        self._waiting = []
        return piece

    def finish(self) -> str:
        """The text of tokens still waiting at the end (replacement characters for bytes that
        never completed a character); "" when none wait."""
        if not self._waiting:
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special
        before = decode(self._context, skip_special_tokens=skip)
        after = decode([*self._context, *self._waiting], skip_special_tokens=skip)
        self._context, self._waiting = [], []
        return after[len(before) :] if after.startswith(before) else after
