"""The draft choosers as real replays through the services on this machine.

For each chooser the services start fresh (`python -m services all` with the drafts given, in a
cell of their own on the system Redis, as `bench.scheduling.real` starts them) with
`scheduler.draft_chooser` set, a running set of `batch_size` and the speculation planner
`planner` (`fixed` drafts every step: on a CPU the default `goodput` planner may find no draft
worth verifying, and then every chooser serves the same plain decoding). `fixed` runs once per
draft, that draft alone served; `default` is the services' default configuration over all the
drafts given (the `fixed` chooser on the first model draft, the first model-free draft's trees
merged with it); the other choosers are served every draft. Model-free drafts (`ngram`,
`suffix`) are served as `models.model_free`, and only where named.

Every run replays the same requests, sent together: held-out chat, code and math prompts (drawn
with a seed, SmolLM2's recorded answers giving each its length capped at `max_tokens`), or with
`kinds` the prompts of those kinds (copy-heavy workloads among them) taken in turn, each asking
for `max_tokens`; always with `ignore_eos`. Goodput is the output tokens of all requests over
the time the last one took; each request's most used draft (`steps_by_draft` in its final SSE
chunk) gives the histogram of where a chooser settled per request kind.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.drafters.experiments import goodput_tps, most_used
from bench.scheduling.real import replay_and_read, running
from shared.engine.model_free import MODEL_FREE_KINDS
from shared.model.model_set import REPO_ROOT, SMOLLM2, model_set_drafts
from tools.load.records import RequestRecord
from tools.load.trace import TraceRequest

LOGS = REPO_ROOT / ".cache" / "bench-drafters"


@dataclasses.dataclass(frozen=True)
class RealRun:
    label: str
    chooser: str
    drafts: tuple[str, ...]  # configured order: `fixed` takes the first
    fast_switching: bool = False
    prune_z: float = 0.0  # LBSS's pruned exploration; 0: off


FAST_SUFFIX = "+fast"  # a chooser name with it: that chooser with scheduler.fast_switching
PRUNED_SUFFIX = "+pruned"  # lbss with pruned exploration


DEFAULT_RUN = "default"  # the services' default: `fixed` on the first model draft, copies merged


def real_runs(drafts: Sequence[str], choosers: Sequence[str], prune_z: float) -> list[RealRun]:
    runs = []
    for name in choosers:
        if name == "fixed":
            runs += [RealRun(f"fixed {d}", "fixed", (d,)) for d in drafts]  # each alone
        elif name == DEFAULT_RUN:
            models = [d for d in drafts if d not in MODEL_FREE_KINDS]
            order = (*models, *(d for d in drafts if d in MODEL_FREE_KINDS))
            runs.append(RealRun(DEFAULT_RUN, "fixed", order))
        elif name.endswith(PRUNED_SUFFIX):
            chooser = name.removesuffix(PRUNED_SUFFIX)
            runs.append(RealRun(name, chooser, tuple(drafts), prune_z=prune_z))
        else:
            chooser = name.removesuffix(FAST_SUFFIX)
            runs.append(RealRun(name, chooser, tuple(drafts), name != chooser))
    return runs


def run_env(
    run: RealRun,
    batch_size: int,
    planner: str,
    alpha: int = 8,
    beta: int = 2,
    *,
    model_set: str = SMOLLM2,
    target_dtype: str | None = None,
) -> dict[str, str]:
    import json

    dirs = model_set_drafts(model_set)
    models = [d for d in run.drafts if d not in MODEL_FREE_KINDS]
    model_free = [d for d in run.drafts if d in MODEL_FREE_KINDS]
    env = {
        "AUGURY_MODELS__MODEL_SET": model_set,
        "AUGURY_MODELS__MODEL_FREE": json.dumps(model_free),
        "AUGURY_SCHEDULER__DRAFT_CHOOSER": run.chooser,
        "AUGURY_SCHEDULER__FAST_SWITCHING": str(run.fast_switching).lower(),
        "AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS": str(batch_size),
        "AUGURY_SCHEDULER__SPECULATION__PLANNER": planner,
        "AUGURY_SCHEDULER__LBSS__ALPHA": str(alpha),
        "AUGURY_SCHEDULER__LBSS__BETA": str(beta),
        "AUGURY_SCHEDULER__LBSS__PRUNE_Z": str(run.prune_z),
        "AUGURY_MODELS__DRAFTS": json.dumps([{"name": d, "dir": str(dirs[d])} for d in models]),
    }
    if target_dtype is not None:
        env["AUGURY_ENGINE__TARGET_DTYPE"] = target_dtype
    return env


def settled(records: Sequence[RequestRecord]) -> dict[str, dict[str, int]]:
    """Per request kind: how many requests drafted most with each draft model."""
    out: dict[str, Counter[str]] = {}
    for record in records:
        used = most_used(record)
        if used is not None:
            out.setdefault(record.kind or "none", Counter())[used] += 1
    return {kind: dict(counts) for kind, counts in sorted(out.items())}


def real(
    trace: list[TraceRequest],
    drafts: Sequence[str],
    choosers: Sequence[str],
    *,
    batch_size: int,
    planner: str,
    timeout_s: float,
    out_dir: Path,
    alpha: int = 8,
    beta: int = 2,
    prune_z: float,
    model_set: str = SMOLLM2,
    target_dtype: str | None = None,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    from tools.load.report import write_report

    rows: dict[str, Any] = {}
    for run in real_runs(drafts, choosers, prune_z):
        env = run_env(
            run, batch_size, planner, alpha, beta, model_set=model_set, target_dtype=target_dtype
        )
        with running(run.label, env, draft=run.drafts, timeout_s=timeout_s, logs=LOGS) as services:
            served = replay_and_read(run.label, services, trace, timeout_s, strict=False)
        records = served.records
        write_report(
            out_dir / "real" / run.label.replace(" ", "-"),
            records,
            meta={"chooser": run.chooser, "drafts": list(run.drafts)},
            plots=False,
        )
        rows[run.label] = {
            "goodput_tok_s": goodput_tps(records),
            "failed": sum(not r.is_completed for r in records),
            "settled": settled(records),
        }
        say(f"{run.label}: {rows[run.label]['goodput_tok_s']:.1f} tok/s")
    return {
        "model_set": model_set,
        "target_dtype": target_dtype,
        "requests": len(trace),
        "batch_size": batch_size,
        "planner": planner,
        "lbss": {"alpha": alpha, "beta": beta, "pruned_z": prune_z},
        "runs": rows,
    }


def heldout_trace(num_requests: int, max_tokens: int, seed: int) -> list[TraceRequest]:
    """Held-out chat, code and math prompts (drawn with `seed`), sent 50 ms apart, each asking
    for its true answer length capped at `max_tokens`."""
    from transformers import AutoTokenizer

    from bench.scheduling.workloads import burst, draw, load_heldout, pool, trace_requests
    from shared.model.model_set import target_dir

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    items = draw(pool(load_heldout(tokenizer), "mix"), num_requests, seed=seed)
    trace = trace_requests(items, burst(len(items), 0.05))
    return [
        dataclasses.replace(t, output_length=min(t.output_length or max_tokens, max_tokens))
        for t in trace
    ]


def kinds_trace(kinds: Sequence[str], per_kind: int, max_tokens: int) -> list[TraceRequest]:
    """`per_kind` prompts of each kind (copy-heavy workloads or the datasets' kinds), the kinds
    taken in turn so that every running set mixes them, sent 50 ms apart, each asking for
    `max_tokens` (there is no recorded answer length for every model set)."""
    from tools.prompts import in_turn, kind_conversations

    requests = in_turn(
        [TraceRequest(0.0, output_length=max_tokens, messages=c, kind=kind)
         for c in kind_conversations(kind, per_kind)]
        for kind in kinds
    )  # fmt: skip
    return [dataclasses.replace(t, arrival_s=i * 0.05) for i, t in enumerate(requests)]
