"""A drafter replica that loads no model: `ngram` or `suffix` (`shared/engine/model_free.py`).

It reads DraftJobs and answers CandidateTrees exactly as a model's drafter replica does (the same
stream names, replays of redelivered steps, `out_of_sync` for a job that does not follow from what
it holds); its state per request is the committed tokens, and for `suffix` an index of them and
the application caches, all in host memory. It needs no accelerator and publishes no cost
profile: the scheduler takes its drafting as free.
"""

from __future__ import annotations

from services.drafter.service import DrafterService, DrafterStats
from services.model_service import ModelService
from shared.bus import Bus
from shared.engine.model_free import MODEL_FREE_KINDS, ModelFreeDrafter
from shared.values.methods import DraftMethod
from shared.wire import DraftedTree, DraftRequest
from shared.wire.streams import DRAFTER, candidates_stream, draft_stream

# Token ids beyond this cannot come from any tokenizer the services load; a job carrying one is
# answered with `invalid_tokens`, as a model's drafter answers ids outside its vocabulary.
MAX_TOKEN_ID = 1 << 24


class ModelFreeDrafterService(DrafterService):
    def __init__(self, bus: Bus, *, kind: str, model: str | None = None, cell: str) -> None:
        if kind not in MODEL_FREE_KINDS:
            raise ValueError(f"unknown model-free draft {kind!r}; known: {list(MODEL_FREE_KINDS)}")
        name = model or kind
        self.replica = bus.consumer_name
        ModelService.__init__(
            self,
            bus,
            service=DRAFTER,
            cell=cell,
            model=name,
            job_stream=draft_stream(cell, name, bus.consumer_name),
            reply_stream=candidates_stream(cell),
        )
        self.drafter = ModelFreeDrafter(kind, name=name)  # type: ignore[assignment]
        self.stats = DrafterStats()
        self._answers: dict[str, DraftedTree] = {}

    @property
    def runner(self) -> None:  # type: ignore[override]
        return None  # no model

    def _sync(self, entry: DraftRequest) -> str | None:
        problem = self.drafter.sync_problem(entry)  # type: ignore[attr-defined]
        if problem is not None:
            return problem
        if any(not 0 <= t < MAX_TOKEN_ID for t in entry.new_tokens):
            return "invalid_tokens: a token id is out of range"
        return None

    def _fit_in_memory(
        self,
        todo: dict[int, DraftRequest],
        indices: list[int],
        method: DraftMethod,
        answers: dict[int, DraftedTree],
    ) -> list[int]:
        return indices  # host memory only: no KV to budget
