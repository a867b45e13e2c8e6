"""The in-process engine: one target, its drafters and the scheduler core, in one loop.

This is the whole system in one process (no Redis), used by the CLI, the benchmarks and the
tests. It is one of the core's executors (the scheduler service is another), so every decision
(admission, preemption, draft model, speculation depth, tree selection) is the core's; the engine
owns the models and their KV, and turns the core's plan into forwards. A step reads as three
lines: schedule, run, observe.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from shared.engine.drafting import Drafter
from shared.engine.model_free import ModelFreeDrafter
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError, OutOfKVMemoryError
from shared.grammar.matcher import GrammarBook
from shared.grammar.spec import check_structured
from shared.model.kv_cache import SwappedKV
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.core import (
    DraftTiming,
    MicroBatch,
    StepOutput,
    StepResult,
    tree_capacity_with,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.executor import (
    DraftKey,
    DraftRound,
    StepDriver,
    check_draft_model,
    new_request,
    resolve,
    route_releases,
)
from shared.scheduling.factory import TargetInfo, make_core
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.text.stop_strings import OutputText
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.steps import DraftedTree, VerifiedRequest, VerifyRequest

# Sees each verified micro-batch (selected trees in `batch.trees`) and its results before the core
# commits them; `bench.acceptance` records acceptance this way.
StepObserver = Callable[[MicroBatch, Mapping[str, StepResult]], None]


class RunnerKV:
    """The verifier's paged cache as the core sees it (block counts only), and its prefix
    cache (`attach_prefix`, a `PrefixKVView`)."""

    can_swap = True

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.runner = verifier.runner

    def attach_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        return self.verifier.attach_prefix(request_id, tokens)

    def num_free_blocks(self) -> int:
        return self.runner.cache.allocator.num_free

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        return self.runner.blocks_needed(request_id, num_new_tokens)

    def blocks_held(self, request_id: str) -> int:
        if not self.runner.has_request(request_id):
            return 0
        return self.runner.cache.num_blocks_alone(request_id)


# A draft model's drafter or one that loads no model; both answer `draft`, `free`, `has_request`.
AnyDrafter = Drafter | ModelFreeDrafter


class LocalTransport:
    """The engine's half of the executor contract (`shared.scheduling.executor.Transport`):
    the verifier and the drafters in this process, called directly."""

    def __init__(
        self, verifier: Verifier, drafters: Mapping[str, AnyDrafter], clock: Callable[[], float]
    ) -> None:
        self.verifier = verifier
        self.drafters = drafters
        self.clock = clock
        self._swapped: dict[str, SwappedKV] = {}
        # while `timed` (the core calibrates its costs): what the last micro-batch's drafter
        # calls and verification took (`take_timings`)
        self.timed = False
        self._drafting: list[DraftTiming] = []
        self._verify_ms: float | None = None

    def swap_out(self, request: RequestState) -> None:
        rid = request.request_id
        self._swapped[rid] = self.verifier.runner.swap_out(rid)

    def swap_in(self, request: RequestState) -> None:
        rid = request.request_id
        self.verifier.runner.swap_in(rid, self._swapped.pop(rid))

    def draft(self, drafts: DraftRound) -> dict[DraftKey, DraftedTree]:
        """One drafter call per (model, method); a request's own drafter and its standby are
        different models."""
        groups: dict[tuple[str, DraftMethod], list[DraftKey]] = {}
        entries = {job.key: job.entry for job in drafts.jobs}
        for job in drafts.jobs:
            rid, drafter = job.entry.request_id, self.drafters[job.plan.model]
            if job.plan.base_len == 0 and drafter.has_request(rid):
                drafter.free(rid)  # the core starts this drafter's copy over
            groups.setdefault((job.plan.model, job.plan.method), []).append(job.key)
        answers: dict[DraftKey, DraftedTree] = {}
        for (model, method), keys in groups.items():
            requests = [entries[key] for key in keys]
            start = self.clock()
            trees = self.drafters[model].draft(requests, method.for_batch(len(requests)))
            if self.timed:
                drafted = tuple((len(r.new_tokens), trees[r.request_id]) for r in requests)
                self._drafting.append(DraftTiming(model, drafted, (self.clock() - start) * 1e3))
            for key, request in zip(keys, requests, strict=True):
                answers[key] = DraftedTree(request.request_id, request.step, trees[key[2]])
        return answers

    def draft_time(self) -> float:
        return self.clock()

    def verify(self, batch: MicroBatch, entries: Sequence[VerifyRequest]) -> list[VerifiedRequest]:
        if not entries:
            return []
        start = self.clock()
        verified = self.verifier.step(entries)
        if self.timed:
            self._verify_ms = (self.clock() - start) * 1e3
        return verified

    def take_timings(self) -> tuple[list[DraftTiming], float | None]:
        """The drafter calls and the verification measured since the last call."""
        timings, verify_ms = self._drafting, self._verify_ms
        self._drafting, self._verify_ms = [], None
        return timings, verify_ms

    def free_target(self, request_id: str) -> None:
        self.verifier.free(request_id)
        self._swapped.pop(request_id, None)

    def free_draft(self, model: str, replica: str, request_id: str) -> None:
        self.drafters[model].free(request_id)


class SpecEngine:
    def __init__(
        self,
        verifier: Verifier,
        drafter: AnyDrafter | Mapping[str, AnyDrafter] | None = None,
        method: DraftMethod | None = None,
        config: SchedulerConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        *,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: StepObserver | None = None,
        tokenizer: Any | None = None,
        grammar: GrammarBook | None = None,
    ) -> None:
        """`tokenizer` (a transformers fast tokenizer): each request's output is also
        detokenized as it is committed (`texts`), requests may give stop strings, and
        structured output (`SamplingParams.structured`) is on: one `GrammarBook` masks the
        verifier's and the model drafts' rows (`grammar` gives one built otherwise)."""
        self.verifier = verifier
        self.tokenizer = tokenizer
        if isinstance(drafter, (Drafter, ModelFreeDrafter)):
            drafter = {drafter.name: drafter}
        self.drafters: dict[str, AnyDrafter] = dict(drafter or {})
        if grammar is None and tokenizer is not None:
            grammar = GrammarBook.from_hf(tokenizer, eos_token_ids)
        self.grammar = grammar
        if grammar is not None:
            verifier.grammar = grammar
            for d in self.drafters.values():
                d.grammar = grammar
        model_free = tuple(n for n, d in self.drafters.items() if isinstance(d, ModelFreeDrafter))
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.observer = observer
        runner = verifier.runner
        self.core = make_core(
            self.config,
            TargetInfo(
                vocab_size=runner.cfg.vocab_size,
                max_context=runner.max_context,
                eos_token_ids=tuple(eos_token_ids),
                hidden_size=runner.cfg.hidden_size,
                feature_drafts=frozenset(
                    name for name, d in self.drafters.items() if d.is_feature_level
                ),
                model_free_drafts=model_free,
            ),
            list(self.drafters),
            cost,
            method=method if self.drafters else None,
            # the verifier attaches cached prefixes itself (`RunnerKV`); the index holds back a
            # request whose prefix another's chunk is computing, so that it is computed once
            prefix_index=(PrefixIndex(runner.cache.block_size) if runner.prefix_caching else None),
        )
        self.core.set_drafters({name: ["local"] for name in self.drafters})
        self.kv = RunnerKV(verifier)
        self.transport = LocalTransport(verifier, self.drafters, clock)
        self.driver = StepDriver(self.core, self.transport)
        self.requests: dict[str, RequestState] = {}  # every request given, until popped
        # with a tokenizer: every request's text (cut at its stop string), until popped
        self.texts: dict[str, OutputText] = {}
        self._ids = 0

    @property
    def stats(self) -> AcceptanceStats:
        """Speculation counters of every verified decode step so far."""
        return self.core.stats

    @property
    def drafter(self) -> AnyDrafter | None:
        """The first drafter (the engine's only one in the common single-draft set-up)."""
        return next(iter(self.drafters.values()), None)

    # ---- admission -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        tpot_slo_ms: float | None = None,
        draft_model: str | None = None,
        speculate: bool = True,
        method: DraftMethod | None = None,
        slo_class: str | None = None,
        app: str = "",
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> str:
        """Queue a request; bad input raises an `AuguryError` naming the limit.

        `slo_class` names one of `config.slo.classes`: the objective is its multiple of the
        baseline latency (`config.slo.baseline_latency_ms`, else the cost model's); an explicit
        `tpot_slo_ms` wins over it. `stop` strings (the engine needs a tokenizer) end the
        output at the token that completes one, finish reason "stop"; the text in `texts` ends
        before the stop string, or after it with `include_stop_str_in_output`."""
        self.core.check(prompt, params.max_tokens)
        text = self._output_text(stop, include_stop_str_in_output)
        runner = self.verifier.runner
        vocab = runner.cfg.vocab_size
        if any(token >= vocab for token, _ in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias holds token ids outside [0, {vocab})", param="logit_bias"
            )
        capacity = tree_capacity_with(self.core.config.method, self.core.config)
        need = runner.cache.num_blocks_for(len(prompt) + params.max_tokens + capacity)
        if need > runner.cache.num_blocks:
            raise OutOfKVMemoryError(
                f"request needs {need} KV blocks, more than the cache's {runner.cache.num_blocks}"
            )
        if params.structured is not None:
            self._check_structured(params)
        check_draft_model(draft_model, self.drafters, param="draft_model")
        resolved = resolve(params, slo_class, tpot_slo_ms, self.config.slo, self.core.cost)
        if request_id is None:
            request_id = f"req-{self._ids}"
            self._ids += 1
        request = new_request(
            request_id,
            prompt,
            params,
            resolved,
            arrival_time=self.clock(),
            priority=priority,
            requested_draft=draft_model,
            speculate=speculate,
            method=method,
            app=app,
        )
        self.core.add(request)
        self.requests[request_id] = request
        if text is not None:
            self.texts[request_id] = text
        return request_id

    def _check_structured(self, params: SamplingParams) -> None:
        """Refuse a grammar that does not compile (within the parser's limits) or an engine
        without a tokenizer to apply one."""
        assert params.structured is not None
        if self.grammar is None:
            raise InvalidRequestError(
                "structured output needs the engine's tokenizer (SpecEngine(..., tokenizer=...))",
                param="response_format",
            )
        check_structured(params.structured)
        matcher = self.grammar.compile(params.structured)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {params.structured.kind}: {matcher.get_error()}",
                param="response_format",
            )

    def _output_text(self, stop: Sequence[str], include: bool) -> OutputText | None:
        if isinstance(stop, str):
            stop = (stop,)
        if stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need the engine's tokenizer (SpecEngine(..., tokenizer=...))",
                param="stop",
            )
        if self.tokenizer is None:
            return None
        try:
            return OutputText(self.tokenizer, tuple(stop), include_stop_str_in_output=include)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="stop") from None

    def abort(self, request_id: str) -> None:
        self.core.cancel(request_id)
        self._release()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.core.next_batch(self.clock(), self.kv)
        if batch is None:
            return []
        self.transport.timed = self.core.calibrating  # a cost model may come later
        results = self.driver.run(batch)
        self.core.note_costs(batch, *self.transport.take_timings())
        if self.observer is not None:
            self.observer(batch, results)
        outputs = batch.failed + self.driver.finish(batch, results, self.clock())
        outputs = [self._detokenize(output) for output in outputs]
        self._release()  # a stop string's request, cancelled by `_detokenize`
        return outputs

    def _detokenize(self, output: StepOutput) -> StepOutput:
        """Follow a request's text; a stop string ends it at the token that completed it (the
        tokens after it, accepted in the same step, are dropped) and the core forgets it."""
        text = self.texts.get(output.request_id)
        if text is None:
            return output
        step = text.push(output.new_tokens)
        if step.stop is None:
            if output.finish_reason is not None:
                text.finish()
            return output
        request = self.requests[output.request_id]
        del request.output[output.offset + step.num_tokens :]
        if request.logprobs is not None:
            request.logprobs = request.logprobs.head(len(request.output))
        if request.finish_reason is None:
            self.core.cancel(request.request_id)  # frees its KV with the next release
        request.finish_reason = "stop"
        logprobs = output.logprobs.head(step.num_tokens) if output.logprobs is not None else None
        return dataclasses.replace(
            output,
            new_tokens=output.new_tokens[: step.num_tokens],
            finish_reason="stop",
            logprobs=logprobs,
        )

    def _release(self) -> None:
        route_releases(self.core, self.transport)

    # ---- conveniences -------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestState]:
        """Run prompts to completion together (continuous batching); requests in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i) for i in ids]

    def stream(
        self, prompt: Sequence[int], params: SamplingParams, stop: Sequence[str] = ()
    ) -> Iterator[list[int]]:
        """Yield each step's new tokens of one request as they are committed."""
        rid = self.add_request(prompt, params, stop=stop)
        while self.requests[rid].finish_reason is None:
            for out in self.step():
                if out.request_id == rid and out.new_tokens:
                    yield out.new_tokens
        self.requests.pop(rid)
        self.texts.pop(rid, None)
