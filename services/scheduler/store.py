"""The scheduler's requests, kept in Redis as they change, so a successor resumes them.

Three keys per cell and two per running request (`shared.wire.streams`):
- `scheduler:submits`, request id -> the accepted Submit with what the scheduler resolved for it
  (seed, TPOT objective, SLO class): written before the Submit is acknowledged;
- `scheduler:progress`, request id -> step, the statistics the policies read and how many
  committed tokens and accepted lengths the request has: written in the same MULTI/EXEC as the
  Tokens that carry those tokens to the client, so what is stored is exactly what the client was
  sent (no gap, no repeat after a takeover);
- `scheduler:output:{request}` and `scheduler:accepted:{request}`, the committed tokens and the
  accepted length of each speculative step, packed int32. Both only grow, so a step writes just
  what it added (SETRANGE at the offset it starts at: a transaction retried after a lost reply
  writes the same bytes again) and a step's store traffic does not grow with the output;
- `scheduler:finished`, the latest finished ids: a Submit redelivered after a restart is
  recognised as done. A finished request leaves the hashes and its two strings in the
  transaction of its last Tokens.

Changes are staged as the core makes them (`stage_*`, encoded at once: the snapshot must match
the messages built beside it) and written with the next publish (`write_staged`). What is not
stored is learned again after a takeover: the target and draft KV (recomputed from the
committed tokens), acceptance estimates, and the policies' own per-request state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis.asyncio.client import Pipeline

from shared.bus import Bus
from shared.scheduling.executor import Resolved
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.wire import Submit
from shared.wire.base import SCHEMA_VERSION
from shared.wire.codec import (
    TOKEN_DTYPE,
    PayloadReader,
    ProtocolError,
    pack_ints,
    pack_payload,
    unpack_payload,
)
from shared.wire.streams import (
    scheduler_accepted_key,
    scheduler_finished_key,
    scheduler_output_key,
    scheduler_progress_key,
    scheduler_submits_key,
)

log = logging.getLogger(__name__)

REMEMBER_FINISHED = 10_000  # finished ids kept, to recognise a redelivered Submit
# A resumed request's steps start this far past the last stored one: the dead scheduler may
# have sent jobs for steps it had not stored yet (one per lane at most), and the verifier and
# drafters replay a cached answer for a step they already answered.
RESUME_STEP_GAP = 1024


class StoredRequestError(ValueError):
    """A stored record that cannot be read back."""


@dataclass(frozen=True)
class Progress:
    """A request's committed state, as its client has been sent it."""

    output: list[int]
    step: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    attained_service_ms: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    draft: tuple[str, str] | None = None  # (model, replica) holding the request's draft KV
    cached_prompt_tokens: int = 0  # prompt tokens the target found cached (for the usage)

    @classmethod
    def of(cls, request: RequestState) -> Progress:
        """The request's state now. Its output and accepted lengths are the request's own lists,
        not copies: a step stages only their new part, and `apply` copies them."""
        draft = None
        if request.draft_model is not None and request.drafter is not None:
            draft = (request.draft_model, request.drafter)
        return cls(
            request.output,
            request.step,
            request.first_token_time,
            request.last_token_time,
            request.attained_service_ms,
            request.accepted_lengths,
            request.stats,
            draft,
            request.num_cached_prompt_tokens,
        )

    def apply(self, request: RequestState) -> None:
        """Resume `request` from here: its KV is recomputed, its steps continue past the gap."""
        request.output = list(self.output)
        request.drop_kv()  # prefill the prompt and the committed output again
        request.step = self.step + RESUME_STEP_GAP
        request.first_token_time = self.first_token_time
        request.last_token_time = self.last_token_time
        request.attained_service_ms = self.attained_service_ms
        request.accepted_lengths = list(self.accepted_lengths)
        request.stats = self.stats
        request.num_cached_prompt_tokens = self.cached_prompt_tokens


@dataclass(frozen=True)
class StoredRequest:
    submit: Submit
    resolved: Resolved
    progress: Progress | None  # None: nothing committed yet


def encode_submit(submit: Submit, resolved: Resolved) -> bytes:
    return pack_payload(
        {
            "v": SCHEMA_VERSION,
            "submit": submit.to_entry()["b"],
            "seed": int(resolved.seed),
            "tpot_slo_ms": resolved.tpot_slo_ms,
            "slo_class": resolved.slo_class,
        }
    )


def decode_submit(data: bytes) -> tuple[Submit, Resolved]:
    try:
        record = PayloadReader(unpack_payload(data, "stored submit"), "stored submit")
        version = record.integer("v", minimum=1)
        entry = {b"v": str(version).encode(), b"t": b"submit", b"b": record.blob("submit")}
        submit = Submit.from_entry(entry)
        resolved = Resolved(
            record.integer("seed"), record.optional_number("tpot_slo_ms"),
            record.optional_text("slo_class"),
        )  # fmt: skip
    except ProtocolError as error:
        raise StoredRequestError(str(error)) from error
    return submit, resolved


def encode_progress(progress: Progress) -> bytes:
    """The progress record; the output and accepted lengths it counts are stored apart."""
    stats = progress.stats
    return pack_payload(
        {
            "num_output": len(progress.output),
            "step": int(progress.step),
            "first_token_time": progress.first_token_time,
            "last_token_time": progress.last_token_time,
            "attained_service_ms": float(progress.attained_service_ms),
            "num_accepted_lengths": len(progress.accepted_lengths),
            "stats": [
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted,
                stats.num_target_forwards,
                stats.num_draft_layers,
            ],
            "accepted_per_position": pack_ints(stats.accepted_per_position),
            "draft": [] if progress.draft is None else list(progress.draft),
            "cached_prompt_tokens": int(progress.cached_prompt_tokens),
        }
    )


def decode_progress(data: bytes, output: bytes | None, accepted_lengths: bytes | None) -> Progress:
    """A progress record with the request's stored output and accepted lengths (their strings'
    bytes, None when absent), each cut to the count the record gives."""
    try:
        record = PayloadReader(unpack_payload(data, "stored progress"), "stored progress")
        counts = record.int_list("stats")
        if len(counts) != 5:
            record.fail("stats", "expected 5 counts")
        drafts, draft_tokens, accepted, forwards, layers = counts
        stats = AcceptanceStats(
            num_drafts=drafts,
            num_draft_tokens=draft_tokens,
            num_accepted=accepted,
            accepted_per_position=list(record.tokens("accepted_per_position")),
            num_target_forwards=forwards,
            num_draft_layers=layers,
        )
        lists = PayloadReader(
            {"output": output or b"", "accepted_lengths": accepted_lengths or b""},
            "stored progress",
        )
        draft = record.texts("draft")
        return Progress(
            counted(lists, "output", record.integer("num_output", minimum=0)),
            record.integer("step", minimum=0),
            record.optional_number("first_token_time"),
            record.optional_number("last_token_time"),
            record.number("attained_service_ms"),
            counted(lists, "accepted_lengths", record.integer("num_accepted_lengths", minimum=0)),
            stats,
            (draft[0], draft[1]) if len(draft) == 2 else None,
            record.integer("cached_prompt_tokens", 0, minimum=0),
        )
    except ProtocolError as error:
        raise StoredRequestError(str(error)) from error


def counted(lists: PayloadReader, name: str, count: int) -> list[int]:
    """The first `count` ints of a stored append-only list; refused when it holds fewer."""
    values = lists.tokens(name)
    if len(values) < count:
        lists.fail(name, f"holds {len(values)} values, the record counts {count}")
    return list(values[:count])


@dataclass
class Appended:
    """Values a request's append-only list gained since it was last staged, and where they go."""

    start: int  # index of the first of them in the whole list
    values: list[int]

    def extend(self, later: Appended) -> None:
        assert later.start == self.start + len(self.values), "appends must be contiguous"
        self.values += later.values


@dataclass
class Staged:
    """Writes waiting for the next publish."""

    submits: dict[str, bytes] = field(default_factory=dict)
    progress: dict[str, bytes] = field(default_factory=dict)
    output: dict[str, Appended] = field(default_factory=dict)
    accepted_lengths: dict[str, Appended] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.submits or self.progress or self.finished)

    def drop(self, request_id: str) -> None:
        for writes in (self.submits, self.progress, self.output, self.accepted_lengths):
            writes.pop(request_id, None)


class RequestStore:
    def __init__(self, bus: Bus, cell: str) -> None:
        self.bus = bus
        self.cell = cell
        self.submits_key = scheduler_submits_key(cell)
        self.progress_key = scheduler_progress_key(cell)
        self.finished_key = scheduler_finished_key(cell)
        self._staged = Staged()
        # request id -> (output tokens, accepted lengths) covered by what has been staged
        self._num_staged: dict[str, tuple[int, int]] = {}

    # ---- staging ---------------------------------------------------------------------------------
    def stage_submit(self, submit: Submit, resolved: Resolved) -> None:
        self._staged.submits[submit.request_id] = encode_submit(submit, resolved)

    def stage_progress(self, request: RequestState) -> None:
        rid = request.request_id
        if rid in self._staged.finished:
            return
        self._staged.progress[rid] = encode_progress(Progress.of(request))
        num_output, num_accepted = self._num_staged.get(rid, (0, 0))
        for lists, start, values in (
            (self._staged.output, num_output, request.output),
            (self._staged.accepted_lengths, num_accepted, request.accepted_lengths),
        ):
            if len(values) > start:
                new = Appended(start, list(values[start:]))
                if rid in lists:
                    lists[rid].extend(new)
                else:
                    lists[rid] = new
        self._num_staged[rid] = (len(request.output), len(request.accepted_lengths))

    def stage_finished(self, request_id: str) -> None:
        self._staged.drop(request_id)
        self._staged.finished.add(request_id)
        self._num_staged.pop(request_id, None)

    def take_staged(self) -> Staged:
        staged, self._staged = self._staged, Staged()
        return staged

    def write_staged(self, pipe: Pipeline, staged: Staged) -> None:
        """Queue `staged` on a transaction pipeline (beside the messages it belongs with)."""
        if staged.submits:
            pipe.hset(self.submits_key, mapping=staged.submits)
        if staged.progress:
            pipe.hset(self.progress_key, mapping=staged.progress)
        for key_of, lists in (
            (scheduler_output_key, staged.output),
            (scheduler_accepted_key, staged.accepted_lengths),
        ):
            for rid, appended in lists.items():
                offset = appended.start * TOKEN_DTYPE.itemsize
                pipe.setrange(key_of(self.cell, rid), offset, pack_ints(appended.values))
        if staged.finished:
            done = list(staged.finished)
            pipe.hdel(self.submits_key, *done)
            pipe.hdel(self.progress_key, *done)
            pipe.delete(
                *(scheduler_output_key(self.cell, rid) for rid in done),
                *(scheduler_accepted_key(self.cell, rid) for rid in done),
            )
            now = time.time()
            pipe.zadd(self.finished_key, dict.fromkeys(done, now))
            pipe.zremrangebyrank(self.finished_key, 0, -REMEMBER_FINISHED - 1)

    # ---- reading back ----------------------------------------------------------------------------
    async def load(self) -> tuple[list[StoredRequest], list[str], list[str]]:
        """The stored requests by arrival, the ids that cannot be read back, and the latest
        finished ids (oldest first). What is loaded counts as staged: the next steps append."""
        pipe = await self.bus.transaction(self.submits_key)
        pipe.hgetall(self.submits_key)
        pipe.hgetall(self.progress_key)
        pipe.zrange(self.finished_key, 0, -1)
        submits, progress, finished = await pipe.execute()
        rids = [raw_id.decode() for raw_id in progress]
        pipe = await self.bus.transaction(self.submits_key)
        for rid in rids:
            pipe.get(scheduler_output_key(self.cell, rid))
            pipe.get(scheduler_accepted_key(self.cell, rid))
        strings = await pipe.execute() if rids else []
        lists = {rid: (strings[2 * i], strings[2 * i + 1]) for i, rid in enumerate(rids)}
        stored: list[StoredRequest] = []
        broken: list[str] = []
        for raw_id, data in submits.items():
            rid = raw_id.decode()
            try:
                submit, resolved = decode_submit(data)
                raw = progress.get(raw_id)
                committed = None if raw is None else decode_progress(raw, *lists[rid])
                stored.append(StoredRequest(submit, resolved, committed))
            except StoredRequestError as error:
                log.error("cannot resume %s: %s", rid, error)
                broken.append(rid)
                continue
            if committed is not None:
                self._num_staged[rid] = (len(committed.output), len(committed.accepted_lengths))
        stored.sort(key=lambda s: s.submit.arrival_time)
        return stored, broken, [rid.decode() for rid in finished]
