"""Messages of one speculation step, all per micro-batch and keyed per entry by (request, step).

Scheduler -> a drafter replica: `DraftJob`; drafter -> scheduler: `CandidateTrees`.
Scheduler -> verifier: `VerifyJob`; verifier -> scheduler: `VerifyResult`.
Their entries are the value types of `shared.values.steps`; this module declares their wire form.
Fields marked `Sparse` were added after version 1 and are written only when set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shared.values.steps import (
    MAX_APP_LEN,
    MAX_ID_LEN,
    DraftedTree,
    DraftRequest,
    VerifiedRequest,
    VerifyRequest,
)
from shared.wire.base import WireMessage
from shared.wire.codec import PayloadReader
from shared.wire.schema import (
    Entries,
    Flag,
    Float,
    Int,
    OptInt,
    OptText,
    Schema,
    Sparse,
    Text,
    Texts,
    TokenIds,
    wire,
)
from shared.wire.values import FEATURES, FINISH, HISTORY, LOGPROBS, METHOD, SAMPLING, TREE

MAX_REASON_LEN = 256
MAX_MODEL_NAME_LEN = 64
MAX_REPLICA_NAME_LEN = 128

DRAFT_REQUEST = Schema.of(
    DraftRequest,
    request_id=Text(MAX_ID_LEN),
    step=Int(),
    base_len=Int(),
    new_tokens=TokenIds(),
    method=METHOD,
    sampling=SAMPLING,
    seed=Int(),
    max_nodes=Sparse(Int()),
    max_depth=Sparse(Int()),
    features=Sparse(FEATURES),
    history=Sparse(HISTORY),
    app=Sparse(Text(MAX_APP_LEN)),
)

DRAFTED_TREE = Schema.of(
    DraftedTree,
    request_id=Text(MAX_ID_LEN),
    step=Int(),
    tree=TREE,
    error=OptText(MAX_REASON_LEN),
)

VERIFY_REQUEST = Schema.of(
    VerifyRequest,
    request_id=Text(MAX_ID_LEN),
    step=Int(),
    sampling=SAMPLING,
    seed=Int(),
    max_new_tokens=Int(),
    chunk=TokenIds(),
    chunk_start=Int(),
    chunk_is_last=Flag(),
    tree=TREE,
    context_len=Sparse(OptInt()),
    want_features=Sparse(Flag()),
    history=Sparse(HISTORY),
)

VERIFIED_REQUEST = Schema.of(
    VerifiedRequest,
    request_id=Text(MAX_ID_LEN),
    step=Int(),
    accepted=TokenIds(),
    bonus=OptInt(minimum=0),  # a token id
    finish=FINISH,
    error=OptText(MAX_REASON_LEN),
    features=Sparse(FEATURES),
    logprobs=Sparse(LOGPROBS),
    cached_tokens=Sparse(Int()),
    prompt_logprobs=Sparse(LOGPROBS),
)


def draft_request_payload(entry: DraftRequest) -> dict[str, Any]:
    return DRAFT_REQUEST.encode(entry)


def read_draft_request(fields: PayloadReader) -> DraftRequest:
    entry: DraftRequest = DRAFT_REQUEST.decode(fields)
    return entry


def verify_request_payload(entry: VerifyRequest) -> dict[str, Any]:
    return VERIFY_REQUEST.encode(entry)


def read_verify_request(fields: PayloadReader) -> VerifyRequest:
    entry: VerifyRequest = VERIFY_REQUEST.decode(fields)
    return entry


def verified_request_payload(entry: VerifiedRequest) -> dict[str, Any]:
    return VERIFIED_REQUEST.encode(entry)


def read_verified_request(fields: PayloadReader) -> VerifiedRequest:
    entry: VerifiedRequest = VERIFIED_REQUEST.decode(fields)
    return entry


@dataclass(frozen=True)
class DraftJob(WireMessage):
    """Draft one micro-batch on one drafter replica; `release` frees finished requests' state."""

    TYPE: ClassVar[str] = "draft_job"
    micro_batch_id: int = wire(Int())
    entries: tuple[DraftRequest, ...] = wire(Entries(DRAFT_REQUEST))
    release: tuple[str, ...] = wire(Texts(MAX_ID_LEN), ())


@dataclass(frozen=True, eq=False)
class CandidateTrees(WireMessage):
    """A drafter's answer to one DraftJob."""

    TYPE: ClassVar[str] = "candidate_trees"
    micro_batch_id: int = wire(Int())
    model: str = wire(Text(MAX_MODEL_NAME_LEN))  # draft model name
    # drafter replica that drafted (its draft KV is now warm)
    replica: str = wire(Text(MAX_REPLICA_NAME_LEN))
    draft_ms: float = wire(Float())  # time spent drafting this micro-batch
    entries: tuple[DraftedTree, ...] = wire(Entries(DRAFTED_TREE))


@dataclass(frozen=True, eq=False)
class VerifyJob(WireMessage):
    """One micro-batch for one verifier forward; `release` frees finished requests' KV."""

    TYPE: ClassVar[str] = "verify_job"
    micro_batch_id: int = wire(Int())
    entries: tuple[VerifyRequest, ...] = wire(Entries(VERIFY_REQUEST))
    release: tuple[str, ...] = wire(Texts(MAX_ID_LEN), ())


@dataclass(frozen=True)
class VerifyResult(WireMessage):
    """The verifier's answer to one VerifyJob."""

    TYPE: ClassVar[str] = "verify_result"
    micro_batch_id: int = wire(Int())
    verify_ms: float = wire(Float())  # time of the batched forward and acceptance
    entries: tuple[VerifiedRequest, ...] = wire(Entries(VERIFIED_REQUEST))
