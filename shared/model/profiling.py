"""Measure what a `ModelRunner`'s forwards cost on this machine: the numbers behind `CostModel`.

Each model gets two curves: n tokens spread over up to 8 requests (a batch's step), and n tokens
as one request's chain (a lone request's tree: its attention and per-request work paid once);
the cost model interpolates between them by the number of requests in a step.

Layout of a measured forward of n tokens at context c in the spread curve:
  - r = min(n, max_requests) requests (default 8), each with a committed prefix of c tokens;
  - the n new tokens are split as evenly as possible over them, each request's share a chain
    (a tree of the same size costs the same: the same rows through every matmul and the same
    tree-region attention), with logits for every new token (`logits="all"`, as the verifier and
    a drafter's tree layers ask);
  - after each timed forward the uncommitted tree region is discarded (`discard_tree`), so every
    repeat sees the same cache.

The committed prefixes are written by `swap_in` of zero KV instead of a prefill forward: a
forward's latency depends on shapes, not on KV values, and a prefill of 8 x 1024 tokens would
take most of a minute on a CPU. After a warm-up sweep, every repeat sweeps the whole grid (so
drift in background load hits all points alike) and each point keeps the median of its
`repeats` timings; on CUDA each forward is bracketed by `torch.cuda.synchronize`.

`measure_profile` is what a service calls at start (quick mode: a few seconds on a CPU);
`python -m tools.profile` runs the full grid and saves the profile under `profiles/`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.errors import OutOfKVMemoryError
from shared.model.config import ModelConfig
from shared.model.kv_cache import SwappedKV
from shared.model.llama import LlamaModel
from shared.model.profile_files import architecture_fingerprint, cpu_name
from shared.model.runner import ForwardItem, ModelRunner
from shared.model.tensor_parallel import full_config, tensor_parallel_size
from shared.scheduling.cost_model import (
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)

MAX_REQUESTS = 8
# Quick mode (services at start): few points, few repeats.
QUICK_CONTEXTS = (0, 512)
QUICK_REPEATS = 3
# Full mode (python -m tools.profile).
FULL_CONTEXTS = (0, 256, 1024)
FULL_REPEATS = 7
_PREFIX = "__profile_"


def fingerprint_of(cfg: ModelConfig) -> str:
    """The architecture fingerprint of a model config (see `profile_files.ARCHITECTURE_FIELDS`)."""
    return architecture_fingerprint(cfg)


def device_name(device: torch.device | str) -> str:
    """ "cpu: AMD EPYC" or "cuda: NVIDIA H100 80GB HBM3"."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda: " + torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_name()
    return device.type


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def precision_name(model: LlamaModel, dtype: torch.dtype) -> str:
    """A profile key's dtype: `int8` (a draft's int8 weights), `int8-token` (a target's) or the
    model's dtype."""
    scales = model.int8_scales
    return dtype_name(dtype) if scales is None else "int8" if scales == "tensor" else "int8-token"


def profile_key(runner: ModelRunner, model: str) -> ProfileKey:
    """The key a profile of `runner`'s model on this machine has (threads: torch's CPU threads,
    0 on CUDA). Services build it to look a profile up before measuring one. A sharded target
    keys on its whole architecture and the number of ranks."""
    return ProfileKey(
        model=model,
        fingerprint=fingerprint_of(full_config(runner.model)),
        device=device_name(runner.device),
        dtype=precision_name(runner.model, runner.dtype),
        threads=0 if runner.device.type == "cuda" else torch.get_num_threads(),
        tensor_parallel=tensor_parallel_size(runner.model),
    )


def token_grid(max_tokens: int, quick: bool) -> list[int]:
    """Token counts to measure, 1..max_tokens: 1, 2, then powers of two (of four in quick mode;
    with their 1.5x midpoints in full mode), always including max_tokens.

    2 is always measured: a single draft token's price is the step from 1 to 2, and some
    kernels multiply one row on a path of their own (int8's `torch._int_mm` on an Intel Xeon
    without AMX takes about half the time for one row as for two), which no interpolation from
    1 and 4 would show."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    grid = {1, min(2, max_tokens), max_tokens}
    p = 2 if not quick else 4
    while p < max_tokens:
        grid.add(p)
        if not quick and p >= 8 and p * 3 // 2 < max_tokens:
            grid.add(p * 3 // 2)
        p *= 2 if not quick else 4
    return sorted(grid)


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _check_room(runner: ModelRunner, contexts: Sequence[int], tokens: Sequence[int], r: int):
    """All contexts' requests live at once: r requests per context, each with its prefix and
    the largest share of new tokens it gets."""
    cache = runner.cache
    num_requests = min(r, max(tokens))
    share = max(max(_split(n, min(n, r))) for n in tokens)
    need = num_requests * sum(cache.num_blocks_for(c + share) for c in contexts)
    if need > cache.allocator.num_free:
        raise OutOfKVMemoryError(
            f"profiling needs {need} free KV blocks ({num_requests} requests at each context "
            f"{list(contexts)}, plus up to {share} new tokens each), the cache has "
            f"{cache.allocator.num_free} free of {cache.num_blocks}: give the runner more "
            f"kv_memory_bytes or measure fewer or smaller contexts"
        )


def measure_curve(
    runner: ModelRunner,
    tokens: Sequence[int],
    contexts: Sequence[int],
    *,
    repeats: int = FULL_REPEATS,
    warmup: int = 1,
    max_requests: int = MAX_REQUESTS,
    progress: Callable[[int], None] | None = None,
) -> ForwardCurve:
    """Time `runner`'s forward over the grid `tokens` x `contexts` (layout: the module's
    docstring). `progress(k)` is called after every k timed forwards. The runner's own requests
    are left alone; it needs free KV room for min(max(tokens), max_requests) requests at each
    context, all at once (else `OutOfKVMemoryError` before anything runs)."""
    tokens, contexts = sorted(set(tokens)), sorted(set(contexts))
    if tokens[-1] + contexts[-1] >= runner.max_context:
        raise ValueError(
            f"context {contexts[-1]} plus {tokens[-1]} tokens is past the model's context of "
            f"{runner.max_context}"
        )
    _check_room(runner, contexts, tokens, max_requests)
    num_requests = min(tokens[-1], max_requests)
    rids = [[f"{_PREFIX}{j}_{i}" for i in range(num_requests)] for j in range(len(contexts))]
    timer = _ForwardTimer(runner, max_requests)
    times = np.zeros((len(tokens), len(contexts), repeats))
    try:
        _add_requests(runner, rids, contexts)
        for _ in range(warmup):
            for j in range(len(contexts)):
                for n in tokens:
                    timer.once(rids[j], n)
        # Every repeat sweeps the whole grid: a burst of background load spreads over all points
        # instead of spoiling one context's column.
        for rep in range(repeats):
            for j in range(len(contexts)):
                for i, n in enumerate(tokens):
                    times[i, j, rep] = timer.once(rids[j], n)
                if progress is not None:
                    progress(len(tokens))
    finally:
        for rid in (rid for group in rids for rid in group):
            runner.free_request(rid)
    median = np.median(times, axis=-1)
    p25, p75 = np.percentile(times, [25, 75], axis=-1)
    return ForwardCurve(
        tokens=list(tokens),
        contexts=list(contexts),
        ms_grid=np.round(median, 4).tolist(),
        rel_spread=np.round((p75 - p25) / median, 4).tolist(),
        repeats=repeats,
    )


def _add_requests(runner: ModelRunner, rids: list[list[str]], contexts: Sequence[int]) -> None:
    """The grid's requests, those of `rids[j]` with a committed prefix of `contexts[j]` tokens
    (zero KV swapped in)."""
    cfg = runner.cfg
    for j, c in enumerate(contexts):
        for rid in rids[j]:
            if c == 0:
                runner.add_request(rid)
            else:
                shape = (cfg.num_layers, c, cfg.num_kv_heads, cfg.head_dim)
                zeros = torch.zeros(shape, dtype=runner.dtype)
                runner.swap_in(rid, SwappedKV(k=zeros, v=zeros))


class _ForwardTimer:
    """Times one forward of made-up tokens spread over some of the grid's requests."""

    def __init__(self, runner: ModelRunner, max_requests: int) -> None:
        self.runner = runner
        self.max_requests = max_requests
        self.cuda = runner.device.type == "cuda"
        self.rng = np.random.default_rng(0)
        # a feature-level draft reads one feature row per token; their values do not change the
        # cost
        self.feature_size = runner.cfg.feature_size
        self.gen = torch.Generator().manual_seed(0)

    def _made_up_features(self, k: int) -> torch.Tensor:
        # on the model's device before the clock starts, so no copy is timed
        rows = torch.randn(k, self.feature_size, generator=self.gen)
        return rows.to(self.runner.device, self.runner.dtype)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)

    def once(self, rids: Sequence[str], n: int) -> float:
        """Milliseconds of a forward of `n` tokens as chains over min(n, max_requests) of
        `rids`; the tokens are discarded after it."""
        r = min(n, self.max_requests)
        vocab = self.runner.cfg.vocab_size
        items = [
            ForwardItem(
                rid,
                self.rng.integers(0, vocab, k).tolist(),
                list(range(-1, k - 1)),
                "all",
                None if self.feature_size is None else self._made_up_features(k),
            )
            for rid, k in zip(rids[:r], _split(n, r), strict=True)
        ]
        self._sync()
        start = time.perf_counter()
        self.runner.forward(items)
        self._sync()
        elapsed = time.perf_counter() - start
        for item in items:
            self.runner.discard_tree(item.request_id)
        return elapsed * 1e3


def measure_profile(
    target: ModelRunner,
    drafts: Mapping[str, ModelRunner],
    *,
    target_name: str,
    max_tokens: int,
    quick: bool = True,
    contexts: Sequence[int] | None = None,
    tokens: Sequence[int] | None = None,
    repeats: int | None = None,
    max_requests: int = MAX_REQUESTS,
    progress: bool = False,
    notes: str = "",
) -> CostProfile:
    """Measure the target's and each draft's forward on this machine and return their profile.

    - `target`, `drafts` (name -> runner): loaded models with free KV room (see `measure_curve`);
      the keys (`profile_key`) are built from them: `target_name` and the draft names label them.
    - `max_tokens`: the largest forward measured (the step's token budget); `tokens` overrides
      the grid (`token_grid(max_tokens, quick)`).
    - `quick=True` (services at start; a few seconds on a 2-core CPU for SmolLM2-135M and the
      three drafts at max_tokens=64): token counts 1, 2, 4, 16, ..., max_tokens, contexts (0, 512),
      3 repeats. `quick=False` (`python -m tools.profile`): 1, 2, 4, 8, 12, 16, 24, ...,
      contexts (0, 256, 1024), 7 repeats. `contexts` and `repeats` override either.
    - `progress`: a tqdm bar on stderr.

    Nothing is saved: `CostProfile.save` does that. Look one up first with
    `profile_files.find_profile(directory, profile_key(target, name), ...)`.
    """
    tokens = sorted(set(tokens)) if tokens else token_grid(max_tokens, quick)
    contexts = (
        sorted(set(contexts)) if contexts else list(QUICK_CONTEXTS if quick else FULL_CONTEXTS)
    )
    repeats = repeats or (QUICK_REPEATS if quick else FULL_REPEATS)
    runners = {target_name: target, **drafts}
    if len(runners) != 1 + len(drafts):
        raise ValueError(f"a draft is named like the target, {target_name!r}")

    bar = None
    if progress:
        from tqdm import tqdm

        total = 2 * len(runners) * len(contexts) * repeats * len(tokens)
        bar = tqdm(total=total, desc="profiling forwards", unit="fwd")
    grid = _Grid(tokens, contexts, repeats, max_requests)
    try:
        target_profile = _measure_model(target, target_name, grid, bar)
        draft_profiles = {name: _measure_model(r, name, grid, bar) for name, r in drafts.items()}
    finally:
        if bar is not None:
            bar.close()
    method = (
        f"curve: n tokens as chains over min(n, {max_requests}) requests; single: one request's "
        f"chain of n; each request with a committed prefix "
        f"of `context` tokens (zero KV); logits for all new tokens; median of {repeats} after a "
        f"warm-up; {'quick' if quick else 'full'} grid"
    )
    return CostProfile(target=target_profile, drafts=draft_profiles, method=method, notes=notes)


@dataclass(frozen=True)
class _Grid:
    tokens: Sequence[int]
    contexts: Sequence[int]
    repeats: int
    max_requests: int


def _measure_model(runner: ModelRunner, name: str, grid: _Grid, bar: Any) -> ModelProfile:
    """One model's profile: its curve spread over requests, then one request's chain."""
    if bar is not None:
        bar.set_postfix_str(name)
    curves = [
        measure_curve(
            runner,
            grid.tokens,
            grid.contexts,
            repeats=grid.repeats,
            max_requests=layout,
            progress=bar.update if bar is not None else None,
        )
        for layout in (grid.max_requests, 1)  # spread over requests, then one request's chain
    ]
    plan = runner.model.linear_plan
    return ModelProfile(
        key=profile_key(runner, name),
        curve=curves[0],
        single=curves[1],
        max_requests=grid.max_requests,
        kernels=plan.to_dict() if plan is not None else None,
    )
