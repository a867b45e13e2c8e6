"""Finding the cost profile of the models this process runs: a matching one from the profile
directory (`python -m tools.profile` writes them), else (when allowed) a quick measurement,
bounded to seconds, checked (`shared.model.profile_trust`) and logged; only a measurement that
passes the checks is cached for later starts.

A profile describes what runs: on a CPU the linear layers' kernel plan (`shared.model.linear`)
travels with it. A stored profile's plan is applied to the model as it is loaded; without one,
the kernels are planned (measured) first and the profile measured with the plan in place.

A stored profile matches by the machine's name, and machines of one name differ: two 2-core
"Intel Xeon Processor" VMs here ran the same bf16 1.5B forward in 152 and 225 ms. So a stored
profile is spot-checked as it loads (`spot_ratio`: a few one-request forwards timed against it)
and, off by more than `SPOT_TOLERANCE`, scaled to this machine. The planner weighs drafting
against verification, so a target priced 1.5x too fast beside drafts measured here makes the
expensive, accurate draft look worse than it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import OutOfKVMemoryError
from shared.model.linear import LinearPlan
from shared.model.profile_files import DEFAULT_PROFILES_DIR
from shared.model.profile_trust import check_profile, combine
from shared.model.profiling import QUICK_CONTEXTS, measure_curve, measure_profile, profile_key
from shared.model.runner import ModelRunner
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)

log = logging.getLogger(__name__)
QUICK_MAX_TOKENS = 64
SPOT_TOKENS = (1, 8)  # one request's forwards timed against a stored profile
# the first forwards after a model loads run up to 3x slow (seen here): warm up first, and take
# the fastest of several
SPOT_WARMUP = 2
SPOT_REPEATS = 3
SPOT_TOLERANCE = 1.25  # a stored profile within this factor of this machine stands as stored
# Quick profiles measured at start are kept here, so that the next start loads them.
CACHE_DIR = Path.home() / ".cache" / "augury" / "profiles"


def _stored(directories: list[Path], key: ProfileKey) -> tuple[ModelProfile, Path] | None:
    """The newest stored profile whose key matches, and the directory it is in: same
    architecture (the fingerprint: costs depend on shapes, not on names or weights), device,
    dtype and threads. Any model of any profile file counts, the target's or a draft's."""
    found: list[tuple[str, ModelProfile, Path]] = []
    for directory in directories:
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                profile = CostProfile.load(path)
            except (OSError, ValueError):
                continue
            for model in (profile.target, *profile.drafts.values()):
                if model.key.mismatch(key) is None and _prices_one_draft_token(model):
                    found.append((profile.created, model, directory))
    if not found:
        return None
    _, model, directory = max(found, key=lambda item: item[0])
    return model, directory


def _prices_one_draft_token(model: ModelProfile) -> bool:
    """Whether the curve measured a 2-token forward (`token_grid` always does now; quick
    profiles cached by earlier versions went from 1 to 4, and are measured again)."""
    tokens = model.curve.tokens
    return 2 in tokens or max(tokens) < 2


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a model runs with, and where it came from."""

    profile: ModelProfile | None
    # "stored" (a profile file), "measured" (a quick one that passed the checks and was
    # cached), "suspect" (measured, failed the checks: not cached), "none"
    source: str
    detail: str = ""  # the file it came from or went to, or what was wrong with it

    @property
    def trusted(self) -> bool:
        return self.source in (STORED, MEASURED)


STORED, MEASURED, SUSPECT, NONE = "stored", "measured", "suspect", "none"
QUICK_RETRIES = 2  # more measurements after a suspect one, combined point by point
RETRY_WAIT_S = 5.0  # between them: the interference (another model loading) may pass


def measured_summary(profile: ModelProfile) -> str:
    """One line of what was measured: ms per forward by token count, at the first context."""
    curve = profile.curve
    rows = zip(curve.tokens, curve.ms_grid, strict=True)
    points = ", ".join(f"{n}: {row[0]:.2f}" for n, row in rows)
    return f"ms per forward by tokens at context {curve.contexts[0]}: {points}"


def _measure_quick(
    runner: ModelRunner, name: str, max_tokens: int, layouts: list[tuple[int, tuple[int, ...]]]
) -> tuple[ModelProfile, tuple[int, tuple[int, ...]]] | None:
    """A quick measurement in the largest layout that fits the free KV, and that layout."""
    for max_requests, ctxs in layouts:
        try:
            measured = measure_profile(
                runner,
                {},
                target_name=name,
                max_tokens=max_tokens,
                quick=True,
                contexts=ctxs,
                max_requests=max_requests,
            )
            return measured.target, (max_requests, ctxs)
        except OutOfKVMemoryError:
            continue
    return None


Measure = Callable[
    [ModelRunner, str, int, list[tuple[int, tuple[int, ...]]]],
    tuple[ModelProfile, tuple[int, tuple[int, ...]]] | None,
]


def choose_profile(
    runner: ModelRunner,
    name: str,
    *,
    directory: Path | None = None,
    measure: bool = True,
    plan_kernels: bool = True,
    max_tokens: int = QUICK_MAX_TOKENS,
    cache_dir: Path = CACHE_DIR,
    reference: ModelProfile | None = None,
    retries: int = QUICK_RETRIES,
    retry_wait_s: float = RETRY_WAIT_S,
    measure_quick: Measure = _measure_quick,
    check_stored: bool = True,
) -> ProfileChoice:
    """One model's profile on this machine: stored (its kernel plan applied), else measured
    quickly (after planning the kernels if asked) and checked (`profile_trust.check_profile`,
    against `reference`: the target's profile when `runner` runs a draft). A suspect
    measurement is measured again up to `retries` times, `retry_wait_s` apart, the
    measurements combined point by point; what passes is cached in `cache_dir`, what never
    passes is returned as "suspect" and not cached (the caller decides what to do with it).
    A profile matches by its key (architecture, device, dtype, threads), whichever model of a
    stored profile it belongs to; `check_stored`: spot-check one from `directory` (measured on
    another machine, maybe) on this machine and scale it where it is off (`spot_ratio`)."""
    directory = directory or DEFAULT_PROFILES_DIR
    key = profile_key(runner, name)
    found = _stored([directory, cache_dir], key)
    if found is not None:
        stored, where = found
        if stored.kernels is not None and not runner.model.is_int8:
            runner.model.plan_kernels(plan=LinearPlan.from_dict(stored.kernels))
        detail = stored.key.file_stem
        log.info("cost profile of %s: loaded (%s)", name, detail)
        # a quick profile in the cache was measured on this machine: nothing to check
        ratio = spot_ratio(runner, stored) if check_stored and where != cache_dir else None
        if ratio is not None and not 1 / SPOT_TOLERANCE <= ratio <= SPOT_TOLERANCE:
            log.warning(
                "cost profile of %s: this machine runs its forwards at %.2fx the stored "
                "profile's times (another machine of the same name measured it): scaled",
                name, ratio,
            )  # fmt: skip
            stored = scaled(stored, ratio)
            detail += f", scaled {ratio:.2f}x"
        return ProfileChoice(stored.model_copy(update={"key": key}), STORED, detail)
    if not measure:
        log.warning("cost profile of %s: none in %s matches %s", name, directory, key)
        return ProfileChoice(None, NONE, f"none in {directory} matches")
    started = time.perf_counter()
    if plan_kernels and runner.device.type == "cpu" and not runner.model.is_int8:
        runner.model.plan_kernels()
    max_tokens = min(max_tokens, runner.max_context // 2)
    contexts = tuple(c for c in QUICK_CONTEXTS if c + max_tokens < runner.max_context)
    # the largest layout that fits the free KV (a small cache measures fewer requests at once)
    layouts = [(8, contexts), (2, contexts), (1, contexts[:1])]
    first = measure_quick(runner, name, max_tokens, layouts)
    if first is None:
        log.warning("cost profile of %s: too little free KV to measure one", name)
        return ProfileChoice(None, NONE, "too little free KV to measure one")
    measurements, layout = [first[0]], first[1]
    combined = first[0]
    verdict = check_profile(combined, reference)
    while not verdict.trusted and len(measurements) <= retries:
        log.warning(
            "cost profile of %s: the quick measurement is suspect (%s; %s); measuring again "
            "in %.0f s (%d of %d)",
            name, verdict, measured_summary(combined), retry_wait_s, len(measurements), retries,
        )  # fmt: skip
        time.sleep(retry_wait_s)
        again = measure_quick(runner, name, max_tokens, [layout])
        if again is None:
            break
        measurements.append(again[0])
        combined = combine(measurements)
        verdict = check_profile(combined, reference)
    elapsed = time.perf_counter() - started
    if not verdict.trusted:
        log.warning(
            "cost profile of %s: measured %d times in %.1f s, still suspect (%s; %s): NOT kept "
            "(python -m tools.profile on a quiet machine measures one to commit)",
            name, len(measurements), elapsed, verdict, measured_summary(combined),
        )  # fmt: skip
        return ProfileChoice(combined, SUSPECT, str(verdict))
    saved = CostProfile(
        target=combined, method=f"quick, {len(measurements)} measurement(s) combined"
    ).save(cache_dir / f"{key.file_stem}.json")
    log.info(
        "cost profile of %s: none in %s matches; measured a quick one in %.1f s (%d "
        "measurement(s); %s), checked and kept in %s (python -m tools.profile measures the "
        "full one)",
        name, directory, elapsed, len(measurements), measured_summary(combined), saved,
    )  # fmt: skip
    return ProfileChoice(combined, MEASURED, str(saved))


def spot_ratio(runner: ModelRunner, profile: ModelProfile) -> float | None:
    """This machine's time for a few one-request forwards (`SPOT_TOKENS`, at the profile's
    first context, the fastest of `SPOT_REPEATS` after `SPOT_WARMUP`) over the profile's, their
    median ratio; None where the free KV cannot hold the request."""
    curve = profile.single or profile.curve
    context = curve.contexts[0]
    tokens = [n for n in SPOT_TOKENS if n <= curve.tokens[-1] and (profile.single or n == 1)]
    try:
        runs = [
            measure_curve(
                runner, tokens, [context], repeats=1, warmup=SPOT_WARMUP * (i == 0), max_requests=1
            )
            for i in range(SPOT_REPEATS)
        ]
    except (OutOfKVMemoryError, ValueError):
        return None
    # the fastest of the repeats: interference only ever adds time
    fastest = [min(run.ms_grid[i][0] for run in runs) for i in range(len(tokens))]
    ratios = [ms / curve.ms(n, context) for n, ms in zip(tokens, fastest, strict=True)]
    return float(np.median(ratios))


def scaled(profile: ModelProfile, factor: float) -> ModelProfile:
    """`profile` with every time multiplied by `factor`."""

    def times(curve: ForwardCurve | None) -> ForwardCurve | None:
        if curve is None:
            return None
        grid = [[ms * factor for ms in row] for row in curve.ms_grid]
        return curve.model_copy(update={"ms_grid": grid})

    curves = {"curve": times(profile.curve), "single": times(profile.single)}
    return profile.model_copy(update=curves)


def model_profile(
    runner: ModelRunner,
    name: str,
    *,
    directory: Path | None = None,
    measure: bool = True,
    plan_kernels: bool = True,
    max_tokens: int = QUICK_MAX_TOKENS,
    cache_dir: Path = CACHE_DIR,
) -> ModelProfile | None:
    """`choose_profile`'s profile, suspect or not (None: neither stored nor measured)."""
    return choose_profile(
        runner,
        name,
        directory=directory,
        measure=measure,
        plan_kernels=plan_kernels,
        max_tokens=max_tokens,
        cache_dir=cache_dir,
    ).profile


def load_or_measure(
    target: ModelRunner,
    drafts: Mapping[str, ModelRunner],
    *,
    target_name: str,
    directory: Path | None = None,
    measure: bool = True,
    plan_kernels: bool = True,
    check_stored: bool = True,
    chosen: dict[str, ProfileChoice] | None = None,
) -> CostModel | None:
    """The cost model of `target` and `drafts` on this machine, or None when the target has no
    profile and measuring is not allowed (a draft without one is dropped, with a warning).
    `check_stored` False: stored profiles as stored (a simulation of the machine they name).
    `chosen`: each model's choice so far in this process, by name, taken as it is and added
    to (engines sharing runners then price each model alike, spot-checked once)."""
    kwargs = {
        "directory": directory,
        "measure": measure,
        "plan_kernels": plan_kernels,
        "check_stored": check_stored,
    }
    chosen = {} if chosen is None else chosen

    def choice(runner: ModelRunner, name: str, **extra: Any) -> ProfileChoice:
        if name not in chosen:
            chosen[name] = choose_profile(runner, name, **kwargs, **extra)
        return chosen[name]

    target_profile = choice(target, target_name).profile
    if target_profile is None:
        return None
    draft_profiles = {}
    for name, runner in drafts.items():
        found = choice(runner, name, reference=target_profile)
        if found.trusted and found.profile is not None:  # a suspect draft: dropped, logged
            draft_profiles[name] = found.profile
    return CostModel(CostProfile(target=target_profile, drafts=draft_profiles))
