"""The per-request entries of one speculation step, as the scheduler core and the executors
pass them: what to draft (`DraftRequest`), what a drafter proposed (`DraftedTree`), what to verify
(`VerifyRequest`) and what the target committed (`VerifiedRequest`). `shared.wire.steps` carries
them between processes inside its per-micro-batch messages; the in-process engine passes them
as they are. Entries carrying token trees compare by identity (trees hold numpy arrays); entries
carrying the target's hidden-state features compare them by value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import numpy as np

from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, TokenHistory
from shared.values.tree import TokenTree

MAX_ID_LEN = 128
MAX_APP_LEN = 128  # an application key (`augury.app`)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled or failed


GRAMMAR_DEAD_END = "grammar_dead_end"  # a VerifiedRequest error: the grammar allows no token


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_ID_LEN:
        raise ValueError(f"request ids are 1 to {MAX_ID_LEN} characters")


def _check_features(features: np.ndarray | None) -> None:
    if features is not None and (
        not isinstance(features, np.ndarray) or features.ndim != 2 or features.dtype != np.float16
    ):
        raise ValueError("features are a 2-D float16 array")


def _same_entry(a: Any, b: Any) -> bool:
    """Field-wise equality of two entries of one type, comparing `features` arrays by value."""
    if type(a) is not type(b):
        return False
    others = [f.name for f in fields(a) if f.name != "features"]
    if [getattr(a, n) for n in others] != [getattr(b, n) for n in others]:
        return False
    x, y = a.features, b.features
    if x is None or y is None:
        return x is y
    return x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


@dataclass(frozen=True)
class DraftRequest:
    """One request's part of a DraftJob.

    The drafter holds `base_len` committed tokens of this request; `new_tokens` are the tokens
    committed since (the whole prompt when base_len is 0). It drops whatever it speculated past
    them, appends them, and grows a tree rooted at the last one. A drafter whose state does not
    hold exactly `base_len` tokens answers with an error so the scheduler resends from 0.

    `features` (feature-level drafters; written only when set): float16 [rows, H], the target's
    last-layer hidden states at the position before each of `new_tokens` (the first prompt
    token has none, so rows = len(new_tokens) - 1 when base_len is 0, else len(new_tokens)).
    """

    request_id: str
    step: int
    base_len: int
    new_tokens: tuple[int, ...]
    method: DraftMethod
    sampling: SamplingParams
    seed: int  # the request's resolved seed (randomness is keyed by seed, step, stream)
    # The scheduler's plan for this step: at most this many draft tokens (0: the method's own
    # limit) and no deeper than `max_depth` (0: the method's depth). Sent only when set.
    max_nodes: int = 0
    max_depth: int = 0
    features: np.ndarray | None = field(default=None, hash=False)
    # what the request's processors and seeded noise read (written only when set)
    history: TokenHistory | None = None
    # the application key the request named (`augury.app`): a model-free `suffix` draft shares
    # its cache of recent sequences among the requests of one key. Sent only when set.
    app: str = ""

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if len(self.app) > MAX_APP_LEN:
            raise ValueError(f"app is at most {MAX_APP_LEN} characters")
        if self.step < 0 or self.base_len < 0 or self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError("step, base_len, max_nodes and max_depth are >= 0")
        if self.base_len + len(self.new_tokens) == 0:
            raise ValueError("a draft needs at least one committed token")
        _check_features(self.features)
        rows = len(self.feature_tokens)
        if self.features is not None and len(self.features) != rows:
            raise ValueError(f"features need {rows} rows for these new tokens")

    @property
    def feature_tokens(self) -> tuple[int, ...]:
        """The new tokens that have a feature before them (one per row of `features`): all of
        them, but the request's first token when drafting starts over."""
        return self.new_tokens[1:] if self.base_len == 0 else self.new_tokens

    def __eq__(self, other: object) -> bool:
        return _same_entry(self, other)


@dataclass(frozen=True, eq=False)
class DraftedTree:
    """One request's candidate tree, or `tree=None` with the reason it could not draft."""

    request_id: str
    step: int
    tree: TokenTree | None
    error: str | None = None  # e.g. out_of_sync (resend from base_len 0), out_of_memory

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if (self.tree is None) == (self.error is None):
            raise ValueError("a drafted tree carries either a tree or an error")


@dataclass(frozen=True, eq=False)
class VerifyRequest:
    """One request's part of a VerifyJob: a chunk of committed tokens to prefill, or a tree.

    A chunk holds committed tokens at positions chunk_start.. (a prompt piece, or recomputation
    after preemption); after the chunk with `chunk_is_last` the verifier samples the first new
    token from the last position. A tree's root is the last committed token (KV not yet
    computed); the verifier accepts a path and samples one bonus token. `max_new_tokens` is what
    the request may still emit, so the verifier can finish it with "length".

    `context_len` (trees; written only when set): the tokens whose KV the verifier must already
    hold, the root's position. A verifier holding any other length answers `out_of_sync`
    instead of extending a KV that a stale, redelivered job has already moved.

    `want_features` (written only when set): return the target's hidden states with the result
    (VerifiedRequest.features), for a feature-level drafter.
    """

    request_id: str
    step: int
    sampling: SamplingParams
    seed: int
    max_new_tokens: int
    chunk: tuple[int, ...] = ()
    chunk_start: int = 0
    chunk_is_last: bool = False
    tree: TokenTree | None = None
    context_len: int | None = None
    want_features: bool = False
    # what the request's processors and seeded noise read (written only when set)
    history: TokenHistory | None = None

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if bool(self.chunk) == (self.tree is not None):
            raise ValueError("a verify entry carries either a prefill chunk or a token tree")
        if self.step < 0 or self.chunk_start < 0 or self.max_new_tokens < 0:
            raise ValueError("step, chunk_start and max_new_tokens are >= 0")
        if self.context_len is not None and (self.context_len < 0 or self.tree is None):
            raise ValueError("context_len is >= 0 and belongs to a tree")


@dataclass(frozen=True)
class VerifiedRequest:
    """What one request committed in a verify step.

    `accepted` are tree tokens the target accepted, root's child first; `bonus` is the target's
    own next token (None after a chunk that was not the last, or when an accepted token finished
    the request). An `error` (e.g. out_of_kv_memory) means nothing was committed.

    `features` (when the entry asked for them; written only when set): float16 [rows, H], the
    target's last-layer hidden states of a tree's accepted KV path (the root, then each accepted
    token: 1 + len(accepted) rows) or of each token of a prefill chunk.

    `cached_tokens` (a chunk's; written only when set): how many of the chunk's first tokens the
    verifier found in its prefix cache and did not compute.
    """

    request_id: str
    step: int
    accepted: tuple[int, ...] = ()
    bonus: int | None = None
    finish: FinishReason | None = None
    error: str | None = None
    features: np.ndarray | None = field(default=None, hash=False)
    # the target's log-probabilities of new_tokens (asked with SamplingParams.logprobs; written
    # only when set)
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0
    # a chunk's: the target's log-probabilities of its prompt tokens (the prompt's first token
    # has none), asked with SamplingParams.prompt_logprobs; written only when set
    prompt_logprobs: TokenLogprobs | None = None

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        _check_features(self.features)
        if self.logprobs is not None and len(self.logprobs) != len(self.new_tokens):
            raise ValueError("logprobs need one entry per new token")

    def __eq__(self, other: object) -> bool:
        return _same_entry(self, other)

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return self.accepted if self.bonus is None else (*self.accepted, self.bonus)
