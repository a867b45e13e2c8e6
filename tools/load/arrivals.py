"""Synthetic arrival times: Poisson (exponential gaps) or gamma (bursty or smooth) processes.

`arrival_times` returns seconds from the start of a run; the first request arrives at 0, so a
trace never opens with an idle gap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

Process = Literal["poisson", "gamma"]
PROCESSES: tuple[Process, ...] = ("poisson", "gamma")

GapSampler = Callable[[int], np.ndarray]  # n -> n gaps (s)


def arrival_times(
    rate: float,
    *,
    duration_s: float | None = None,
    count: int | None = None,
    process: Process = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Arrival times (s, ascending, float64) of a renewal process with mean rate `rate` req/s.

    Stops after `count` arrivals, or before `duration_s` seconds (exactly one of them). Gaps are
    exponential for "poisson" and gamma-distributed for "gamma", whose coefficient of variation
    `cv` sets the burstiness: cv > 1 bursty, cv < 1 smoother than Poisson, cv = 1 Poisson.
    """
    _check(rate, duration_s, count, process, cv)
    draw = _gap_sampler(rate, process, cv, np.random.default_rng(seed))
    if count is not None:
        return _starts(draw(count))
    assert duration_s is not None
    return _within(draw, rate, duration_s)


def _check(
    rate: float, duration_s: float | None, count: int | None, process: str, cv: float
) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s and count")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {PROCESSES}, got {process!r}")
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    if process == "poisson" and cv != 1.0:
        raise ValueError(f"cv={cv} needs process='gamma' (Poisson gaps have cv 1)")


def _gap_sampler(rate: float, process: Process, cv: float, rng: np.random.Generator) -> GapSampler:
    if process == "poisson":
        return lambda n: rng.exponential(1.0 / rate, size=n)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    return lambda n: rng.gamma(shape, scale, size=n)


def _starts(gaps: np.ndarray) -> np.ndarray:
    """Arrivals from gaps: the first at 0, each next one a gap later (the last gap is unused)."""
    out = np.zeros(len(gaps), dtype=np.float64)
    np.cumsum(gaps[:-1], out=out[1:])
    return out


def _within(draw: GapSampler, rate: float, duration_s: float) -> np.ndarray:
    chunk = int(rate * duration_s * 1.1) + 16
    gaps = draw(chunk)
    while gaps.sum() < duration_s:
        gaps = np.concatenate([gaps, draw(chunk)])
    times = _starts(gaps)
    return times[times < duration_s]
