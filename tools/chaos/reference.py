"""The reference outputs: plain greedy decoding of the target, in this process.

The engine runs the requests together with no draft model (one target forward per token), on
the same model code the verifier uses, so a speculative answer that differs in any token from
this one is wrong. Lossless speculation under greedy sampling must reproduce it exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tools.chaos.workload import ChaosRequest

KV_MEMORY_BYTES = 1 << 30
BLOCK_SIZE = 16


def plain_greedy_ids(target: Path, requests: Sequence[ChaosRequest]) -> list[list[int]]:
    """Each request's output token ids (greedy, `max_tokens` of them, EOS ignored)."""
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model
    from shared.model.runner import ModelRunner
    from shared.values.sampling import SamplingParams

    runner = ModelRunner(load_model(target), block_size=BLOCK_SIZE, kv_memory_bytes=KV_MEMORY_BYTES)
    engine = SpecEngine(Verifier(runner), eos_token_ids=runner.cfg.eos_token_ids)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    states = engine.generate([list(r.prompt_ids) for r in requests], params)
    return [list(state.output) for state in states]


def timed_reference(
    target: Path, requests: Sequence[ChaosRequest]
) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    outputs = plain_greedy_ids(target, requests)
    return outputs, time.perf_counter() - started
