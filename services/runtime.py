"""What the model services share: loading a runner from the settings, a single model thread,
the default model set, and the event loop (uvloop).

A service's model work runs on its own one-thread executor, so the asyncio loop stays free for
Redis while the forward runs (torch releases the GIL), and the drafter and the verifier of one
process compute at the same time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from shared.model.config import ModelConfig
from shared.settings import AugurySettings, EngineSettings

T = TypeVar("T")


class ModelThread:
    """One thread that owns a model: every call into the runner goes through `run`."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass(frozen=True)
class ModelPaths:
    target: Path
    drafts: dict[str, Path] = field(default_factory=dict)
    model_free: tuple[str, ...] = ()  # drafts that load no model (`ngram`, `suffix`)

    @property
    def draft_names(self) -> list[str]:
        """Every draft the cell serves, model drafts first."""
        return [*self.drafts, *self.model_free]


def resolve_models(settings: AugurySettings) -> ModelPaths:
    """The configured checkpoints (GGUF files converted once); unset: the model set's
    (`models.model_set`): SmolLM2-135M-Instruct and the committed drafts, `draft-e` first
    (`served_draft_dirs`), by default."""
    from shared.model.loader import checkpoint_dir
    from shared.model.model_set import SMOLLM2, model_set_drafts, model_set_target

    model_set = settings.models.model_set
    target = checkpoint_dir(settings.models.target_dir or model_set_target(model_set))
    model_free = tuple(settings.models.model_free)
    if settings.models.drafts:
        drafts = {d.name: checkpoint_dir(d.dir) for d in settings.models.drafts}
        return ModelPaths(target, drafts, model_free)
    try:
        drafts = model_set_drafts(model_set, served=True)
    except FileNotFoundError:
        if model_set != SMOLLM2:
            raise
        drafts = {}  # no draft checkpoints yet: plain decoding
    return ModelPaths(target, drafts, model_free)


def read_model_config(path: Path) -> ModelConfig:
    """The architecture from config.json only (the scheduler never loads weights)."""
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def max_context(settings: EngineSettings, config: ModelConfig) -> int:
    limit = config.max_position_embeddings
    return min(limit, settings.max_context) if settings.max_context else limit


def load_runner(path: Path, settings: EngineSettings, *, target: Path | None = None) -> Any:
    """A ModelRunner for the checkpoint with the engine's dtype (the target: `target_dtype`
    where set), device and KV budget.

    `target`: the target checkpoint, given for a draft (it may share the target's input
    embedding; its linear layers run int8 weights where `settings.draft_weights` says so)."""
    import torch

    from shared.model import load_model, load_target
    from shared.model.precision import TargetPrecision, check_target_precision
    from shared.model.quantized import uses_int8
    from shared.model.runner import ModelRunner

    dtype = getattr(torch, settings.dtype)
    if target is not None:  # a draft
        int8 = uses_int8(settings.draft_weights, settings.device)
        model = load_model(path, dtype=dtype, device=settings.device, target_path=target, int8=int8)
    else:
        precision = TargetPrecision(dtype)
        if settings.target_dtype is not None:
            precision = check_target_precision(
                settings.target_dtype, settings.device, setting="AUGURY_ENGINE__TARGET_DTYPE"
            )
        model = load_target(path, precision, settings.device)
    runner = ModelRunner(
        model,
        block_size=settings.block_size,
        kv_memory_bytes=settings.kv_memory_bytes,
        cuda_graph_max_tokens=settings.cuda_graph_max_tokens,
        cuda_graph_max_requests=settings.cuda_graph_max_requests,
        prefix_caching=settings.enable_prefix_caching,
        max_kept_fraction=settings.prefix_cache_max_kept_fraction,
        exact_attention=settings.exact_attention,
    )
    runner.capture_graphs()  # on CUDA: now, not on the first requests
    return runner


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's main coroutine on uvloop."""
    return uvloop.run(main)
