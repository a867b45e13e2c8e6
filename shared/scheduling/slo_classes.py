"""A request's TPOT objective from its SLO class (`settings.scheduler.slo`).

A class is a multiple of the machine's baseline latency: `slo.baseline_latency_ms` where set,
else one plain-decoding step at batch 8 from the target's cost profile
(`CostModel.baseline_latency_ms`). An explicit `tpot_slo_ms` wins over the class; a request that
names neither takes `slo.default_class` (none: best effort).
"""

from __future__ import annotations

from shared.errors import InvalidRequestError
from shared.scheduling.cost_model import CostModel
from shared.settings import SloSettings

CUSTOM_CLASS = "custom"  # how metrics name the class of an objective given in ms only
SLO_CLASS_PARAM = "augury.slo_class"


def baseline_latency_ms(slo: SloSettings, cost: CostModel | None) -> float | None:
    """The latency classes are multiples of; None without a setting or a cost model."""
    if slo.baseline_latency_ms is not None:
        return slo.baseline_latency_ms
    return None if cost is None else cost.baseline_latency_ms()


def effective_class(
    slo_class: str | None, tpot_slo_ms: float | None, slo: SloSettings
) -> str | None:
    """The class a request belongs to: the one it names, else the default when it gives no
    objective at all."""
    if slo_class is not None or tpot_slo_ms is not None:
        return slo_class
    return slo.default_class


def resolve_tpot_slo(
    slo_class: str | None,
    tpot_slo_ms: float | None,
    slo: SloSettings,
    cost: CostModel | None,
) -> float | None:
    """The request's TPOT objective in ms (None: best effort).

    Raises InvalidRequestError for a class `slo.classes` does not know (even beside an explicit
    `tpot_slo_ms`), and for a class objective with no baseline to multiply (no cost profile yet
    and no `slo.baseline_latency_ms`).
    """
    name = effective_class(slo_class, tpot_slo_ms, slo)
    if name is not None and name not in slo.classes:
        raise InvalidRequestError(
            f"unknown SLO class {name!r}; known: {sorted(slo.classes)}", param=SLO_CLASS_PARAM
        )
    if tpot_slo_ms is not None:
        return tpot_slo_ms
    if name is None:
        return None
    baseline = baseline_latency_ms(slo, cost)
    if baseline is None:
        raise InvalidRequestError(
            f"SLO class {name!r} is a multiple of the baseline latency, which is not known yet "
            "(no cost profile of the target, and scheduler.slo.baseline_latency_ms is not set); "
            "give augury.tpot_slo_ms instead",
            param=SLO_CLASS_PARAM,
        )
    return slo.classes[name] * baseline
