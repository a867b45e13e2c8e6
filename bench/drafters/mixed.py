"""Issue 38's mixed trace in the simulator: copy-heavy requests (code editing, revision, passage
questions, agent loops) and open chat served together: each draft alone, each model draft with a
model-free draft's tree merged into its own (the first such pair is Augury's default
configuration), every draft chooser, and an oracle.

The requests are the recording's prompts that kept their text (`python -m tools.sim.acceptance
--tokens`), interleaved by kind, all queued at t = 0, `batch_size` running at once, each
replaying its recorded greedy output (so model-free drafts propose from the real tokens) and
naming its kind as its application (`augury.app`: the suffix draft's shared cache). Goodput is
the output tokens of all requests over the time the last one took. The choosers and the oracle
see every draft and, as the default configuration does, merge the first model-free draft's
tree beside whichever model draft a request drafts with.

The oracle (`best_static_assignment`) is an oracle of one family, not a bound: each request gets
one draft for its whole life, and the whole batch is simulated under that assignment, so the
steps a request shares with others are priced in (a step waits for its slowest drafter; issue
38: picking each request's best fixed-draft run is not a bound). Starting from the best of every
fixed draft, each request's fastest draft on its own and the draft the counterfactual chooser
used most for it, coordinate ascent moves one request at a time to each other draft and keeps
a move that raises the run's goodput, until a pass changes nothing. It is the best static
assignment that search finds: a local optimum of the static family. It bounds neither choosers
that switch a request's draft mid-request (the counterfactual chooser leaves a copy when it
runs out) nor the static family's true optimum (3^n assignments, not searched exhaustively);
a chooser can beat it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.drafters.experiments import (
    ChooserRun,
    Setup,
    batch_aware_oracle,
    goodput_tps,
    most_used,
    per_request_best,
    simulate,
)
from shared.engine.model_free import MODEL_FREE_KINDS
from tools.load.records import RequestRecord
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimRequest
from tools.workloads import COPY_KINDS

MIXED_KINDS = ("chat", *COPY_KINDS)
COUNTERFACTUAL = "counterfactual"
PLAIN = "plain decoding"
ORACLE = "oracle (best static assignment found)"


def mixed_requests(
    acceptance: AcceptanceModel, max_tokens: int, per_kind: int | None = None, copies: int = 1
) -> list[SimRequest]:
    """The recording's prompts with text, `per_kind` of each kind (None: all), interleaved by
    kind, `copies` rounds of them, each request as long as its recorded output (at most
    `max_tokens`) and carrying `max_tokens` as its cap. A round's requests of one kind share an
    application key; rounds do not (the suffix draft's cache never holds a request's own
    answer from an earlier copy)."""
    by_kind: dict[str, list[int]] = {}
    for session in acceptance.sessions:
        if session.kind in MIXED_KINDS and session.output_tokens is not None:
            prompts = by_kind.setdefault(session.kind, [])
            if session.prompt not in prompts:
                prompts.append(session.prompt)
    requests = []
    rounds = max((len(p) for p in by_kind.values()), default=0)
    pairs = [
        (copy, i)
        for copy in range(copies)
        for i in range(rounds if per_kind is None else min(rounds, per_kind))
    ]
    for copy, i in pairs:
        for kind in MIXED_KINDS:
            prompts = sorted(by_kind.get(kind, []))
            if i >= len(prompts):
                continue
            # the key that makes the simulator follow prompt `prompts[i]` of this kind
            key = next(
                k
                for k in range(1000)
                if acceptance.prompt_for(kind, k, acceptance.drafts) == (kind, prompts[i])
            )
            session = acceptance.session_for(kind, acceptance.drafts[0], key, (kind, prompts[i]))
            assert session.prompt_tokens is not None and session.output_tokens is not None
            requests.append(
                SimRequest(
                    arrival_s=0.0,
                    num_prompt_tokens=len(session.prompt_tokens),
                    num_output_tokens=min(len(session.output_tokens), max_tokens),
                    kind=kind,
                    prompt_tokens=session.prompt_tokens,
                    session_key=key,
                    max_tokens=max_tokens,
                    app=f"{kind}/{copy}",
                )
            )
    return requests


def merged_label(model: str, model_free: str) -> str:
    return f"{model} + {model_free} merged"


def split_drafts(drafts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(model drafts, model-free drafts), each in the order given."""
    return [d for d in drafts if d not in MODEL_FREE_KINDS], [
        d for d in drafts if d in MODEL_FREE_KINDS
    ]


def default_label(drafts: Sequence[str]) -> str | None:
    """The run of Augury's default configuration: the first model draft, fixed, with the first
    model-free draft's tree merged into its own every step (`merge_drafts` auto)."""
    models, free = split_drafts(drafts)
    return merged_label(models[0], free[0]) if models and free else None


def runs(drafts: Sequence[str]) -> list[ChooserRun]:
    """Plain decoding; each draft alone; each model draft merged with each model-free one (the
    chooser `fixed` drafts with the model; the first merged run is the default configuration);
    the choosers over every draft, which merge the first model-free draft beside a model draft
    as the default does."""
    every = tuple(drafts)
    fixed = [ChooserRun(f"fixed {d}", "fixed", (d,)) for d in drafts]
    models, free = split_drafts(drafts)
    merged = [ChooserRun(merged_label(m, f), "fixed", (m, f)) for m in models for f in free]
    choosers = [ChooserRun(name, name, every) for name in ("eps-greedy", "lbss", COUNTERFACTUAL)]
    return [ChooserRun(PLAIN, "fixed", ()), *fixed, *merged, *choosers]


@dataclass
class MixedResult:
    goodput: dict[str, float]  # run label -> tokens/s
    # run label -> workload -> draft -> requests that drafted most with it
    histogram: dict[str, dict[str, dict[str, int]]]
    # workload -> draft -> steps drafted with it under the counterfactual chooser
    counterfactual_steps: dict[str, dict[str, int]]
    # fixed and merged runs: label -> workload -> output tokens per decode step (per forward)
    per_forward: dict[str, dict[str, float]]
    default: str | None = None  # the default configuration's run label

    @property
    def best_fixed(self) -> str:
        """The fastest run of one draft alone."""
        fixed = {k: v for k, v in self.goodput.items() if k.startswith("fixed ")}
        return max(fixed, key=lambda k: fixed[k])

    def ratios(self) -> dict[str, float]:
        g = self.goodput
        compared = [k for k in (self.default, COUNTERFACTUAL) if k is not None]
        out = {f"{k} / best fixed": g[k] / g[self.best_fixed] for k in compared}
        out |= {f"{k} / oracle": g[k] / g[ORACLE] for k in compared}
        out["oracle / best fixed"] = g[ORACLE] / g[self.best_fixed]
        return out | {f"{k} / plain": g[k] / g[PLAIN] for k in (self.best_fixed, *compared)}


def by_workload(
    requests: Sequence[SimRequest], records: Sequence[RequestRecord]
) -> dict[str, dict[str, int]]:
    """Per workload: requests by the draft they drafted most steps with ("none": no step)."""
    counts: dict[str, Counter[str]] = {}
    for request, record in zip(requests, records, strict=True):
        counts.setdefault(request.kind or "", Counter())[most_used(record) or "none"] += 1
    return {kind: dict(sorted(c.items())) for kind, c in counts.items()}


def tokens_per_forward(
    requests: Sequence[SimRequest], records: Sequence[RequestRecord]
) -> dict[str, float]:
    """Per workload: output tokens after the first over the decode steps that made them."""
    tokens: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    for request, record in zip(requests, records, strict=True):
        tokens[request.kind or ""] += record.num_output_tokens - 1
        steps[request.kind or ""] += len(record.chunks) - 1
    return {kind: tokens[kind] / steps[kind] for kind in sorted(steps) if steps[kind]}


def mixed(
    setup: Setup,
    requests: Sequence[SimRequest],
    drafts: Sequence[str],
    *,
    oracle_passes: int = 2,
    say: Callable[[str], None] = print,
) -> MixedResult:
    goodput: dict[str, float] = {}
    histogram: dict[str, dict[str, dict[str, int]]] = {}
    fixed: dict[str, list[RequestRecord]] = {}
    steps: dict[str, Counter[str]] = {}
    starts: list[dict[str, str]] = []
    per_forward: dict[str, dict[str, float]] = {}
    for run in runs(drafts):
        records = simulate(setup, requests, run)
        goodput[run.label] = goodput_tps(records)
        histogram[run.label] = by_workload(requests, records)
        if run.chooser == "fixed" and run.drafts:
            per_forward[run.label] = tokens_per_forward(requests, records)
        if run.chooser == "fixed" and len(run.drafts) == 1:
            fixed[run.drafts[0]] = records
            starts.append({f"sim-{i}": run.drafts[0] for i in range(len(requests))})
        if run.label == COUNTERFACTUAL:
            starts.append({f"sim-{i}": most_used(r) or drafts[0] for i, r in enumerate(records)})
            for request, record in zip(requests, records, strict=True):
                steps.setdefault(request.kind or "", Counter()).update(record.steps_by_draft)
        say(f"{run.label}: {goodput[run.label]:.1f} tok/s")
    starts.append(per_request_best(fixed))
    best, goodput[ORACLE] = batch_aware_oracle(
        setup, requests, drafts, starts, passes=oracle_passes
    )
    histogram[ORACLE] = {}
    for request, (_, draft) in zip(
        requests, sorted(best.items(), key=lambda kv: int(kv[0].removeprefix("sim-"))), strict=True
    ):
        kind = histogram[ORACLE].setdefault(request.kind or "", {})
        kind[draft] = kind.get(draft, 0) + 1
    say(f"{ORACLE}: {goodput[ORACLE]:.1f} tok/s")
    counterfactual_steps = {kind: dict(sorted(c.items())) for kind, c in steps.items()}
    return MixedResult(goodput, histogram, counterfactual_steps, per_forward, default_label(drafts))


def _header(title: str, first: str, kinds: Sequence[str], align: str) -> list[str]:
    """A titled table's first lines: one column `first`, then one per workload kind."""
    return ["", title, "", f"| {first} | " + " | ".join(kinds) + " |", "|---|" + align * len(kinds)]


def mixed_table(result: MixedResult, drafts: Sequence[str]) -> str:
    labels = [run.label for run in runs(drafts)] + [ORACLE]
    lines = ["| run | goodput (tok/s) |", "|---|---:|"]
    lines += [f"| {label} | {result.goodput[label]:.1f} |" for label in labels]
    lines += ["", "| ratio | |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in result.ratios().items()]
    kinds = sorted({k for h in result.histogram.values() for k in h})
    lines += _header("Requests by the draft they drafted most steps with, per workload:",
                     "run", kinds, "---|")  # fmt: skip
    for label in (COUNTERFACTUAL, "lbss", "eps-greedy", ORACLE):
        cells = [
            ", ".join(f"{d} {n}" for d, n in result.histogram[label].get(k, {}).items())
            for k in kinds
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    steps = result.counterfactual_steps
    cells = [", ".join(f"{d} {n}" for d, n in steps.get(k, {}).items()) for k in kinds]
    lines.append(f"| {COUNTERFACTUAL}: steps per draft | " + " | ".join(cells) + " |")
    lines += _header("Output tokens per target forward (decode steps) of each fixed draft and "
                     "merged pair, per workload:", "draft", kinds, "---:|")  # fmt: skip
    for draft, row in result.per_forward.items():
        cells = [f"{row[k]:.2f}" if k in row else "-" for k in kinds]
        lines.append(f"| {draft} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
