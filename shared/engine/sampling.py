"""Sampling options and the target distribution they define.

Lossless speculative sampling reproduces exactly the distribution of plain sampling from the
*processed* target distribution: logits / temperature, then top-k, then top-p (nucleus).
Randomness is counter-based: every draw for a request comes from a generator keyed by
(seed, step, stream), so a seeded request reproduces exactly whatever else is in its batch, and
a redelivered step redraws the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.errors import InvalidRequestError

MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-5  # below: greedy (vLLM's epsilon); dividing logits by less overflows
SEED_BITS = 63

# Streams of random numbers per (request, step): one for drafting, one for verification.
DRAFT_STREAM = 0
VERIFY_STREAM = 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # 1/T would overflow: greedy, as vLLM does
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
                param="temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.seed is not None and not 0 <= self.seed < 2**SEED_BITS:
            raise InvalidRequestError(f"seed must be in [0, 2^{SEED_BITS})", param="seed")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def step_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, stream])


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float64 probabilities of the distribution we sample from."""
    if params.is_greedy:
        probs = torch.zeros_like(logits, dtype=torch.float64)
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs
    x = logits.double() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from one distribution [V] with a uniform u in [0, 1)."""
    cdf = probs.cumsum(-1)
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    idx = int(torch.searchsorted(cdf, target, right=True))
    # guard against round-off at the top end, and never return a zero-probability token
    idx = min(idx, probs.shape[-1] - 1)
    while probs[idx] <= 0:
        idx -= 1
    return idx


# Options other servers accept that we do not implement, with the values that mean "off". A
# request may send a neutral value; anything else is refused, never silently ignored. The one
# list for the gateway and the engine.
UNSUPPORTED_OPTIONS: dict[str, tuple[object, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "n": (1, None),
    "best_of": (1, None),
    "min_p": (0, 0.0, None),
    "use_beam_search": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def refuse_unsupported(options: Mapping[str, object]) -> None:
    """Raise `UnsupportedOptionError` for the first option we would otherwise ignore."""
    from shared.errors import UnsupportedOptionError

    for name, neutral in UNSUPPORTED_OPTIONS.items():
        if name in options and options[name] not in neutral:
            raise UnsupportedOptionError(
                f"{name}={options[name]!r} is not supported by this server", param=name
            )


SUPPORTED_OPTIONS = {f.name for f in SamplingParams.__dataclass_fields__.values()}


def sampling_params_from_options(**options: object) -> SamplingParams:
    """Build SamplingParams from request options, refusing what we would otherwise ignore."""
    from shared.errors import UnsupportedOptionError

    refuse_unsupported(options)
    for name in options:
        if name not in SUPPORTED_OPTIONS and name not in UNSUPPORTED_OPTIONS:
            raise UnsupportedOptionError(f"unknown sampling option {name!r}", param=name)
    kwargs = {k: v for k, v in options.items() if k in SUPPORTED_OPTIONS and v is not None}
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])  # type: ignore[arg-type]
    return SamplingParams(**kwargs)  # type: ignore[arg-type]
