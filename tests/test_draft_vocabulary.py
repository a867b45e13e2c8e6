"""A draft cut to its most frequent output tokens: the kept rows' logits are the full draft's,
and speculation with it gives the target's greedy output whether or not the target's tokens are
among the kept ones (a token the draft cannot propose is emitted by the target itself)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.draft_vocabulary import frequent_tokens, write_restricted_draft
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.conftest import make_tiny_checkpoint

PROMPTS = [[5, 17, 3, 44, 60, 2, 71], [9, 10, 11, 12, 13, 14, 15, 16]]
MAX_TOKENS = 24


def test_frequent_tokens_keeps_the_special_ones_then_the_most_frequent():
    counts = np.array([5, 0, 9, 9, 1, 7])
    assert frequent_tokens(counts, 3, must_include=[1]) == [1, 2, 3]  # 9, 9: lower id first
    assert frequent_tokens(counts, 4, must_include=[1, 1]) == [1, 2, 3, 5]
    assert frequent_tokens(counts, 6, must_include=[]) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        frequent_tokens(counts, 7, must_include=[])


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def target_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vocab_target"), seed=3, tie=request.param)


def engine(target: Path, draft: Path | None) -> SpecEngine:
    verifier = Verifier(ModelRunner(load_model(target), block_size=4, kv_memory_bytes=2 << 20))
    drafter = None
    if draft is not None:
        drafter = Drafter(ModelRunner(load_model(draft), block_size=4, kv_memory_bytes=2 << 20))
    method = DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3)
    return SpecEngine(
        verifier, drafter, method if draft else None, SchedulerConfig(planner="fixed")
    )


def test_kept_rows_give_the_full_drafts_logits(target_dir: Path, tmp_path: Path):
    keep = list(range(0, 96, 3))
    cut = load_model(write_restricted_draft(target_dir, tmp_path / "cut", keep))
    assert cut.output_token_ids.tolist() == keep
    logits = {}
    for name, model in [("full", load_model(target_dir)), ("cut", cut)]:
        runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20)
        runner.add_request("a")
        [logits[name]] = runner.forward([ForwardItem.chain("a", PROMPTS[0], logits="all")])
    torch.testing.assert_close(logits["cut"], logits["full"][:, keep])


def test_greedy_output_is_the_targets_with_a_cut_draft(target_dir: Path, tmp_path: Path):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = [r.output for r in engine(target_dir, None).generate(PROMPTS, params)]
    emitted = sorted({t for out in plain for t in out})
    # every token the target emits is kept: the cut draft (the target itself) drafts them all
    covering = engine(target_dir, write_restricted_draft(target_dir, tmp_path / "a", emitted))
    assert [r.output for r in covering.generate(PROMPTS, params)] == plain
    assert covering.stats.mean_accepted_length > 3.0
    # half of them missing: the draft cannot propose those, and the output is still the target's
    missing = emitted[::2]
    rest = [t for t in range(96) if t not in missing]
    partial = engine(target_dir, write_restricted_draft(target_dir, tmp_path / "b", rest))
    assert [r.output for r in partial.generate(PROMPTS, params)] == plain
    assert partial.stats.mean_accepted_length < covering.stats.mean_accepted_length
