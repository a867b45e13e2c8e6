"""The target's side of a step: one packed forward over prompt chunks and token trees,
acceptance per request, and compaction of the accepted path's KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.sampling import VERIFY_STREAM, SamplingParams, processed_probs, sample, step_rng
from shared.engine.tree import TokenTree
from shared.engine.verification import verify
from shared.model.runner import ForwardItem, ModelRunner


@dataclass
class VerifyEntry:
    request_id: str
    step: int
    params: SamplingParams
    seed: int
    prompt_chunk: Sequence[int] = ()  # prefill work ...
    is_final_chunk: bool = False
    tree: TokenTree | None = None  # ... or a draft tree rooted at the last committed token


@dataclass
class VerifyResult:
    request_id: str
    step: int
    tokens: list[int]  # emitted: accepted draft tokens then the bonus (or the first token)
    num_draft_tokens: int  # draft tokens the tree offered
    num_accepted: int  # of them accepted


class Verifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def free(self, request_id: str) -> None:
        self.runner.free_request(request_id)

    @torch.inference_mode()
    def step(self, entries: Sequence[VerifyEntry]) -> list[VerifyResult]:
        items = []
        for e in entries:
            if not self.runner.has_request(e.request_id):
                self.runner.add_request(e.request_id)
            if e.tree is None:
                logits = "last" if e.is_final_chunk else "none"
                items.append(ForwardItem.chain(e.request_id, e.prompt_chunk, logits=logits))
            else:
                items.append(ForwardItem(e.request_id, e.tree.tokens.tolist(), e.tree.parents))
        all_logits = self.runner.forward(items)
        commits: dict[str, Sequence[int]] = {}
        results = []
        for e, logits in zip(entries, all_logits, strict=True):
            rng = step_rng(e.seed, e.step, VERIFY_STREAM)
            if e.tree is None:
                commits[e.request_id] = range(len(e.prompt_chunk))
                tokens = []
                if e.is_final_chunk:
                    probs = processed_probs(logits, e.params)[0]
                    tokens = [sample(probs, rng.random())]
                results.append(VerifyResult(e.request_id, e.step, tokens, 0, 0))
            else:
                verdict = verify(e.tree, logits, e.params, rng)
                commits[e.request_id] = verdict.kv_path
                results.append(
                    VerifyResult(
                        e.request_id,
                        e.step,
                        verdict.emitted,
                        e.tree.num_nodes - 1,
                        len(verdict.accepted_tokens),
                    )
                )
        self.runner.commit(commits)
        return results
