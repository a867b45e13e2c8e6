"""Building the scheduler core and its policies from their names and the validated settings.

The factories live here, above the modules they build from, so those import only downward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.core import CoreConfig, MergePolicy, SchedulerCore
from shared.scheduling.cost_model import CostModel
from shared.scheduling.counterfactual import Counterfactual
from shared.scheduling.draft_choice import (
    CHOOSERS,
    DraftChooser,
    EpsilonGreedy,
    FixedDraftModel,
    GreedyByLength,
    Oracle,
    PlannedChoice,
)
from shared.scheduling.laps import LAPSSD, LAS, LPSJF, PREDICTORS, OracleLength
from shared.scheduling.lbss import Lbss
from shared.scheduling.ordering import FCFS, POLICIES, SchedulingPolicy
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.replicas import make_matcher
from shared.scheduling.slo import AdaServe, EqualGreedy, Incremental, StaticTree, ThesisSlo
from shared.scheduling.tree_selection import SELECTORS, GlobalGreedy, Goodput, TreeSelector
from shared.settings import (
    AugurySettings,
    LapsSettings,
    LbssSettings,
    SloSettings,
    SpeculationSettings,
)
from shared.values.methods import DraftMethod


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
    """The scheduler service's core, from the settings."""
    engine = settings.engine
    return make_core(
        SchedulerConfig.from_settings(settings),
        target,
        draft_models,
        cost,
        method=method_from_settings(settings.scheduler.speculation),
        first_batch_id=first_batch_id,
        # the verifier's prefix cache, as far as the core can tell from token ids
        prefix_index=PrefixIndex(engine.block_size) if engine.enable_prefix_caching else None,
    )


def make_core(
    config: SchedulerConfig,
    target: TargetInfo,
    draft_models: Sequence[str],
    cost: CostModel | None,
    *,
    method: DraftMethod | None,
    first_batch_id: int = 1,
    prefix_index: PrefixIndex | None = None,
    true_lengths: Mapping[str, int] | None = None,
    best_drafts: Mapping[str, str] | None = None,
) -> SchedulerCore:
    """The core every executor drives: `config` with what the executor knows of its target
    and drafts (`method`: the default drafting method; None: no speculation). `true_lengths`
    and `best_drafts` are for the oracles of an experiment (`make_policy`, `make_chooser`)."""
    model_free = tuple(m for m in target.model_free_drafts if m in draft_models)
    has_models = len(model_free) < len(draft_models)
    return SchedulerCore(
        CoreConfig(
            vocab_size=target.vocab_size,
            max_context=target.max_context,
            eos_token_ids=target.eos_token_ids,
            token_budget=config.max_tokens_per_step,
            max_running=config.max_running_requests,
            micro_batches=config.most_micro_batches,
            auto_micro_batches=config.micro_batches == "auto",
            micro_batch_drop=config.micro_batch_drop,
            micro_batch_split=config.micro_batch_split,
            method=method,
            planner=config.planner,
            calibrate_costs=config.calibrate_costs,
            switch_margin=config.switch_margin,
            feature_drafts=target.feature_drafts,
            feature_size=target.hidden_size,
            fast_switching=config.fast_switching,
            merge_drafts=resolve_merge(config.merge_drafts, bool(model_free), has_models),
            model_beside_copy=config.model_beside_copy,
            model_free_drafts=model_free,
        ),
        policy=make_policy(config.policy, config.length_predictor, config.laps, true_lengths),
        chooser=make_chooser(
            config.draft_chooser,
            list(draft_models),
            config.lbss,
            best_drafts,
            model_free=model_free,
        ),
        matcher=make_matcher(config.replica_matcher),
        selector=make_selector(config.tree_selection, config.slo),
        cost=cost,
        first_batch_id=first_batch_id,
        prefix_index=prefix_index,
    )


def make_chooser(
    name: str,
    preferred: Sequence[str],
    lbss: LbssSettings | None = None,
    best: Mapping[str, str] | None = None,
    model_free: Sequence[str] = (),
) -> DraftChooser:
    """The chooser called `name`; `preferred`: the draft models, smallest first. The oracle
    needs `best` (each request's best model), which only an experiment knows; `model_free`:
    the drafts among them that load no model (the counterfactual chooser scores them)."""
    if name == "fixed":
        return FixedDraftModel(preferred)
    if name == "greedy-length":
        return GreedyByLength(preferred)
    if name == "eps-greedy":
        return EpsilonGreedy(preferred)
    if name == "lbss":
        return Lbss(preferred, lbss)
    if name == "counterfactual":
        return Counterfactual(preferred, model_free, lbss)
    if name == "planned":
        return PlannedChoice(preferred)
    if name == "oracle":
        if best is None:
            raise ValueError("the oracle chooser needs each request's best draft model")
        return Oracle(best)
    raise ValueError(f"unknown draft chooser {name!r}; known: {list(CHOOSERS)}")


def make_policy(
    name: str,
    predictor: str | None = None,
    laps: LapsSettings | None = None,
    true_lengths: Mapping[str, int] | None = None,
) -> SchedulingPolicy:
    """The policy called `name`; LP-SJF and LAPS-SD use the length predictor named (None: the
    learned one). `true_lengths` (request id -> its answer's length, filled as requests come)
    is for the `oracle` predictor of an experiment that knows them; no other predictor sees it."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {list(POLICIES)}")
    if name == "fcfs":
        return FCFS()
    if name == "las":
        return LAS()
    predictor = predictor or "learned"
    if predictor not in PREDICTORS:
        raise ValueError(
            f"unknown output-length predictor {predictor!r} (known: {sorted(PREDICTORS)}; "
            "the oracle is for experiments that know each request's length)"
        )
    lengths = OracleLength(true_lengths) if predictor == "oracle" else PREDICTORS[predictor]()
    if name == "lp-sjf":
        return LPSJF(lengths)
    return LAPSSD(lengths) if laps is None else LAPSSD(lengths, laps)


def make_selector(name: str, slo: SloSettings | None = None) -> TreeSelector:
    """A selector by its settings name; the SLO-aware ones read `slo` (None: the defaults)."""
    match name:
        case "goodput":
            return Goodput()
        case "global-greedy":
            return GlobalGreedy()
        case "equal-greedy":
            return EqualGreedy()
        case "adaserve":
            return AdaServe(slo)
        case "thesis-slo":
            return ThesisSlo(slo)
        case "static":
            return StaticTree()
        case "incremental":
            return Incremental()
    raise ValueError(f"unknown tree selection {name!r}; known: {list(SELECTORS)}")
