"""Recording traffic through Redis, exporting it, and replaying traces against the services.

The services run in this process on a tiny random target that carries SmolLM2's tokenizer (the
gateway needs a real tokenizer and chat template; a tiny model keeps every step fast), with a
tiny draft, all over a real embedded Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from services.gateway.body import GenerationRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.progress import Progress
from services.gateway.recording import Recorder
from services.run import Stack, start_stack
from services.runtime import ModelPaths
from shared.bus import Bus, EmbeddedRedis
from shared.settings import GatewaySettings, RedisSettings
from shared.values.sampling import SamplingParams
from shared.wire.streams import recorded_stream
from tests.conftest import make_tiny_checkpoint
from tests.test_services_support import make_settings
from tools.load.client import RequestFailed, apply_event, replay, schedule
from tools.load.readers import read_trace
from tools.load.recording import read_recorded, split_trace_url
from tools.load.records import RequestRecord
from tools.load.report import load_records
from tools.load.trace import TraceRequest
from tools.replay import main

pytestmark = pytest.mark.anyio

SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QUESTION = "What is the capital of France?"
MODEL = "SmolLM2-135M-Instruct"  # the gateway's default model name


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelPaths:
    from shared.model.smollm2 import ensure_smollm2

    target = make_tiny_checkpoint(
        tmp_path_factory.mktemp("target"),
        seed=0,
        vocab_size=SMOLLM2_VOCAB,
        num_layers=1,
        max_positions=2048,
        tie=True,
    )
    for name in TOKENIZER_FILES:
        if (ensure_smollm2() / name).is_file():
            shutil.copy(ensure_smollm2() / name, target / name)
    draft = make_tiny_checkpoint(
        tmp_path_factory.mktemp("draft"),
        seed=1,
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=32,
        num_layers=1,
        max_positions=2048,
        tie=True,
    )
    return ModelPaths(target, {"tiny": draft})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(
    server: EmbeddedRedis,
    models: ModelPaths,
    cell: str,
    *,
    scheduler: dict[str, Any] | None = None,
    **gateway: Any,
) -> AsyncIterator[tuple[Stack, str]]:
    """All services with the gateway; yields the stack and the gateway's base URL."""
    port = free_port()
    settings = make_settings(
        server.url,
        cell,
        gateway={"port": port, **gateway},
        models={"target_dir": models.target},
        scheduler=scheduler or {},
    )
    stack = await start_stack(settings, server.url, models)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base)
        yield stack, base
    finally:
        await stack.stop()


async def wait_healthy(base: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"{base}/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not come up")


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as response:
        answer = await response.json()
        answer["status"] = response.status
        return answer


async def stream_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer, up to [DONE]."""
    events = []
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            data = line.strip().removeprefix(b"data:").strip()
            if data == b"[DONE]":
                break
            if data:
                events.append(json.loads(data))
    return events


async def eventually(read: Callable[[], Any], ready: Callable[[Any], bool]) -> Any:
    """Poll a blocking read (off the loop) until its value is ready; at most 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        value = await asyncio.to_thread(read)
        if ready(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


def raw_records(url: str, stream: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        entries = client.xrange(stream)
    finally:
        client.close()
    records = [json.loads(f["record"]) for _, f in entries if f["v"] == "1"]
    return sorted(records, key=lambda r: r["arrival_time"])


# ---- (a) recording and export ----------------------------------------------------------------
async def test_gateway_records_what_it_accepted_and_export_reads_it_back(
    server: EmbeddedRedis,
    models: ModelPaths,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stream = recorded_stream("rec")
    async with (
        serving(server, models, "rec", record_requests=True, record_prompts=True) as (_, base),
        aiohttp.ClientSession() as http,
    ):
        chat = await post(
            http,
            f"{base}/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 5,
                "temperature": 0,
                "priority": 3,
                "augury": {"tpot_slo_ms": 50},
            },
        )
        assert chat["status"] == 200, chat
        events = await stream_events(
            http,
            f"{base}/v1/completions",
            {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 7,
                "temperature": 0.7,
                "top_k": 5,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        refused = await post(
            http,
            f"{base}/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        )
        assert refused["status"] == 400  # refused before it was accepted: not recorded

        raw = await eventually(lambda: raw_records(server.url, stream), lambda r: len(r) >= 2)
        assert [r["chat"] for r in raw] == [True, False]
        assert [r["stream"] for r in raw] == [False, True]
        assert [r["finish_reason"] for r in raw] == ["length", "length"]
        assert raw[1]["ignore_eos"] is True and raw[1]["top_k"] == 5
        assert all(0 <= r["ttft_s"] <= r["e2e_s"] for r in raw)

        recorded = read_recorded(server.url, stream)
        first, second = recorded
        assert first.arrival_s == 0.0 and second.arrival_s > 0.0
        assert first.input_length == chat["usage"]["prompt_tokens"]
        assert second.input_length == events[-1]["usage"]["prompt_tokens"]
        assert (first.output_length, second.output_length) == (5, 7)
        assert first.max_tokens is None  # the replay generates the recorded length
        assert (first.priority, first.tpot_slo_ms, first.temperature) == (3, 50.0, 0.0)
        assert second.temperature == 0.7 and second.tpot_slo_ms is None
        assert first.messages == (("user", QUESTION),) and first.prompt is None
        assert second.prompt == "Once upon a time" and second.messages is None
        assert read_recorded(server.url, stream, count=1) == [first]

        # an entry of a record version we do not know is skipped with a warning
        client = redis.Redis.from_url(server.url)
        client.xadd(stream, {"v": "99", "record": "{}"})
        with caplog.at_level(logging.WARNING, logger="tools.load.recording"):
            assert read_recorded(server.url, stream) == recorded
        assert "unknown record version" in caplog.text

        # export: the recording as a JSONL trace that read_trace reads back
        out = tmp_path / "recorded.jsonl"
        assert main(["export", "--redis", f"{server.url}?stream={stream}", "--out", str(out)]) == 0
        assert "2 requests written" in capsys.readouterr().out
        exported = read_trace(out)
        assert [(r.input_length, r.output_length) for r in exported] == [
            (r.input_length, r.output_length) for r in recorded
        ]
        assert exported[0].messages == first.messages and exported[1].prompt == second.prompt
        arrivals = [r.arrival_s for r in recorded]
        assert [r.arrival_s for r in exported] == pytest.approx(arrivals, abs=1e-3)

        # run replays a recording named by its Redis URL
        trace, run_dir = f"{server.url}?stream={stream}", tmp_path / "run"
        argv = ["run", "--trace", trace, "--base-url", base, "--out", str(run_dir)]
        assert await asyncio.to_thread(main, [*argv, "--no-progress", "--no-plots"]) == 0
        replayed = load_records(run_dir)
        assert [r.num_output_tokens for r in replayed] == [5, 7]
        # (a completion's prompt is replayed as a chat message: only the chat keeps its length)
        assert replayed[0].num_prompt_tokens == first.input_length
        capsys.readouterr()

        # failed after it was accepted (the scheduler refuses the draft), and abandoned
        error = await post(
            http,
            f"{base}/v1/completions",
            {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "augury": {"draft_model": "nope"}},
        )
        assert error["status"] == 400 and "draft model" in error["error"]["message"]
        long = {"model": MODEL, "prompt": "Hi", "max_tokens": 1500, "stream": True}
        async with http.post(f"{base}/v1/completions", json=long) as response:
            await response.content.readline()  # the first chunk: then leave
            response.close()
        # (the replay above was recorded too: 2 + 2 before these)
        raw = await eventually(lambda: raw_records(server.url, stream), lambda r: len(r) >= 6)
        assert [r["finish_reason"] for r in raw[4:]] == ["error", "cancelled"]
        assert raw[4]["draft_model"] == "nope" and raw[5]["output_length"] < 1500

        # trimming: MAXLEN ~ keeps whole stream nodes, so small nodes make the bound visible
        node_entries = client.config_get("stream-node-max-entries")["stream-node-max-entries"]
        client.config_set("stream-node-max-entries", 4)
        try:
            await _trimmed_to_maxlen(server, models, client)
        finally:
            client.config_set("stream-node-max-entries", node_entries)
            client.close()


async def _trimmed_to_maxlen(
    server: EmbeddedRedis, models: ModelPaths, client: redis.Redis
) -> None:
    stream, maxlen = recorded_stream("trim"), 3
    async with (
        serving(server, models, "trim", record_requests=True, record_maxlen=maxlen) as (_, base),
        aiohttp.ClientSession() as http,
    ):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        answers = await asyncio.gather(
            *(post(http, f"{base}/v1/completions", body) for _ in range(12))
        )
        assert all(a["status"] == 200 for a in answers)
    # the gateway has stopped, which waits for its recording writes
    assert maxlen <= client.xlen(stream) <= maxlen + 4
    assert all("prompt" not in r for r in raw_records(server.url, stream))  # off by default


async def test_a_failing_redis_never_fails_the_request() -> None:
    bus = Bus("unix:///nonexistent/redis.sock", RedisSettings(), "gone")
    metrics = GatewayMetrics()
    recorder = Recorder(bus, GatewaySettings(record_requests=True), "gone", metrics)
    gen = GenerationRequest(
        chat=False,
        prompt_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=4),
        stream=False,
        include_usage=False,
        priority=0,
        tpot_slo_ms=None,
        draft_model=None,
        speculate=True,
    )
    started = time.monotonic()
    recorder.record(gen, Progress(started=started), arrival_time=time.time(), failed=True)
    assert time.monotonic() - started < 0.05  # the write happens in the background
    await recorder.stop()
    await bus.close()
    assert metrics.registry.get_sample_value("augury_recording_failures_total") == 1


def test_trace_urls_keep_unix_sockets_and_other_parameters() -> None:
    assert split_trace_url("unix:///run/redis.sock?db=1&stream=augury:{0}:recorded") == (
        "unix:///run/redis.sock?db=1",
        "augury:{0}:recorded",
    )
    assert split_trace_url("redis://h:6379/0") == ("redis://h:6379/0", None)


# ---- (b) a real replay, (c) continuous usage -------------------------------------------------
def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_replay_a_trace_against_the_services(
    server: EmbeddedRedis,
    models: ModelPaths,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    outputs = [8, 12, 16, 8, 12, 16]
    rows: list[dict[str, Any]] = []
    for i, n in enumerate(outputs):
        row: dict[str, Any] = {"timestamp": 60 * i, "output_length": n, "slo_class": "s"}
        if i % 2:  # half get a dataset prompt of their length from the tokenizer
            row["input_length"] = 40
        else:
            row["messages"] = [{"role": "user", "content": f"Count to {i + 3}."}]
            row["tpot_slo_ms"] = 500
        rows.append(row)
    trace = write_jsonl(tmp_path / "trace.jsonl", rows)
    out = tmp_path / "run"
    # the trace's class "s": 5 x a 100 ms baseline (the tests measure no cost profile)
    slo = {"classes": {"s": 5.0}, "baseline_latency_ms": 100.0}
    async with serving(server, models, "replay", scheduler={"slo": slo}) as (_, base):
        argv = ["run", "--trace", str(trace), "--base-url", f"{base}/v1", "--out", str(out)]
        argv += ["--rate-scale", "2", "--target", str(models.target), "--label", "tiny"]
        argv += ["--no-progress", "--no-plots"]
        assert await asyncio.to_thread(main, argv) == 0

        # one request's failure is its record, not an exception
        [failed] = await replay(
            [TraceRequest(0.0, output_length=4, prompt="Hi")], base, model="no-such-model"
        )
        assert not failed.is_completed and "HTTP 404" in (failed.error or "")

        await _continuous_usage(base)
    client = redis.Redis.from_url(server.url)
    assert not client.exists(recorded_stream("replay"))  # recording is off by default
    client.close()

    assert "# Load test: tiny" in capsys.readouterr().out
    records = load_records(out)
    assert [r.index for r in records] == list(range(6))
    for record, row in zip(records, rows, strict=True):
        assert record.is_completed, record.error
        assert record.arrival_s == pytest.approx(row["timestamp"] / 1000 / 2)
        assert record.num_output_tokens == row["output_length"]  # ignore_eos honoured
        assert sum(n for _, n in record.chunks) == record.num_output_tokens
        assert record.first_token_s is not None and record.first_token_s >= record.arrival_s
        assert record.finish_s is not None and record.finish_s >= record.first_token_s
        assert record.finish_reason == "length" and record.num_prompt_tokens > 0
        assert record.slo_class == "s" and record.tpot_slo_ms == row.get("tpot_slo_ms")
        assert set(record.steps_by_draft) <= {"tiny"}
    assert [r.num_prompt_tokens for r in records[1::2]] == pytest.approx([40] * 3, abs=4)
    report = json.loads((out / "report.json").read_text())
    assert (report["requests"], report["completed"], report["failed"]) == (6, 6, 0)
    assert report["total_output_tokens"] == sum(outputs)
    for key in ("duration_s", "ttft_s", "tpot_ms", "e2e_s", "per_class", "meta"):
        assert key in report
    meta = report["meta"]
    assert meta["label"] == "tiny" and meta["rate_scale"] == 2.0 and meta["trace"] == str(trace)
    assert meta["base_url"] == f"{base}/v1" and "tools.replay run" in meta["command"]
    assert (out / "report.md").is_file() and (out / "records.jsonl").is_file()


async def _continuous_usage(base: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 10,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with aiohttp.ClientSession() as http:
        events = await stream_events(http, f"{base}/v1/chat/completions", body)
        usages = [e["usage"] for e in events]  # every chunk carries one
        completions = [u["completion_tokens"] for u in usages]
        assert completions == sorted(completions) and completions[-1] == 10
        assert completions[0] == 0  # the role chunk, before any token
        assert len(set(completions)) > 2  # counted as the tokens came
        assert len({u["prompt_tokens"] for u in usages}) == 1
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        assert events[-1]["choices"] == []  # include_usage's final chunk is still there

        plain = await stream_events(
            http, f"{base}/v1/chat/completions", {**body, "stream_options": {}}
        )
        assert all("usage" not in e for e in plain)
        body["stream_options"] = {"continuous_usage_stats": "yes"}
        bad = await post(http, f"{base}/v1/chat/completions", body)
        assert bad["status"] == 400 and "continuous_usage_stats" in bad["error"]["message"]


def test_schedule_scales_arrivals_and_stops_sending() -> None:
    trace = [TraceRequest(t, output_length=1, prompt="x") for t in (2.0, 0.0, 1.0, 3.0)]
    assert schedule(trace, rate_scale=2.0) == [(1, 0.0), (2, 0.5), (0, 1.0), (3, 1.5)]
    assert schedule(trace, rate_scale=2.0, duration_s=1.0) == [(1, 0.0), (2, 0.5), (0, 1.0)]
    assert schedule(trace, max_requests=2) == [(1, 0.0), (2, 1.0)]


def test_events_fold_into_the_record() -> None:
    record = RequestRecord(index=0, arrival_s=0.0, num_prompt_tokens=0)
    usage = {"prompt_tokens": 9, "total_tokens": 9}
    apply_event(record, {"choices": [{"delta": {"role": "assistant"}}], "usage": usage}, 0.1)
    assert record.first_token_s is None and record.chunks == []
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    apply_event(record, {"choices": [{"delta": {"content": "a b c"}}], "usage": usage}, 0.2)
    final = {
        "choices": [{"delta": {}, "finish_reason": "length"}],
        "usage": {**usage, "completion_tokens": 4},
        "augury": {"drafts": 2, "draft_tokens": 6, "steps_by_draft": {"d": 2}},
    }
    apply_event(record, final, 0.3)
    assert record.chunks == [(0.2, 3), (0.3, 1)] and record.first_token_s == 0.2
    assert (record.num_prompt_tokens, record.num_output_tokens) == (9, 4)
    assert (record.finish_reason, record.drafts, record.draft_tokens) == ("length", 2, 6)
    assert record.accepted_tokens == 0 and record.steps_by_draft == {"d": 2}
    with pytest.raises(RequestFailed, match="overloaded"):
        apply_event(record, {"error": {"message": "overloaded"}}, 0.4)


# ---- bad input -------------------------------------------------------------------------------
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    base = f"http://127.0.0.1:{free_port()}"
    malformed = write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "output_length": 4}])
    good = write_jsonl(
        tmp_path / "good.jsonl", [{"timestamp": 0, "output_length": 4, "prompt": "Hi"}]
    )
    cases = [
        (
            ["run", "--trace", str(tmp_path / "none.jsonl"), "--base-url", base, "--out", out],
            "trace file not found",
        ),
        (["run", "--trace", str(malformed), "--base-url", base, "--out", out], "bad.jsonl:1"),
        (
            [
                "run",
                "--trace",
                str(good),
                "--base-url",
                base,
                "--out",
                out,
                "--health-timeout",
                "0.3",
            ],
            "not ready",
        ),
        (
            ["export", "--redis", "unix:///nonexistent/redis.sock?stream=s", "--out", out],
            "could not read the recording s",
        ),
        (["compare", str(tmp_path)], "report.json"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tools.replay: error: ") and expected in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


# ---- the load-testing doc's own commands, and failures ---------------------------------------
LOAD_TESTING_DOC = Path(__file__).resolve().parents[1] / "docs" / "load-testing.md"


def doc_command(prefix: str) -> list[str]:
    """The arguments of the first command in the doc's bash blocks that starts with `prefix`
    (continuation lines joined; `[...]` optional parts dropped), after `python -m MODULE`."""
    import re
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", LOAD_TESTING_DOC.read_text(), flags=re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                words = shlex.split(re.sub(r"\[[^\]]*\]", "", line.split("#")[0]))
                return words[3:]
    raise AssertionError(f"no `{prefix}` command in {LOAD_TESTING_DOC}")


def with_options(argv: list[str], values: dict[str, list[str]]) -> list[str]:
    """`argv` with each named option's values replaced (same number of values)."""
    out = list(argv)
    for option, replacement in values.items():
        at = out.index(option)
        out[at + 1 : at + 1 + len(replacement)] = replacement
    return out


async def test_the_docs_synth_trace_replays_and_failures_exit_1_counted_by_reason(
    server: EmbeddedRedis,
    models: ModelPaths,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tools.traces import main as traces_main

    # docs/load-testing.md's synth command, as written but for its size and paths
    trace = tmp_path / "trace.jsonl"
    synth = doc_command("python -m tools.traces synth")
    synth = with_options(synth, {"--rate": ["4"], "--duration": ["1"], "--out": [str(trace)]})
    assert "--slo" in synth and synth[synth.index("--slo") + 1 :][:2] == ["tight=60", "loose=150"]
    assert traces_main([*synth, "--target", str(models.target)]) in (0, None)
    requests = read_trace(trace)
    assert {r.slo_class for r in requests} == {"tight", "loose"} and len(requests) >= 2
    # a trace class the server does not know, without an objective in ms: a 400 per request
    unknown = write_jsonl(
        tmp_path / "unknown.jsonl",
        [
            {"timestamp": 10 * i, "output_length": 3, "prompt": "Hi", "slo_class": "nope"}
            for i in range(3)
        ],  # fmt: skip
    )
    async with serving(server, models, "docs") as (_, base):
        # and its replay command (the server's classes know neither tight nor loose)
        run = doc_command("python -m tools.replay run")
        run = with_options(run, {"--base-url": [base], "--out": [str(tmp_path / "ok")]})
        run = [part.replace("trace.jsonl", str(trace)) for part in run if not part.startswith("[")]
        argv = [*run, "--no-progress", "--no-plots", "--target", str(models.target)]
        assert await asyncio.to_thread(main, argv) == 0
        records = load_records(tmp_path / "ok")
        assert all(r.is_completed for r in records), [r.error for r in records]
        assert {r.slo_class for r in records} == {"tight", "loose"}  # the report keeps them
        capsys.readouterr()

        argv = ["run", "--trace", str(unknown), "--base-url", base, "--no-progress"]
        assert await asyncio.to_thread(main, [*argv, "--out", str(tmp_path / "bad")]) == 1
        err = capsys.readouterr().err
        assert "3 of 3 requests failed" in err and "HTTP 400" in err and "nope" in err
        argv += ["--out", str(tmp_path / "allowed"), "--allow-failures", "--no-plots"]
        assert await asyncio.to_thread(main, argv) == 0
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    [(reason, count)] = report["failures_by_reason"].items()
    assert count == 3 and reason.startswith("HTTP 400: unknown SLO class 'nope'")
    markdown = (tmp_path / "bad" / "report.md").read_text()
    assert "## Failures" in markdown and f"| 3 | {reason} |" in markdown
    assert (tmp_path / "bad" / "throughput.png").is_file()
