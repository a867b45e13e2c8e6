"""The goodput planner drafts for seeded (Gumbel-coupled) sampled requests on the real models.

A seeded request at temperature 0.8 is verified as greedy is, so its output must equal plain
decoding's token for token; the planner must also find that drafting pays for it, priced by a
committed CPU cost profile (a fixed file, so the plan depends on acceptance alone, not on how
fast this machine is). The floor is on counts: accepted tokens per target forward.
"""

from __future__ import annotations

import pytest

from shared.datasets import eval_prompts
from shared.engine.drafting import Drafter
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import all_draft_dirs, target_dir
from shared.model.profile_files import DEFAULT_PROFILES_DIR
from shared.model.runner import ModelRunner
from shared.scheduling.cost_model import CostModel, CostProfile
from shared.values.sampling import SamplingParams
from tools.prompts import chat_ids

PROFILE = "SmolLM2-135M-Instruct-cpu-amd-epyc-float32-t2-int8-drafts.json"
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def engines() -> tuple[SpecEngine, SpecEngine]:
    tdir = target_dir()
    target = ModelRunner(load_model(tdir), kv_memory_bytes=KV_BYTES)
    draft = load_model(all_draft_dirs()["draft-e"], target_path=tdir)
    drafter = Drafter(ModelRunner(draft, kv_memory_bytes=KV_BYTES), name="draft-e")
    cost = CostModel(CostProfile.load(DEFAULT_PROFILES_DIR / PROFILE))
    verifier = Verifier(target)
    eos = target.cfg.eos_token_ids
    plain = SpecEngine(verifier, eos_token_ids=eos)
    spec = SpecEngine(verifier, drafter, DEFAULT_METHOD, eos_token_ids=eos, cost=cost)
    return plain, spec


def test_a_seeded_sample_drafts_and_equals_plain_decoding(
    engines: tuple[SpecEngine, SpecEngine],
) -> None:
    from transformers import AutoTokenizer

    plain, spec = engines
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    prompt = chat_ids(tokenizer, eval_prompts("code", 1)[0])
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=1)
    [expected] = plain.generate([prompt], params)
    [got] = spec.generate([prompt], params)
    assert got.output == expected.output
    stats = spec.stats
    assert stats.num_drafts >= stats.num_target_forwards // 2, stats
    # measured 2.58 tokens per target forward here; plain decoding is 1.00
    assert stats.mean_accepted_length >= 1.5, stats
