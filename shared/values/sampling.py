"""Sampling options and the target distribution they define.

Lossless speculative sampling reproduces exactly the distribution of plain sampling from the
*processed* target distribution: the logits processors (`shared.engine.processors`: min_tokens,
logit_bias, repetition/frequency/presence penalties, with the counts of each tree node's own
path), then / temperature, then min_p, then top-k, then top-p (nucleus), vLLM's order.

Randomness: an unseeded request draws from generators keyed by (seed, step, stream), so a
redelivered step redraws the same numbers. A seeded request samples through Gumbel noise keyed
by (seed, output position) alone (`gumbel_noise`): its tokens do not depend on steps, drafts or
what else runs (`docs/engine.md`, "Seeds that reproduce").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.errors import InvalidRequestError

MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 100.0
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MIN_TEMPERATURE = 1e-5  # below: greedy (vLLM's epsilon); dividing logits by less overflows
SEED_BITS = 63
MAX_STRUCTURED_SPEC_CHARS = 65_536  # a schema, regex or grammar longer than this is refused
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# Streams of random numbers per (request, step): one for drafting, one for verification.
DRAFT_STREAM = 0
VERIFY_STREAM = 1
GUMBEL_STREAM = 2  # a seeded request's noise, keyed by (seed, output position, GUMBEL_STREAM)
NOISE_CACHE_SIZE = 64  # positions' noise kept (a 49k vocabulary: 0.4 MB each)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text, compiled by `shared.grammar` (one per request).

    kind: "json_object" (any JSON object; spec ""), "json_schema" (spec: the schema as JSON
    text), "regex" (spec: the pattern), "choice" (spec: a JSON list of the allowed strings),
    "grammar" (spec: a Lark grammar as llguidance reads it)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}",
                param="response_format",
            )
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} is {len(self.spec)} characters; at most "
                f"{MAX_STRUCTURED_SPEC_CHARS} are accepted",
                param="response_format",
            )


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # logits processors (vLLM's semantics): presence/frequency over the output so far,
    # repetition over prompt and output; logit_bias as sorted (token id, bias) pairs (a mapping
    # with int or str keys is accepted); min_tokens masks EOS and stop_token_ids until then
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_p: float = 0.0
    min_tokens: int = 0
    # the target's raw log-probabilities of each emitted token and its top `logprobs`
    # alternatives (None: none returned; 0: the emitted token's alone)
    logprobs: int | None = None
    # the target's raw log-probabilities of each prompt token but the first, with the top
    # `prompt_logprobs` alternatives, read from the prefill forward (vLLM's `prompt_logprobs`);
    # such a request computes its whole prompt (it does not reuse cached prefix blocks)
    prompt_logprobs: int | None = None
    # the output must follow this grammar (JSON schema, regex, choice, ...); every node of a
    # draft tree is masked with the grammar state along its path
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:  # vLLM's and SGLang's "off"
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check_processors()
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

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}]", param=name
                )
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
                param="repetition_penalty",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
                param="min_tokens",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_coupled(self) -> bool:
        """Seeded sampling: each position's token is the argmax of the processed log-probabilities
        plus Gumbel noise keyed by (seed, position); speculation verifies it as greedy does."""
        return self.seed is not None and not self.is_greedy

    @property
    def needs_counts(self) -> bool:
        """Whether the processors read the tokens so far (the penalties)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_filters(self) -> bool:
        """Whether min_p, top-k or top-p may drop tokens after the temperature."""
        return self.min_p > 0.0 or self.top_k > 0 or self.top_p < 1.0

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor changes the model's logits."""
        return self.needs_counts or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def needs_output(self) -> bool:
        """Whether drafting and verification read the committed output itself (the penalties'
        counts, a grammar's state)."""
        return self.needs_counts or self.structured is not None

    @property
    def needs_history(self) -> bool:
        """Whether drafting and verification need the request's `TokenHistory`."""
        return self.needs_output or self.min_tokens > 0 or self.is_coupled


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, checked; ids are checked against the
    vocabulary where it is known (the gateway, the engine)."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, Iterable):
        raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
    pairs: dict[int, float] = {}
    for item in items:
        try:
            key, value = item
            token = int(key)  # JSON keys are strings
        except (TypeError, ValueError):
            raise InvalidRequestError(
                "logit_bias must map token ids to biases", param="logit_bias"
            ) from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError("logit_bias values must be numbers", param="logit_bias")
        if token < 0 or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidRequestError(
                f"logit_bias: token ids >= 0, biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                param="logit_bias",
            )
        pairs[token] = float(value)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias holds more than {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias"
        )
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class TokenHistory:
    """What a request's processors and seeded noise read, sent with each step when
    `SamplingParams.needs_history`: the committed output's length (the output position the
    root's next token takes), the output itself (penalties and grammars only), the prompt's
    distinct ids (repetition penalty only) and the ids min_tokens masks (EOS unless ignore_eos,
    stop ids)."""

    output_len: int
    output: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.output_len < 0 or len(self.output) > self.output_len:
            raise ValueError("output_len is >= 0 and counts the output sent")


def token_history(
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Sequence[int],
) -> TokenHistory | None:
    """A request's history for this step (None when its sampling reads none)."""
    if not params.needs_history:
        return None
    end_ids: tuple[int, ...] = ()
    if params.min_tokens > len(output):
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        end_ids = tuple(sorted({*eos, *params.stop_token_ids}))
    repeats = params.repetition_penalty != 1.0
    return TokenHistory(
        output_len=len(output),
        output=tuple(output) if params.needs_output else (),
        prompt=tuple(sorted(set(prompt))) if repeats else (),
        end_ids=end_ids,
    )


@functools.lru_cache(maxsize=NOISE_CACHE_SIZE)
def gumbel_noise(seed: int, position: int, size: int) -> np.ndarray:
    """[size] float64 standard Gumbel noise of one output position of a seeded request (read
    only); a prefix of the noise of a larger size (draws are sequential), so drafts and targets
    whose vocabularies differ in padding see the same noise for the same id. Cached: the next
    step's tree covers most of this step's positions again."""
    noise = np.random.default_rng([seed, position, GUMBEL_STREAM]).gumbel(size=size)
    noise.flags.writeable = False
    return noise


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
    if params.min_p > 0.0:  # drop tokens less likely than min_p times the likeliest
        logp = torch.log_softmax(x, dim=-1)
        floor = logp.max(-1, keepdim=True).values + math.log(params.min_p)
        x = x.masked_fill(logp < floor, float("-inf"))
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
    "n": (1, None),
    "best_of": (1, None),
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
