"""The scheduler's durable state: stored records read back exactly, staged writes land in one
transaction with the messages they belong to, and the cell's lease admits one holder at a time."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from services.scheduler.store import (
    RESUME_STEP_GAP,
    Appended,
    Progress,
    RequestStore,
    Resolved,
    StoredRequestError,
    decode_progress,
    decode_submit,
    encode_progress,
    encode_submit,
)
from shared.bus import Bus, EmbeddedRedis
from shared.bus.lease import Lease
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.settings import RedisSettings
from shared.values.sampling import SamplingParams
from shared.wire import Submit, Tokens, decode_entry
from shared.wire.codec import pack_ints
from shared.wire.streams import scheduler_accepted_key, scheduler_output_key

pytestmark = pytest.mark.anyio

SUBMIT = Submit(
    "r1",
    (5, 6, 7),
    SamplingParams(max_tokens=9, temperature=0.7, stop_token_ids=(3,)),
    "augury:{0}:out:g1",
    1234.5,
    priority=2,
    slo_class="urgent",
)


@pytest.fixture
async def bus(server: EmbeddedRedis) -> AsyncIterator[Bus]:
    bus = Bus(server.url, RedisSettings(url=server.url), f"store-{uuid.uuid4().hex[:6]}")
    yield bus
    await bus.close()


def decoding_request() -> RequestState:
    request = RequestState("r1", [5, 6, 7], SUBMIT.sampling, seed=11)
    request.output = [8, 9, 10]
    request.num_prefilled = 3
    request.step = 4
    request.first_token_time, request.last_token_time = 100.0, 101.5
    request.attained_service_ms = 42.0
    request.draft_model, request.drafter = "draft-s", "host-1"
    request.record_step(4, 2, "draft-s", depth=3)
    request.record_step(4, 0, "draft-s", depth=3)
    return request


def test_a_stored_submit_reads_back_with_what_was_resolved() -> None:
    resolved = Resolved(seed=77, tpot_slo_ms=35.0, slo_class="urgent")
    submit, back = decode_submit(encode_submit(SUBMIT, resolved))
    assert submit == SUBMIT and back == resolved


def round_trip(progress: Progress) -> Progress:
    record = encode_progress(progress)
    return decode_progress(record, pack_ints(progress.output), pack_ints(progress.accepted_lengths))


def test_progress_resumes_a_request_with_its_output_statistics_and_a_fresh_step() -> None:
    request = decoding_request()
    progress = round_trip(Progress.of(request))
    assert progress == Progress.of(request)
    resumed = RequestState("r1", [5, 6, 7], SUBMIT.sampling, seed=11)
    progress.apply(resumed)
    assert resumed.output == [8, 9, 10]
    # the KV is recomputed: prompt and output are prefilled again, the drafter starts over
    assert resumed.prefill_tokens == [5, 6, 7, 8, 9, 10] and resumed.is_prefilling
    assert resumed.kv == "dropped" and resumed.num_seen_by_drafter == 0
    # past every step the dead scheduler may have sent (the model services replay by step)
    assert resumed.step == 4 + RESUME_STEP_GAP
    assert resumed.stats == request.stats and resumed.accepted_lengths == [2, 0]
    assert (resumed.first_token_time, resumed.attained_service_ms) == (100.0, 42.0)


@pytest.mark.parametrize("damage", [b"", b"\x93\x01", b"\x81\xa1v\x01"])
def test_unreadable_records_are_refused(damage: bytes) -> None:
    with pytest.raises(StoredRequestError):
        decode_submit(damage)
    with pytest.raises(StoredRequestError):
        decode_progress(damage, None, None)


def test_stored_lists_shorter_than_their_record_counts_are_refused() -> None:
    record = encode_progress(Progress.of(decoding_request()))  # 3 tokens, 2 accepted lengths
    longer = decode_progress(record, pack_ints([8, 9, 10, 99]), pack_ints([2, 0]))
    assert longer.output == [8, 9, 10]
    with pytest.raises(StoredRequestError, match="output"):
        decode_progress(record, pack_ints([8, 9]), pack_ints([2, 0]))
    with pytest.raises(StoredRequestError, match="accepted_lengths"):
        decode_progress(record, pack_ints([8, 9, 10]), None)
    with pytest.raises(StoredRequestError, match="output"):
        decode_progress(record, b"\x08\x00\x00", pack_ints([2, 0]))  # not whole int32s


async def test_staged_changes_are_written_with_the_messages_and_finished_requests_leave(
    bus: Bus,
) -> None:
    cell = f"c{uuid.uuid4().hex[:6]}"
    store = RequestStore(bus, cell)
    request = decoding_request()
    store.stage_submit(SUBMIT, Resolved(11, None, None))
    store.stage_progress(request)
    staged = store.take_staged()
    assert not store.take_staged()  # taken once
    tokens = Tokens("r1", 4, 0, (8, 9, 10))
    await bus.publish_all(
        [("augury:{0}:out:g1", tokens)], also=lambda pipe: store.write_staged(pipe, staged)
    )
    stored, broken, finished = await store.load()
    assert broken == [] and finished == []
    assert [s.submit for s in stored] == [SUBMIT] and stored[0].progress == Progress.of(request)
    entries = await bus.redis.xrange("augury:{0}:out:g1")
    assert decode_entry(entries[-1][1]) == tokens

    store.stage_progress(request)
    store.stage_finished("r1")  # finishing drops the progress staged beside it
    staged = store.take_staged()
    assert staged.progress == {}
    await bus.publish_all(
        [], also=lambda pipe: store.write_staged(pipe, staged), slot_key=store.submits_key
    )
    stored, broken, finished = await store.load()
    assert stored == [] and finished == ["r1"]
    assert not await bus.redis.exists(scheduler_output_key(cell, "r1"))
    assert not await bus.redis.exists(scheduler_accepted_key(cell, "r1"))


async def test_a_step_stores_only_what_it_added_and_a_successor_reads_it_all(bus: Bus) -> None:
    cell = f"c{uuid.uuid4().hex[:6]}"
    store = RequestStore(bus, cell)
    request = decoding_request()
    store.stage_submit(SUBMIT, Resolved(11, None, None))

    async def step(new_tokens: list[int], accepted: int, *, write_twice: bool = False) -> None:
        request.output += new_tokens
        request.record_step(4, accepted, "draft-s", depth=4)
        store.stage_progress(request)
        staged = store.take_staged()
        assert staged.output["r1"].values == new_tokens  # not the whole output again
        assert staged.accepted_lengths["r1"].values == [accepted]
        # a transaction retried after its reply was lost writes the same bytes again
        for _ in range(2 if write_twice else 1):
            await bus.publish_all(
                [], also=lambda pipe: store.write_staged(pipe, staged), slot_key=store.submits_key
            )

    store.stage_progress(request)  # the first stage carries everything so far
    first = store.take_staged()
    assert first.output["r1"].values == [8, 9, 10] and first.accepted_lengths["r1"].values == [2, 0]
    await bus.publish_all(
        [], also=lambda pipe: store.write_staged(pipe, first), slot_key=store.submits_key
    )
    for i in range(40):
        await step([100 + 3 * i, 101 + 3 * i, 102 + 3 * i], i % 4, write_twice=i % 7 == 0)
    # two steps staged before one write go out as one contiguous append
    request.output += [1, 2]
    request.record_step(4, 1, "draft-s", depth=4)
    store.stage_progress(request)
    request.output += [3]
    request.record_step(4, 0, "draft-s", depth=4)
    store.stage_progress(request)
    staged = store.take_staged()
    assert staged.output["r1"].values == [1, 2, 3]
    await bus.publish_all(
        [], also=lambda pipe: store.write_staged(pipe, staged), slot_key=store.submits_key
    )

    successor = RequestStore(bus, cell)
    [stored], _, _ = await successor.load()
    assert stored.progress == Progress.of(request)
    assert len(stored.progress.output) == 3 + 120 + 3
    resumed = RequestState("r1", [5, 6, 7], SUBMIT.sampling, seed=11)
    stored.progress.apply(resumed)
    resumed.output.append(77)  # the successor's first step appends after what it loaded
    successor.stage_progress(resumed)
    staged = successor.take_staged()
    assert staged.output["r1"] == Appended(len(request.output), [77])
    await bus.publish_all(
        [], also=lambda pipe: successor.write_staged(pipe, staged), slot_key=successor.submits_key
    )
    [again], _, _ = await RequestStore(bus, cell).load()
    assert again.progress.output == request.output + [77]


async def test_a_broken_record_is_reported_and_the_rest_still_load(bus: Bus) -> None:
    cell = f"c{uuid.uuid4().hex[:6]}"
    store = RequestStore(bus, cell)
    store.stage_submit(SUBMIT, Resolved(11, None, None))
    staged = store.take_staged()
    await bus.publish_all(
        [], also=lambda pipe: store.write_staged(pipe, staged), slot_key=store.submits_key
    )
    await bus.redis.hset(store.submits_key, "bad", b"\xc1")
    stored, broken, _ = await store.load()
    assert [s.submit.request_id for s in stored] == ["r1"] and broken == ["bad"]
    assert stored[0].progress is None  # nothing committed yet: it starts from its prompt


async def test_the_lease_has_one_holder_and_passes_on_when_it_is_not_renewed(bus: Bus) -> None:
    key = f"lease-{uuid.uuid4().hex[:6]}"
    first = Lease(bus, key, "first", ttl_ms=300)
    second = Lease(bus, key, "second", ttl_ms=300)
    assert await first.try_take()
    assert not await second.try_take()
    waited: list[str | None] = []
    taking = asyncio.create_task(second.take(on_wait=waited.append))
    keeping = asyncio.create_task(first.keep())
    await asyncio.sleep(0.5)  # renewed past its TTL: the second still waits
    assert not taking.done() and waited == ["first"]
    keeping.cancel()  # the holder dies: no more renewals
    async with asyncio.timeout(2):
        await taking
    assert await second.holder_now() == "second"
    assert not await first.renew()  # the old holder cannot extend ...
    await first.release()  # ... nor delete its successor's lease
    assert await second.holder_now() == "second"
    async with asyncio.timeout(2):
        reason = await first.keep()  # and learns it lost the lease at its next renewal
    assert "second" in reason
    await second.release()
    assert await first.try_take()


async def test_a_lease_that_expired_with_nobody_taking_it_is_taken_again(bus: Bus) -> None:
    lease = Lease(bus, f"lease-{uuid.uuid4().hex[:6]}", "stalled", ttl_ms=300)
    assert await lease.try_take()
    await bus.redis.delete(lease.key)  # expired while the holder's event loop was busy
    assert await lease.renew() and await lease.holder_now() == "stalled"
    other = Lease(bus, lease.key, "other", ttl_ms=300)
    await bus.redis.set(lease.key, "other")  # but one that somebody took is lost
    assert not await lease.renew() and await other.holder_now() == "other"


async def test_a_holder_that_cannot_reach_redis_gives_the_lease_up_within_its_ttl(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = Lease(bus, f"lease-{uuid.uuid4().hex[:6]}", "cut-off", ttl_ms=300)
    assert await lease.try_take()

    async def unreachable() -> bool:
        raise ConnectionError("redis is gone")

    monkeypatch.setattr(lease, "renew", unreachable)
    async with asyncio.timeout(1):
        reason = await lease.keep()
    assert "not renewed" in reason


def test_acceptance_stats_round_trip_exactly() -> None:
    stats = AcceptanceStats()
    stats.record(5, 3, depth=4)
    progress = Progress([1], 1, stats=stats)
    assert round_trip(progress).stats == stats
