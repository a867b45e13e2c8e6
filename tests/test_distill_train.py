"""Distillation training on a synthetic top-k cache: the held-out split, the batches, and that
training learns the teacher and keeps the best held-out checkpoint."""

from __future__ import annotations

import numpy as np
import torch

from distill import train
from distill.data import TopKCache
from distill.model import DraftSpec, TrainableDraft

VOCAB = 64


def synthetic_cache(num_sequences: int = 60, length: int = 24, seed: int = 0) -> TopKCache:
    """Sequences where the teacher's next token is a fixed function of the current token."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(VOCAB)
    tokens = rng.integers(0, VOCAB, (num_sequences, length)).astype(np.int32)
    top_ids = np.stack([successor[tokens], (successor[tokens] + 1) % VOCAB], -1).astype(np.int32)
    top_logp = np.log(np.broadcast_to([0.9, 0.1], top_ids.shape)).astype(np.float16)
    return TopKCache(
        tokens=tokens.reshape(-1),
        offsets=np.arange(num_sequences + 1, dtype=np.int64) * length,
        kinds=["chat"] * num_sequences,
        generated=np.arange(num_sequences) % 2 == 0,
        topk_ids=top_ids.reshape(-1, 2),
        topk_logp=top_logp.reshape(-1, 2),
    )


def test_validation_split_holds_out_target_answers_only():
    cache = synthetic_cache()
    train_ids, validation_ids = train.split_validation(cache)
    assert len(validation_ids) > 0 and cache.generated[validation_ids].all()
    assert not set(train_ids) & set(validation_ids)
    assert sorted([*train_ids, *validation_ids]) == list(range(cache.num_sequences))
    batches = train.make_batches(cache, 100, train_ids)
    assert sorted(int(i) for b in batches for i in b) == sorted(train_ids.tolist())
    assert all(len(b) * 24 <= 100 for b in batches)


def test_training_learns_the_teacher_and_keeps_the_best_checkpoint(monkeypatch):
    monkeypatch.setattr(train, "VALIDATION_EVERY", 4)
    monkeypatch.setattr(train, "EVAL_INTERVAL", 40)
    cache = synthetic_cache()
    torch.manual_seed(0)
    spec = DraftSpec("t", 32, 1, 2, 1, 64, None, VOCAB, train_steps=120, lr=1e-2)
    draft = TrainableDraft(spec, VOCAB, torch.arange(VOCAB), max_positions=64)
    gen = torch.Generator().manual_seed(0)
    for p in draft.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, 0.05, generator=gen)
    stats = train.train_draft(draft, spec, cache, np.zeros(cache.num_sequences, np.int64), seed=0)
    history = dict(stats["held_out_history"])
    assert list(history) == [40, 80, 120]
    assert stats["held_out_answer_top1"] == max(history.values()) > 0.9
    assert stats["kept_step"] in history
    builder = train.BatchBuilder(cache, np.arange(VOCAB), np.zeros(cache.num_sequences, np.int64))
    _, validation_ids = train.split_validation(cache)
    kept = train.answer_agreement(draft, builder, train.make_batches(cache, 2048, validation_ids))
    assert abs(kept - stats["held_out_answer_top1"]) < 1e-4  # the best weights were restored
