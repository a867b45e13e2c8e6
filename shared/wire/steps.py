"""Messages of one speculation step, all per micro-batch and keyed per entry by (request, step).

Scheduler -> a drafter replica: `DraftJob`; drafter -> scheduler: `CandidateTrees`.
Scheduler -> verifier: `VerifyJob`; verifier -> scheduler: `VerifyResult`.
Their entries are the value types of `shared.values.steps`; this module writes and reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from shared.values.steps import (
    MAX_APP_LEN,
    MAX_ID_LEN,
    DraftedTree,
    DraftRequest,
    VerifiedRequest,
    VerifyRequest,
)
from shared.wire.base import WireMessage
from shared.wire.codec import PayloadReader, pack_ints, pack_matrix_f16
from shared.wire.values import (
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


def _features_payload(features: np.ndarray | None) -> dict[str, Any]:
    """Written only when set, so entries without features keep their version-1 bytes."""
    return {} if features is None else {"features": pack_matrix_f16(features)}


# ---- drafting --------------------------------------------------------------------------------


def _limits(e: DraftRequest) -> dict[str, int]:
    return {"max_nodes": e.max_nodes, "max_depth": e.max_depth}


def draft_request_payload(e: DraftRequest) -> dict[str, Any]:
    return (
        {
            "request_id": e.request_id,
            "step": int(e.step),
            "base_len": int(e.base_len),
            "new_tokens": pack_ints(e.new_tokens),
            "method": method_payload(e.method),
            "sampling": sampling_payload(e.sampling),
            "seed": int(e.seed),
        }
        | {name: int(v) for name, v in _limits(e).items() if v}
        | _features_payload(e.features)
        | optional_history_payload(e.history)
        | ({"app": e.app} if e.app else {})
    )


def read_draft_request(fields: PayloadReader) -> DraftRequest:
    return fields.build(
        DraftRequest,
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
            "entries": [draft_request_payload(e) for e in self.entries],
            "release": _release_payload(self.release),
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            entries=tuple(read_draft_request(e) for e in fields.subs("entries")),
            release=fields.texts("release", max_len=MAX_ID_LEN),
        )


def drafted_tree_payload(e: DraftedTree) -> dict[str, Any]:
    return {
        "request_id": e.request_id,
        "step": int(e.step),
        "tree": optional_tree_payload(e.tree),
        "error": e.error,
    }


def read_drafted_tree(fields: PayloadReader) -> DraftedTree:
    return fields.build(
        DraftedTree,
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
            "entries": [drafted_tree_payload(e) for e in self.entries],
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            model=fields.text("model", max_len=64),
            replica=fields.text("replica", max_len=128),
            draft_ms=fields.number("draft_ms"),
            entries=tuple(read_drafted_tree(e) for e in fields.subs("entries")),
        )


# ---- verification ----------------------------------------------------------------------------


def verify_request_payload(e: VerifyRequest) -> dict[str, Any]:
    return (
        {
            "request_id": e.request_id,
            "step": int(e.step),
            "sampling": sampling_payload(e.sampling),
            "seed": int(e.seed),
            "max_new_tokens": int(e.max_new_tokens),
            "chunk": pack_ints(e.chunk),
            "chunk_start": int(e.chunk_start),
            "chunk_is_last": bool(e.chunk_is_last),
            "tree": optional_tree_payload(e.tree),
        }
        | ({} if e.context_len is None else {"context_len": int(e.context_len)})
        | ({"want_features": True} if e.want_features else {})
        | optional_history_payload(e.history)
    )


def read_verify_request(fields: PayloadReader) -> VerifyRequest:
    return fields.build(
        VerifyRequest,
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
            "entries": [verify_request_payload(e) for e in self.entries],
            "release": _release_payload(self.release),
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            entries=tuple(read_verify_request(e) for e in fields.subs("entries")),
            release=fields.texts("release", max_len=MAX_ID_LEN),
        )


def verified_request_payload(e: VerifiedRequest) -> dict[str, Any]:
    return (
        {
            "request_id": e.request_id,
            "step": int(e.step),
            "accepted": pack_ints(e.accepted),
            "bonus": None if e.bonus is None else int(e.bonus),
            "finish": finish_payload(e.finish),
            "error": e.error,
        }
        | _features_payload(e.features)
        | optional_logprobs_payload(e.logprobs)
        | ({"cached_tokens": int(e.cached_tokens)} if e.cached_tokens else {})
        | optional_logprobs_payload(e.prompt_logprobs, "prompt_logprobs")
    )


def read_verified_request(fields: PayloadReader) -> VerifiedRequest:
    bonus = fields.optional_integer("bonus")
    if bonus is not None and bonus < 0:
        fields.fail("bonus", "token ids must be >= 0")
    return fields.build(
        VerifiedRequest,
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
            "entries": [verified_request_payload(e) for e in self.entries],
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            micro_batch_id=fields.integer("micro_batch_id", minimum=0),
            verify_ms=fields.number("verify_ms"),
            entries=tuple(read_verified_request(e) for e in fields.subs("entries")),
        )
