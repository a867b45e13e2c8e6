"""What this machine's forwards cost, measured, so that the scheduler speculates only when it pays.

A `CostProfile` holds, for the verifier (target) and for each draft model, a `ForwardCurve`: the
latency in ms of one packed forward of n tokens (all requests of a step together) at a
per-request context length, measured on a grid by `shared/model/profiling.py` (or
`python -m tools.profile`) and saved as JSON under `profiles/`. `CostModel` answers the
scheduler's questions from it by piecewise-linear interpolation.

A profile is valid only for the machine and the architecture it was measured on: `ProfileKey`
names the model's architecture fingerprint (shapes that decide cost, never the weights), the
device, the dtype and the CPU threads, and `CostProfile.check` refuses a profile whose key differs
(`ProfileMismatchError` names the field). Fingerprints, the processor's name and the search of a
profile directory (`load_matching`, `find_profile`) are in `shared.model.profile_files`.

A profile times bare forwards. What a step pays in a running process is more: a drafter grows
trees and samples between its forwards, the verifier builds tree masks and accepts. So a
`CostModel` may be calibrated as it runs (`calibrate`): per role (the target, each draft), the
measured time of what it did over the profile's figure for it, decayed, scales every answer.

This module is pure Python (numpy at most): the scheduler core imports it and never touches
tensors or reads the machine.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
# The per-request context at which the convenience numbers (per-token draft cost, knee) are read.
TYPICAL_CONTEXT = 256
# AdaServe's baseline latency is measured by plain decoding at batch 8, 32 + 128 tokens.
BASELINE_BATCH = 8
BASELINE_CONTEXT = 96
TARGET_ROLE = "target"  # the verifier's role in `CostModel.scales`
# calibration: weight of the scale before each measurement, and the range of one measurement's
# ratio (a step that waited on something else is not what a forward costs)
SCALE_DECAY = 0.9
SCALE_RATIO_CLIP = (0.5, 3.0)


def slug(text: str) -> str:
    """ "cpu: AMD EPYC" -> "cpu-amd-epyc" (for file names)."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


class ProfileKey(BaseModel):
    """What a measurement is valid for. `model` is a label; the fingerprint is what is checked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    fingerprint: str
    device: str  # "cpu: AMD EPYC", "cuda: NVIDIA H100 80GB HBM3"
    dtype: str  # "float32", "bfloat16", ...; "int8": int8 weights (`LlamaModel.quantize_int8`)
    threads: int = Field(ge=0)  # torch threads on CPU; 0 on CUDA
    # Ranks the model was split over (`shared/model/tensor_parallel.py`): the forward measured
    # is one rank's share plus the all-reduces; `device` names one rank's device.
    tensor_parallel: int = Field(default=1, ge=1)

    # Fields compared by `mismatch`, in the order they are reported.
    CHECKED: ClassVar[tuple[str, ...]] = (
        "fingerprint",
        "device",
        "dtype",
        "threads",
        "tensor_parallel",
    )

    def mismatch(self, asked: ProfileKey) -> str | None:
        """The first checked field whose value differs from `asked`, or None."""
        for name in ProfileKey.CHECKED:
            if getattr(self, name) != getattr(asked, name):
                return name
        return None

    @property
    def file_stem(self) -> str:
        """`<model>-<device-slug>-<dtype>-t<threads>` (then `-tp<n>` when sharded): the default
        profile file name."""
        sharded = f"-tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"{self.model}-{slug(self.device)}-{self.dtype}-t{self.threads}{sharded}"


class ProfileMismatchError(ValueError):
    """A profile measured for another architecture, device, dtype or thread count (or lacking a
    draft the caller needs). `field` names what differs ("fingerprint", "device", "dtype",
    "threads", "drafts", "schema_version")."""

    def __init__(self, message: str, *, field: str, path: str | Path | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.path = path


# ---- curves --------------------------------------------------------------------------------------
def _bracket(grid: Sequence[int], x: float) -> tuple[int, float]:
    """Index i and weight w with x ~ grid[i] * (1 - w) + grid[i + 1] * w; w is outside [0, 1]
    past the ends (linear extrapolation). Needs len(grid) >= 2."""
    i = bisect.bisect_right(grid, x) - 1
    i = min(max(i, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


class ForwardCurve(BaseModel):
    """Latency of one forward of `tokens[i]` tokens at per-request context `contexts[j]`:
    `ms_grid[i][j]` milliseconds (the median of `repeats` timings)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
    contexts: list[int]
    ms_grid: list[list[float]]
    # Relative spread of the timings of each grid point ((p75 - p25) / median); a measure of noise.
    rel_spread: list[list[float]] | None = None
    repeats: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ForwardCurve:
        if not self.tokens or not self.contexts:
            raise ValueError("a curve needs at least one token count and one context")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"tokens must increase strictly: {self.tokens}")
        if any(b <= a for a, b in zip(self.contexts, self.contexts[1:], strict=False)):
            raise ValueError(f"contexts must increase strictly: {self.contexts}")
        if self.tokens[0] < 1 or self.contexts[0] < 0:
            raise ValueError("tokens start at 1 or more, contexts at 0 or more")
        for grid, name in ((self.ms_grid, "ms_grid"), (self.rel_spread, "rel_spread")):
            if grid is None:
                continue
            if len(grid) != len(self.tokens) or any(len(r) != len(self.contexts) for r in grid):
                raise ValueError(
                    f"{name} must be [{len(self.tokens)} tokens][{len(self.contexts)} contexts]"
                )
        if any(not (0.0 < v < float("inf")) for row in self.ms_grid for v in row):
            raise ValueError("latencies must be positive and finite")
        return self

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def monotone(self) -> ForwardCurve:
        """The same curve with each context's column made non-decreasing in tokens (a running
        maximum): a forward of more tokens never costs less, whatever the timing noise said."""
        grid = [list(row) for row in self.ms_grid]
        for i in range(1, len(grid)):
            grid[i] = [max(a, b) for a, b in zip(grid[i - 1], grid[i], strict=True)]
        return self.model_copy(update={"ms_grid": grid})

    def _at_context(self, i: int, context: float) -> float:
        """Row i interpolated in context, clamped to the grid's ends."""
        row = self.ms_grid[i]
        if len(self.contexts) == 1 or context <= self.contexts[0]:
            return row[0]
        if context >= self.contexts[-1]:
            return row[-1]
        j, w = _bracket(self.contexts, context)
        return row[j] * (1.0 - w) + row[j + 1] * w

    def ms(self, num_tokens: float, context: float) -> float:
        """Latency of a forward of `num_tokens` tokens at per-request context `context`.

        Piecewise linear on the grid. In tokens: below the first grid point the first point's
        value (a forward of fewer tokens is not cheaper in practice), past the last point
        extrapolated along the last segment (its slope floored at 0); 0 tokens cost 0. In
        context: clamped to the grid's ends.
        """
        return self.along_tokens(num_tokens, self.column(context))

    def column(self, context: float) -> list[float]:
        """Every token grid point's latency at `context` (for `along_tokens`)."""
        return [self._at_context(i, context) for i in range(len(self.tokens))]

    def along_tokens_many(self, num_tokens: np.ndarray, column: Sequence[float]) -> np.ndarray:
        """`along_tokens` of every entry of `num_tokens` at once."""
        ns = np.asarray(num_tokens, dtype=np.float64)
        tokens = np.asarray(self.tokens, dtype=np.float64)
        values = np.asarray(column, dtype=np.float64)
        if len(tokens) == 1:
            out = values[0] * np.maximum(1.0, ns / tokens[0])
        else:
            out = np.interp(ns, tokens, values)  # held at the first point below the grid
            slope = max(0.0, values[-1] - values[-2]) / (tokens[-1] - tokens[-2])
            past = ns > tokens[-1]
            out[past] = values[-1] + slope * (ns[past] - tokens[-1])
        out[ns <= 0] = 0.0
        return out

    def along_tokens(self, num_tokens: float, column: Sequence[float]) -> float:
        """`ms` at the context whose `column` is given (the planner caches columns)."""
        if num_tokens <= 0:
            return 0.0
        tokens = self.tokens
        if len(tokens) == 1:
            return column[0] * max(1.0, num_tokens / tokens[0])
        if num_tokens <= tokens[0]:
            return column[0]
        i = min(bisect.bisect_right(tokens, num_tokens) - 1, len(tokens) - 2)
        lo, hi = column[i], column[i + 1]
        w = (num_tokens - tokens[i]) / (tokens[i + 1] - tokens[i])
        if w > 1.0:  # past the last point: never decreasing
            return hi + max(0.0, hi - lo) * (w - 1.0)
        return lo * (1.0 - w) + hi * w


class ModelProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: ProfileKey
    curve: ForwardCurve  # n tokens spread over min(n, max_requests) requests
    # n tokens as one request's chain: what a lone request's tree costs (attention and
    # per-request work once, not n times). None in profiles measured before it existed.
    single: ForwardCurve | None = None
    max_requests: int = 8  # the spread layout of `curve`
    # The linear-kernel plan the curve was measured with (`shared.model.linear.LinearPlan`
    # as a dict; None: plain F.linear). Whoever uses the curve must run the same plan.
    kernels: dict[str, Any] | None = None


class CostProfile(BaseModel):
    """The measured costs of one machine: the verifier's (target's) forward and each draft's.

    A draft's curve is one drafter forward over n tokens (all requests of a draft step): drafting
    a tree costs its root chain forward plus one forward per tree layer (`CostModel.draft_tree_ms`).
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    target: ModelProfile
    drafts: dict[str, ModelProfile] = Field(default_factory=dict)
    # How the forwards were laid out and timed, e.g. "n tokens as chains over min(n, 8) requests".
    method: str = ""
    notes: str = ""

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> CostProfile:
        return cls.model_validate_json(text)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        return cls.from_json(Path(path).read_text())

    # ---- checks ---------------------------------------------------------------------------------
    def check(
        self,
        key: ProfileKey,
        drafts: Mapping[str, ProfileKey] | Iterable[ProfileKey] = (),
        *,
        path: str | Path | None = None,
    ) -> None:
        """Raise `ProfileMismatchError` unless the target's key and the key of every draft asked
        for match (fingerprint, device, dtype, threads; model names are labels, not checked)."""
        where = f"profile {path}" if path else "profile"
        if (field := self.target.key.mismatch(key)) is not None:
            raise ProfileMismatchError(
                f"{where} was measured for target {field} {getattr(self.target.key, field)!r}, "
                f"not {getattr(key, field)!r}",
                field=field,
                path=path,
            )
        asked = drafts.items() if isinstance(drafts, Mapping) else ((k.model, k) for k in drafts)
        for name, draft_key in asked:
            have = self.drafts.get(name)
            if have is None:
                raise ProfileMismatchError(
                    f"{where} has no draft {name!r} (it has {sorted(self.drafts)})",
                    field="drafts",
                    path=path,
                )
            if (field := have.key.mismatch(draft_key)) is not None:
                raise ProfileMismatchError(
                    f"{where} was measured for draft {name!r} with {field} "
                    f"{getattr(have.key, field)!r}, not {getattr(draft_key, field)!r}",
                    field=field,
                    path=path,
                )


# ---- the scheduler's view ------------------------------------------------------------------------
class CostModel:
    """Forward latencies for the scheduler, from a `CostProfile`.

    Curves are made monotone in tokens (`ForwardCurve.monotone`) so that timing noise never
    makes a larger forward look cheaper. All answers are milliseconds.
    """

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self._verify = _Curves(profile.target)
        self._drafts = {name: _Curves(p) for name, p in profile.drafts.items()}
        self._budgets: dict[tuple[float, int], int] = {}  # hardware_budget's, read every step
        # measured over the profile's figure, per role (`TARGET_ROLE` or a draft's name)
        self.scales: dict[str, float] = {}

    def fresh(self) -> CostModel:
        """The same profile, uncalibrated: for a scheduler of its own (a calibration is what
        one process's forwards cost)."""
        return CostModel(self.profile)

    def calibrate(self, role: str, modeled_ms: float, measured_ms: float) -> None:
        """Fold one measurement into `role`'s scale: `measured_ms` for work whose answer here,
        as scaled now, is `modeled_ms`."""
        scale = self.scales.get(role, 1.0)
        base = modeled_ms / scale
        if base <= 0.0 or measured_ms <= 0.0:
            return
        ratio = min(max(measured_ms / base, SCALE_RATIO_CLIP[0]), SCALE_RATIO_CLIP[1])
        self.scales[role] = SCALE_DECAY * scale + (1.0 - SCALE_DECAY) * ratio

    @property
    def draft_models(self) -> list[str]:
        return list(self._drafts)

    def has_draft(self, model: str) -> bool:
        return model in self._drafts

    @property
    def max_tokens(self) -> int:
        """The largest forward the target was measured at (past it, costs are extrapolated)."""
        return self._verify.max_tokens

    def draft_max_tokens(self, model: str) -> int:
        """The largest forward draft `model` was measured at."""
        return self._drafts[model].max_tokens

    def verify_ms(self, num_tokens: int, context: int, num_requests: int | None = None) -> float:
        """One target forward of `num_tokens` tokens (all requests of a step together) at a
        typical per-request context `context`, over `num_requests` requests (None: as many as
        the profile's spread layout puts them in)."""
        return self._verify.ms(num_tokens, context, num_requests) * self.scales.get(
            TARGET_ROLE, 1.0
        )

    def verify_ms_many(
        self, num_tokens: np.ndarray, context: int, num_requests: int | None = None
    ) -> np.ndarray:
        """`verify_ms` of every entry of `num_tokens` (a planner's candidate step sizes)."""
        scale = self.scales.get(TARGET_ROLE, 1.0)
        return self._verify.ms_many(num_tokens, context, num_requests) * scale

    def draft_forward_ms(
        self, model: str, num_tokens: int, context: int, num_requests: int | None = None
    ) -> float:
        """One forward of draft `model` over `num_tokens` tokens (all requests of a draft step)."""
        try:
            curves = self._drafts[model]
        except KeyError:
            raise KeyError(
                f"no cost profile for draft {model!r} (have {self.draft_models})"
            ) from None
        return curves.ms(num_tokens, context, num_requests) * self.scales.get(model, 1.0)

    def draft_tree_ms(
        self,
        model: str,
        root_tokens: int,
        layer_tokens: Sequence[int],
        context: int,
        num_requests: int | None = None,
    ) -> float:
        """Drafting trees: the root chain forward (`root_tokens`: the committed deltas of all
        requests) plus one forward per tree layer (`layer_tokens[d]`: nodes drafted at depth d,
        all requests together); the last layer needs no forward of its own."""
        forwards = [root_tokens, *layer_tokens[:-1]]
        return sum(
            self.draft_forward_ms(model, n, context, num_requests) for n in forwards if n > 0
        )

    def draft_forward_ms_many(
        self, model: str, num_tokens: np.ndarray, context: int, num_requests: np.ndarray | int
    ) -> np.ndarray:
        """`draft_forward_ms` of every entry of `num_tokens` (with its own request count)."""
        if model not in self._drafts:
            raise KeyError(f"no cost profile for draft {model!r} (have {self.draft_models})")
        scale = self.scales.get(model, 1.0)
        return self._drafts[model].ms_many(num_tokens, context, num_requests) * scale

    def draft_cost_per_token_ms(self, model: str, context: int = TYPICAL_CONTEXT) -> float:
        """A draft forward of one token at context `context` (default 256)."""
        return self.draft_forward_ms(model, 1, context)

    def baseline_latency_ms(
        self, batch: int = BASELINE_BATCH, context: int = BASELINE_CONTEXT
    ) -> float:
        """AdaServe's baseline latency: one plain-decoding step of `batch` requests (one token
        each) at per-request context `context` (their profiling: batch 8, 32 prompt tokens, 128
        generated, so 96 on average). SLO classes are multiples of it."""
        return self.verify_ms(batch, context, batch)

    def hardware_budget(self, growth: float = 1.5, context: int = TYPICAL_CONTEXT) -> int:
        """AdaServe's budget B: tokens one verifier forward takes before it turns compute-bound.

        The largest power of two n (up to the measured maximum) such that every doubling up to
        it costs at most `growth` times the forward of half as many tokens: memory-bound, a
        doubling costs little; compute-bound, nearly twice. (A tolerance over the one-token
        forward, `knee_tokens`, finds 1 on a CPU, where every token costs something.)"""
        key = (growth, context)
        if key not in self._budgets:
            budget = 1
            while budget * 2 <= self.max_tokens:
                if self.verify_ms(budget * 2, context) > growth * self.verify_ms(budget, context):
                    break
                budget *= 2
            self._budgets[key] = budget
        return self._budgets[key]

    def knee_tokens(self, tolerance: float = 0.1, context: int = TYPICAL_CONTEXT) -> int:
        """AdaServe's hardware budget: the largest n (up to the measured maximum) where
        verify_ms(n) <= (1 + tolerance) * verify_ms(1), at per-request context `context`."""
        limit = (1.0 + tolerance) * self.verify_ms(1, context)
        knee = 1
        for n in range(1, self.max_tokens + 1):
            if self.verify_ms(n, context) <= limit:
                knee = n
            else:
                break  # the curve is monotone
        return knee


MAX_CACHED_COLUMNS = 4096
MAX_CACHED_POINTS = 1 << 16


class _Curves:
    """A model's monotone curves: spread over requests, and (when measured) one request's.

    For r requests between 1 and the spread layout's count, the cost is interpolated linearly
    between the two: per-request work (attention over each prefix, bookkeeping) grows with r.
    """

    def __init__(self, profile: ModelProfile) -> None:
        self.spread = profile.curve.monotone()
        self.single = profile.single.monotone() if profile.single is not None else None
        self.max_requests = profile.max_requests
        # the planner asks about many token counts at one context: cache the context's column
        self._columns: dict[tuple[bool, float], list[float]] = {}
        self._points: dict[tuple[float, float], tuple[float, float | None]] = {}

    @property
    def max_tokens(self) -> int:
        return self.spread.max_tokens

    def _curve_ms(self, curve: ForwardCurve, num_tokens: float, context: float) -> float:
        return curve.along_tokens(num_tokens, self._column(curve, context))

    def _column(self, curve: ForwardCurve, context: float) -> list[float]:
        key = (curve is self.single, context)
        column = self._columns.get(key)
        if column is None:
            if len(self._columns) >= MAX_CACHED_COLUMNS:
                self._columns.clear()
            column = self._columns[key] = curve.column(context)
        return column

    def ms_many(
        self,
        num_tokens: np.ndarray,
        context: float,
        num_requests: int | np.ndarray | None = None,
    ) -> np.ndarray:
        """`ms` of every entry of `num_tokens` at once (`num_requests` one for all, or each's)."""
        ns = np.asarray(num_tokens, dtype=np.float64)
        spread = self.spread.along_tokens_many(ns, self._column(self.spread, context))
        if self.single is None or num_requests is None:
            return spread
        single = self.single.along_tokens_many(ns, self._column(self.single, context))
        layout = np.clip(ns.astype(np.int64), 1, self.max_requests)
        requests = np.maximum(num_requests, 1)
        share = (np.minimum(requests, layout) - 1) / np.maximum(layout - 1, 1)
        return single + share * (spread - single)

    def ms(self, num_tokens: float, context: float, num_requests: int | None = None) -> float:
        key = (num_tokens, context)
        both = self._points.get(key)
        if both is None:  # the request count changes the mix below, not these two lookups
            if len(self._points) >= MAX_CACHED_POINTS:
                self._points.clear()
            spread = self._curve_ms(self.spread, num_tokens, context)
            single = None
            if self.single is not None:
                single = self._curve_ms(self.single, num_tokens, context)
            both = self._points[key] = (spread, single)
        spread, single = both
        if single is None or num_requests is None:
            return spread
        layout = min(max(int(num_tokens), 1), self.max_requests)  # requests in the spread layout
        if layout <= 1:
            return single
        share = (min(max(num_requests, 1), layout) - 1) / (layout - 1)
        return single + share * (spread - single)
