"""Log-probabilities as OpenAI's two APIs show them.

The values are the target's raw log-probabilities (before temperature, penalties and filters)
that the verifier read from the forward that verified each token (`shared.values.logprobs`).
Each token's text is its own decoding; `bytes` are that text's UTF-8 bytes.

Chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}, ...]}]}`, `top_logprobs` holding the asked number of likeliest tokens.
Completions: `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, each
`top_logprobs` entry a map of token text to log-probability holding the likeliest tokens and the
emitted one (vLLM's convention, so `logprobs: 0` maps each token to its own log-probability),
`text_offset` each token's character offset in the choice's text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from services.gateway.body import Tokenizer
from shared.values.logprobs import TokenLogprobs


def _text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _value(logprob: float) -> float:
    """JSON has no -Infinity: a token the model gives no mass gets the smallest float."""
    return logprob if math.isfinite(logprob) else -9999.0


def _chat_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: TokenLogprobs
) -> dict[str, Any]:
    """`{"content": [...]}` for these tokens (one entry each)."""
    content = []
    for i, token in enumerate(token_ids):
        entry = _chat_entry(tokenizer, token, logprobs.logprobs[i])
        entry["top_logprobs"] = [
            _chat_entry(tokenizer, alt, lp)
            for alt, lp in zip(logprobs.top_ids[i], logprobs.top_logprobs[i], strict=True)
        ]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: TokenLogprobs, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions object for these tokens; offsets start at `text_offset`."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for i, token in enumerate(token_ids):
        text = _text(tokenizer, token)
        tokens.append(text)
        values.append(_value(logprobs.logprobs[i]))
        top = {
            _text(tokenizer, alt): _value(lp)
            for alt, lp in zip(logprobs.top_ids[i], logprobs.top_logprobs[i], strict=True)
        }
        top.setdefault(text, _value(logprobs.logprobs[i]))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def choice_logprobs(
    chat: bool,
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: TokenLogprobs | None,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's `logprobs` field for these tokens (None: the request asked for none)."""
    if logprobs is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, token_ids, logprobs)
    return completion_logprobs(tokenizer, token_ids, logprobs, text_offset)


# ---- the prompt's: completions' `echo` and vLLM's `prompt_logprobs` ------------------------------


def echo_logprobs(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], prompt_logprobs: TokenLogprobs
) -> dict[str, Any]:
    """The completions object for an echoed prompt: every prompt token, the first with null
    `token_logprobs` and `top_logprobs` (nothing predicts it), offsets from 0."""
    first = _text(tokenizer, prompt_ids[0])
    rest = completion_logprobs(tokenizer, prompt_ids[1:], prompt_logprobs, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects one after the other (the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], prompt_logprobs: TokenLogprobs
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a map of token id to
    {logprob, rank, decoded_token} holding the prompt token and the likeliest ones. The rank
    (1: likeliest) is null for a prompt token outside the asked top."""
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for i, token in enumerate(prompt_ids[1:]):
        top_ids = prompt_logprobs.top_ids[i]
        rank = top_ids.index(token) + 1 if token in top_ids else None
        entry = {str(token): _vllm_entry(tokenizer, token, prompt_logprobs.logprobs[i], rank)}
        for r, (alt, lp) in enumerate(zip(top_ids, prompt_logprobs.top_logprobs[i], strict=True)):
            entry.setdefault(str(alt), _vllm_entry(tokenizer, alt, lp, r + 1))
        entries.append(entry)
    return entries


def _vllm_entry(tokenizer: Tokenizer, token: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": _value(logprob), "rank": rank, "decoded_token": _text(tokenizer, token)}
