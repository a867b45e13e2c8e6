"""Is a quick cost profile, measured as a service starts, fit to keep?

A measurement taken while something else runs on the machine (another model loading or
converting, a neighbour's benchmark) comes out too slow, and a draft priced at twice its
target's cost is never used to speculate. `check_profile` names what is wrong with a
measurement:

- **spread**: the timings disagree across repeats (the median over the grid of each point's
  relative interquartile range is above `MAX_MEDIAN_SPREAD`; one wild point is left to the
  median of repeats, which already ignores it);
- **not monotone**: more tokens cost clearly less than fewer at the same context (a dip beyond
  `MONOTONE_SLACK` plus the two points' own spreads, and beyond `MONOTONE_FLOOR_MS`): a burst
  of load hit the smaller forward;
- **a draft dearer than its target**: at the grid points both measured, the draft's median cost
  ratio to its target's profile on the same kind of machine (same device, dtype and threads)
  exceeds `MAX_DRAFT_TO_TARGET`. The committed profiles have every draft at 0.02-0.35 of its
  target; a draft is small by design.

`combine` takes the element-wise minimum of several measurements of one model: interference
only ever adds time, so the fastest repeat of each point is the best estimate of the quiet cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.scheduling.cost_model import CostProfile, ForwardCurve, ModelProfile, ProfileKey

MAX_MEDIAN_SPREAD = 1.0  # the committed profiles reach 0.52 (a draft on a shared 2-core VM)
MONOTONE_SLACK = 0.5  # CPU kernels: the committed draft-m costs 3.16 ms at 1 token, 1.69 at 2
MONOTONE_FLOOR_MS = 0.5  # dips smaller than this are timer and launch jitter (tiny models)
MAX_DRAFT_TO_TARGET = 1.0


@dataclass(frozen=True)
class Verdict:
    problems: tuple[str, ...] = ()

    @property
    def trusted(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        return "; ".join(self.problems) if self.problems else "trusted"


def check_profile(measured: ModelProfile, target: ModelProfile | None = None) -> Verdict:
    """What is wrong with `measured` (nothing: trusted). `target`: the target's profile to
    compare a draft with (ignored unless measured on the same kind of machine)."""
    problems: list[str] = []
    for name, curve in (("curve", measured.curve), ("single", measured.single)):
        if curve is not None:
            problems += _spread_problems(name, curve) + _monotone_problems(name, curve)
    if target is not None and same_machine_kind(measured.key, target.key):
        problems += _dearer_than_target(measured.curve, target.curve, target.key.model)
    return Verdict(tuple(problems))


def same_machine_kind(a: ProfileKey, b: ProfileKey) -> bool:
    return (a.device, a.dtype, a.threads) == (b.device, b.dtype, b.threads)


def _spread_problems(name: str, curve: ForwardCurve) -> list[str]:
    if curve.rel_spread is None:
        return []
    spread = np.asarray(curve.rel_spread, dtype=float)
    median = float(np.median(spread))
    if median > MAX_MEDIAN_SPREAD:
        return [f"{name}: repeats disagree (median relative spread {median:.2f})"]
    return []


def _monotone_problems(name: str, curve: ForwardCurve) -> list[str]:
    ms = np.asarray(curve.ms_grid, dtype=float)
    spread = (
        np.asarray(curve.rel_spread, dtype=float)
        if curve.rel_spread is not None
        else np.zeros_like(ms)
    )
    for j, context in enumerate(curve.contexts):
        for i in range(len(curve.tokens) - 1):
            slack = MONOTONE_SLACK + spread[i, j] + spread[i + 1, j]
            if ms[i, j] - ms[i + 1, j] > max(ms[i, j] * slack, MONOTONE_FLOOR_MS):
                return [
                    f"{name}: {curve.tokens[i + 1]} tokens cost {ms[i + 1, j]:.2f} ms, less than "
                    f"{curve.tokens[i]} tokens' {ms[i, j]:.2f} ms (context {context})"
                ]
    return []


def _dearer_than_target(draft: ForwardCurve, target: ForwardCurve, target_name: str) -> list[str]:
    ratios = [
        draft.ms_grid[i][j] / target.ms_grid[ti][tj]
        for i, n in enumerate(draft.tokens)
        for j, c in enumerate(draft.contexts)
        if n in target.tokens
        and c in target.contexts
        and target.ms_grid[ti := target.tokens.index(n)][tj := target.contexts.index(c)] > 0
    ]
    if not ratios:
        return []
    ratio = float(np.median(ratios))
    if ratio > MAX_DRAFT_TO_TARGET:
        return [
            f"costs {ratio:.2f}x its target {target_name}'s forward (median over "
            f"{len(ratios)} grid points; a draft costs at most {MAX_DRAFT_TO_TARGET:g}x)"
        ]
    return []


def combine(measurements: Sequence[ModelProfile]) -> ModelProfile:
    """The element-wise fastest of several measurements of one model on one grid (the
    spreads: the smallest at each point)."""
    first = measurements[0]
    if len(measurements) == 1:
        return first

    def fastest(curves: Sequence[ForwardCurve]) -> ForwardCurve:
        ms = np.min([np.asarray(c.ms_grid) for c in curves], axis=0)
        spreads = [np.asarray(c.rel_spread) for c in curves if c.rel_spread is not None]
        spread = np.min(spreads, axis=0).tolist() if len(spreads) == len(curves) else None
        return curves[0].model_copy(
            update={
                "ms_grid": ms.tolist(),
                "rel_spread": spread,
                "repeats": sum(c.repeats for c in curves),
            }
        )

    singles = [m.single for m in measurements if m.single is not None]
    single = fastest(singles) if len(singles) == len(measurements) else first.single
    return first.model_copy(
        update={"curve": fastest([m.curve for m in measurements]), "single": single}
    )


def committed_target(
    directories: Iterable[Path], key: ProfileKey, fingerprint: str
) -> ModelProfile | None:
    """The target profile, of the target with `fingerprint`, that a profile file in
    `directories` holds for the machine kind of `key` (the newest such file)."""
    found: list[tuple[str, ModelProfile]] = []
    for directory in directories:
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
            try:
                profile = CostProfile.load(path)
            except (OSError, ValueError):
                continue
            target = profile.target
            if target.key.fingerprint == fingerprint and same_machine_kind(target.key, key):
                found.append((profile.created, target))
    return max(found, key=lambda item: item[0])[1] if found else None
