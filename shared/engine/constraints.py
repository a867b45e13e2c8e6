"""What the verifier and the drafters ask of a grammar (`shared.grammar.GrammarBook` answers):
the tokens allowed after each tree node, the tokens forced after a node, and dead ends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shared.values.sampling import StructuredOutput


class NodeConstraints(Protocol):
    def allowed(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        paths: Sequence[Sequence[int]],
        width: int,
    ) -> torch.Tensor:
        """[len(paths), width] bool: the tokens allowed after the committed `output` and each
        path (by full token id)."""
        ...

    def forced(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        path: Sequence[int],
        limit: int,
    ) -> list[int]:
        """The run of at most `limit` tokens the grammar forces after `output` and `path`."""
        ...

    def canonical(self, tokens: Sequence[int]) -> list[int]:
        """The tokenizer's own tokenization of the tokens' text."""
        ...

    def dead_end(
        self, request_id: str, structured: StructuredOutput, output: Sequence[int]
    ) -> str | None:
        """Why no token may follow the committed output (None: some may)."""
        ...

    def free(self, request_id: str) -> None: ...
