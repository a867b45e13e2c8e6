"""Model-free drafts with the real SmolLM2 target on copy-heavy requests: greedy output equal to
plain decoding, with acceptance floors that only copying reaches."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared.engine.model_free import MODEL_FREE_KINDS, ModelFreeDrafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import target_dir
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tools.workloads import conversation_ids, workload_messages

pytestmark = pytest.mark.smollm2

MAX_TOKENS = 48
# Tokens per target forward on the first code-edit and revision requests (the whole model-free
# tree verified every step, 48 tokens each): measured 3.03 with ngram and with suffix; a draft
# that copied nothing would stay near 1.
FLOOR = 2.0


@pytest.fixture(scope="module")
def target():
    return load_model(target_dir())


@pytest.fixture(scope="module")
def prompts():
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    conversations = [workload_messages("code-edit", 1)[0], workload_messages("revision", 1)[0]]
    return [conversation_ids(tokenizer, c) for c in conversations]


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = SpecEngine(Verifier(ModelRunner(target)), eos_token_ids=target.cfg.eos_token_ids)
    return [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("kind", MODEL_FREE_KINDS)
def test_model_free_drafts_copy_and_keep_greedy_output(target, prompts, plain, kind):
    engine = SpecEngine(
        Verifier(ModelRunner(target)),
        ModelFreeDrafter(kind),
        DraftMethod("chain", k=4),
        SchedulerConfig(planner="fixed"),
        eos_token_ids=target.cfg.eos_token_ids,
    )
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.output for r in reqs] == plain
    assert engine.stats.mean_accepted_length >= FLOOR
