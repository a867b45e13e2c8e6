"""The target's side of a step: one packed forward over prompt chunks and token trees,
acceptance per request, and compaction of the accepted path's KV.

It takes and answers the step entries of `shared.values.steps` (`VerifyRequest`,
`VerifiedRequest`), which the verifier service carries over Redis inside its messages, so the
in-process engine and the service run one verification path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from shared.engine.constraints import NodeConstraints
from shared.engine.processors import coupled_scores, process_logits, tree_paths
from shared.engine.verification import Verdict, verify, verify_greedy
from shared.model.runner import ForwardItem, ModelRunner
from shared.values.logprobs import TokenLogprobs, token_logprobs
from shared.values.sampling import VERIFY_STREAM, processed_probs, sample, step_rng
from shared.values.steps import GRAMMAR_DEAD_END, FinishReason, VerifiedRequest, VerifyRequest


def verified(entry: VerifyRequest, emitted: Sequence[int], num_accepted: int) -> VerifiedRequest:
    """The answer for one entry, cut to what the request may still emit (then "length")."""
    emitted = list(emitted[: entry.max_new_tokens])
    accepted = emitted[:num_accepted]
    bonus = emitted[num_accepted] if len(emitted) > num_accepted else None
    reached = bool(emitted) and len(emitted) >= entry.max_new_tokens
    return VerifiedRequest(
        entry.request_id,
        entry.step,
        accepted=tuple(accepted),
        bonus=bonus,
        finish=FinishReason.LENGTH if reached else None,
    )


def _samples(entry: VerifyRequest) -> bool:
    """Whether the entry picks a token (a tree, or a prompt's last chunk)."""
    return entry.tree is not None or entry.chunk_is_last


class Verifier:
    def __init__(self, runner: ModelRunner, grammar: NodeConstraints | None = None) -> None:
        self.runner = runner
        # structured output: every row is masked with its node's grammar state
        self.grammar = grammar
        # prompt_logprobs requests between chunks: the last row of the chunk before, which
        # predicts the next chunk's first token
        self._last_rows: dict[str, torch.Tensor] = {}

    def free(self, request_id: str) -> None:
        self._last_rows.pop(request_id, None)
        self.runner.free_request(request_id)
        if self.grammar is not None:
            self.grammar.free(request_id)

    def _dead_end(self, e: VerifyRequest) -> str | None:
        """Why a structured entry cannot pick a token (None: it can, or it is unconstrained)."""
        structured = e.sampling.structured
        if structured is None or not _samples(e):
            return None
        if self.grammar is None:
            return f"{GRAMMAR_DEAD_END}: this verifier has no tokenizer for structured output"
        why = self.grammar.dead_end(e.request_id, structured, self._output(e))
        return None if why is None else f"{GRAMMAR_DEAD_END}: {why}"

    @staticmethod
    def _output(e: VerifyRequest) -> tuple[int, ...]:
        if e.history is None:
            raise ValueError(f"request {e.request_id}: structured output needs its history")
        return e.history.output

    def _allowed(self, e: VerifyRequest, paths: Sequence[Sequence[int]], width: int):
        """[len(paths), width] bool: the grammar's tokens per row (None: unconstrained)."""
        if e.sampling.structured is None or self.grammar is None:
            return None
        return self.grammar.allowed(
            e.request_id, e.sampling.structured, self._output(e), paths, width
        )

    def attach_prefix(self, request_id: str, prompt: Sequence[int]) -> int:
        """Admission: the prompt tokens the prefix cache already holds for this new request,
        which then holds them; the last prompt token is always left to compute (its logits give
        the first token)."""
        if not self.runner.has_request(request_id):
            self.runner.add_request(request_id)
        return self.runner.attach_prefix(request_id, prompt, len(prompt) - 1)

    @torch.inference_mode()
    def step(self, entries: Sequence[VerifyRequest]) -> list[VerifiedRequest]:
        """Verify the entries; a structured entry whose grammar allows no next token answers
        a `grammar_dead_end` error instead (its request ends) and runs nothing."""
        ended = {e.request_id: why for e in entries if (why := self._dead_end(e)) is not None}
        if ended:
            runnable = [e for e in entries if e.request_id not in ended]
            done = {r.request_id: r for r in self._step(runnable)} if runnable else {}
            return [
                done.get(e.request_id)
                or VerifiedRequest(e.request_id, e.step, error=ended[e.request_id])
                for e in entries
            ]
        return self._step(entries)

    def _step(self, entries: Sequence[VerifyRequest]) -> list[VerifiedRequest]:
        items = []
        skipped: dict[str, int] = {}  # chunk tokens found in the prefix cache, not computed
        for e in entries:
            if not self.runner.has_request(e.request_id):
                self.runner.add_request(e.request_id)
            feature_rows = "all" if e.want_features else "none"
            if e.tree is None:
                chunk = e.chunk
                # the scheduler service's first chunk, and any later chunk that continues cached
                # blocks (the engine attaches at admission too, features aside); the prompt's
                # log-probabilities need every position's logits: computed
                if e.sampling.prompt_logprobs is None:
                    skip = self.runner.attach_prefix(
                        e.request_id, chunk, len(chunk) - 1, with_features=e.want_features
                    )
                    chunk = chunk[skip:]
                    skipped[e.request_id] = skip
                logits = "last" if e.chunk_is_last else "none"
                if e.sampling.prompt_logprobs is not None:
                    logits = "all"
                items.append(
                    ForwardItem.chain(e.request_id, chunk, logits=logits, feature_rows=feature_rows)
                )
            else:
                tokens = e.tree.tokens.tolist()
                items.append(
                    ForwardItem(e.request_id, tokens, e.tree.parents, feature_rows=feature_rows)
                )
        outputs = self.runner.forward_full(items)
        commits: dict[str, Sequence[int]] = {}
        features: dict[str, np.ndarray] = {}
        results = []
        for e, out in zip(entries, outputs, strict=True):
            if e.tree is None:
                skip = skipped.get(e.request_id, 0)
                kept: Sequence[int] = range(len(e.chunk) - skip)
                tokens, rows = [], []
                last = out.logits.shape[0] - 1  # one row ("last") or one per chunk token
                if e.chunk_is_last:
                    tokens, rows = [self._first_token(e, out.logits[last:])], [last]
                result = replace(verified(e, tokens, 0), cached_tokens=skip)
                if e.sampling.prompt_logprobs is not None:
                    prompt = self._prompt_logprobs(e, out.logits)
                    result = replace(result, prompt_logprobs=prompt)
            else:
                verdict = self._accept(e, out.logits)
                kept = verdict.kv_path
                rows = verdict.kv_path
                result = verified(e, verdict.emitted, len(verdict.accepted_tokens))
            if e.sampling.logprobs is not None and result.new_tokens:
                emitted = result.new_tokens
                raw = out.logits[list(rows[: len(emitted)])]  # the rows that predicted them
                lps = token_logprobs(raw, emitted, e.sampling.logprobs)
                result = replace(result, logprobs=lps)
            commits[e.request_id] = kept
            if e.want_features:  # the committed positions' features, for a feature-level draft
                computed = out.features[list(kept)].to(torch.float16).cpu().numpy()
                rows = features[e.request_id] = np.ascontiguousarray(computed)
                if skip := skipped.get(e.request_id, 0):  # the cached blocks' rows come first
                    start = e.chunk_start
                    cached = self.runner.prefix_features(e.request_id, start, start + skip)
                    rows = np.concatenate([cached, rows])
                result = replace(result, features=rows)
            results.append(result)
        self.runner.commit(commits, features)
        return results

    def _prompt_logprobs(self, e: VerifyRequest, logits: torch.Tensor) -> TokenLogprobs:
        """The chunk's tokens' log-probabilities from its [len(chunk), V] logits (row i predicts
        token i + 1) and the chunk before's last row; the prompt's first token has none."""
        assert e.sampling.prompt_logprobs is not None
        rows = logits[:-1]
        tokens = list(e.chunk[1:])
        if e.chunk_start > 0:
            before = self._last_rows.pop(e.request_id, None)
            if before is None:  # a chunk continuing a prompt this verifier did not compute
                raise RuntimeError(f"{e.request_id}: prompt_logprobs lost the previous chunk")
            rows = torch.cat([before, rows])
            tokens = [e.chunk[0], *tokens]
        if not e.chunk_is_last:
            self._last_rows[e.request_id] = logits[-1:].clone()
        return token_logprobs(rows, tokens, e.sampling.prompt_logprobs)

    def _first_token(self, e: VerifyRequest, logits: torch.Tensor) -> int:
        """The token after a prompt's last chunk, from its [1, V] logits."""
        allowed = self._allowed(e, [[]], logits.shape[1])
        logits = process_logits(logits, e.sampling, e.history, [[]], allowed=allowed)
        if e.sampling.is_coupled:
            assert e.history is not None
            return int(coupled_scores(logits, e.sampling, [e.history.output_len])[0].argmax())
        rng = step_rng(e.seed, e.step, VERIFY_STREAM)
        return sample(processed_probs(logits, e.sampling)[0], rng.random())

    def _accept(self, e: VerifyRequest, logits: torch.Tensor) -> Verdict:
        """Verify a tree on its [num_nodes, V] logits, each node's row processed with its own
        path; a seeded request verifies its Gumbel-perturbed scores as greedy does."""
        assert e.tree is not None
        constrained = e.sampling.structured is not None
        paths = []
        if e.sampling.has_processors or constrained:
            paths = tree_paths(e.tree.parents, e.tree.tokens)
            allowed = self._allowed(e, paths, logits.shape[1])
            logits = process_logits(logits, e.sampling, e.history, paths, allowed=allowed)
        if e.sampling.is_coupled:
            assert e.history is not None
            depths = e.tree.depths().tolist()
            positions = [e.history.output_len + d for d in depths]
            return verify_greedy(e.tree, coupled_scores(logits, e.sampling, positions))
        return verify(e.tree, logits, e.sampling, step_rng(e.seed, e.step, VERIFY_STREAM))
