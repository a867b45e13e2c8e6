"""Spin's Fig. 11 on the simulator: goodput of each draft chooser at a fixed running set.

For each workload (chat, code, math) the recorded evaluation prompts of that kind are served
together (every request queued at t = 0, `--batch-size` of them running at once, every request
`--max-tokens` long) by the real scheduler core on a virtual clock: step times from a cost
profile with one device per draft model and one for the verifier, acceptance replayed from the
recording, each request following its own prompt's recorded text under whichever draft model
drafts it. Goodput is the output tokens of all requests over the time the last one took.

Choosers (`shared/scheduling/draft_choice.py`): `fixed` on each draft model alone, Spin's
`greedy-length`, `eps-greedy` (0.2), `lbss`, `lbss` with fast switching
(`scheduler.fast_switching`: the standby draft's KV kept in step on its own device), and two
static assignments of a draft to each request, run with the `oracle` chooser:

- *per-request best* (`per_request_best`): each request's draft is the one it decoded fastest
  with (tokens per second from its first token to its last) in the runs where every request
  used one draft. Not a bound: a step waits for the slowest drafter of its micro-batch, so a
  request put on its own fastest draft can slow every request it shares steps with, and this
  assignment can fall below the best fixed draft.
- *oracle (batch-aware)* (`batch_aware_oracle`): each request's draft chosen with the steps it
  shares priced in. Starting from the best of the fixed drafts and the per-request best, one
  request at a time is moved to each other draft, and the move is kept when the whole run's
  goodput rises, until a pass over every request changes nothing (or `passes` run out). It is
  at least the best fixed draft and the per-request best by construction; it is the best static
  assignment this search finds, a local optimum, not proven a bound on choosers that switch
  drafts within a request.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel
from shared.settings import LbssSettings
from tools.load.records import RequestRecord
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimConfig, SimRequest, Simulator

KINDS = ("chat", "code", "math")


FAST = "lbss + fast switching"
PER_REQUEST = "per-request best (not a bound)"
ORACLE = "oracle (batch-aware)"


@dataclass(frozen=True)
class ChooserRun:
    label: str
    chooser: str
    drafts: tuple[str, ...]
    fast_switching: bool = False


def chooser_runs(drafts: Sequence[str]) -> list[ChooserRun]:
    """Fixed on each draft, then the choosers that pick among all of them."""
    every = tuple(drafts)
    runs = [ChooserRun(f"fixed {d}", "fixed", (d,)) for d in drafts]
    runs += [ChooserRun(name, name, every) for name in ("greedy-length", "eps-greedy", "lbss")]
    runs.append(ChooserRun(FAST, "lbss", every, fast_switching=True))
    return [*runs, ChooserRun(PER_REQUEST, "oracle", every), ChooserRun(ORACLE, "oracle", every)]


@dataclass(frozen=True)
class Setup:
    cost: CostModel
    acceptance: AcceptanceModel
    batch_size: int = 8
    max_tokens: int = 128
    lbss: LbssSettings = field(default_factory=LbssSettings)
    seed: int = 0
    planner: str = "goodput"  # "fixed": every step drafts the whole tree (as the real runs do)


def workload(
    kind: str, prompt_lengths: Sequence[int], max_tokens: int, copies: int = 1
) -> list[SimRequest]:
    """Every recorded prompt of `kind` (`copies` times), queued at once, each following its own
    prompt's recording."""
    return [
        SimRequest(
            arrival_s=0.0,
            num_prompt_tokens=length,
            num_output_tokens=max_tokens,
            kind=kind,
            session_key=prompt,
        )
        for _ in range(copies)
        for prompt, length in enumerate(prompt_lengths)
    ]


def simulate(
    setup: Setup,
    requests: Sequence[SimRequest],
    run: ChooserRun,
    oracle: Mapping[str, str] | None = None,
    *,
    micro_batches: int = 1,
    auto_micro_batches: bool = False,
    micro_batch_split: str = "policy",
    switches: Counter[str] | None = None,
) -> list[RequestRecord]:
    """The run's records; `switches` (if given) gets the core's draft-switch counts."""
    scheduler = SchedulerConfig(
        max_running_requests=setup.batch_size,
        micro_batches="auto" if auto_micro_batches else micro_batches,
        max_micro_batches=micro_batches,
        micro_batch_split=micro_batch_split,
        draft_chooser=run.chooser,
        lbss=setup.lbss,
        fast_switching=run.fast_switching,
        planner=setup.planner,
    )
    config = SimConfig(scheduler, drafts=run.drafts, oracle=dict(oracle or {}), shared_device=False)
    simulator = Simulator(config, setup.cost, setup.acceptance)
    records = simulator.run(requests)
    if switches is not None:
        switches.update(simulator.core.switches)
    failed = [r for r in records if not r.is_completed]
    if failed:
        raise RuntimeError(f"{len(failed)} simulated requests failed: {failed[0].error}")
    return records


def goodput_tps(records: Sequence[RequestRecord]) -> float:
    """Output tokens per second of the whole run (all arrive at 0: over the last finish)."""
    end = max(r.finish_s or 0.0 for r in records)
    return sum(r.num_output_tokens for r in records) / end if end > 0 else 0.0


def decode_rate(record: RequestRecord) -> float:
    """A request's tokens per second while it decoded (first token to last)."""
    if record.first_token_s is None or record.finish_s is None:
        return 0.0
    span = record.finish_s - record.first_token_s
    return (record.num_output_tokens - 1) / span if span > 0 else float("inf")


def per_request_best(fixed: Mapping[str, Sequence[RequestRecord]]) -> dict[str, str]:
    """Each request's fastest draft on its own: the one it decoded fastest with, in the runs
    where every request used that one draft (`fixed`: draft -> the run's records, in request
    order). Blind to the steps it shares: not a bound."""
    drafts = sorted(fixed)
    num_requests = len(fixed[drafts[0]])
    return {
        f"sim-{i}": max(drafts, key=lambda d: (decode_rate(fixed[d][i]), d))
        for i in range(num_requests)
    }


def batch_aware_oracle(
    setup: Setup,
    requests: Sequence[SimRequest],
    drafts: Sequence[str],
    starts: Sequence[Mapping[str, str]],
    *,
    passes: int = 2,
) -> tuple[dict[str, str], float]:
    """Each request's draft chosen with the steps it shares priced in, and the run's goodput:
    from the best of `starts` (assignments request id -> draft), coordinate ascent on the whole
    run's goodput, one request's draft at a time, for at most `passes` passes over them.

    An oracle of the static family (one draft per request for its whole life, the whole batch
    simulated under the assignment), not a bound: it is a local optimum of that family, at
    least as good as every start, and a chooser that switches drafts within a request (LBSS,
    the counterfactual chooser) is outside the family and can beat it."""
    run = ChooserRun(ORACLE, "oracle", tuple(drafts))
    seen: dict[tuple[tuple[str, str], ...], float] = {}

    def goodput_of(assignment: Mapping[str, str]) -> float:
        key = tuple(sorted(assignment.items()))
        if key not in seen:
            seen[key] = goodput_tps(simulate(setup, requests, run, assignment))
        return seen[key]

    best = dict(max(starts, key=goodput_of))
    best_goodput = goodput_of(best)
    for _ in range(passes):
        moved = False
        for rid in sorted(best, key=lambda r: int(r.removeprefix("sim-"))):
            for draft in drafts:
                if draft == best[rid]:
                    continue
                trial = {**best, rid: draft}
                if goodput_of(trial) > best_goodput:
                    best, best_goodput, moved = trial, goodput_of(trial), True
        if not moved:
            break
    return best, best_goodput


@dataclass
class KindResult:
    kind: str
    goodput: dict[str, float]  # chooser label -> tokens/s
    settled: dict[str, dict[str, int]]  # lbss: draft model -> requests that drafted most on it
    oracle: dict[str, int]  # draft model -> requests the batch-aware oracle put on it
    # lbss runs: switches "warm" / "cold" and the tokens the new drafter had to append at them
    switches: dict[str, dict[str, int]] = field(default_factory=dict)
    per_request_best: dict[str, int] = field(default_factory=dict)  # draft -> requests, the same


def most_used(record: RequestRecord) -> str | None:
    steps = record.steps_by_draft
    return max(steps, key=lambda d: (steps[d], d)) if steps else None


def fig11(
    setup: Setup,
    prompt_lengths: Mapping[str, Sequence[int]],
    drafts: Sequence[str],
    *,
    copies: int = 1,
    oracle_passes: int = 2,
    say: Callable[[str], None] = print,
) -> list[KindResult]:
    results = []
    for kind in KINDS:
        if kind not in prompt_lengths:
            continue
        requests = workload(kind, prompt_lengths[kind], setup.max_tokens, copies)
        goodput: dict[str, float] = {}
        settled: dict[str, dict[str, int]] = {}
        switches: dict[str, dict[str, int]] = {}
        fixed: dict[str, list[RequestRecord]] = {}
        each: dict[str, str] = {}
        best: dict[str, str] = {}
        for run in chooser_runs(drafts):
            if run.label == ORACLE:
                everyone = [{f"sim-{i}": d for i in range(len(requests))} for d in drafts]
                best, goodput[run.label] = batch_aware_oracle(
                    setup, requests, drafts, [*everyone, each], passes=oracle_passes
                )
                say(f"{kind}: {run.label} {goodput[run.label]:.1f} tok/s")
                continue
            if run.label == PER_REQUEST:
                each = per_request_best(fixed)
            counted: Counter[str] = Counter()
            records = simulate(setup, requests, run, each, switches=counted)
            if run.chooser == "fixed":
                fixed[run.drafts[0]] = records
            goodput[run.label] = goodput_tps(records)
            if run.chooser == "lbss":
                used = [most_used(r) for r in records]
                settled[run.label] = {d: used.count(d) for d in drafts}
                switches[run.label] = dict(counted)
            say(f"{kind}: {run.label} {goodput[run.label]:.1f} tok/s")
        oracle = {d: list(best.values()).count(d) for d in drafts}
        per_request = {d: list(each.values()).count(d) for d in drafts}
        results.append(KindResult(kind, goodput, settled, oracle, switches, per_request))
    return results


def ratios(result: KindResult, drafts: Sequence[str]) -> dict[str, float]:
    """LBSS against the best fixed draft, eps-greedy and the batch-aware oracle."""
    g = result.goodput
    best_fixed = max(g[f"fixed {d}"] for d in drafts)
    return {
        "lbss / best fixed": g["lbss"] / best_fixed,
        "lbss / eps-greedy": g["lbss"] / g["eps-greedy"],
        "lbss / oracle": g["lbss"] / g[ORACLE],
        "oracle / best fixed": g[ORACLE] / best_fixed,
        "per-request best / best fixed": g[PER_REQUEST] / best_fixed,
        "fast / lbss": g[FAST] / g["lbss"],
    }


def mean_ratio(results: Sequence[KindResult], drafts: Sequence[str], key: str) -> float:
    return statistics.fmean(ratios(r, drafts)[key] for r in results)


@dataclass
class PipelineResult:
    kind: str
    goodput: dict[int, float]  # micro-batches -> tokens/s
    auto: float  # tokens/s with the heuristic choosing (`scheduler.micro_batches = auto`)

    @property
    def best(self) -> int:
        return max(self.goodput, key=lambda m: (self.goodput[m], -m))


def fig13(
    setup: Setup,
    prompt_lengths: Mapping[str, Sequence[int]],
    drafts: Sequence[str],
    *,
    chooser: str = "lbss",
    max_micro_batches: int = 6,
    copies: int = 2,
    split: str = "policy",
    say: Callable[[str], None] = print,
) -> list[PipelineResult]:
    """Spin's Fig. 13: goodput against the number of micro-batches, and the heuristic's pick;
    `split` is `scheduler.micro_batch_split` (which requests each micro-batch takes)."""
    run = ChooserRun(chooser, chooser, tuple(drafts))
    results = []
    for kind in KINDS:
        if kind not in prompt_lengths:
            continue
        requests = workload(kind, prompt_lengths[kind], setup.max_tokens, copies)
        goodput = {}
        for m in range(1, max_micro_batches + 1):
            records = simulate(setup, requests, run, micro_batches=m, micro_batch_split=split)
            goodput[m] = goodput_tps(records)
            say(f"{kind}: {m} micro-batches {goodput[m]:.1f} tok/s")
        auto = goodput_tps(
            simulate(
                setup,
                requests,
                run,
                micro_batches=max_micro_batches,
                auto_micro_batches=True,
                micro_batch_split=split,
            )
        )
        say(f"{kind}: auto {auto:.1f} tok/s")
        results.append(PipelineResult(kind, goodput, auto))
    return results
