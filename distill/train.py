"""Train one draft on the cached target top-k distributions (forward KL over the top-k)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from tqdm import tqdm

from distill.data import TopKCache
from distill.model import DraftSpec, TrainableDraft

BATCH_TOKENS = 2048
ANSWER_WEIGHT = 2.0  # positions inside the target's own answers count double
WARMUP_STEPS = 30


def make_batches(cache: TopKCache, batch_tokens: int) -> list[np.ndarray]:
    """Sequence indices grouped by similar length, each group at most `batch_tokens` padded."""
    lengths = np.diff(cache.offsets)
    order = np.argsort(lengths, kind="stable")
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
    """Turns a group of cached sequences into padded training tensors over the draft vocab."""

    def __init__(self, cache: TopKCache, output_token_ids: np.ndarray, gen_starts: np.ndarray):
        self.cache = cache
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
        return (
            torch.from_numpy(ids),
            torch.from_numpy(tgt),
            torch.from_numpy(prob),
            torch.from_numpy(weight),
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


def train_draft(
    draft: TrainableDraft,
    spec: DraftSpec,
    cache: TopKCache,
    gen_starts: np.ndarray,
    *,
    seed: int,
    batch_tokens: int = BATCH_TOKENS,
) -> dict:
    """Fixed number of AdamW steps (warmup + cosine), bf16 autocast on CPU; returns stats."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    builder = BatchBuilder(cache, draft.output_token_ids.numpy(), gen_starts)
    batches = make_batches(cache, batch_tokens)
    decay = [p for n, p in draft.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
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
    start = time.time()
    bar = tqdm(range(spec.train_steps), desc=f"train {spec.name}", unit="step")
    for step in bar:
        if not order:
            order = rng.permutation(len(batches)).tolist()
        ids, tgt, prob, weight = builder(batches[order.pop()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft(ids)
        loss, acc = distill_loss(logits, tgt, prob, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        tokens_seen += int((weight > 0).sum())
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = acc.item() if ema_acc is None else 0.95 * ema_acc + 0.05 * acc.item()
        bar.set_postfix(loss=f"{ema_loss:.3f}", top1=f"{ema_acc:.3f}")
    bar.close()
    draft.eval()
    return {
        "steps": spec.train_steps,
        "batch_tokens": batch_tokens,
        "tokens_seen": tokens_seen,
        "final_loss_ema": round(float(ema_loss or 0.0), 4),
        "final_top1_agreement_ema": round(float(ema_acc or 0.0), 4),
        "train_seconds": round(time.time() - start, 1),
    }
