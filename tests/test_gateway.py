"""The gateway over a real embedded Redis, answered by a stand-in scheduler loop in this test.

The stand-in reads Submit/Cancel from the cell's request stream in the scheduler's consumer
group and answers on the Submit's reply_to stream, as the real scheduler will.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from services.gateway.app import Gateway
from shared.bus import Bus, Delivery, EmbeddedRedis, StreamConsumer
from shared.bus.preemptions import add_preemptions
from shared.model.smollm2 import ensure_smollm2
from shared.settings import AugurySettings, GatewaySettings, RedisSettings
from shared.wire import Cancel, FinishReason, RequestError, Submit, Tokens
from shared.wire.streams import SCHEDULER, requests_stream

pytestmark = pytest.mark.anyio

REPLY = " Hello world, from the stand-in scheduler!"
MEASURED_TPOT_MS = 30.0  # what the stand-in reports as each request's TPOT
FAST = RedisSettings(block_ms=100, claim_idle_ms=1000)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


class StandInScheduler:
    """Answers each Submit with REPLY in two steps (the first one sent twice, as a redelivery
    would), a RequestError for prompts containing "fail", and nothing for prompts with "hang".
    The last step echoes the Submit's SLO class and objective, with MEASURED_TPOT_MS.
    """

    def __init__(self, bus: Bus, tokenizer: Any) -> None:
        self.bus = bus
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.submits: list[Submit] = []
        self.cancelled: list[str] = []

    async def __call__(self, delivery: Delivery) -> None:
        message = delivery.message
        if isinstance(message, Cancel):
            self.cancelled.append(message.request_id)
            return
        assert isinstance(message, Submit)
        self.submits.append(message)
        prompt = self.tokenizer.decode(message.prompt)
        if "hang" in prompt:
            return
        if "fail" in prompt:
            error = RequestError(message.request_id, "invalid_request", "no failing", "prompt")
            await self.bus.publish(message.reply_to, error)
            return
        ids = self.reply_ids[: message.sampling.max_tokens]
        finish = FinishReason.LENGTH if len(ids) < len(self.reply_ids) else FinishReason.STOP
        first = Tokens(message.request_id, 0, 0, tuple(ids[:1]))
        rest = Tokens(
            message.request_id,
            1,
            1,
            tuple(ids[1:]),
            finish,
            1,
            4,
            3,
            "draft-s",
            slo_class=message.slo_class,
            tpot_slo_ms=message.tpot_slo_ms,
            tpot_ms=MEASURED_TPOT_MS,
        )
        await self.bus.publish_all(
            [(message.reply_to, first), (message.reply_to, first), (message.reply_to, rest)]
        )


def make_settings(**gateway: Any) -> AugurySettings:
    return AugurySettings(redis=FAST, gateway=GatewaySettings(**gateway), service={"cell": "t"})


async def start(
    server: EmbeddedRedis, tokenizer: Any, name: str, **gateway: Any
) -> tuple[TestClient, StandInScheduler, StreamConsumer]:
    settings = make_settings(**gateway)
    bus = Bus(server.url, settings.redis, name)
    scheduler = StandInScheduler(Bus(server.url, settings.redis, f"{name}-sched"), tokenizer)
    consumer = StreamConsumer(
        scheduler.bus,
        group=SCHEDULER,
        streams=[requests_stream(f"t-{name}")],
        handler=scheduler,
        concurrency=8,
    )
    settings = settings.model_copy(
        update={"service": settings.service.model_copy(update={"cell": f"t-{name}"})}
    )
    gateway_app = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    client = TestClient(TestServer(gateway_app.app()))
    await client.start_server()
    await consumer.start()
    return client, scheduler, consumer


@pytest.fixture
async def running(
    server: EmbeddedRedis, tokenizer: Any, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[TestClient, StandInScheduler]]:
    client, scheduler, consumer = await start(server, tokenizer, request.node.name[:40])
    yield client, scheduler
    await consumer.stop()
    await client.close()
    await scheduler.bus.close()


def model_name() -> str:
    return GatewaySettings().model_name


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_models_and_health(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [model_name()]
    health = await client.get("/health")
    assert health.status == 200


async def test_ready_once_a_generation_goes_through(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    response = await client.get("/health/ready")
    assert response.status == 200 and (await response.json())["status"] == "ready"
    (probe,) = scheduler.submits  # one real one-token request went through
    assert probe.sampling.max_tokens == 1
    assert (await client.get("/health/ready")).status == 200
    assert len(scheduler.submits) == 1  # a fresh answer is reused, not probed again


async def test_not_ready_without_a_scheduler(server: EmbeddedRedis, tokenizer: Any) -> None:
    settings = make_settings(ready_timeout_s=0.3)
    bus = Bus(server.url, settings.redis, "lonely")
    gateway = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    try:
        assert (await client.get("/health")).status == 200  # alive ...
        response = await client.get("/health/ready")  # ... but nothing answers
        assert response.status == 503
    finally:
        await client.close()


async def test_completion(running: tuple[TestClient, StandInScheduler], tokenizer: Any) -> None:
    client, scheduler = running
    body = {"model": model_name(), "prompt": "Say hello", "max_tokens": 50, "temperature": 0}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200, await response.text()
    out = await response.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["choices"][0]["text"] == REPLY  # the repeated first step is not doubled
    assert out["choices"][0]["finish_reason"] == "stop"
    prompt_len = len(tokenizer.encode("Say hello"))
    completion_len = len(scheduler.reply_ids)
    assert out["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "total_tokens": prompt_len + completion_len,
    }
    assert out["augury"]["acceptance_rate"] == 0.75
    assert out["augury"]["mean_accepted_length"] == 4.0
    assert out["augury"]["steps_by_draft"] == {"draft-s": 1}
    assert out["augury"]["tpot_ms"] == MEASURED_TPOT_MS
    assert out["augury"]["slo_class"] is None and out["augury"]["tpot_slo_ms"] is None
    assert out["augury"]["slo_met"] is None  # no objective
    (submit,) = scheduler.submits
    assert submit.prompt == tuple(tokenizer.encode("Say hello"))
    assert submit.sampling.max_tokens == 50 and submit.sampling.temperature == 0.0
    assert scheduler.cancelled == []  # finished requests are not cancelled


async def test_chat_stream_with_usage(
    running: tuple[TestClient, StandInScheduler], tokenizer: Any
) -> None:
    client, scheduler = running
    body = {
        "model": model_name(),
        "messages": [{"role": "user", "content": "Hi there"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": 3,
        "augury": {
            "tpot_slo_ms": 40,
            "slo_class": "relaxed",
            "draft_model": "tiny",
            "speculate": True,
        },
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    stats = chunks[-2]["augury"]
    assert (stats["slo_class"], stats["tpot_slo_ms"]) == ("relaxed", 40.0)
    assert (stats["tpot_ms"], stats["slo_met"]) == (MEASURED_TPOT_MS, True)
    assert all("augury" not in c for c in chunks[:-2])  # statistics come once, at the end
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(scheduler.reply_ids)
    (submit,) = scheduler.submits
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(submit.prompt) == templated
    assert (submit.priority, submit.tpot_slo_ms, submit.draft_model) == (3, 40.0, "tiny")
    assert submit.slo_class == "relaxed"


async def test_openai_client_conformance(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    openai = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    chat = await openai.chat.completions.create(
        model=model_name(), messages=[{"role": "user", "content": "Hello"}], max_tokens=3
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    stream = await openai.completions.create(
        model=model_name(),
        prompt="Hello",
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for part in stream:
        pieces.extend(choice.text for choice in part.choices)
        usage = part.usage or usage
    assert "".join(pieces) == REPLY[: len("".join(pieces))] and pieces
    assert usage is not None and usage.completion_tokens > 0
    await openai.close()


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "prompt"),
        # options other servers honour are refused, never silently ignored (one list)
        # processors and logprobs out of range (shared/engine/processors.py implements them)
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": 3},
            400,
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            400,
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "xml"},
            },
            400,
            "response_format.type",
        ),
        # limits: a draft name the scheduler could not take, an unbounded stop list
        (
            "/v1/completions",
            {"prompt": "x", "augury": {"draft_model": "d" * 65}},
            400,
            "augury.draft_model",
        ),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * 65}, 400, "stop_token_ids"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * 257},
            400,
            "messages",
        ),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
        (
            "/v1/completions",
            {"prompt": "x", "augury": {"tpot_slo_ms": -1}},
            400,
            "augury.tpot_slo_ms",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "augury": {"slo_class": "platinum"}},
            400,
            "augury.slo_class",
        ),
        ("/v1/completions", {"prompt": "x", "augury": {"slo_class": 2}}, 400, "augury.slo_class"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ],
)
async def test_bad_requests_name_the_field(
    running: tuple[TestClient, StandInScheduler],
    path: str,
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    client, scheduler = running
    response = await client.post(path, json={"model": model_name(), **body})
    assert response.status == status
    error = (await response.json())["error"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert scheduler.submits == []  # nothing reached the scheduler


async def test_neutral_values_of_unsupported_options_pass(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {
        "model": model_name(),
        "messages": [{"role": "user", "content": "x"}],
        "presence_penalty": 0,
        "logit_bias": {},
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "temperature": 1e-320,  # below vLLM's epsilon: greedy, not NaN probabilities
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    assert scheduler.submits[-1].sampling.temperature == 0.0


async def test_an_oversized_body_is_an_openai_413(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {"model": model_name(), "prompt": "x" * (5 << 20)}  # over the default 4 MiB
    response = await client.post("/v1/completions", json=body)
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "too_large"
    assert scheduler.submits == []


async def test_invalid_json_is_a_400(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    response = await client.post("/v1/completions", data=b"{not json")
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_json"


async def test_scheduler_errors_reach_the_client(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, _ = running
    response = await client.post("/v1/completions", json={"model": model_name(), "prompt": "fail"})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "prompt"
    stream = await client.post(
        "/v1/completions", json={"model": model_name(), "prompt": "fail", "stream": True}
    )
    events = await sse_events(stream)
    assert events[0]["error"]["code"] == "invalid_request" and events[-1] == "[DONE]"


async def test_client_disconnect_cancels_the_request(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {
        "model": model_name(),
        "messages": [{"role": "user", "content": "hang"}],
        "stream": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    await response.content.readline()  # the role chunk: the request is in flight
    response.close()
    for _ in range(100):
        if scheduler.cancelled:
            break
        await asyncio.sleep(0.05)
    (submit,) = scheduler.submits
    assert scheduler.cancelled == [submit.request_id]


async def test_non_streaming_disconnect_cancels_too(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {"model": model_name(), "prompt": "hang"}
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.5))
    for _ in range(100):
        if scheduler.cancelled:
            break
        await asyncio.sleep(0.05)
    assert scheduler.cancelled == [scheduler.submits[0].request_id]


async def test_overload_answers_429_with_retry_after(server: EmbeddedRedis, tokenizer: Any) -> None:
    client, scheduler, consumer = await start(
        server, tokenizer, "overload", max_concurrent_requests=1
    )
    hanging = asyncio.create_task(
        client.post("/v1/completions", json={"model": model_name(), "prompt": "hang"})
    )
    for _ in range(100):
        if scheduler.submits:
            break
        await asyncio.sleep(0.02)
    response = await client.post("/v1/completions", json={"model": model_name(), "prompt": "hi"})
    assert response.status == 429
    assert response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["type"] == "rate_limit_error"
    hanging.cancel()
    await consumer.stop()
    await client.close()


async def test_api_key_is_required_when_configured(server: EmbeddedRedis, tokenizer: Any) -> None:
    client, _, consumer = await start(server, tokenizer, "auth", api_key="sk-test")
    body = {"model": model_name(), "prompt": "hi", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body)).status == 401
    wrong = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status == 401
    assert (await wrong.json())["error"]["code"] == "invalid_api_key"
    ok = await client.post(
        "/v1/completions", json=body, headers={"Authorization": "Bearer sk-test"}
    )
    assert ok.status == 200
    assert (await client.get("/health")).status == 200  # liveness needs no key
    assert (await client.get("/metrics")).status == 200  # metrics neither, by default
    await consumer.stop()
    await client.close()


async def test_several_keys_and_guarded_metrics(server: EmbeddedRedis, tokenizer: Any) -> None:
    client, _, consumer = await start(
        server, tokenizer, "keys", api_key="sk-old", api_keys=["sk-new"], metrics_need_key=True
    )
    body = {"model": model_name(), "prompt": "hi", "max_tokens": 2}
    for key in ("sk-old", "sk-new"):
        headers = {"Authorization": f"Bearer {key}"}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
        assert (await client.get("/metrics", headers=headers)).status == 200
    assert (await client.get("/metrics")).status == 401
    wrong = {"Authorization": "Bearer sk-ol"}
    assert (await client.post("/v1/completions", json=body, headers=wrong)).status == 401
    assert (await client.get("/health")).status == 200
    await consumer.stop()
    await client.close()


async def test_metrics_are_exposed(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    await client.post("/v1/completions", json={"model": model_name(), "prompt": "hi"})
    text = await (await client.get("/metrics")).text()
    assert "augury_time_to_first_token_seconds_count 1.0" in text
    assert "augury_e2e_request_latency_seconds_count 1.0" in text
    assert "augury_spec_decode_num_draft_tokens_total 4.0" in text
    assert 'augury_spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0' in text
    assert 'augury_request_success_total{finished_reason="stop"} 1.0' in text
    assert "augury_num_requests_running 0.0" in text
    assert 'augury_num_preemptions_total{cell="t-test_metrics_are_exposed",kind="kept"} 0.0' in text


async def test_slo_attainment_is_counted(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    bodies = [
        {"tpot_slo_ms": 40, "slo_class": "urgent"},  # met: 30 <= 40
        {"tpot_slo_ms": 40, "slo_class": "urgent"},
        {"tpot_slo_ms": 20},  # missed, and no class: custom
        {},  # no objective: not counted
    ]
    for augury in bodies:
        body = {"model": model_name(), "prompt": "hi", "augury": augury}
        assert (await client.post("/v1/completions", json=body)).status == 200
    text = await (await client.get("/metrics")).text()
    assert 'augury_slo_requests_total{attained="true",slo_class="urgent"} 2.0' in text
    assert 'augury_slo_requests_total{attained="false",slo_class="custom"} 1.0' in text
    assert text.count("augury_slo_requests_total{") == 2


async def test_preemption_totals_come_from_redis(
    running: tuple[TestClient, StandInScheduler], request: pytest.FixtureRequest
) -> None:
    client, scheduler = running
    cell = f"t-{request.node.name[:40]}"
    await add_preemptions(scheduler.bus, cell, {"kept": 3, "recomputed": 1})
    await add_preemptions(scheduler.bus, cell, {"kept": 2, "swapped": 0})
    text = await (await client.get("/metrics")).text()
    assert f'augury_num_preemptions_total{{cell="{cell}",kind="kept"}} 5.0' in text
    assert f'augury_num_preemptions_total{{cell="{cell}",kind="recomputed"}} 1.0' in text
    assert f'augury_num_preemptions_total{{cell="{cell}",kind="swapped"}} 0.0' in text
