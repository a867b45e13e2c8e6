"""Committing a verified micro-batch: each request's accepted tokens, prompt progress, stops and
outputs, the verifier's errors (recompute later, or fail the request), and the step's lessons
(`learning.py`)."""

from __future__ import annotations

from collections.abc import Mapping

from shared.scheduling.core_types import MicroBatch, StepOutput, StepResult
from shared.scheduling.features import FeatureLog
from shared.scheduling.learning import Learner
from shared.scheduling.pool import RequestPool
from shared.scheduling.request import RequestState, append_tokens
from shared.values.logprobs import EMPTY, TokenLogprobs
from shared.values.steps import GRAMMAR_DEAD_END


class Committer:
    def __init__(self, pool: RequestPool, learner: Learner) -> None:
        self.pool = pool
        self.learner = learner

    def commit(
        self,
        batch: MicroBatch,
        results: Mapping[str, StepResult],
        now: float,
        shares: Mapping[str, float],
    ) -> list[StepOutput]:
        """Every member's outcome, in the batch's order; the outputs to report."""
        chunks = {r.request_id: n for r, n in batch.prefill}
        elapsed_ms = 1000 * (now - batch.started)
        outputs: list[StepOutput] = []
        for request in batch.members:
            request.in_flight = False
            rid = request.request_id
            if request.cancelled:
                outputs.append(self.pool.finished_output(request, "abort"))
                continue
            result = results.get(rid)
            if result is None or result.step != request.step:
                result = StepResult(rid, request.step, error="out_of_sync")
            if result.error is not None:
                output = self._failed(request, result.error)
                if output is not None:
                    outputs.append(output)
                continue
            request.step += 1
            request.attained_service_ms += elapsed_ms
            self._keep_features(request, result, rid in chunks)
            drafted = 0
            if rid in chunks:
                self._commit_chunk(request, result, chunks[rid])
            else:
                drafted = self.learner.learn_step(batch, request, result, elapsed_ms, shares)
            output = self._commit_tokens(request, result, drafted, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _keep_features(self, request: RequestState, result: StepResult, is_chunk: bool) -> None:
        """The target's features at the positions it committed, for feature-level drafts."""
        config = self.pool.config
        if result.features is not None and config.feature_drafts:
            first = request.num_prefilled if is_chunk else request.num_tokens - 1
            log = self.pool.features.setdefault(request.request_id, FeatureLog(config.feature_size))
            log.put(first, result.features)

    def _commit_chunk(self, request: RequestState, result: StepResult, chunk: int) -> None:
        if not request.output and result.prompt_logprobs is not None:
            before = request.prompt_logprobs if request.num_prefilled else EMPTY
            request.prompt_logprobs = (before or EMPTY) + result.prompt_logprobs
        request.num_prefilled += chunk
        if not request.output:  # a verifier that found the chunk's start cached
            request.num_cached_prompt_tokens += result.cached_tokens
        if self.pool.prefix_index is not None:  # the verifier named the chunk's blocks
            self.pool.prefix_index.insert(request.prefill_tokens, request.num_prefilled)

    def _commit_tokens(
        self, request: RequestState, result: StepResult, drafted: int, now: float
    ) -> StepOutput | None:
        """Append the step's tokens (up to a stop); the output to report, if any."""
        new = append_tokens(request, result.tokens, self.pool.config.eos_token_ids)
        logprobs: TokenLogprobs | None = None
        if result.logprobs is not None:  # the appended tokens are a prefix of the result's
            logprobs = result.logprobs.head(len(new))
            request.logprobs = (request.logprobs or EMPTY) + logprobs
        self.learner.settle_counterfactuals(request)
        if new:
            request.first_token_time = request.first_token_time or now
            request.last_token_time = now
        output = None
        if new or request.is_finished:
            output = StepOutput(
                request.request_id,
                result.step,
                len(request.output) - len(new),
                new,
                request.finish_reason,
                drafted,
                result.num_accepted if drafted else 0,
                request.draft_model if drafted else None,
                logprobs=logprobs,
                prompt_logprobs=(
                    request.prompt_logprobs if new and len(request.output) == len(new) else None
                ),
            )
        if request.is_finished:
            self.pool.finish(request, request.finish_reason or "stop")
        return output

    def _failed(self, request: RequestState, error: str) -> StepOutput | None:
        """Out of KV or out of sync: recompute later. Anything else fails the request."""
        pool = self.pool
        kind = error.split(":")[0]
        if kind == GRAMMAR_DEAD_END:  # the output so far is kept; nothing may follow it
            return pool.finished_output(request, "abort", error, GRAMMAR_DEAD_END)
        if kind == "out_of_kv_memory" and pool.running == [request]:
            message = "the request needs more KV memory than the verifier has, even alone"
            return pool.finished_output(request, "abort", message, "context_length_exceeded")
        if kind in ("out_of_kv_memory", "out_of_sync", "verify_timeout"):
            if kind == "out_of_kv_memory":
                pool.kv_full = True
                pool.drop_kept()
                pool.preemptions["recomputed"] += 1
            pool.release_target(request)
            pool.requeue(request)
            return None
        return pool.finished_output(
            request, "abort", f"verification failed: {kind}", "internal_error"
        )
