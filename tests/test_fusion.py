"""EAGLE-3's fused features (`python -m distill fusion`): the cached features are the named target
layers' outputs at every position, a fused draft reads them through its projection and trains
without the feature regression, learns what only a low layer carries, and is never exported."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from distill import data, fusion, train
from distill.model import DraftSpec, TrainableDraft, export_draft
from tests.test_feature_draft import random_draft, running_sum_cache

SEQUENCES = [[1, 5, 9], [8, 7, 3, 44, 12, 80, 6], [3, 2, 3, 4, 5]]  # no shared prefix


def test_fused_features_are_the_named_layers_outputs_at_every_position(
    tiny_target_dir: Path, tmp_path: Path
):
    from transformers import AutoModelForCausalLM

    recipe = data.Recipe({}, {})
    seqs = [{"kind": "chat", "generated": True, "tokens": t, "gen_start": 1} for t in SEQUENCES]
    data.sequences_path(tmp_path, recipe).write_text(json.dumps(seqs))
    # batches of at most 10 tokens: padded rows, and the longest sequence first
    fused = data.build_fused_features(tmp_path, tiny_target_dir, recipe, (1, 0), batch_tokens=10)
    assert fused.shape == (sum(map(len, SEQUENCES)), 2 * 64)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.bfloat16).eval()
    wants = []
    for tokens in SEQUENCES:
        with torch.no_grad():
            states = model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        wants.append(torch.cat([states[2][0], states[1][0]], dim=-1).float())  # layer 1, 0
    want = torch.cat(wants)
    got = torch.from_numpy(np.asarray(fused, dtype=np.float32))
    # bf16 rounds a padded batch's rows apart from a lone sequence's, by a step or two
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.1)
    nearest = torch.cdist(got, want).argmin(dim=1)
    assert nearest.tolist() == list(range(len(want)))  # every row is its own position's
    assert data.fused_features_path(tmp_path, recipe, (1, 0)).is_file()  # cached once


def fused_cache(num_sequences: int):
    """`running_sum_cache` whose state sits in a low layer's block of three; the middle and
    high blocks (the high one is what the fused draft starts from) are noise."""
    cache, onehot, vocab = running_sum_cache(num_sequences=num_sequences)
    noise = np.random.default_rng(1).normal(0.0, 1.0, (len(onehot), 32)).astype(np.float16)
    return cache, np.concatenate([onehot, noise], axis=1), vocab


def test_a_fused_draft_reads_its_projection_and_trains_without_the_regression():
    cache, features, vocab = fused_cache(4)
    spec = DraftSpec("t-e3", 16, 1, 2, 1, 64, None, vocab, 1, 1e-3, feature_size=16)
    spec = replace(spec, fused_layers=(0, 1, 2))
    assert not spec.regresses_features
    torch.manual_seed(0)
    draft = TrainableDraft(spec, vocab, torch.arange(vocab), max_positions=64).eval()
    batch = train.BatchBuilder(cache, np.arange(vocab), np.zeros(4, np.int64), features)(
        np.arange(4)
    )
    ids, tgt, prob, weight, feats, _ = batch
    assert feats.shape[-1] == 48
    expected = torch.zeros(())
    for logits, _ in draft.forward_levels(ids, draft.fuse(feats), 3):
        expected = expected + train.distill_loss(logits, tgt, prob, weight)[0]
    loss, _ = train.draft_losses(draft, batch, feature_passes=3, level_context="chain")
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="fuses several target layers"):
        export_draft(draft, Path("unused"), bos_token_id=1, eos_token_id=2, metadata={})


def test_a_fused_draft_learns_what_only_a_low_layer_carries(monkeypatch):
    monkeypatch.setattr(train, "VALIDATION_EVERY", 4)
    monkeypatch.setattr(train, "EVAL_INTERVAL", 100)
    cache, features, vocab = fused_cache(80)
    spec = DraftSpec("t-e3", 16, 1, 2, 1, 64, None, vocab, 200, 1e-2, feature_size=16)
    spec = replace(spec, fused_layers=(0, 1, 2))
    draft = random_draft(spec, vocab)
    starts = np.zeros(cache.num_sequences, np.int64)
    # one pass (level 1 alone): the deeper levels' own features are another matter
    stats = train.train_draft(
        draft, spec, cache, starts, seed=0, features=features, feature_passes=1
    )
    assert stats["held_out_top1_by_level"][0] > 0.95  # level 1 reads the target's fused layers


def test_the_layers_and_the_chain_estimate():
    assert fusion.fused_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert fusion.fused_layers(28) == (2, 14, 25)  # the qwen2.5-coder 1.5B
    assert fusion.expected_chain([0.5, 0.5, 0.0]) == 0.75
