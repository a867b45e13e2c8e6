"""The counterfactual draft chooser: LBSS among the model drafts, and each model-free draft scored
on every step by what it would have achieved (the core's counterfactual trees)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import ChooserTraits, DraftOutcome, GoodputTable
from shared.scheduling.lbss import Lbss
from shared.scheduling.request import RequestState
from shared.settings import LbssSettings

RECENT_DECAY = 0.7  # the counterfactual chooser's per-request goodput: weight of older steps
# When the model-free draft misses, a request's model draft runs again if the request has run
# it fewer than MIN_MODEL_STEPS steps or not in its last RETRY_AFTER steps, and its estimate is
# at least EXPLORE_WITHIN of the model-free draft's: that estimate is not renewed while the
# model does not run, and a few unlucky steps would otherwise keep it off for good; a model far
# behind is not worth the steps a retry costs.
MIN_MODEL_STEPS = 3
RETRY_AFTER = 8
EXPLORE_WITHIN = 0.5
# A model draft's estimate for a request is its recent goodput there shrunk toward the draft's
# mean over all requests, which counts as PRIOR_STEPS of the request's own steps: one unlucky
# first step (nothing accepted) would otherwise write the model off for the request's whole
# life. Model-free drafts are scored on every step, so their own recent goodput stands alone.
PRIOR_STEPS = 2.0


class Counterfactual(ChooserTraits):
    """Model-free drafts judged on every step by what they would have achieved, model drafts by
    LBSS among themselves; per request, the model-free draft with the best recent goodput wins
    over LBSS's model when it is at least as good (decayed means per request and draft). A miss
    (a model-free step that accepted nothing) sends the request back to a model draft it has run
    fewer than `MIN_MODEL_STEPS` steps or not in its last `RETRY_AFTER`, unless that draft's
    estimate is below `EXPLORE_WITHIN` of the model-free draft's."""

    name = "counterfactual"
    learns = True
    counterfactual = True  # the core scores model-free trees beside every model draft
    parks_switched = True  # a request back from a model-free draft resumes its model's state

    def __init__(
        self,
        preferred: Sequence[str] = (),
        model_free: Sequence[str] = (),
        lbss: LbssSettings | None = None,
        seed: int = 0,
    ) -> None:
        self.model_free = tuple(model_free)
        self.lbss = Lbss([m for m in preferred if m not in self.model_free], lbss, seed)
        self.table = GoodputTable()  # every outcome: a draft's mean where a request has none
        self.recent: dict[tuple[str, str], float] = {}
        # (request, model-free draft) whose latest step accepted none of its tokens
        self.missed: set[tuple[str, str]] = set()
        self.model_steps: dict[tuple[str, str], int] = {}  # (request, model draft): steps run
        self.since_model: dict[str, int] = {}  # request: steps since it last ran a model draft

    def estimate(self, request_id: str, model: str) -> float | None:
        """The request's recent goodput on `model` (a model draft's shrunk toward its mean over
        all requests by `PRIOR_STEPS`), else that mean."""
        own = self.recent.get((request_id, model))
        population = self.table.model_mean(model)
        if own is None or population is None or model in self.model_free:
            return own if own is not None else population
        steps = self.model_steps.get((request_id, model), 0)
        return (PRIOR_STEPS * population + steps * own) / (PRIOR_STEPS + steps)

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: CostModel | None
    ) -> dict[str, str]:
        free = [m for m in self.model_free if m in live_models]
        models = sorted(m for m in live_models if m not in self.model_free)
        base = self.lbss.assign(requests, models, cost) if models else {}
        chosen = {}
        for r in requests:
            rid = r.request_id
            model = base.get(rid)
            theirs = self.estimate(rid, model) if model is not None else None
            scores = {m: e for m in free if (e := self.estimate(rid, m)) is not None}
            if model is not None and self._retries(rid, model, theirs, scores):
                scores = {m: e for m, e in scores.items() if (rid, m) not in self.missed}
            best_free = max(scores.items(), key=lambda pair: (pair[1], pair[0]), default=None)
            if best_free is None:  # not scored yet: a model draft's step scores it
                pick = model if model is not None else (free[0] if free else None)
            elif model is None or theirs is None or best_free[1] >= theirs:
                pick = best_free[0]
            else:
                pick = model
            if pick is not None:
                chosen[rid] = pick
                ran_model = pick not in self.model_free
                self.since_model[rid] = 0 if ran_model else self.since_model.get(rid, 0) + 1
        return chosen

    def _retries(
        self, request_id: str, model: str, theirs: float | None, scores: dict[str, float]
    ) -> bool:
        """Whether a miss of a model-free draft sends the request back to `model` this step."""
        due = (
            self.model_steps.get((request_id, model), 0) < MIN_MODEL_STEPS
            or self.since_model.get(request_id, 0) >= RETRY_AFTER
        )
        best = max(scores.values(), default=0.0)
        return due and (theirs is None or theirs >= EXPLORE_WITHIN * best)

    def observe(self, outcome: DraftOutcome) -> None:
        self.table.add(outcome)
        key = (outcome.request_id, outcome.draft_model)
        old = self.recent.get(key)
        new = outcome.goodput
        if outcome.draft_model in self.model_free:
            if outcome.num_accepted:
                self.missed.discard(key)
            else:
                self.missed.add(key)
        elif not outcome.counterfactual:
            self.model_steps[key] = self.model_steps.get(key, 0) + 1
        self.recent[key] = new if old is None else RECENT_DECAY * old + (1 - RECENT_DECAY) * new
        if outcome.draft_model not in self.model_free:
            self.lbss.observe(outcome)

    def next_model(self, request: RequestState, live_models: Sequence[str]) -> str | None:
        models = [m for m in live_models if m not in self.model_free]
        return self.lbss.next_model(request, models) if models else None

    def forget(self, request_id: str) -> None:
        self.lbss.forget(request_id)
        self.table.forget(request_id)
        for key in [k for k in self.recent if k[0] == request_id]:
            del self.recent[key]
            self.missed.discard(key)
            self.model_steps.pop(key, None)
        self.since_model.pop(request_id, None)
