"""Train one draft on the cached target top-k distributions (forward KL over the top-k).

A feature-level draft (`DraftSpec.feature_size`) also reads the target's cached features: its
input at pair i is (token t[i+1], target feature f[i]) and it learns the target's distribution at
position i+1 and, by regression, the feature f[i+1] itself. Each batch runs `feature_passes`
times: once on the target's features and then on the draft's own predicted ones:
in pass p, pair i reads the feature predicted at pair i-1 in pass p-1, so pass p sees what a
draft's tree level p+1 sees at serving time (p predictions of its own in a row) and errors of its
own features are trained against rather than met for the first time when drafting.

What the deeper passes attend to (`level_context`): "chain" is what drafting sees (the committed
context, computed from the target's features, and the node's own chain; `forward_levels`);
"own" is every pair of the pass, each reading the draft's own prediction (how the committed
draft-e's first 4000 steps were trained, with two passes).
Held-out agreement per level is always measured the drafting way.
"""

from __future__ import annotations

import math
import random
import time
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from distill.data import TopKCache
from distill.model import DraftSpec, TrainableDraft, own_features

BATCH_TOKENS = 2048
FEATURE_WEIGHT = 1.0  # the feature regression (smooth L1) beside the cross-entropy
ANSWER_WEIGHT = 2.0  # positions inside the target's own answers count double
FEATURE_PASSES = 3  # a feature-level draft's passes per batch: target's features, then its own
LevelContext = Literal["chain", "own"]
LEVEL_CONTEXT: LevelContext = "chain"  # what its deeper passes attend to (module docstring)
HELD_OUT_LEVELS = 4  # tree levels whose held-out agreement a feature-level draft reports
WARMUP_STEPS = 30
VALIDATION_EVERY = 20  # every 20th generated sequence is held out of training
EVAL_INTERVAL = 250  # steps between held-out checks; the best checkpoint is kept


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_validation(cache: TopKCache) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) sequence indices: every VALIDATION_EVERY-th target answer is held out,
    so the held-out top-1 agreement measures what serving sees (the target's own answers)."""
    generated = np.flatnonzero(cache.generated)
    validation = generated[VALIDATION_EVERY // 2 :: VALIDATION_EVERY]
    train = np.setdiff1d(np.arange(cache.num_sequences), validation)
    return train, validation


def make_batches(
    cache: TopKCache, batch_tokens: int, seq_ids: np.ndarray | None = None
) -> list[np.ndarray]:
    """Sequence indices grouped by similar length, each group at most `batch_tokens` padded."""
    lengths = np.diff(cache.offsets)
    ids = np.arange(cache.num_sequences) if seq_ids is None else np.asarray(seq_ids)
    order = ids[np.argsort(lengths[ids], kind="stable")]
    batches: list[np.ndarray] = []
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j + 1 - i) * lengths[order[j]] <= batch_tokens:
            j += 1
        batches.append(order[i:j])
        i = j
    return batches


class BatchBuilder:
    """Turns a group of cached sequences into padded training tensors over the draft vocab.

    With `features` (the target's [N, F] cache) it builds feature-level pairs instead: a sequence
    of L tokens gives L - 1 pairs (t[i+1], f[i]) whose targets are position i+1's distribution and
    f[i+1]; `__call__` then also returns the input and target features."""

    def __init__(
        self,
        cache: TopKCache,
        output_token_ids: np.ndarray,
        gen_starts: np.ndarray,
        features: np.ndarray | None = None,
    ):
        self.cache = cache
        self.features = features
        vocab = int(max(cache.topk_ids.max(), cache.tokens.max(), output_token_ids.max())) + 1
        self.to_draft = np.full(vocab, -1, dtype=np.int64)
        self.to_draft[output_token_ids] = np.arange(len(output_token_ids))
        self.gen_starts = gen_starts

    def __call__(self, seq_ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        c = self.cache
        lengths = [int(c.offsets[s + 1] - c.offsets[s]) for s in seq_ids]
        width = max(lengths)
        k = c.topk_ids.shape[1]
        ids = np.zeros((len(seq_ids), width), dtype=np.int64)
        tgt = np.zeros((len(seq_ids), width, k), dtype=np.int64)
        prob = np.zeros((len(seq_ids), width, k), dtype=np.float32)
        weight = np.zeros((len(seq_ids), width), dtype=np.float32)
        for r, s in enumerate(seq_ids):
            sl = c.sequence(int(s))
            n = lengths[r]
            ids[r, :n] = c.tokens[sl]
            mapped = self.to_draft[c.topk_ids[sl]]
            p = np.exp(c.topk_logp[sl].astype(np.float32)) * (mapped >= 0)
            total = p.sum(-1, keepdims=True)
            prob[r, :n] = p / np.maximum(total, 1e-9)
            tgt[r, :n] = np.maximum(mapped, 0)
            w = np.where(total[:, 0] > 0, 1.0, 0.0)
            if c.generated[s]:
                w[max(0, int(self.gen_starts[s]) - 1) :] *= ANSWER_WEIGHT
            weight[r, :n] = w
        tensors = (
            torch.from_numpy(ids),
            torch.from_numpy(tgt),
            torch.from_numpy(prob),
            torch.from_numpy(weight),
        )
        if self.features is None:
            return tensors
        # pairs: token i+1 with feature i, predicting position i+1 (drop the last column's slot)
        feats = np.zeros((len(seq_ids), width, self.features.shape[1]), dtype=np.float32)
        for r, s in enumerate(seq_ids):
            lo = int(c.offsets[s])
            feats[r, : lengths[r]] = self.features[lo : lo + lengths[r]]
        feats_t = torch.from_numpy(feats)
        ids_t, tgt_t, prob_t, weight_t = tensors
        return (
            ids_t[:, 1:],
            tgt_t[:, 1:],
            prob_t[:, 1:],
            weight_t[:, 1:],
            feats_t[:, :-1],
            feats_t[:, 1:],
        )


def distill_loss(
    logits: torch.Tensor, tgt: torch.Tensor, prob: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy to the target's renormalized top-k; also top-1 agreement."""
    logq = torch.log_softmax(logits, dim=-1)
    ce = -(prob * logq.gather(-1, tgt)).sum(-1)
    loss = (ce * weight).sum() / weight.sum().clamp_min(1.0)
    mask = weight > 0
    agree = (logits.argmax(-1) == tgt[..., 0]) & (prob[..., 0] > 0)
    acc = (agree & mask).sum() / mask.sum().clamp_min(1)
    return loss, acc


def feature_loss(predicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """Smooth L1 between predicted and target features over the weighted (real) positions."""
    per_pos = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)
    mask = (weight > 0).float()
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


def draft_losses(
    draft: TrainableDraft,
    batch: tuple[torch.Tensor, ...],
    *,
    feature_passes: int = FEATURE_PASSES,
    level_context: LevelContext = LEVEL_CONTEXT,
):
    """(loss, top-1 agreement) of one batch; a feature-level draft's loss sums its passes (the
    agreement is the first pass's, on the target's features)."""
    if not draft.spec.is_feature_level:
        ids, tgt, prob, weight = batch
        return distill_loss(draft(ids), tgt, prob, weight)
    ids, tgt, prob, weight, target_feats, next_feats = batch
    feats = draft.target_features(target_feats)
    if level_context == "chain":
        passes = draft.forward_levels(ids, feats, feature_passes)
    else:
        passes, inputs = [], feats
        for _ in range(feature_passes):
            passes.append(draft.forward_features(ids, inputs))
            inputs = own_features(feats, passes[-1][1])
    loss = torch.zeros(())
    agreements = []
    for logits, predicted in passes:
        ce, agree = distill_loss(logits, tgt, prob, weight)
        loss = loss + ce
        if draft.spec.regresses_features:
            loss = loss + FEATURE_WEIGHT * feature_loss(predicted, next_feats, weight)
        agreements.append(agree)
    return loss, agreements[0]


@torch.inference_mode()
def answer_agreement(
    draft: TrainableDraft, builder: BatchBuilder, batches: list[np.ndarray], *, level: int = 1
) -> float:
    """Top-1 agreement with the target on the answer positions of held-out target answers.

    `level` (feature-level drafts): 1 reads the target's features; level L reads the draft's own
    predictions L - 1 deep and attends as a tree's level L does (`forward_levels`)."""
    agree = total = 0
    for seq_ids in batches:
        ids, tgt, prob, weight, *feature_inputs = builder(seq_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if feature_inputs:
                feats = draft.target_features(feature_inputs[0])
                logits = draft.forward_levels(ids, feats, level)[-1][0]
            else:
                logits = draft(ids)
        # answer positions carry ANSWER_WEIGHT; the top-1 must be inside the draft's vocabulary
        mask = (weight >= ANSWER_WEIGHT) & (prob[..., 0] > 0)
        agree += int(((logits.argmax(-1) == tgt[..., 0]) & mask).sum())
        total += int(mask.sum())
    return agree / max(1, total)


def agreement_by_level(
    draft: TrainableDraft,
    builder: BatchBuilder,
    batches: list[np.ndarray],
    num_levels: int = HELD_OUT_LEVELS,
) -> list[float]:
    """`answer_agreement` at tree levels 1..num_levels (a feature-level draft), rounded."""
    return [
        round(answer_agreement(draft, builder, batches, level=lv), 4)
        for lv in range(1, num_levels + 1)
    ]


def train_draft(
    draft: TrainableDraft,
    spec: DraftSpec,
    cache: TopKCache,
    gen_starts: np.ndarray,
    *,
    seed: int,
    batch_tokens: int = BATCH_TOKENS,
    features: np.ndarray | None = None,
    feature_passes: int = FEATURE_PASSES,
    level_context: LevelContext = LEVEL_CONTEXT,
) -> dict:
    """Fixed number of AdamW steps (warmup + cosine), bf16 autocast on CPU, keeping the weights
    with the best held-out agreement (checked every EVAL_INTERVAL steps); returns stats.

    A feature-level draft trains `feature_passes` passes per batch (see `draft_losses`)."""
    if feature_passes < 1:
        raise ValueError(f"feature_passes must be at least 1, got {feature_passes}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if spec.is_feature_level and features is None:
        raise ValueError(f"{spec.name} is feature-level: pass the target's feature cache")
    builder = BatchBuilder(
        cache,
        draft.output_token_ids.numpy(),
        gen_starts,
        features if spec.is_feature_level else None,
    )
    train_ids, validation_ids = split_validation(cache)
    batches = make_batches(cache, batch_tokens, train_ids)
    validation = make_batches(cache, batch_tokens, validation_ids)
    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.dim() == 2]
    no_decay = [p for n, p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < WARMUP_STEPS:
            return spec.lr * (step + 1) / WARMUP_STEPS
        frac = (step - WARMUP_STEPS) / max(1, spec.train_steps - WARMUP_STEPS)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    draft.train()
    order: list[int] = []
    tokens_seen = 0
    ema_loss = ema_acc = None
    best = (-1.0, 0, {k: v.clone() for k, v in draft.state_dict().items()})
    history: list[tuple[int, float]] = []
    start = time.time()
    bar = tqdm(range(spec.train_steps), desc=f"train {spec.name}", unit="step")
    for step in bar:
        if not order:
            order = rng.permutation(len(batches)).tolist()
        batch = builder(batches[order.pop()])
        weight = batch[3]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, acc = draft_losses(
                draft, batch, feature_passes=feature_passes, level_context=level_context
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        tokens_seen += int((weight > 0).sum())
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = acc.item() if ema_acc is None else 0.95 * ema_acc + 0.05 * acc.item()
        bar.set_postfix(loss=f"{ema_loss:.3f}", top1=f"{ema_acc:.3f}")
        done = step + 1
        if done % EVAL_INTERVAL == 0 or done == spec.train_steps:
            draft.eval()
            held_out = answer_agreement(draft, builder, validation)
            if spec.is_feature_level:  # the mean of the first and the second level
                own = answer_agreement(draft, builder, validation, level=2)
                bar.write(f"{spec.name} step {done}: held-out top-1 at level 2 {own:.4f}")
                held_out = (held_out + own) / 2
            draft.train()
            history.append((done, round(held_out, 4)))
            if held_out > best[0]:
                best = (held_out, done, {k: v.clone() for k, v in draft.state_dict().items()})
            bar.write(f"{spec.name} step {done}: held-out answer top-1 {held_out:.4f}")
    bar.close()
    draft.load_state_dict(best[2])
    draft.eval()
    levels = {}
    if spec.is_feature_level:
        levels = {
            "feature_passes": feature_passes,
            "level_context": level_context,
            "held_out_top1_by_level": agreement_by_level(draft, builder, validation),
        }
    return {
        "steps": spec.train_steps,
        "kept_step": best[1],
        "held_out_answer_top1": round(best[0], 4),
        "held_out_history": history,
        "validation_sequences": len(validation_ids),
        "batch_tokens": batch_tokens,
        "tokens_seen": tokens_seen,
        "final_loss_ema": round(float(ema_loss or 0.0), 4),
        "final_top1_agreement_ema": round(float(ema_acc or 0.0), 4),
        "train_seconds": round(time.time() - start, 1),
        **levels,
    }
