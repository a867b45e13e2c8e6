"""Eq. 6 against real execution times: the in-process engine serves held-out requests one at a
time (B = 1) under LAPS-SD, with this machine's models and cost profile.

When a request becomes perceptible (its acceptance rate stable) we take LAPS-SD's Eq. 6 estimate
of its remaining time and its attained service at that moment; when it finishes, the service it
attained since is its real remaining execution time (at B = 1 a step serves one request, so its
attained service is the wall time of its own steps). The error is |estimate - real| / real, per
request, with the true output length (the oracle, which the run schedules by: the error of
Eq. 6's time model and the stabilized acceptance rate alone) and with the learned predictor's
length at the same moment (what LAPS-SD ranks by when it serves; Eq. 6 is proportional to it).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from bench.scheduling.workloads import MAX_TOKENS, Labelled, draw, pool
from shared.scheduling.laps import LAPSSD, OracleLength, remaining_tokens
from shared.scheduling.lengths import LearnedLength
from shared.scheduling.ordering import PolicyContext
from shared.settings import LapsSettings
from shared.values.sampling import SamplingParams


def serve(
    args: argparse.Namespace, heldout: Sequence[Labelled], laps: LapsSettings
) -> list[dict[str, Any]]:
    """One run with the oracle's lengths: every request's estimates at perceptibility (with the
    true remaining length, and with the learned predictor's) and its real remaining time."""
    import torch

    from shared.engine.drafting import Drafter
    from shared.engine.presets import DEFAULT_METHOD
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model
    from shared.model.cost_profiles import load_or_measure
    from shared.model.model_set import draft_dirs, target_dir
    from shared.model.runner import ModelRunner
    from shared.scheduling.config import SchedulerConfig

    torch.set_num_threads(args.threads)
    tdir = target_dir()
    items = draw(pool(heldout, args.workload), args.requests, seed=args.seed)
    target = load_model(tdir)
    verifier = Verifier(ModelRunner(target))
    drafter = Drafter(
        ModelRunner(load_model(draft_dirs()[args.draft], target_path=tdir)), name=args.draft
    )
    cost = load_or_measure(verifier.runner, {args.draft: drafter.runner}, target_name=tdir.name)
    config = SchedulerConfig(
        max_running_requests=1, policy="laps-sd", length_predictor="oracle", laps=laps
    )
    engine = SpecEngine(
        verifier, drafter, DEFAULT_METHOD, config,
        eos_token_ids=target.cfg.eos_token_ids, cost=cost,
    )  # fmt: skip
    policy = engine.core.policy
    assert isinstance(policy, LAPSSD)
    ids = {}
    for i, item in enumerate(items):
        params = SamplingParams(max_tokens=item.num_output_tokens, ignore_eos=True)
        ids[engine.add_request(list(item.prompt_ids), params, f"q{i}")] = item
    learned = LearnedLength()
    seen: dict[str, tuple[float, float, float]] = {}  # request -> estimates, attained then
    ctx = PolicyContext(0.0, cost, 1)
    while engine.has_unfinished():
        engine.step()
        for rid, request in engine.core.requests.items():
            if rid in seen:
                continue
            acceptance = policy.acceptance(request)
            if acceptance is not None:
                estimate = policy.estimated_ms(request, acceptance, ctx)
                # Eq. 6 is proportional to the remaining length: the learned one's estimate,
                # its prediction capped at the generic cap, not at this request's max_tokens
                # (its true length here)
                total = min(max(learned.predict_tokens(request.prompt), 1.0), float(MAX_TOKENS))
                scale = max(total - len(request.output), 1.0) / remaining_tokens(
                    request, OracleLength()
                )
                seen[rid] = (estimate, estimate * scale, request.attained_service_ms)
    rows = []
    for rid, item in ids.items():
        if rid not in seen:  # finished before its rate was stable: nothing was estimated
            continue
        oracle, predicted, attained = seen[rid]
        real = engine.requests[rid].attained_service_ms - attained
        if real > 0:
            rows.append(
                {"kind": item.kind, "real_ms": real,
                 "oracle_ms": oracle, "oracle_error": abs(oracle - real) / real,
                 "learned_ms": predicted, "learned_error": abs(predicted - real) / real}
            )  # fmt: skip
    return rows


def summary(rows: list[dict[str, Any]], lengths: str) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row[f"{lengths}_error"])
    errors = [row[f"{lengths}_error"] for row in rows]
    return {
        "requests": len(rows),
        "mean": statistics.fmean(errors),
        "median": statistics.median(errors),
        "by_kind": {k: statistics.fmean(v) for k, v in sorted(by_kind.items())},
    }


def estimate(
    args: argparse.Namespace, heldout: Sequence[Labelled], laps: LapsSettings
) -> dict[str, Any]:
    rows = serve(args, heldout, laps)
    if not rows:
        raise RuntimeError("no request became perceptible: nothing to compare")
    return {
        "workload": args.workload,
        "requests": args.requests,
        "draft": args.draft,
        "errors": {lengths: summary(rows, lengths) for lengths in ("oracle", "learned")},
        "rows": rows,
    }
