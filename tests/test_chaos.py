"""`python -m tools.chaos`: its verdict logic on hand-made records, and a bounded real run that
SIGKILLs and restarts the gateway, scheduler, verifier and drafter processes mid-replay."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import make_tiny_checkpoint
from tools.chaos.client import COMPLETED, FAILED, HUNG, Chunk, Received, Replay, apply_event
from tools.chaos.cluster import Draft
from tools.chaos.compare import Reference, compare
from tools.chaos.faults import Kill
from tools.chaos.report import (
    DIFFERENT,
    FAILED_CLEARLY,
    HUNG_RESULT,
    IDENTICAL,
    NO_KILL,
    Report,
    evaluate,
    gateway_died,
    phase_of,
    service_rows,
)
from tools.chaos.run import ChaosConfig, recovery_settings, run_chaos
from tools.chaos.workload import ChaosRequest
from tools.load.client import RequestFailed

# ---- comparison and report on hand-made records ---------------------------------------------

PIECES = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " the", 6: " mat", 7: "", 8: " dog"}
REF = [1, 2, 3, 4, 5, 6]  # "The cat sat on the mat"


def decode(ids: Sequence[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def reference(ids: Sequence[int] = REF) -> Reference:
    return Reference(ids, decode)


def test_identical_text_and_count() -> None:
    result = compare("The cat sat on the mat", 6, reference(), complete=True)
    assert result.identical and (result.lost, result.duplicated, result.wrong) == (0, 0, 0)


def test_a_missing_chunk_is_lost() -> None:
    result = compare("The cat the mat", 4, reference(), complete=True)
    assert not result.identical
    assert (result.lost, result.duplicated, result.wrong) == (2, 0, 0)


def test_a_repeated_chunk_is_duplicated() -> None:
    result = compare("The cat sat sat on the mat", 7, reference(), complete=True)
    assert (result.lost, result.duplicated, result.wrong) == (0, 1, 0)


def test_a_repeat_in_place_of_the_next_chunk_is_lost_and_duplicated() -> None:
    # the max_tokens budget spent on a repeat: " sat" again where " on" belonged
    result = compare("The cat sat sat the mat", 6, reference(), complete=True)
    assert (result.lost, result.duplicated) == (1, 1)


def test_other_text_is_wrong() -> None:
    result = compare("The cat sat on the dog", 6, reference(), complete=True)
    assert not result.identical and result.wrong >= 1 and result.duplicated == 0


def test_tokens_without_text_count_by_number() -> None:
    with_eos = reference([1, 2, 7, 3])  # an ignored EOS decodes to nothing
    assert compare("The cat sat", 4, with_eos, complete=True).identical
    repeated = compare("The cat sat", 5, with_eos, complete=True)
    assert (repeated.identical, repeated.duplicated, repeated.lost) == (False, 1, 0)
    assert compare("The cat sat", 3, with_eos, complete=True).lost == 1


def test_a_cut_answer_is_compared_to_the_reference_start() -> None:
    assert compare("The cat sat", 3, reference(), complete=False).identical
    assert compare("The cat", 3, reference(), complete=False).lost == 1
    held_back = Reference([1, 9], lambda ids: "The\ufffd" if list(ids) == [1, 9] else decode(ids))
    assert compare("The", 2, held_back, complete=False).identical  # incomplete UTF-8 held back


def received(
    index: int,
    status: str,
    *,
    text: str = "The cat sat on the mat",
    tokens: int = 6,
    sent: float = 0.0,
    connected: float | None = None,
    ended: float = 1.0,
    error: str | None = None,
    never_connected: bool = False,
) -> Received:
    """A request as the client would record it (connected when sent, unless said otherwise)."""
    return Received(
        index,
        sent_at_s=sent,
        connected_at_s=None if never_connected else (sent if connected is None else connected),
        ended_at_s=ended,
        status=status,
        error=error,
        finish_reason="length" if status == COMPLETED else None,
        text=text,
        completion_tokens=tokens,
    )


KILLS = [
    Kill("gateway", "g0", killed_at_s=10.0, restarted_replica="g1", restarted_at_s=11.0,
         back_at_s=15.0),
    Kill("verifier", "v0", killed_at_s=30.0, restarted_replica="v1", restarted_at_s=31.0,
         back_at_s=36.0),
]  # fmt: skip


def test_phases_and_gateway_deaths() -> None:
    before = received(0, COMPLETED, sent=1.0, ended=5.0)
    cut = received(1, FAILED, sent=8.0, connected=8.0, ended=10.0, text="The", tokens=1)
    refused = received(2, COMPLETED, sent=12.0, connected=15.5, ended=18.0)
    spanning = received(3, COMPLETED, sent=14.0, connected=15.2, ended=31.0)
    assert phase_of(before, KILLS) == NO_KILL
    assert phase_of(cut, KILLS) == "gateway"
    assert phase_of(refused, KILLS) == "gateway"  # waited for the gateway to come back
    assert phase_of(spanning, KILLS) == "gateway+verifier"
    assert gateway_died(cut, KILLS)
    assert not gateway_died(refused, KILLS)  # it reached the new gateway
    assert not gateway_died(received(4, FAILED, never_connected=True, ended=20.0), KILLS)


def test_a_connection_dropped_under_the_request_reached_the_gateway() -> None:
    """A gateway that accepts the connection and dies before reading the request (a SIGKILL
    at that moment): the client's write or read fails with an OS error, not a refusal, so
    the request counts as connected, and as failed on a dying gateway if one was killed then."""

    async def run() -> Received:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()  # a reset, as the kernel sends for a killed process

        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            replay = Replay(f"http://127.0.0.1:{port}", "m", hang_s=5.0, connect_timeout_s=1.0)
            request = ChaosRequest(0, "chat", tuple(range(50_000)), 4, send_at_s=0.0)
            (got,) = await replay.run([request])
            return got

    got = asyncio.run(run())
    assert got.status == FAILED and got.connect_retries == 0, got
    assert got.connected_at_s is not None
    kill = Kill("gateway", "g0", killed_at_s=got.connected_at_s)
    assert gateway_died(got, [kill])


def test_report_counts_and_verdict() -> None:
    records = [
        received(0, COMPLETED, sent=1.0, ended=5.0),
        received(1, FAILED, sent=8.0, connected=8.0, ended=10.0, text="The cat", tokens=2,
                 error="connection error"),
        received(2, COMPLETED, sent=12.0, connected=15.5, ended=18.0),
        received(3, COMPLETED, sent=29.0, ended=33.0, text="The cat sat sat on the mat",
                 tokens=7),
        received(4, FAILED, sent=32.0, ended=34.0, error="HTTP 503: no output"),
        received(5, HUNG, sent=40.0, ended=100.0, text="The", tokens=1, error="nothing"),
    ]  # fmt: skip
    records[2].connect_retries = 9
    outcomes = evaluate(records, [reference()] * len(records), KILLS)
    results = [o.result for o in outcomes]
    assert results == [IDENTICAL, FAILED_CLEARLY, IDENTICAL, DIFFERENT, FAILED_CLEARLY, HUNG_RESULT]
    assert [o.failure_allowed for o in outcomes] == [False, True, False, False, False, False]
    report = Report({"requests": 6}, KILLS, outcomes, planned_kills=2)
    rows = {row.phase: row for row in report.rows}
    assert (rows["none"].requests, rows["none"].identical, rows["none"].hung) == (2, 1, 1)
    gateway = rows["gateway"]
    assert (gateway.requests, gateway.failed, gateway.failed_on_killed_gateway) == (2, 1, 1)
    assert gateway.connect_retries == 1 and gateway.lost == 0
    verifier = rows["verifier"]
    assert (verifier.different, verifier.failed, verifier.duplicated) == (1, 1, 1)
    assert rows["all"].requests == 6
    assert not report.passed
    found = "\n".join(report.found)
    assert "request 3 (verifier): completed with different output" in found
    assert "request 4 (verifier): failed without its gateway dying" in found
    assert "request 5 (none): hung" in found
    assert "request 1" not in found  # its gateway died: failing is allowed
    assert "| gateway | 2 | 1 | 0 | 1 | 1 | 0 | 0 | 0 | 0 | 1 |" in report.markdown()


def test_per_service_rows_count_a_request_under_every_kill_it_lived_through() -> None:
    both = received(0, COMPLETED, sent=5.0, ended=32.0)  # through the gateway and verifier kills
    outcomes = evaluate(
        [both, received(1, COMPLETED, sent=1.0, ended=2.0)], [reference()] * 2, KILLS
    )
    assert outcomes[0].phase == "gateway+verifier"
    rows = {row.phase: row for row in service_rows(outcomes, KILLS)}
    assert set(rows) == {"gateway", "verifier"}
    assert rows["gateway"].requests == rows["verifier"].requests == 1


def test_a_clean_report_passes_and_missing_kills_do_not() -> None:
    outcomes = evaluate([received(0, COMPLETED)], [reference()], KILLS)
    assert Report({}, KILLS, outcomes, planned_kills=2).passed
    assert not Report({}, KILLS[:1], outcomes, planned_kills=2).passed
    unfinished = [Kill("scheduler", "s0", 1.0, "s1", 2.0, None)]
    assert not Report({}, unfinished, outcomes, planned_kills=1).passed
    died = Report({}, [], outcomes, planned_kills=0, exits=["x-verifier-0 exited by itself"])
    assert not died.passed


def test_stream_events_fold_into_what_was_received() -> None:
    got = Received(0, sent_at_s=0.0)
    apply_event(got, {"choices": [{"text": "The", "finish_reason": None}],
                      "usage": {"completion_tokens": 1}}, 0.5)  # fmt: skip
    apply_event(got, {"choices": [{"text": " cat", "finish_reason": "length"}],
                      "usage": {"completion_tokens": 2}}, 0.7)  # fmt: skip
    apply_event(got, {"choices": [], "usage": {"completion_tokens": 2}}, 0.8)
    assert (got.text, got.completion_tokens, got.finish_reason) == ("The cat", 2, "length")
    assert got.chunks == [Chunk(0.5, 1, "The"), Chunk(0.7, 2, " cat")]
    assert Received.from_json(got.to_json()) == got
    with pytest.raises(RequestFailed, match="no output"):
        apply_event(got, {"error": {"message": "no output"}}, 0.9)


# ---- a bounded real run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA with SmolLM2's vocabulary and tokenizer files: the gateway needs a
    tokenizer, and a tiny model keeps the run within CI's time on a CPU."""
    from shared.model.smollm2 import ensure_smollm2

    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("chaos_target"),
        seed=0,
        vocab_size=49152,
        hidden_size=64,
        num_layers=2,
        max_positions=2048,
        tie=True,
    )
    for source in ensure_smollm2().iterdir():
        if source.name.startswith("tokenizer") or source.suffix == ".jinja":
            shutil.copy(source, path / source.name)
    return path


def test_services_survive_a_sigkill_of_each_service(
    tiny_with_tokenizer: Path, tmp_path: Path
) -> None:
    no_profiles = tmp_path / "profiles"
    no_profiles.mkdir()
    settings = {
        **recovery_settings(),
        # tiny models: a small KV, no cost profile stored or measured (it takes seconds)
        "AUGURY_ENGINE__BLOCK_SIZE": "4",
        "AUGURY_ENGINE__KV_MEMORY_BYTES": str(16 << 20),
        "AUGURY_ENGINE__MEASURE_PROFILE": "false",
        "AUGURY_ENGINE__PROFILE_DIR": str(no_profiles),
        "AUGURY_ENGINE__PROFILE_CACHE_DIR": str(no_profiles),
        # without a cost profile the goodput planner would not draft: the whole tree each step
        "AUGURY_SCHEDULER__SPECULATION__PLANNER": "fixed",
        "AUGURY_SCHEDULER__SPECULATION__MIN_PATH_PROB": "0",
    }
    kills = ("gateway", "scheduler", "verifier", "drafter")
    config = ChaosConfig(
        target=tiny_with_tokenizer,
        # the target as its own draft: its greedy path is accepted, so steps commit several
        # tokens and what a restarted drafter drafts is checked
        drafts=(Draft("self", tiny_with_tokenizer),),
        requests=40,  # arrivals over ~50 s: past the last kill on a slower machine too
        rate=0.8,
        max_tokens=16,
        kill=kills,
        first_kill_s=2.0,
        spacing_s=1.5,
        restart_after_s=1.0,
        busy_wait_s=10.0,
        hang_s=45.0,
        connect_timeout_s=60.0,
        start_timeout_s=120.0,
        settings=settings,
        logs=tmp_path / "logs",
    )
    started = time.monotonic()
    report = run_chaos(config, say=print)
    report.write(tmp_path / "out")
    print(report.markdown(), f"\n{time.monotonic() - started:.0f} s")
    assert [k.service for k in report.kills] == list(kills)
    assert all(k.back_at_s is not None for k in report.kills)
    for service in kills:  # every kill hit requests in flight
        assert any(service in o.phase.split("+") for o in report.outcomes), service
    assert len(report.outcomes) == 40
    assert not [o for o in report.outcomes if o.result in (DIFFERENT, HUNG_RESULT)]
    assert not [o for o in report.outcomes if o.lost or o.duplicated or o.wrong]
    assert all(o.failure_allowed for o in report.outcomes if o.result == FAILED_CLEARLY)
    assert report.passed, report.found
    assert sum(o.received.accepted_tokens for o in report.outcomes) > 0  # speculation ran
    assert (tmp_path / "out" / "chaos.md").is_file()
