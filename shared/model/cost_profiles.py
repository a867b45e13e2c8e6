"""Finding the cost profile of the models this process runs: a matching one from the profile
directory (`python -m bench.profile` writes them), else (when allowed) a quick measurement,
bounded to seconds and logged.

A profile describes what runs: on a CPU the linear layers' kernel plan (`shared.model.linear`)
travels with it. A stored profile's plan is applied to the model as it is loaded; without one,
the kernels are planned (measured) first and the profile measured with the plan in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from shared.errors import OutOfKVMemoryError
from shared.model.linear import LinearPlan
from shared.model.profiling import QUICK_CONTEXTS, measure_profile, profile_key
from shared.model.runner import ModelRunner
from shared.scheduling.cost_model import (
    DEFAULT_PROFILES_DIR,
    CostModel,
    CostProfile,
    ModelProfile,
    ProfileKey,
)

log = logging.getLogger(__name__)
QUICK_MAX_TOKENS = 64
# Quick profiles measured at start are kept here, so that the next start loads them.
CACHE_DIR = Path.home() / ".cache" / "augury" / "profiles"


def _stored(directories: list[Path], key: ProfileKey) -> ModelProfile | None:
    """The newest stored profile whose key matches: same architecture (the fingerprint: costs
    depend on shapes, not on names or weights), device, dtype and threads. Any model of any
    profile file counts, the target's or a draft's."""
    found: list[tuple[str, ModelProfile]] = []
    for directory in directories:
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                profile = CostProfile.load(path)
            except (OSError, ValueError):
                continue
            for model in (profile.target, *profile.drafts.values()):
                if model.key.mismatch(key) is None:
                    found.append((profile.created, model))
    return max(found, key=lambda item: item[0])[1] if found else None


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
    """One model's profile on this machine: stored (its kernel plan applied), else measured
    quickly, after planning the kernels if asked, and kept in `cache_dir` (None: neither).
    A profile matches by its key (architecture, device, dtype, threads), whichever model of a
    stored profile it belongs to."""
    directory = directory or DEFAULT_PROFILES_DIR
    key = profile_key(runner, name)
    stored = _stored([directory, cache_dir], key)
    if stored is not None:
        if stored.kernels is not None and not runner.model.is_int8:
            runner.model.plan_kernels(plan=LinearPlan.from_dict(stored.kernels))
        log.info("cost profile of %s: loaded (%s)", name, stored.key.file_stem)
        return stored.model_copy(update={"key": key})
    if not measure:
        log.warning("cost profile of %s: none in %s matches %s", name, directory, key)
        return None
    started = time.perf_counter()
    if plan_kernels and runner.device.type == "cpu" and not runner.model.is_int8:
        runner.model.plan_kernels()
    max_tokens = min(max_tokens, runner.max_context // 2)
    contexts = tuple(c for c in QUICK_CONTEXTS if c + max_tokens < runner.max_context)
    measured = None
    # the largest layout that fits the free KV (a small cache measures fewer requests at once)
    for max_requests, ctxs in ((8, contexts), (2, contexts), (1, contexts[:1])):
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
            break
        except OutOfKVMemoryError:
            continue
    if measured is None:
        log.warning("cost profile of %s: too little free KV to measure one", name)
        return None
    saved = measured.save(cache_dir / f"{key.file_stem}.json")
    log.info(
        "cost profile of %s: none in %s matches; measured a quick one in %.1f s, kept in %s "
        "(python -m bench.profile measures the full one)",
        name,
        directory,
        time.perf_counter() - started,
        saved,
    )
    return measured.target


def load_or_measure(
    target: ModelRunner,
    drafts: Mapping[str, ModelRunner],
    *,
    target_name: str,
    directory: Path | None = None,
    measure: bool = True,
    plan_kernels: bool = True,
) -> CostModel | None:
    """The cost model of `target` and `drafts` on this machine, or None when the target has no
    profile and measuring is not allowed (a draft without one is dropped, with a warning)."""
    kwargs = {"directory": directory, "measure": measure, "plan_kernels": plan_kernels}
    target_profile = model_profile(target, target_name, **kwargs)
    if target_profile is None:
        return None
    draft_profiles = {}
    for name, runner in drafts.items():
        found = model_profile(runner, name, **kwargs)
        if found is not None:
            draft_profiles[name] = found
    return CostModel(CostProfile(target=target_profile, drafts=draft_profiles))
