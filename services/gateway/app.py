"""The OpenAI-compatible HTTP front: validate, tokenize, Submit, stream Tokens back as SSE.

It talks to the bus only: `Submit` and `Cancel` go to the cell's request stream, `Tokens` and
`RequestError` come back on this replica's output stream (see outputs.py). With
`gateway.record_requests`, every accepted request is recorded when it ends (see recording.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from services.gateway.body import APIError, GenerationRequest, Tokenizer, parse_generation
from services.gateway.cell_scrape import scrape_cells
from services.gateway.cells import CellRouter, RoutingRules
from services.gateway.choices import (
    Choice,
    ChoiceDelta,
    combined_statistics,
    make_choices,
    merged,
)
from services.gateway.logprobs import (
    choice_logprobs,
    echo_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.outputs import OutputRouter
from services.gateway.progress import Progress, count_slo, follow
from services.gateway.recording import Outcome, Recorder, noting_failure
from services.gateway.structured import check_compiles
from services.gateway.tool_output import finish_reason, stream_deltas, tool_message
from shared.bus import Bus
from shared.settings import AugurySettings
from shared.text.tool_calls import ToolCallParser
from shared.values.sampling import SamplingParams
from shared.wire import Cancel, FinishReason, Submit, Tokens
from shared.wire.streams import requests_stream

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
READY_FRESH_S = 5.0  # a readiness probe that went through answers for this long
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it

RouteHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    def __init__(
        self,
        settings: AugurySettings,
        bus: Bus,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_context: int,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.model_name = settings.gateway.model_name
        self.metrics = GatewayMetrics()
        self.cells = CellRouter(bus, routing_rules(settings))
        self.outputs = OutputRouter(bus, self.cells.cells)
        self.recorder = Recorder(bus, settings.gateway, settings.service.cell, self.metrics)
        self.active = 0
        self.draining = False
        # one thread: the tokenizer is not shared across threads, and the loop stays free
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # grammars compile here, so that a slow one holds neither the loop nor tokenizing
        self._compiling = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._probing = asyncio.Lock()
        self._ready_at = -math.inf  # when a readiness probe last went through

    # ---- application ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._auth],
            client_max_size=self.settings.gateway.max_body_bytes,
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        await self.cells.start()
        await self.outputs.start()

    async def _stop(self, app: web.Application) -> None:
        self.draining = True
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self._compiling.shutdown(wait=False, cancel_futures=True)
        await self.outputs.stop()
        await self.cells.stop()
        await self.recorder.stop()

    @web.middleware
    async def _errors(self, request: web.Request, handler: RouteHandler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as error:
            headers = {"Retry-After": RETRY_AFTER_S} if error.status in (429, 503) else None
            return web.json_response(error.body(), status=error.status, headers=headers)
        except web.HTTPRequestEntityTooLarge:
            limit = self.settings.gateway.max_body_bytes
            error = APIError(413, f"the request body is over {limit} bytes", code="too_large")
            return web.json_response(error.body(), status=413)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("unhandled error on %s", request.path)
            error = APIError(500, "internal error", kind="internal_error", code="internal_error")
            return web.json_response(error.body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: RouteHandler) -> web.StreamResponse:
        keys = self.settings.gateway.accepted_api_keys
        guarded = request.path.startswith("/v1/") or (
            request.path == "/metrics" and self.settings.gateway.metrics_need_key
        )
        if keys and guarded:
            given = request.headers.get("Authorization", "").encode()
            # every key compared, each in constant time: neither a match nor its place leaks
            matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]
            if not any(matches):
                raise APIError(
                    401,
                    "missing or wrong API key",
                    kind="authentication_error",
                    code="invalid_api_key",
                )
        return await handler(request)

    # ---- simple endpoints ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "augury",
            "max_model_len": self.max_context,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 once a one-token generation has gone through every hop (gateway,
        scheduler, verifier and back) within the last few seconds; 503 while starting or
        draining, or when the probe fails."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        async with self._probing:  # one probe at a time; the others share its answer
            if time.monotonic() - self._ready_at > READY_FRESH_S:
                if await self._probe():
                    self._ready_at = time.monotonic()
                else:
                    return web.json_response({"status": "not ready"}, status=503)
        return web.json_response({"status": "ready"})

    async def _probe(self) -> bool:
        request_id = f"ready-{uuid.uuid4().hex}"
        queue = self.outputs.open(request_id)
        prompt = tuple(self.tokenizer.encode("Hi", add_special_tokens=False)) or (0,)
        cell = self.cells.assign([request_id], prompt)
        submit = Submit(
            request_id,
            prompt,
            SamplingParams(max_tokens=1),
            self.outputs.stream_of(cell),
            time.time(),
        )
        try:
            await self.bus.publish(requests_stream(cell), submit)
            async with asyncio.timeout(self.settings.gateway.ready_timeout_s):
                message = await queue.get()
            return isinstance(message, Tokens) and bool(message.token_ids)
        except (TimeoutError, RedisError, OSError) as error:
            log.warning("readiness probe failed: %s", error or type(error).__name__)
            await self._cancel(request_id)
            return False
        finally:
            self.outputs.close(request_id)
            self.cells.release(request_id)

    async def prometheus(self, request: web.Request) -> web.Response:
        await scrape_cells(self.bus, self.cells.cells, self.metrics)  # every cell, labelled
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        started, arrival_time = time.monotonic(), time.time()
        if self.draining:
            raise APIError(503, "the server is draining", kind="server_error", code="unavailable")
        if self.active >= self.settings.gateway.max_concurrent_requests:  # before any work
            raise APIError(
                429,
                "too many concurrent requests; retry later",
                kind="rate_limit_error",
                code="overloaded",
            )
        self.active += 1  # the slot is this request's from here on
        try:
            gen = await self._parse(request, chat=chat)
            self._take_slots(gen.n - 1)  # n choices are n requests
        except BaseException:
            self.active -= 1
            raise
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = make_choices(request_id, gen, self.tokenizer, started)
        outcome = Outcome()
        for choice in choices:
            choice.queue = self.outputs.open(choice.request_id)
        self.cells.assign([choice.request_id for choice in choices], gen.prompt_ids)
        self.metrics.running.inc()
        # n > 1 with prefix caching: choices 1.. wait for choice 0's prefill (its first token),
        # so that they find its prompt's full blocks cached instead of computing them again
        share = gen.n > 1 and self.settings.engine.enable_prefix_caching
        share = share and gen.sampling.prompt_logprobs is None  # those compute their prompts
        prefilled = asyncio.Event() if share else None
        try:
            for choice in choices[:1] if prefilled is not None else choices:
                await self._submit_choice(gen, choice)
            deltas = merged([self._choice_deltas(gen, choice, prefilled) for choice in choices])
            deltas = noting_failure(deltas, outcome)
            if gen.stream:
                return await self._stream(request, request_id, gen, choices, deltas)
            return await self._collect(request, request_id, gen, choices, deltas)
        except APIError:
            outcome.failed = True
            raise
        finally:
            self.active -= gen.n
            self.metrics.running.dec()
            for choice in choices:
                await self._close_choice(gen, choice, arrival_time, outcome)

    def _take_slots(self, extra: int) -> None:
        if extra and self.active + extra > self.settings.gateway.max_concurrent_requests:
            raise APIError(
                429,
                f"n={extra + 1} completions would pass the concurrent request limit; retry later",
                kind="rate_limit_error",
                code="overloaded",
            )
        self.active += extra

    async def _choice_deltas(
        self, gen: GenerationRequest, choice: Choice, prefilled: asyncio.Event | None = None
    ) -> AsyncIterator[ChoiceDelta]:
        """One choice's text as it comes (the prompt's first, with echo); a stop string cancels
        its request in the scheduler at once, so that it stops taking compute. An echo with
        the prompt's logprobs waits for them (they come with the first token)."""
        echo_pending = gen.echo and gen.sampling.prompt_logprobs is not None
        if gen.echo and not echo_pending:
            yield ChoiceDelta(choice, self._prompt_text(gen), None)
        if prefilled is not None and choice.index > 0:  # submitted once choice 0 prefilled
            await prefilled.wait()
            await self._submit_choice(gen, choice)
        assert choice.queue is not None
        progress = choice.progress
        deltas = follow(
            choice.queue,
            progress,
            choice.text,
            self.metrics,
            self.settings.gateway.output_idle_timeout_s,
        )
        async for delta in _noting_first(deltas, prefilled if choice.index == 0 else None):
            if progress.stop_reason is not None and not choice.cancelled:
                choice.cancelled = True
                await self._cancel(choice.request_id)
            if gen.echo_only:  # the one generated token is not shown
                delta = ""
            if echo_pending:
                delta, echo_pending = self._prompt_text(gen) + delta, False
            yield ChoiceDelta(choice, delta, self._finish_reason(progress))

    def _prompt_text(self, gen: GenerationRequest) -> str:
        if gen.prompt_text is not None:
            return gen.prompt_text
        return self.tokenizer.decode(list(gen.prompt_ids), skip_special_tokens=True)

    async def _close_choice(
        self, gen: GenerationRequest, choice: Choice, arrival_time: float, outcome: Outcome
    ) -> None:
        progress = choice.progress
        self.outputs.close(choice.request_id)
        self.recorder.record(gen, progress, arrival_time=arrival_time, failed=outcome.failed)
        try:
            if progress.finish is None:
                self.metrics.aborted.inc()  # the client left (or the stream failed)
                if choice.submitted:
                    await self._cancel(choice.request_id)
            else:
                self._record_finished(gen, progress, prompt=choice.index == 0)
        finally:
            self.cells.release(choice.request_id)

    async def _parse(self, request: web.Request, *, chat: bool) -> GenerationRequest:
        try:
            body = await request.json()
        except ValueError:  # not JSON, not UTF-8, or an integer of more digits than Python reads
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        call_format = self.settings.gateway.tool_call_format
        parse = functools.partial(
            parse_generation,
            body,
            chat=chat,
            tokenizer=self.tokenizer,
            model_name=self.model_name,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            max_stop_token_ids=self.settings.gateway.max_stop_token_ids,
            max_messages=self.settings.gateway.max_messages,
            slo_classes=tuple(self.settings.scheduler.slo.classes),
            default_max_tokens=self.settings.gateway.default_max_tokens,
            max_n=self.settings.gateway.max_n,
            call_format=None if call_format == "auto" else call_format,
        )
        # templating and tokenizing a long prompt must not stall every other stream
        gen = await asyncio.get_running_loop().run_in_executor(self._tokenizing, parse)
        structured = gen.sampling.structured
        if structured is not None:
            field = gen.structured_field or "response_format"
            timeout_s = self.settings.gateway.structured_compile_timeout_s
            await check_compiles(structured, field, self._compiling, timeout_s)
        return gen

    async def _submit_choice(self, gen: GenerationRequest, choice: Choice) -> None:
        choice.submitted = True  # before: a failed publish is still cancelled on the way out
        await self._submit(choice.request_id, gen, choice.sampling)

    async def _submit(
        self, request_id: str, gen: GenerationRequest, sampling: SamplingParams
    ) -> None:
        submit = Submit(
            request_id=request_id,
            prompt=gen.prompt_ids,
            sampling=sampling,
            reply_to=self.outputs.stream_of(self.cells.cell_of(request_id)),
            arrival_time=time.time(),
            priority=gen.priority,
            tpot_slo_ms=gen.tpot_slo_ms,
            draft_model=gen.draft_model,
            speculate=gen.speculate,
            slo_class=gen.slo_class,
            app=gen.app,
        )
        try:
            await self.bus.publish(requests_stream(self.cells.cell_of(request_id)), submit)
        except (RedisError, OSError):
            log.exception("could not submit %s", request_id)
            raise APIError(
                503, "the scheduler is unreachable", kind="server_error", code="unavailable"
            ) from None

    async def _cancel(self, request_id: str) -> None:
        try:
            stream = requests_stream(self.cells.cell_of(request_id))
            await self.bus.publish(stream, Cancel(request_id))
        except (RedisError, OSError):
            log.warning("could not cancel %s", request_id)

    def _record_finished(
        self, gen: GenerationRequest, progress: Progress, *, prompt: bool = True
    ) -> None:
        assert progress.finish is not None
        self.metrics.e2e_latency.observe(time.monotonic() - progress.started)
        if prompt:  # n choices of one prompt count it once
            self.metrics.prompt_tokens.inc(len(gen.prompt_ids))
            if progress.cached_tokens is not None:
                self.metrics.prefix_cache_queries.inc(len(gen.prompt_ids))
                self.metrics.prefix_cache_hits.inc(progress.cached_tokens)
        self.metrics.generation_tokens.inc(len(progress.token_ids))
        self.metrics.requests.labels(finished_reason=progress.finish.value).inc()
        if progress.finish is FinishReason.ABORT:
            self.metrics.aborted.inc()
        count_slo(self.metrics, progress)

    # ---- responses -----------------------------------------------------------------------------
    @staticmethod
    def _usage(gen: GenerationRequest, choices: list[Choice]) -> dict[str, Any]:
        prompt = len(gen.prompt_ids)
        completion = sum(len(output_ids(gen, choice.progress)) for choice in choices)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        # the scheduler says when a request finishes; n choices: the least any of them found
        cached = [c.progress.cached_tokens for c in choices if c.progress.cached_tokens is not None]
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": min(cached)}
        return usage

    @staticmethod
    def _finish_reason(progress: Progress) -> str | None:
        if progress.finish is None:
            return None
        return "length" if progress.finish is FinishReason.LENGTH else "stop"

    def _logprobs(
        self, gen: GenerationRequest, progress: Progress, start: int, text_offset: int = 0
    ) -> dict[str, Any] | None:
        """The choice's logprobs of the tokens from `start` on (None unless asked for)."""
        if gen.sampling.logprobs is None:
            return None
        tokens = output_ids(gen, progress)[start:]
        logprobs = progress.logprobs.tail(start).head(len(tokens))
        return choice_logprobs(gen.chat, self.tokenizer, tokens, logprobs, text_offset)

    def _echo_logprobs(self, gen: GenerationRequest, progress: Progress) -> dict[str, Any] | None:
        """An echoing completion's logprobs of its prompt (None unless it asked for logprobs)."""
        if not gen.echo or gen.sampling.logprobs is None or progress.prompt_logprobs is None:
            return None
        return echo_logprobs(self.tokenizer, gen.prompt_ids, progress.prompt_logprobs)

    def _vllm_prompt_logprobs(
        self, gen: GenerationRequest, progress: Progress
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        if progress.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, gen.prompt_ids, progress.prompt_logprobs)

    async def _collect(
        self,
        request: web.Request,
        request_id: str,
        gen: GenerationRequest,
        choices: list[Choice],
        deltas: AsyncIterator[ChoiceDelta],
    ) -> web.Response:
        texts = [""] * len(choices)
        try:
            async for delta in until_disconnected(request, deltas):
                texts[delta.choice.index] += delta.text
        except ConnectionResetError:
            return web.Response(status=CLIENT_CLOSED)
        answers = []
        for choice, text in zip(choices, texts, strict=True):
            progress = choice.progress
            finish = self._finish_reason(progress)
            echoed = self._echo_logprobs(gen, progress)
            offset = len(self._prompt_text(gen)) if gen.echo else 0
            logprobs = self._logprobs(gen, progress, 0, offset)
            if echoed is not None and logprobs is not None:
                logprobs = joined(echoed, logprobs)
            if gen.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if gen.tools is not None:
                    message, called = tool_message(text, gen.call_format, gen.tools.forced)
                    finish = finish_reason(finish, called)
                answer: dict[str, Any] = {
                    "index": choice.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            else:
                answer = {
                    "index": choice.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
                if gen.sampling.prompt_logprobs is not None:
                    answer["prompt_logprobs"] = self._vllm_prompt_logprobs(gen, progress)
            answer["stop_reason"] = progress.stop_reason
            if len(choices) > 1:
                answer["augury"] = progress.statistics()
            answers.append(answer)
        answer_body: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion" if gen.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": answers,
            "usage": self._usage(gen, choices),
            "augury": combined_statistics(choices),
        }
        if gen.chat and gen.sampling.prompt_logprobs is not None:  # vLLM: the response's
            answer_body["prompt_logprobs"] = self._vllm_prompt_logprobs(gen, choices[0].progress)
        return web.json_response(answer_body)

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        gen: GenerationRequest,
        choices: list[Choice],
        deltas: AsyncIterator[ChoiceDelta],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        events = _StreamEvents(self, request_id, gen, choices)
        try:
            if gen.chat:
                for opening in events.chat_openings():
                    await send_event(response, opening)
            async for delta in deltas:
                for event in events.of_delta(delta):
                    await send_event(response, event)
            if gen.include_usage:
                await send_event(response, events.chunk([], usage=self._usage(gen, choices)))
        except APIError as error:
            with contextlib.suppress(ConnectionResetError):
                await send_event(response, error.body())
        except ConnectionResetError:
            return response  # the client left; _generate cancels the request
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response


class _StreamEvents:
    """The events of one streamed answer, made as its choices' deltas come."""

    def __init__(
        self, gateway: Gateway, request_id: str, gen: GenerationRequest, choices: list[Choice]
    ) -> None:
        self.gateway = gateway
        self.request_id = request_id
        self.gen = gen
        self.choices = choices
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if gen.chat else "text_completion"
        # per choice: tokens whose logprobs were sent, and the length of their texts
        self.logprobs_sent: dict[int, tuple[int, int]] = {}
        self.echo_offset = len(gateway._prompt_text(gen)) if gen.echo else 0
        self.prompt_sent: set[int] = set()  # choices whose prompt logprobs went out
        # chat with tools: each choice's output parsed into content and calls as it comes
        tools = gen.tools
        self.parsers = {
            c.index: ToolCallParser(gen.call_format, tools.forced)
            for c in choices
            if tools is not None
        }

    def chunk(self, choices_now: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        event = {
            "id": self.request_id,
            "object": self.kind,
            "created": self.created,
            "model": self.gateway.model_name,
            "choices": choices_now,
        }
        if self.gen.continuous_usage:
            event["usage"] = self.gateway._usage(self.gen, self.choices)
        return {**event, **extra}

    def chat_openings(self) -> list[dict[str, Any]]:
        # with tools, as OpenAI: no content until some comes (maybe none: calls alone)
        role = {"role": "assistant", "content": None if self.gen.tools else ""}
        return [
            self.chunk([{"index": choice.index, "delta": role, "finish_reason": None}])
            for choice in self.choices
        ]

    def of_delta(self, delta: ChoiceDelta) -> Iterator[dict[str, Any]]:
        """The chunks a choice's delta makes (none for a delta with nothing to show), each made
        after the one before it was sent."""
        gen, choice = self.gen, delta.choice
        progress = choice.progress
        extra = {"augury": progress.statistics()} if delta.finish_reason else {}
        if gen.chat:  # vLLM puts them on the response, not the choice
            extra |= self.prompt_logprobs_now(choice)
        # with continuous usage, tokens that made no text yet still get their chunk
        counted = gen.continuous_usage and len(progress.token_ids) > choice.sent_tokens
        if not gen.chat:
            if delta.text or delta.finish_reason or counted:
                yield self.chunk([self.choice_event(delta)], **extra)
                choice.sent_tokens = len(progress.token_ids)
            return
        bodies = self.chat_deltas(delta)
        for position, body in enumerate(bodies):
            last = position == len(bodies) - 1
            if body or (last and (delta.finish_reason or counted)):
                event = self.choice_event(delta, body, last)
                yield self.chunk([event], **(extra if last else {}))
                choice.sent_tokens = len(progress.token_ids)

    def choice_logprobs_now(self, choice: Choice) -> dict[str, Any] | None:
        """The logprobs of the tokens the choice added since its last chunk (an echo's
        first chunk: the prompt's first)."""
        gen = self.gen
        start, offset = self.logprobs_sent.get(choice.index, (0, self.echo_offset))
        logprobs = self.gateway._logprobs(gen, choice.progress, start, offset)
        if logprobs is not None:
            texts = logprobs["content"] if gen.chat else logprobs["tokens"]
            offset += sum(len(t["token"] if gen.chat else t) for t in texts)
            self.logprobs_sent[choice.index] = (len(output_ids(gen, choice.progress)), offset)
            echoed = self.gateway._echo_logprobs(gen, choice.progress)
            if echoed is not None and choice.index not in self.prompt_sent:
                logprobs = joined(echoed, logprobs)
        return logprobs

    def prompt_logprobs_now(self, choice: Choice) -> dict[str, Any]:
        """vLLM's `prompt_logprobs`, on the first chunk after they arrived."""
        if choice.index in self.prompt_sent or choice.progress.prompt_logprobs is None:
            return {}
        self.prompt_sent.add(choice.index)
        return {"prompt_logprobs": self.gateway._vllm_prompt_logprobs(self.gen, choice.progress)}

    def chat_deltas(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The delta objects of a chat choice's new text (one, maybe empty, at least)."""
        parser = self.parsers.get(delta.choice.index)
        if parser is None:
            return [{"content": delta.text} if delta.text else {}]
        pieces = [parser.push(delta.text)]
        if delta.finish_reason:
            pieces.append(parser.finish())
        return stream_deltas(pieces) or [{}]

    def choice_event(
        self, delta: ChoiceDelta, content: dict[str, Any] | None = None, last: bool = True
    ) -> dict[str, Any]:
        index, text = delta.choice.index, delta.text
        finish = delta.finish_reason if last else None
        logprobs = self.choice_logprobs_now(delta.choice) if last else None
        if self.gen.chat:
            parser = self.parsers.get(index)
            if parser is not None:
                finish = finish_reason(finish, bool(parser.calls))
            event = {"index": index, "delta": content or {}, "logprobs": logprobs}
        else:
            event = {"index": index, "text": text, "logprobs": logprobs}
        event["finish_reason"] = finish
        if not self.gen.chat:
            event |= self.prompt_logprobs_now(delta.choice)
        if finish:
            event["stop_reason"] = delta.choice.progress.stop_reason
        return event


async def _noting_first(
    items: AsyncIterator[str], first: asyncio.Event | None
) -> AsyncIterator[str]:
    """The items; `first` is set at the first one, or when they end (a failure included)."""
    try:
        async for item in items:
            if first is not None:
                first.set()
            yield item
    finally:
        if first is not None:
            first.set()


def output_ids(gen: GenerationRequest, progress: Progress) -> list[int]:
    """The choice's output tokens as the client sees them (an echo of the prompt alone: none)."""
    return [] if gen.echo_only else progress.token_ids


async def send_event(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


async def until_disconnected(
    request: web.Request, deltas: AsyncIterator[str], poll_s: float = 0.25
) -> AsyncIterator[str]:
    """Pass deltas through; raise ConnectionResetError once the client has gone."""
    iterator = deltas.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        while not step.done():
            await asyncio.wait({step}, timeout=poll_s)
            transport = request.transport
            if not step.done() and (transport is None or transport.is_closing()):
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
                raise ConnectionResetError("client disconnected")
        try:
            delta = step.result()
        except StopAsyncIteration:
            return
        yield delta


def routing_rules(settings: AugurySettings) -> RoutingRules:
    gateway = settings.gateway
    return RoutingRules(
        cells=gateway.cells or (settings.service.cell,),
        affinity_prefix_tokens=gateway.affinity_prefix_tokens,
        affinity_max_extra_load=gateway.affinity_max_extra_load,
    )
