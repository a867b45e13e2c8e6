"""Building the scheduler core from the validated settings (the services' way in)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.engine.methods import DraftMethod
from shared.scheduling.core import CoreConfig, MergePolicy, SchedulerCore
from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import make_chooser
from shared.scheduling.ordering import make_policy
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.replicas import make_matcher
from shared.scheduling.tree_selection import make_selector
from shared.settings import AugurySettings, SpeculationSettings


@dataclass(frozen=True)
class TargetInfo:
    """What the scheduler knows about the target: limits, not weights."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    hidden_size: int = 0  # the width of the target's features
    feature_drafts: frozenset[str] = frozenset()  # draft models that read them
    model_free_drafts: tuple[str, ...] = ()  # drafts that load no model (`models.model_free`)


def method_from_settings(spec: SpeculationSettings) -> DraftMethod | None:
    """The default drafting method; None when speculation is off."""
    common = {"min_path_prob": spec.min_path_prob}
    match spec.method:
        case "chain":
            return DraftMethod("chain", k=spec.chain_length, **common)
        case "static":
            return DraftMethod("static", expansion=tuple(spec.static_expansion), **common)
        case "beam":
            return DraftMethod("beam", depth=spec.beam_depth, width=spec.beam_width, **common)
        case "dynamic":
            return DraftMethod(
                "dynamic",
                budget=spec.dynamic_max_nodes,
                max_size=spec.dynamic_max_nodes,
                max_depth=spec.dynamic_max_depth,
                max_width=spec.dynamic_max_width,
                **common,
            )
    return None


def resolve_merge(policy: str, model_free: bool, models: bool) -> MergePolicy:
    """`auto`: a model-free draft merged with the model draft where there are both, else off."""
    if policy == "auto":
        return "model-free" if model_free and models else "off"
    return policy  # type: ignore[return-value]


def build_core(
    settings: AugurySettings,
    target: TargetInfo,
    draft_models: Sequence[str],
    cost: CostModel | None,
    *,
    first_batch_id: int = 1,
) -> SchedulerCore:
    config = settings.scheduler
    model_free = tuple(m for m in target.model_free_drafts if m in draft_models)
    has_models = len(model_free) < len(draft_models)
    return SchedulerCore(
        CoreConfig(
            vocab_size=target.vocab_size,
            max_context=target.max_context,
            eos_token_ids=target.eos_token_ids,
            token_budget=settings.engine.max_tokens_per_step,
            max_running=config.max_running_requests,
            micro_batches=(
                config.max_micro_batches if config.micro_batches == "auto" else config.micro_batches
            ),
            auto_micro_batches=config.micro_batches == "auto",
            micro_batch_drop=config.micro_batch_drop,
            micro_batch_split=config.micro_batch_split,
            method=method_from_settings(config.speculation),
            planner=config.speculation.planner,
            feature_drafts=target.feature_drafts,
            feature_size=target.hidden_size,
            fast_switching=config.fast_switching,
            merge_drafts=resolve_merge(config.merge_drafts, bool(model_free), has_models),
            model_free_drafts=model_free,
        ),
        policy=make_policy(config.policy, config.length_predictor, config.laps),
        chooser=make_chooser(
            config.draft_chooser, draft_models, config.lbss, model_free=model_free
        ),
        matcher=make_matcher(config.replica_matcher),
        selector=make_selector(config.tree_selection, config.slo),
        cost=cost,
        first_batch_id=first_batch_id,
        # the verifier's prefix cache, as far as the core can tell from token ids
        prefix_index=(
            PrefixIndex(settings.engine.block_size)
            if settings.engine.enable_prefix_caching
            else None
        ),
    )
