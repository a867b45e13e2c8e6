"""The scheduler core on a virtual clock: the core's own decisions, measured costs, recorded
acceptance, and no model.

The simulator is a third executor of `SchedulerCore` (beside the in-process engine and the
scheduler service), driving it exactly as they do: `next_batch`, drafting, `select_trees`,
verification, `observe`. What it replaces is the work:

- drafting a request returns the tree a real drafter proposed at that step of a recorded session
  of the request's kind (`tools.sim.acceptance`), cut at the depth the core planned; a request
  follows one recorded prompt under every draft, so a changed draft continues the same text;
- verification accepts what the target accepted of that tree, restricted to the selected subtree;
- a request ends at its recorded length: by an end-of-sequence token where that is short of the
  `max_tokens` it carries (as the target ends an answer), else at `max_tokens`; so the scheduler
  and its length predictors see only the cap a client would send, never the answer's length;
- time comes from the cost profile: drafting a micro-batch costs `CostModel.draft_tree_ms` per
  draft model, verifying it `CostModel.verify_ms` over every prompt-chunk and tree node, plus a
  per-step overhead (scheduling, messaging, contention, which no forward measures): a fixed
  part plus a part growing with the square root of the decoding requests (`tools.sim.calibrate`
  measures both from a running scheduler).

Model-free drafts (`ngram`, `suffix`: `shared/engine/model_free.py`) are simulated where the
recording keeps each prompt's text (`python -m tools.sim.acceptance --tokens`): a request then
carries its recorded prompt and commits its recorded greedy output token by token, whatever
drafts it. A model-free draft proposes from those tokens with the engine's own drafter
(`ModelFreeDrafter`, the suffix draft's application caches included), and greedy verification
accepts the longest path of the selected tree that follows the recorded output (the target's
greedy continuation: exactly what the real verifier would accept). A model draft's recorded tree
is relabelled onto the text: its recorded accepted path carries the output's next tokens, its
other nodes tokens that no text has; where the recorded run drafted nothing (no node reached
`min_path_prob`), it drafts nothing either, so a run that follows the recorded steps replays
them exactly. A model-free draft costs `model_free_draft_ms` per request
and step on a device of its own (its CPU time; no forward). A model-free tree the core asks for
beside a model draft is merged into the model's tree (`merge_drafts`: auto merges where both
kinds are configured, as the services do) and the union verified like any tree, or, with
merging off, only scored for a chooser that reads counterfactuals. A recorded model tree
follows the text from where the request has got to, also where the copy took it past the
recorded step's start (the step recorded at or after that point).

Up to M micro-batches are in flight (the core's `micro_batches`). Devices are FIFO servers: the
verifier, and each draft model's drafter, unless `shared_device` (one host whose processes take
turns on the same cores, as on a CPU machine) makes them one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.model_free import MODEL_FREE_KINDS, ModelFreeDrafter
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.core import (
    MicroBatch,
    StepOutput,
    StepResult,
    mean_context,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.executor import (
    DraftJob,
    DraftKey,
    DraftRound,
    Resolved,
    StepDriver,
    new_request,
)
from shared.scheduling.factory import TargetInfo, make_core
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.request import RequestState
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.steps import DraftedTree, VerifiedRequest, VerifyRequest
from shared.values.tree import TokenTree, counterfactual_accepted
from tools.load.records import RequestRecord
from tools.sim.acceptance import TOKEN_BASE, AcceptanceModel, Session
from tools.sim.prefix import hashed_prompt

PROMPT_TOKEN = 1  # simulated prompts and bonus tokens; only counts matter
BONUS_TOKEN = 2
EOS_TOKEN = 3  # ends a request at its recorded length
# tokens of a relabelled model tree's nodes off the recorded path: beyond any vocabulary
OFF_TEXT_TOKEN = 1 << 24
TEXT_EOS_TOKEN = OFF_TEXT_TOKEN - 1  # EOS where requests replay recorded text (no text has it)
# a model-free draft's CPU time per request and step: a constant, assumed and not measured (no
# cost profile has a model-free entry); a proposal is a numpy window match over the request's
# ~1k tokens and a trie of at most 32 nodes
MODEL_FREE_DRAFT_MS = 0.3


def step_overhead_ms(fixed_ms: float, per_request_ms: float, num_decoding: int) -> float:
    """A micro-batch's time outside the forwards: fixed + per_request * sqrt(decoding)."""
    return fixed_ms + per_request_ms * math.sqrt(num_decoding)


@dataclass(frozen=True)
class SimConfig:
    # the scheduling, as the engine and the scheduler service are given it
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    vocab_size: int = 49152
    max_context: int = 8192
    oracle: dict[str, str] = field(default_factory=dict)  # "oracle": request id -> best draft
    drafts: tuple[str, ...] = ("draft-s",)
    method: DraftMethod | None = None  # None: the acceptance recording's method
    shared_device: bool = True
    # time of a micro-batch outside the forwards (scheduling, messages, contention on a shared
    # host): step_overhead_ms + request_overhead_ms * sqrt(decoding requests), as measured from
    # the scheduler service's DEBUG log by `tools.sim.calibrate`
    step_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0
    # prefix caching (`tools/sim/prefix.py`): the verifier's cache of `block_size`-token blocks
    # (at most `prefix_cache_blocks`, least recently used out) and the core's index of it
    prefix_caching: bool = False
    block_size: int = 16
    prefix_cache_blocks: int = 1 << 20
    model_free_draft_ms: float = MODEL_FREE_DRAFT_MS


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # the answer's length: where it ends
    kind: str | None = None
    slo_class: str | None = None
    tpot_slo_ms: float | None = None
    priority: int = 0
    # the prompt's token ids where known (a length predictor reads them); else placeholders
    prompt_tokens: tuple[int, ...] | None = None
    session_key: int | None = None  # which recorded prompt of its kind it follows; None: index
    # the cap the request carries, as a client's max_tokens (at least num_output_tokens); None:
    # num_output_tokens, which tells the scheduler the length (only where nothing predicts it)
    max_tokens: int | None = None
    # Mooncake's prefix block hashes: the prompt's tokens are drawn from them (with
    # `prompt_tokens` None), so that requests share what the trace says they share
    hash_ids: tuple[int, ...] | None = None
    app: str = ""  # `augury.app`: the suffix draft's cache of the application's recent requests

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < self.num_output_tokens:
            raise ValueError(
                f"max_tokens {self.max_tokens} is below the answer of {self.num_output_tokens}"
            )


@dataclass(order=True)
class _InFlight:
    done_at: float
    order: int
    batch: MicroBatch = field(compare=False)
    results: dict[str, StepResult] = field(compare=False)


class Simulator:
    def __init__(self, config: SimConfig, cost: CostModel, acceptance: AcceptanceModel) -> None:
        self.model_free = tuple(d for d in config.drafts if d in MODEL_FREE_KINDS)
        self.models = tuple(d for d in config.drafts if d not in MODEL_FREE_KINDS)
        missing = [d for d in self.models if d not in acceptance.drafts]
        if missing:
            raise ValueError(
                f"no recorded acceptance for draft(s) {missing} (recorded: {acceptance.drafts})"
            )
        missing = [d for d in self.models if not cost.has_draft(d)]
        if missing:
            raise ValueError(f"the cost profile has no draft(s) {missing} ({cost.draft_models})")
        scheduler = config.scheduler
        if scheduler.merge_drafts in ("standby", "at-risk"):
            raise ValueError(
                "the simulator merges a model-free draft's tree into a model draft's, never two "
                "model drafts' (their recorded trees share no tokens): merge_drafts must be "
                "auto, off or model-free"
            )
        self.config = config
        self.cost = cost
        self.acceptance = acceptance
        self._model_free_drafters = {name: ModelFreeDrafter(name) for name in self.model_free}
        # request -> its recorded prompt and output (text mode: model-free drafts need it)
        self._texts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.eos = TEXT_EOS_TOKEN if acceptance.has_text else EOS_TOKEN
        # request -> its answer's length: where the simulator ends it, and what only the
        # `oracle` length predictor is given
        self._lengths: dict[str, int] = {}
        method = config.method or acceptance.method
        self.core = make_core(
            scheduler,
            TargetInfo(
                # the recorded target's texts may use ids past the default vocabulary
                max(config.vocab_size, acceptance.max_token_id + 1),
                config.max_context,
                (self.eos,),
                model_free_drafts=self.model_free,
            ),
            config.drafts,
            cost,
            method=method if config.drafts else None,
            # the core's index as large as the cache it mirrors (it forgets no more than that)
            prefix_index=(
                PrefixIndex(config.block_size, max_blocks=config.prefix_cache_blocks)
                if config.prefix_caching
                else None
            ),
            true_lengths=self._lengths,
            best_drafts=config.oracle,
        )
        # the simulated verifier's prefix cache, and its count of prompt tokens (vLLM's queries
        # and hits; a recomputed request's tokens count again)
        self.verifier_cache = (
            PrefixIndex(config.block_size, max_blocks=config.prefix_cache_blocks)
            if config.prefix_caching
            else None
        )
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.core.set_drafters({name: ["sim"] for name in config.drafts})
        self.records: dict[str, RequestRecord] = {}
        self._kinds: dict[str, str | None] = {}
        self._session_keys: dict[str, int] = {}
        # the recorded prompt a request follows under every draft (None: none recorded by all)
        self._prompts: dict[str, tuple[str, int] | None] = {}
        self._sessions: dict[tuple[str, str], Session] = {}  # (request, draft) -> session
        self._text_at: dict[str, int] = {}  # request -> where its recorded text has got to
        self._free_at: dict[str, float] = {}  # device -> when it is next free
        self._order = itertools.count()
        # the micro-batch being dispatched: when it started, when its drafting and its
        # verification end, and the recorded step each drafted request follows
        self._now = self._draft_done = self._verify_done = 0.0
        self._drafted: dict[str, tuple[Session, int]] = {}
        self.driver = StepDriver(self.core, self)

    # ---- the run ---------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        """Serve every request; one record per request, in the order given."""
        arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        in_flight: list[_InFlight] = []
        now = 0.0
        next_arrival = 0
        while next_arrival < len(arrivals) or self.core.has_unfinished() or in_flight:
            while next_arrival < len(arrivals):
                index = arrivals[next_arrival]
                if requests[index].arrival_s > now:
                    break
                self._add(index, requests[index])
                next_arrival += 1
            while len(in_flight) < self.core.config.micro_batches:
                batch = self.core.next_batch(now)
                if batch is None:
                    break
                self._outputs(batch.failed, now)
                heapq.heappush(in_flight, self._dispatch(batch, now))
            times = [f.done_at for f in in_flight[:1]]
            if next_arrival < len(arrivals):
                times.append(requests[arrivals[next_arrival]].arrival_s)
            if not times:
                stuck = len(self.core.requests)
                raise RuntimeError(f"the core scheduled nothing with {stuck} requests waiting")
            now = max(now, min(times))
            while in_flight and in_flight[0].done_at <= now:
                done = heapq.heappop(in_flight)
                self._outputs(self.driver.finish(done.batch, done.results, now), now)
        return [self.records[f"sim-{i}"] for i in range(len(requests))]

    def _add(self, index: int, request: SimRequest) -> None:
        rid = f"sim-{index}"
        cap = request.num_output_tokens if request.max_tokens is None else request.max_tokens
        params = SamplingParams(max_tokens=cap)
        self._lengths[rid] = request.num_output_tokens
        self._kinds[rid] = request.kind
        self._session_keys[rid] = index if request.session_key is None else request.session_key
        prompt = request.prompt_tokens or (PROMPT_TOKEN,) * request.num_prompt_tokens
        if request.prompt_tokens is None and request.hash_ids is not None:
            prompt = hashed_prompt(
                request.hash_ids, request.num_prompt_tokens, self.config.vocab_size
            )
        text = self._text_of(rid)
        if text is not None:
            prompt = text[0]
            self._texts[rid] = text
        elif self.model_free:
            raise ValueError(
                f"request {rid}: model-free drafts need the recorded text of its prompt "
                "(a recording made with --tokens)"
            )
        # the trace's objective as it is: no class is resolved against a baseline here
        resolved = Resolved(seed=index, tpot_slo_ms=request.tpot_slo_ms, slo_class=None)
        state = new_request(
            rid,
            prompt,
            params,
            resolved,
            arrival_time=request.arrival_s,
            priority=request.priority,
            app=request.app,
        )
        record = RequestRecord(
            index=index,
            arrival_s=request.arrival_s,
            num_prompt_tokens=request.num_prompt_tokens,
            kind=request.kind,
            slo_class=request.slo_class,
            tpot_slo_ms=request.tpot_slo_ms,
        )
        self.records[rid] = record
        try:
            self.core.add(state)
        except ValueError as error:  # refused (too long for the context): a failed request
            record.error = str(error)
            record.finish_s = request.arrival_s

    def _prompt_of(self, rid: str) -> tuple[str, int] | None:
        """The recorded prompt the request follows under every model draft (every recorded
        draft when it drafts with none)."""
        if rid not in self._prompts:
            drafts = self.models or tuple(self.acceptance.drafts)
            self._prompts[rid] = self.acceptance.prompt_for(
                self._kinds[rid], self._session_keys[rid], drafts
            )
        return self._prompts[rid]

    def _text_of(self, rid: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The recorded prompt's and output's token ids of the request's prompt, if kept."""
        prompt = self._prompt_of(rid)
        if prompt is None:
            return None
        for draft in self.models or tuple(self.acceptance.drafts):
            session = self.acceptance.session_for(prompt[0], draft, 0, prompt)
            if session.prompt_tokens is not None and session.output_tokens is not None:
                return session.prompt_tokens, session.output_tokens
        return None

    # ---- one micro-batch: the simulator's transport (`shared.scheduling.executor`) --------------
    def _dispatch(self, batch: MicroBatch, now: float) -> _InFlight:
        self._now = self._draft_done = self._verify_done = now
        self._drafted = {}
        results = self.driver.run(batch)
        return _InFlight(self._verify_done, next(self._order), batch, results)

    def draft(self, drafts: DraftRound) -> dict[DraftKey, DraftedTree]:
        """Each draft model's trees from the recording, the model's device busy for their
        forwards; then fast switching's warm-ups."""
        answers: dict[DraftKey, DraftedTree] = {}
        by_model: dict[str, list[DraftJob]] = {}
        for job in drafts.jobs:
            if job.plan.model in self.model_free and job.role != "warm":
                by_model.setdefault(job.plan.model, []).append(job)  # a model-free partner too
            elif job.role == "draft":
                by_model.setdefault(job.plan.model, []).append(job)
        for model, jobs in sorted(by_model.items()):
            if model in self.model_free:
                answers |= self._draft_model_free(model, jobs)
                continue
            layers: dict[int, int] = {}
            for job in jobs:
                rid, plan = job.entry.request_id, job.plan
                session, step = self._drafted[rid] = self._session_step(rid, model)
                tree, sizes = self.acceptance.drafted(session, step, plan.max_depth, plan.method)
                if rid in self._texts:
                    at = len(self.core.requests[rid].output)
                    if session.drafted_nothing_at(at):  # as the recorded drafter did here
                        tree, sizes = (
                            TokenTree.root_only(self.core.requests[rid].all_tokens[-1]),
                            (),
                        )
                    else:
                        tree = self._onto_text(rid, tree, session, step)
                answers[job.key] = DraftedTree(rid, job.entry.step, tree)
                for depth, size in enumerate(sizes, start=1):
                    layers[depth] = layers.get(depth, 0) + size
            ms = self.cost.draft_tree_ms(
                model,
                sum(len(job.plan.new_tokens) for job in jobs),
                [layers[d] for d in sorted(layers)] or [0],
                mean_context([self.core.requests[job.entry.request_id] for job in jobs]),
                len(jobs),
            )
            self._draft_done = max(self._draft_done, self._occupy(f"draft:{model}", self._now, ms))
        answers |= self._warm([job for job in drafts.jobs if job.role == "warm"])
        return answers

    def _draft_model_free(
        self, model: str, jobs: Sequence[DraftJob]
    ) -> dict[DraftKey, DraftedTree]:
        """The engine's model-free drafter's trees over the requests' recorded text; its device
        busy `model_free_draft_ms` per request. A job that does not follow from what the drafter
        holds goes unanswered (the core starts that drafter over), as the service's would."""
        drafter = self._model_free_drafters[model]
        answers: dict[DraftKey, DraftedTree] = {}
        for job in jobs:
            if drafter.sync_problem(job.entry) is not None:
                continue
            tree = drafter.draft([job.entry], job.plan.method)[job.entry.request_id]
            answers[job.key] = DraftedTree(job.entry.request_id, job.entry.step, tree)
        ms = self.config.model_free_draft_ms * len(jobs)
        self._draft_done = max(self._draft_done, self._occupy(f"draft:{model}", self._now, ms))
        return answers

    def _onto_text(self, rid: str, tree: TokenTree, session: Session, step: int) -> TokenTree:
        """A recorded model tree relabelled onto the request's text: the root is its last
        token, the recorded accepted path carries the output's next tokens, every other node a
        token no text has (so the target accepts exactly the recorded path's length, as far as
        the text goes)."""
        request = self.core.requests[rid]
        output = self._texts[rid][1]
        at = len(request.output)
        path = [
            TOKEN_BASE + node for node in session.steps[step % len(session.steps)].accepted_path()
        ]
        onto = {token: output[at + d] for d, token in enumerate(path) if at + d < len(output)}
        tokens = [
            onto.get(int(token), OFF_TEXT_TOKEN + i) for i, token in enumerate(tree.tokens.tolist())
        ]
        tokens[0] = request.all_tokens[-1]
        return TokenTree.build(tokens, tree.parents.tolist(), tree.logq.tolist())

    def _warm(self, jobs: Sequence[DraftJob]) -> dict[DraftKey, DraftedTree]:
        """Fast switching's warm-ups: each standby draft appends the committed tokens it lacks,
        on its own device once that is free (after its part of this step's drafting); the step
        does not wait for them unless the device is shared. Answered with the root alone (the
        tree of a warm-up is not used)."""
        by_model: dict[str, list[DraftJob]] = {}
        for job in jobs:
            by_model.setdefault(job.plan.model, []).append(job)
        answers: dict[DraftKey, DraftedTree] = {}
        for model, group in sorted(by_model.items()):
            tokens = sum(len(job.plan.new_tokens) for job in group)
            context = mean_context([self.core.requests[job.entry.request_id] for job in group])
            ms = self.cost.draft_forward_ms(model, tokens, context)
            self._occupy(f"draft:{model}", self._now, ms)
            for job in group:
                rid = job.entry.request_id
                root = TokenTree.root_only(self.core.requests[rid].all_tokens[-1])
                answers[job.key] = DraftedTree(rid, job.entry.step, root)
        return answers

    def draft_time(self) -> float:
        return self._draft_done

    def verify(self, batch: MicroBatch, entries: Sequence[VerifyRequest]) -> list[VerifiedRequest]:
        """What the target accepted of each selected tree, as recorded; the verifier busy for
        the forward from the end of drafting."""
        verified = [self._verify_one(entry) for entry in entries]
        # what the core expected cached and the verifier did not find: computed all the same
        found = {v.request_id: v.cached_tokens for v in verified}
        missed = sum(n - found[rid] for rid, n in batch.prefill_cached.items())
        nodes = sum(e.tree.num_nodes for e in entries if e.tree is not None)
        num_tokens = batch.prefill_tokens + missed + nodes
        ms = self.cost.verify_ms(num_tokens, mean_context(batch.members), len(batch.members))
        ms += max(0.0, self.overhead_ms(len(batch.decode)))
        self._verify_done = self._occupy("verifier", self._draft_done, ms)
        return verified

    def swap_out(self, request: RequestState) -> None:
        raise AssertionError("the simulator gives the core no KV view: nothing is swapped")

    swap_in = swap_out

    def free_target(self, request_id: str) -> None:
        pass  # no memory to free on a virtual clock

    def free_draft(self, model: str, replica: str, request_id: str) -> None:
        drafter = self._model_free_drafters.get(model)
        if drafter is not None:  # the suffix draft's application cache takes the request's text
            drafter.free(request_id)

    def overhead_ms(self, num_decoding: int) -> float:
        return step_overhead_ms(
            self.config.step_overhead_ms, self.config.request_overhead_ms, num_decoding
        )

    def _occupy(self, device: str, ready: float, ms: float) -> float:
        """Run `ms` of work on `device` once it is free and the input is `ready`; when it ends."""
        if self.config.shared_device:
            device = "device"
        start = max(ready, self._free_at.get(device, 0.0))
        self._free_at[device] = start + ms / 1000
        return self._free_at[device]

    def _session_step(self, rid: str, model: str) -> tuple[Session, int]:
        """The recorded session and step a request drafts from with `model`: the session of the
        request's prompt under that draft (the same prompt under every draft), at the first step
        it recorded where the text has got to. With one draft that is the next step, wrapping
        round; a request whose draft changes continues the same text."""
        key = (rid, model)
        session = self._sessions.get(key)
        if session is None:
            session = self.acceptance.session_for(
                self._kinds[rid], model, self._session_keys[rid], self._prompt_of(rid)
            )
            self._sessions[key] = session
        if rid in self._texts:  # where the text has got to is the request's own output
            step = session.step_at(len(self.core.requests[rid].output))
            return session, step
        step = session.step_at(self._text_at.get(rid, 0))
        self._text_at[rid] = session.end_of(step)
        return session, step

    def _verify_one(self, entry: VerifyRequest) -> VerifiedRequest:
        request = self.core.requests[entry.request_id]
        text = self._texts.get(entry.request_id)
        if entry.tree is None:  # a prompt chunk
            cached = self._prefill_cached(request, entry)
            bonus = None
            if entry.chunk_is_last:
                bonus = text[1][0] if text is not None else BONUS_TOKEN
            return VerifiedRequest(entry.request_id, entry.step, bonus=bonus, cached_tokens=cached)
        accepted, path = 0, []
        if text is not None:  # greedy verification against the recorded output
            path = list(text[1][len(request.output) :])
            accepted = (
                counterfactual_accepted(entry.tree, path)[0] if entry.tree.num_nodes > 1 else 0
            )
        elif entry.tree.num_nodes > 1 and entry.request_id in self._drafted:
            session, step = self._drafted[entry.request_id]
            accepted = self.acceptance.num_accepted(session, step, entry.tree)
            path = self.acceptance.target_tokens(session, step)
        # the recorded target's tokens, so that what the core learns from the tree as drafted
        # (the level below the accepted path) is what the recording says
        tokens = self._committed(request, path[: accepted + 1], accepted + 1)
        return VerifiedRequest(entry.request_id, entry.step, tokens[:-1], tokens[-1])

    def _prefill_cached(self, request: RequestState, entry: VerifyRequest) -> int:
        """The chunk's first tokens the verifier finds cached (as `Verifier.step` looks them
        up); its blocks are cached from then on."""
        start, chunk, tokens = entry.chunk_start, len(entry.chunk), request.prefill_tokens
        self.prompt_tokens += chunk
        cache = self.verifier_cache
        if cache is None:
            return 0
        cached = cache.cached_tokens(tokens, start, start + chunk)
        cache.insert(tokens, start + chunk)
        self.cached_prompt_tokens += cached
        return cached

    def _committed(
        self, request: RequestState, known: Sequence[int], count: int
    ) -> tuple[int, ...]:
        """`count` tokens the target commits, the `known` ones first, then fillers, ending with
        EOS where they reach the recorded length before the request's cap (EOS is the target's
        token too: it takes one of them)."""
        tokens = (*known[:count], *(BONUS_TOKEN,) * (count - len(known[:count])))
        left = self._lengths[request.request_id] - len(request.output)
        if left >= count or left >= request.tokens_left:
            return tokens
        return (*tokens[: max(0, left)], self.eos)

    def _outputs(self, outputs: Sequence[StepOutput], now: float) -> None:
        for out in outputs:
            record = self.records[out.request_id]
            if out.new_tokens:
                record.chunks.append((now, len(out.new_tokens)))
                record.num_output_tokens += len(out.new_tokens)
                if record.first_token_s is None:
                    record.first_token_s = now
            if out.num_draft_tokens:
                record.drafts += 1
                record.draft_tokens += out.num_draft_tokens
                record.accepted_tokens += out.num_accepted
                if out.draft_model is not None:
                    steps = record.steps_by_draft
                    steps[out.draft_model] = steps.get(out.draft_model, 0) + 1
            if out.finish_reason is not None:
                record.finish_s = now
                if out.error is not None or out.finish_reason == "abort":
                    record.error = out.error or "aborted"
                else:
                    record.finish_reason = out.finish_reason
