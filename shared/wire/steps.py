"""Messages of one speculation step, all per micro-batch and keyed per entry by (request, step).

Scheduler -> a drafter replica: `DraftJob`; drafter -> scheduler: `CandidateTrees`.
Scheduler -> verifier: `VerifyJob`; verifier -> scheduler: `VerifyResult`.
Messages carrying token trees compare by identity (trees hold numpy arrays); entries carrying
the target's hidden-state features compare them by value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

import numpy as np

from shared.values.logprobs import TokenLogprobs
from shared.values.sampling import SamplingParams, TokenHistory
from shared.values.tree import TokenTree
from shared.wire.base import WireMessage
from shared.wire.codec import PayloadReader, pack_ints, pack_matrix_f16
from shared.wire.requests import MAX_APP_LEN, MAX_ID_LEN, check_request_id
from shared.wire.values import (
    DraftMethod,
    FinishReason,
    finish_payload,
    method_payload,
    optional_history_payload,
    optional_logprobs_payload,
    optional_tree_payload,
    read_finish,
    read_method,
    read_optional_history,
    read_optional_logprobs,
    read_optional_tree,
    read_sampling,
    sampling_payload,
)

MAX_REASON_LEN = 256


def _release_payload(request_ids: tuple[str, ...]) -> list[str]:
    return list(request_ids)


# ---- hidden-state features -------------------------------------------------------------------


def _check_features(features: np.ndarray | None) -> None:
    if features is not None and (
        not isinstance(features, np.ndarray) or features.ndim != 2 or features.dtype != np.float16
    ):
        raise ValueError("features are a 2-D float16 array")


def _features_payload(features: np.ndarray | None) -> dict[str, Any]:
    """Written only when set, so entries without features keep their version-1 bytes."""
    return {} if features is None else {"features": pack_matrix_f16(features)}


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


# ---- drafting --------------------------------------------------------------------------------


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

    def payload(self) -> dict[str, Any]:
        return (
            {
                "request_id": self.request_id,
                "step": int(self.step),
                "base_len": int(self.base_len),
                "new_tokens": pack_ints(self.new_tokens),
                "method": method_payload(self.method),
                "sampling": sampling_payload(self.sampling),
                "seed": int(self.seed),
            }
            | {name: int(v) for name, v in self._limits().items() if v}
            | _features_payload(self.features)
            | optional_history_payload(self.history)
            | ({"app": self.app} if self.app else {})
        )

    def _limits(self) -> dict[str, int]:
        return {"max_nodes": self.max_nodes, "max_depth": self.max_depth}

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            step=fields.integer("step", minimum=0),
            base_len=fields.integer("base_len", minimum=0),
            new_tokens=fields.tokens("new_tokens"),
            method=read_method(fields.sub("method")),
            sampling=read_sampling(fields.sub("sampling")),
            seed=fields.integer("seed", minimum=0),
            max_nodes=fields.integer("max_nodes", 0, minimum=0),
            max_depth=fields.integer("max_depth", 0, minimum=0),
            features=fields.optional_f16_matrix("features"),
            history=read_optional_history(fields),
            app=fields.text("app", "", max_len=MAX_APP_LEN),
        )


@dataclass(frozen=True)
class DraftJob(WireMessage):
    """Draft one micro-batch on one drafter replica; `release` frees finished requests' state."""

    TYPE: ClassVar[str] = "draft_job"
    micro_batch_id: int
    entries: tuple[DraftRequest, ...]
    release: tuple[str, ...] = ()

    def payload(self) -> dict[str, Any]:
        return {
            "micro_batch_id": int(self.micro_batch_id),
            "entries": [e.payload() for e in self.entries],
            "release": _release_payload(self.release),
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            entries=tuple(DraftRequest.from_payload(e) for e in fields.subs("entries")),
            release=fields.texts("release", max_len=MAX_ID_LEN),
        )


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

    def payload(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "step": int(self.step),
            "tree": optional_tree_payload(self.tree),
            "error": self.error,
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            step=fields.integer("step", minimum=0),
            tree=read_optional_tree(fields, "tree"),
            error=fields.optional_text("error", max_len=MAX_REASON_LEN),
        )


@dataclass(frozen=True, eq=False)
class CandidateTrees(WireMessage):
    """A drafter's answer to one DraftJob."""

    TYPE: ClassVar[str] = "candidate_trees"
    micro_batch_id: int
    model: str  # draft model name
    replica: str  # drafter replica that drafted (its draft KV is now warm)
    draft_ms: float  # time spent drafting this micro-batch
    entries: tuple[DraftedTree, ...]

    def payload(self) -> dict[str, Any]:
        return {
            "micro_batch_id": int(self.micro_batch_id),
            "model": self.model,
            "replica": self.replica,
            "draft_ms": float(self.draft_ms),
            "entries": [e.payload() for e in self.entries],
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            model=fields.text("model", max_len=64),
            replica=fields.text("replica", max_len=128),
            draft_ms=fields.number("draft_ms"),
            entries=tuple(DraftedTree.from_payload(e) for e in fields.subs("entries")),
        )


# ---- verification ----------------------------------------------------------------------------


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

    def payload(self) -> dict[str, Any]:
        return (
            {
                "request_id": self.request_id,
                "step": int(self.step),
                "sampling": sampling_payload(self.sampling),
                "seed": int(self.seed),
                "max_new_tokens": int(self.max_new_tokens),
                "chunk": pack_ints(self.chunk),
                "chunk_start": int(self.chunk_start),
                "chunk_is_last": bool(self.chunk_is_last),
                "tree": optional_tree_payload(self.tree),
            }
            | ({} if self.context_len is None else {"context_len": int(self.context_len)})
            | ({"want_features": True} if self.want_features else {})
            | optional_history_payload(self.history)
        )

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            step=fields.integer("step", minimum=0),
            sampling=read_sampling(fields.sub("sampling")),
            seed=fields.integer("seed", minimum=0),
            max_new_tokens=fields.integer("max_new_tokens", minimum=0),
            chunk=fields.tokens("chunk", ()),
            chunk_start=fields.integer("chunk_start", 0, minimum=0),
            chunk_is_last=fields.flag("chunk_is_last", False),
            tree=read_optional_tree(fields, "tree"),
            context_len=fields.optional_integer("context_len"),
            want_features=fields.flag("want_features", False),
            history=read_optional_history(fields),
        )


@dataclass(frozen=True, eq=False)
class VerifyJob(WireMessage):
    """One micro-batch for one verifier forward; `release` frees finished requests' KV."""

    TYPE: ClassVar[str] = "verify_job"
    micro_batch_id: int
    entries: tuple[VerifyRequest, ...]
    release: tuple[str, ...] = ()

    def payload(self) -> dict[str, Any]:
        return {
            "micro_batch_id": int(self.micro_batch_id),
            "entries": [e.payload() for e in self.entries],
            "release": _release_payload(self.release),
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            entries=tuple(VerifyRequest.from_payload(e) for e in fields.subs("entries")),
            release=fields.texts("release", max_len=MAX_ID_LEN),
        )


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

    def payload(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "step": int(self.step),
            "accepted": pack_ints(self.accepted),
            "bonus": None if self.bonus is None else int(self.bonus),
            "finish": finish_payload(self.finish),
            "error": self.error,
        } | _features_payload(self.features) | optional_logprobs_payload(self.logprobs) | (
            {"cached_tokens": int(self.cached_tokens)} if self.cached_tokens else {}
        ) | optional_logprobs_payload(self.prompt_logprobs, "prompt_logprobs")

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        bonus = fields.optional_integer("bonus")
        if bonus is not None and bonus < 0:
            fields.fail("bonus", "token ids must be >= 0")
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            step=fields.integer("step", minimum=0),
            accepted=fields.tokens("accepted", ()),
            bonus=bonus,
            finish=read_finish(fields, "finish"),
            error=fields.optional_text("error", max_len=MAX_REASON_LEN),
            features=fields.optional_f16_matrix("features"),
            logprobs=read_optional_logprobs(fields),
            cached_tokens=fields.integer("cached_tokens", 0, minimum=0),
            prompt_logprobs=read_optional_logprobs(fields, "prompt_logprobs"),
        )


@dataclass(frozen=True)
class VerifyResult(WireMessage):
    """The verifier's answer to one VerifyJob."""

    TYPE: ClassVar[str] = "verify_result"
    micro_batch_id: int
    verify_ms: float  # time of the batched forward and acceptance
    entries: tuple[VerifiedRequest, ...]

    def payload(self) -> dict[str, Any]:
        return {
            "micro_batch_id": int(self.micro_batch_id),
            "verify_ms": float(self.verify_ms),
            "entries": [e.payload() for e in self.entries],
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            verify_ms=fields.number("verify_ms"),
            entries=tuple(VerifiedRequest.from_payload(e) for e in fields.subs("entries")),
        )
