"""Which draft model speculates for each request this step, with feedback from what steps achieved.

The core asks the chooser once per step (a time slot, in Spin's words) for the requests that
will draft in it: `assign` sees them, the live draft models and the cost model, and names a model
for each (a request left out drafts nothing this step). After every verified step that used a
draft, `observe` reports what it achieved: committed tokens and the step's time, whose ratio is
the request's goodput on that model. Choosers:

- `fixed`: the first preferred live model, kept for the request's life (the default);
- `greedy-length` (Spin's "Greedy"): shorter prompts get smaller models, by the prompt's rank
  among the recent prompts, kept for the request's life;
- `eps-greedy`: each step, with probability ε every request tries a random model, otherwise each
  takes the model with its best goodput so far (the model's mean over all requests where it has
  none of its own);
- `lbss`: Spin's learning-based selection (`shared/scheduling/lbss.py`): epochs of chunked random
  exploration and exploitation by max-weight matching under per-model capacities;
- `oracle`: each request's model assigned in advance (experiments only: the simulator works it
  out from runs on the recorded acceptance);
- `planned`: the goodput planner's choice (`shared/scheduling/planning.py`): each step, the
  draft whose plan for the request promises the most committed tokens per millisecond, by the
  request's acceptance estimate on each draft (a draft's mean over all requests where it has
  none of its own, optimistic before any), its cost and what it would have to catch up;
- `counterfactual`: for model-free drafts (`shared/engine/model_free.py`), what each would have
  achieved is scored after every step from the tokens the target committed, run or not (the core
  reports it as an outcome with `counterfactual` set); for model drafts, whose outcome is known
  only where they ran, LBSS's exploration. Each request takes the model-free draft when its
  recent goodput is at least its model draft's.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState

EPSILON = 0.2
RECENT_PROMPTS = 256  # greedy-length ranks a prompt among this many recent ones
RECENT_REQUESTS = 256  # finished requests' goodputs kept per model (LBSS's pruning reads them)


@dataclass(frozen=True)
class DraftOutcome:
    """What one verified step of a request achieved with a draft model."""

    request_id: str
    draft_model: str
    num_draft_tokens: int
    num_accepted: int
    step_ms: float  # the step's wall time as the executor saw it
    # the request's own share of the step's modeled time (its verified nodes' share of the
    # verifier's forward, its drafted nodes' share of its model's drafting); None: no cost model
    share_ms: float | None = None
    # not run: a model-free draft's tree scored against the tokens the target committed
    counterfactual: bool = False

    @property
    def goodput(self) -> float:
        """Tokens committed per ms: the accepted drafts and the target's bonus over the
        request's own share of the step where it is known, else over the whole step (which
        every request of the step shares, whatever it drafted with)."""
        ms = self.share_ms if self.share_ms is not None else self.step_ms
        return (1 + self.num_accepted) / max(ms, 1e-3)


class DraftChooser(Protocol):
    name: str
    learns: bool  # reads `observe`: the core prices each request's share of a step only then
    planned: bool  # the goodput planner picks each drafting request's model (`DraftPlanner`)
    parks_switched: bool  # a request switching away keeps its state on the old drafter
    counterfactual: bool  # the core scores model-free trees beside every model draft for it

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        """A live draft model for each request that drafts this step (absent: none this step).
        `live_models` is never empty; a request's current model is `request.draft_model`."""
        ...

    def observe(self, outcome: DraftOutcome) -> None:
        """Feedback after a verified step that used a draft."""
        ...

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> str | None:
        """The model the request will most likely move to from its current one (Spin's fast
        switching keeps that model's KV of the request in step ahead of the switch); None
        when no switch is foreseen."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished."""
        ...


class ChooserTraits:
    """What the core and planner ask of a chooser beyond its methods; most answer no to all."""

    planned = False
    parks_switched = False
    counterfactual = False


@dataclass
class GoodputTable:
    """Observed goodput per (request, model): running means, and each model's over all requests."""

    sums: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    model_sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    model_counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _models_of: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    # each finished request's mean per model, the most recent RECENT_REQUESTS per model
    finished: dict[str, deque[float]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=RECENT_REQUESTS))
    )

    def add(self, outcome: DraftOutcome) -> None:
        key = (outcome.request_id, outcome.draft_model)
        self._models_of[outcome.request_id].add(outcome.draft_model)
        self.sums[key] += outcome.goodput
        self.counts[key] += 1
        self.model_sums[outcome.draft_model] += outcome.goodput
        self.model_counts[outcome.draft_model] += 1

    def model_mean(self, model: str) -> float | None:
        n = self.model_counts.get(model, 0)
        return self.model_sums[model] / n if n else None

    def mean(self, request_id: str, model: str) -> float | None:
        """The request's own mean on `model`; None where it never ran there."""
        n = self.counts.get((request_id, model), 0)
        return self.sums[(request_id, model)] / n if n else None

    def estimate(self, request_id: str, model: str) -> float:
        """The request's mean, else the model's over all requests, else the best model's (an
        optimistic guess, so that an untried model is not written off)."""
        own = self.mean(request_id, model)
        if own is not None:
            return own
        prior = self.model_mean(model)
        if prior is not None:
            return prior
        known = [m for m in (self.model_mean(x) for x in self.model_counts) if m is not None]
        return max(known, default=0.0)

    def forget(self, request_id: str) -> None:
        for model in self._models_of.pop(request_id, ()):
            key = (request_id, model)
            self.finished[model].append(self.sums.pop(key) / self.counts.pop(key))

    def request_means(self, model: str) -> list[float]:
        """Each request's mean goodput on `model`, running requests' and recently finished
        ones': one sample per request (a request's steps are far from independent)."""
        running = [self.sums[key] / n for key, n in self.counts.items() if key[1] == model]
        return [*self.finished.get(model, ()), *running]

    def dominated(self, models: Sequence[str], z: float, min_requests: int) -> set[str]:
        """The models whose goodput is confidently below another's: the upper bound of their
        mean over requests (mean + z standard errors) under the best lower bound. A model tried
        by fewer than `min_requests` requests is never dominated."""
        bounds: dict[str, tuple[float, float]] = {}
        for model in models:
            samples = self.request_means(model)
            if len(samples) < min_requests:
                continue
            mean = float(np.mean(samples))
            error = z * float(np.std(samples, ddof=1)) / len(samples) ** 0.5
            bounds[model] = (mean - error, mean + error)
        if not bounds:
            return set()
        best_low = max(low for low, _ in bounds.values())
        return {m for m, (_, high) in bounds.items() if high < best_low}

    def best_other(self, request: RequestState, live_models: Sequence[str]) -> str | None:
        """The live model other than the request's current one with the highest estimated
        goodput (Spin's destination for a fast switch outside exploration)."""
        others = sorted(m for m in live_models if m != request.draft_model)
        return max(others, key=lambda m: self.estimate(request.request_id, m), default=None)


class FixedDraftModel(ChooserTraits):
    """The first of the preferred models that is alive (configured order), else any live one;
    a request keeps its model while it lives."""

    name = "fixed"
    learns = False

    def __init__(self, preferred: Sequence[str] = ()) -> None:
        self.preferred = list(preferred)

    def first_live(self, live_models: Sequence[str]) -> str:
        for model in self.preferred:
            if model in live_models:
                return model
        return min(live_models)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        first = self.first_live(live_models)
        return {
            r.request_id: r.draft_model if r.draft_model in live_models else first for r in requests
        }

    def observe(self, outcome: DraftOutcome) -> None:
        pass

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> None:
        return None  # a request keeps its model

    def forget(self, request_id: str) -> None:
        pass


class GreedyByLength(ChooserTraits):
    """Spin's Greedy: a prompt's rank among recent prompts picks the model, shorter prompts the
    smaller models (`preferred` lists them smallest first); kept for the request's life."""

    name = "greedy-length"
    learns = False

    def __init__(self, preferred: Sequence[str] = ()) -> None:
        self.preferred = list(preferred)
        self._recent: deque[int] = deque(maxlen=RECENT_PROMPTS)
        self._chosen: dict[str, str] = {}

    def _by_size(self, live_models: Sequence[str]) -> list[str]:
        ranked = [m for m in self.preferred if m in live_models]
        return ranked + sorted(m for m in live_models if m not in ranked)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        models = self._by_size(live_models)
        out = {}
        for r in requests:
            chosen = self._chosen.get(r.request_id)
            if chosen not in live_models:
                length = len(r.prompt)
                self._recent.append(length)
                ordered = sorted(self._recent)
                quantile = bisect.bisect_left(ordered, length) / len(ordered)
                chosen = models[min(int(quantile * len(models)), len(models) - 1)]
                self._chosen[r.request_id] = chosen
            out[r.request_id] = chosen
        return out

    def observe(self, outcome: DraftOutcome) -> None:
        pass

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> None:
        return None  # a request keeps its model

    def forget(self, request_id: str) -> None:
        self._chosen.pop(request_id, None)


class EpsilonGreedy(ChooserTraits):
    """Each step: with probability ε every request tries a random live model; otherwise each
    takes its best model by observed goodput."""

    name = "eps-greedy"
    learns = True

    def __init__(
        self, preferred: Sequence[str] = (), epsilon: float = EPSILON, seed: int = 0
    ) -> None:
        self.epsilon = epsilon
        self.table = GoodputTable()
        self._rng = random.Random(seed)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        models = sorted(live_models)
        if self._rng.random() < self.epsilon:
            return {r.request_id: self._rng.choice(models) for r in requests}
        return {
            r.request_id: max(models, key=lambda m, r=r: self.table.estimate(r.request_id, m))
            for r in requests
        }

    def observe(self, outcome: DraftOutcome) -> None:
        self.table.add(outcome)

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> str | None:
        return self.table.best_other(request, live_models)

    def forget(self, request_id: str) -> None:
        self.table.forget(request_id)


class PlannedChoice(ChooserTraits):
    """The speculation planner chooses (`DraftPlanner`, which reads `planned`); this object only
    answers for requests it leaves out: each keeps its model, a new one takes the first
    preferred. A request switching away parks its drafter (`parks_switched`), so a switch back
    appends only the tokens that drafter missed."""

    name = "planned"
    learns = False
    planned = True
    parks_switched = True

    def __init__(self, preferred: Sequence[str] = ()) -> None:
        self.fallback = FixedDraftModel(preferred)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        return self.fallback.assign(requests, live_models, cost)

    def observe(self, outcome: DraftOutcome) -> None:
        pass

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> None:
        return None  # no standby: a switch resumes the parked drafter instead

    def forget(self, request_id: str) -> None:
        pass


class Oracle(ChooserTraits):
    """Each request's model, assigned in advance by an experiment (`bench.drafters`: the
    per-request best of fixed-draft runs, which is no bound since a step waits for its slowest
    drafter, or the batch-aware search); a request it does not know gets the first live model."""

    name = "oracle"
    learns = False

    def __init__(self, best: Mapping[str, str]) -> None:
        self.best = dict(best)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        fallback = min(live_models)
        return {
            r.request_id: m if (m := self.best.get(r.request_id)) in live_models else fallback
            for r in requests
        }

    def observe(self, outcome: DraftOutcome) -> None:
        pass

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> None:
        return None  # a request keeps its model

    def forget(self, request_id: str) -> None:
        pass


CHOOSERS = ("fixed", "lbss", "greedy-length", "eps-greedy", "oracle", "counterfactual", "planned")
