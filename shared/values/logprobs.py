"""The target's log-probabilities of emitted tokens, read from the verification forward.

They are the model's raw log-probabilities (log_softmax of the target's logits, before
temperature, penalties, logit_bias and the top-k/top-p/min_p filters), as vLLM returns by
default: the same whether or not the request speculated, since every emitted token's logits row
is one row of the forward that verified it (a tree node's row, or a prompt's last row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """Per emitted token: its log-probability and the `k` likeliest tokens with theirs."""

    logprobs: tuple[float, ...]  # [n]
    top_ids: tuple[tuple[int, ...], ...]  # [n][k], likeliest first
    top_logprobs: tuple[tuple[float, ...], ...]  # [n][k]

    def __post_init__(self) -> None:
        n = len(self.logprobs)
        if len(self.top_ids) != n or len(self.top_logprobs) != n:
            raise ValueError("logprobs, top_ids and top_logprobs differ in length")
        if any(len(a) != len(b) for a, b in zip(self.top_ids, self.top_logprobs, strict=True)):
            raise ValueError("top_ids and top_logprobs differ in width")

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    def tail(self, start: int) -> TokenLogprobs:
        return TokenLogprobs(self.logprobs[start:], self.top_ids[start:], self.top_logprobs[start:])

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(
            self.logprobs + other.logprobs,
            self.top_ids + other.top_ids,
            self.top_logprobs + other.top_logprobs,
        )


EMPTY = TokenLogprobs((), (), ())


def token_logprobs(
    logits: torch.Tensor,  # [R, V] the rows that predicted each emitted token
    tokens: Sequence[int],  # [R] the emitted tokens
    num_top: int,
) -> TokenLogprobs:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if num_top:
        top = logp.topk(min(num_top, logp.shape[1]), dim=-1)
        top_ids = [tuple(row) for row in top.indices.tolist()]
        top_lps = [tuple(row) for row in top.values.tolist()]
    else:
        top_ids, top_lps = [() for _ in tokens], [() for _ in tokens]
    return TokenLogprobs(tuple(chosen), tuple(top_ids), tuple(top_lps))
