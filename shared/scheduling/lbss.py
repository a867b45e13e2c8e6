"""Spin's learning-based draft-model selection (LBSS, Alg. 1-2) as a draft chooser.

Time is cut into slots, one per step the core plans (`assign`), and slots into epochs k = 1, 2, ...
Each epoch has two stages:

- **exploration**, `alpha` slots in chunks of `beta`: at each chunk's start every request draws a
  live model at random and keeps it for the chunk (fewer switches than a draw per slot); a model
  drawn by more requests than its capacity takes a random `capacity` of them, the others draft
  nothing that slot (Alg. 2);
- **exploitation**, 2^k slots: requests are assigned by a maximum-weight matching of requests to
  models with per-model capacities (`max_weight_assignment`, each model's capacity as that many
  columns), the weight being the request's estimated goodput on the model (Eq. 10). A request
  that arrives during the stage is matched when it first drafts, against what is left.

Fast switching (Spin §IV-C): `next_model` names the model a request will most likely move to, so
that the core can keep that model's KV of the request in step ahead of the switch. Within an
exploration stage it is the next chunk's random draw (a draw is a function of the seed, the chunk
and the request, so knowing it early changes nothing); otherwise the model with the highest
estimated goodput other than the current one.

Pruned exploration (`prune_z`, 1 by default; 0 is Spin's Alg. 2): a model whose goodput,
averaged per request over the requests that tried it, is confidently below the best model's
(upper bound under the best's lower bound, `prune_z` standard errors each side) is no longer
drawn in exploration. Where one draft is far better for nearly every request, exploring the
others costs every request's chunks on them and teaches nothing new; exploitation still matches
on each request's own estimates, so a request that does better on a pruned model keeps it.

Goodput is what the core observes after each verified step: tokens committed per ms of the step
(`DraftOutcome.goodput`), averaged per (request, model) over every step seen; a request that
never ran on a model is estimated by the model's mean over all requests. Switching costs a
prefill of the request's tokens on the new model: in the matching, a switch's weight is reduced
by the share of the stage that prefill takes, times `switch_cost` (Spin's lambda; 0 ignores it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import ChooserTraits, DraftOutcome, GoodputTable
from shared.scheduling.request import RequestState
from shared.settings import LbssSettings

SLOT_MS_DECAY = 0.9  # the running mean of a slot's duration


def max_weight_assignment(weights: np.ndarray, capacities: Sequence[int]) -> list[int | None]:
    """Model index per request maximizing the total weight, at most `capacities[j]` requests on
    model j; None for a request left without a model (the capacities run out).

    weights: [num_requests, num_models]."""
    num_requests = weights.shape[0]
    columns = [j for j, c in enumerate(capacities) for _ in range(min(c, num_requests))]
    assigned: list[int | None] = [None] * num_requests
    if not columns or not num_requests:
        return assigned
    rows, picked = linear_sum_assignment(weights[:, columns], maximize=True)
    for row, column in zip(rows, picked, strict=True):
        assigned[int(row)] = columns[int(column)]
    return assigned


class Lbss(ChooserTraits):
    name = "lbss"
    learns = True

    def __init__(
        self, preferred: Sequence[str] = (), settings: LbssSettings | None = None, seed: int = 0
    ) -> None:
        self.settings = settings or LbssSettings()
        self.table = GoodputTable()
        self.epoch = 1
        self.is_exploring = True
        self.slot = 0  # within the current stage
        self.stage = 0  # stages begun so far (ids for the assignments made in one)
        self.slot_ms: float | None = None
        self.seed = seed
        self._rng = random.Random(seed)
        self._explored: dict[str, tuple[tuple[int, int], str]] = {}  # rid -> (chunk, model)
        self._matched: dict[str, tuple[int, str]] = {}  # rid -> (stage, model)
        # the models exploration draws from, worked out once per slot and table state
        self._explorable: tuple[tuple[int, int, tuple[str, ...]], list[str]] | None = None

    @property
    def stage_slots(self) -> int:
        return self.settings.alpha if self.is_exploring else 2**self.epoch

    def capacity(self, model: str, num_requests: int) -> int:
        return self.settings.capacities.get(model, num_requests)

    # ---- the chooser interface ---------------------------------------------------------------
    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        models = sorted(live_models)
        if self.is_exploring:
            chosen = self._explore(requests, self.explorable(models))
        else:
            chosen = self._exploit(requests, models, cost)
        self._next_slot()
        return chosen

    def observe(self, outcome: DraftOutcome) -> None:
        self.table.add(outcome)
        self._explorable = None  # the table changed
        if self.slot_ms is None:
            self.slot_ms = outcome.step_ms
        else:
            self.slot_ms = SLOT_MS_DECAY * self.slot_ms + (1 - SLOT_MS_DECAY) * outcome.step_ms

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> str | None:
        models = sorted(live_models)
        held = self._explored.get(request.request_id)
        if self.is_exploring and held is not None and held[0][0] == self.stage:
            following = (self.stage, held[0][1] + 1)
            if following[1] * self.settings.beta < self.settings.alpha:  # a chunk of this stage
                drawn = self._draw(request.request_id, following, self.explorable(models))
                return drawn if drawn != request.draft_model else None
        return self.table.best_other(request, models)

    def forget(self, request_id: str) -> None:
        self.table.forget(request_id)
        self._explorable = None
        self._explored.pop(request_id, None)
        self._matched.pop(request_id, None)

    def explorable(self, models: list[str]) -> list[str]:
        """The models exploration draws from: all of them, or with `prune_z` those not
        confidently worse than the best over the requests that tried them."""
        if not self.settings.prune_z:
            return models
        key = (self.stage, self.slot, tuple(models))
        if self._explorable is None or self._explorable[0] != key:
            dominated = self.table.dominated(
                models, self.settings.prune_z, self.settings.prune_min_requests
            )
            self._explorable = (key, [m for m in models if m not in dominated])
        return self._explorable[1]

    # ---- stages ----------------------------------------------------------------------------
    def _next_slot(self) -> None:
        self.slot += 1
        if self.slot < self.stage_slots:
            return
        self.slot = 0
        self.stage += 1
        if not self.is_exploring:
            self.epoch += 1
        self.is_exploring = not self.is_exploring

    def _explore(self, requests: Sequence[RequestState], models: list[str]) -> dict[str, str]:
        chunk = (self.stage, self.slot // self.settings.beta)
        drawn: dict[str, list[str]] = {m: [] for m in models}
        for r in requests:
            held = self._explored.get(r.request_id)
            if held is None or held[0] != chunk or held[1] not in drawn:
                held = (chunk, self._draw(r.request_id, chunk, models))
                self._explored[r.request_id] = held
            drawn[held[1]].append(r.request_id)
        chosen = {}
        for model, ids in drawn.items():
            keep = self.capacity(model, len(requests))
            if len(ids) > keep:  # over capacity: a random `keep` of them draft this slot
                ids = self._rng.sample(ids, keep)
            chosen.update(dict.fromkeys(ids, model))
        return chosen

    def _draw(self, request_id: str, chunk: tuple[int, int], models: list[str]) -> str:
        """The request's random model for an exploration chunk, the same whenever it is asked."""
        return random.Random(f"{self.seed}:{chunk}:{request_id}").choice(models)

    def _exploit(
        self, requests: Sequence[RequestState], models: list[str], cost: CostModel | None
    ) -> dict[str, str]:
        chosen: dict[str, str] = {}
        todo: list[RequestState] = []
        for r in requests:
            held = self._matched.get(r.request_id)
            if held is not None and held[0] == self.stage and held[1] in models:
                chosen[r.request_id] = held[1]
            else:
                todo.append(r)
        if not todo:
            return chosen
        left = [self.capacity(m, len(requests)) - list(chosen.values()).count(m) for m in models]
        weights = np.array([[self.weight(r, m, cost) for m in models] for r in todo])
        for r, j in zip(todo, max_weight_assignment(weights, left), strict=True):
            if j is not None:
                chosen[r.request_id] = models[j]
                self._matched[r.request_id] = (self.stage, models[j])
        return chosen

    def weight(self, request: RequestState, model: str, cost: CostModel | None) -> float:
        """Estimated goodput of the request on `model` over this stage, a switch's prefill off."""
        goodput = self.table.estimate(request.request_id, model)
        if request.draft_model in (None, model) or not self.settings.switch_cost:
            return goodput
        if cost is None or not cost.has_draft(model) or not self.slot_ms:
            return goodput
        tokens = request.num_tokens
        standby = request.standby
        if standby is not None and standby.model == model:  # fast switching: mostly prefilled
            tokens -= standby.num_seen
        if tokens <= 0:
            return goodput
        prefill_ms = cost.draft_forward_ms(model, tokens, request.num_tokens)
        stage_ms = self.stage_slots * self.slot_ms
        lost = min(1.0, self.settings.switch_cost * prefill_ms / stage_ms)
        return goodput * (1 - lost)
