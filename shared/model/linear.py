"""Per-shape choice of the kernel behind each linear layer, made once by measuring.

The same product `x @ W.T` costs up to several times more or less depending on the operand
layout and the number of tokens n, because BLAS (MKL, oneDNN) picks a different kernel per shape:
on one CPU `F.linear` of a 576 -> 49152 head is twice as slow at n = 1 as the same product
against a transposed copy of the weight, and four times as slow at n = 5 as oneDNN with a
pre-packed weight. Which layout wins depends on the CPU, so nothing is hard-coded: `measure`
times every candidate kernel on the model's own weights (all layers of a role in turn, so the
weights stream from memory as in a real forward) for each token-count bucket, `choose` picks per
role and bucket, deterministically from those timings, and `PlannedLinear` applies the choice.

A token count n uses the kernel of the smallest bucket >= n; past the largest bucket (prompt
chunks, large trees) it uses plain `F.linear`, the unplanned behaviour, unless one
batch-invariant kernel serves every bucket: then that one, so that a token's output rounds the
same whether its forward holds one token or many (speculative greedy output then equals plain
decoding's bit for bit, in bf16 too). A plan is plain data (`to_dict` / `from_dict`), so
processes that must agree bit for bit can share one measured plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_TOKEN_COUNTS = (1, 2, 3, 5, 9, 17)
BASELINE = "linear"

Prepared = dict[str, torch.Tensor]
ApplyFn = Callable[[torch.Tensor, Prepared, torch.Tensor | None], torch.Tensor]


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _linear(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, p["w"], bias)


def padded_rows(fn: ApplyFn, rows: int) -> ApplyFn:
    """`fn` with fewer than `rows` rows padded to `rows` (with copies of the first row; only the
    real rows are returned). BLAS may multiply one row by a matrix-vector kernel that rounds
    differently from its n-row product (oneDNN's bf16 on an AVX-512 CPU does, for wide weights):
    padded to two, a token's output does not depend on how many tokens share its forward, and
    plain decoding rounds as verification does. And it may block two or three rows worse than
    four: oneDNN's packed bf16 on an AMD EPYC with AVX-512 BF16 took a third longer for one row
    padded to two than for four rows; padded to four, one token costs what four do there."""

    def apply(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[0]
        if n >= rows:
            return fn(x, p, bias)
        return fn(torch.cat([x, x[:1].expand(rows - n, -1)]), p, bias)[:n]

    return apply


def two_rows(fn: ApplyFn) -> ApplyFn:
    return padded_rows(fn, 2)


def four_rows(fn: ApplyFn) -> ApplyFn:
    return padded_rows(fn, 4)


def _x_wt(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    # x [n, K] @ W^T stored contiguous [K, N]: BLAS sees no transposed operand.
    if bias is None:
        return torch.mm(x, p["wt"])
    return torch.addmm(bias, x, p["wt"])


def _w_xt(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    # (W [N, K] @ x^T) computes the transposed result [N, n]: the weight is the left operand.
    return _add_bias(torch.mm(p["w"], x.t()).t().contiguous(), bias)


def _onednn(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p["w"], bias, "none", [], "")


def _onednn_packed(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p["packed"], bias, "none", [], "")


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class Kernel:
    name: str
    apply: ApplyFn
    # The extra copy of the weight this kernel needs ("" = none: it reads the weight in place).
    layout: str = ""

    def prepare(self, w: torch.Tensor, prepared: Prepared) -> None:
        """Add this kernel's copy of `w` to `prepared` (shared by kernels of the same layout)."""
        prepared.setdefault("w", w)
        if self.layout == "wt" and "wt" not in prepared:
            prepared["wt"] = w.t().contiguous()
        elif self.layout == "packed" and "packed" not in prepared:
            # oneDNN's own blocked layout for this CPU; the batch size is only a hint.
            prepared["packed"] = torch.ops.mkldnn._reorder_linear_weight(w, 8)


def available_kernels(device: torch.device) -> dict[str, Kernel]:
    """Candidate kernels for weights on `device`; F.linear only off the CPU."""
    kernels = {BASELINE: Kernel(BASELINE, _linear)}
    if device.type != "cpu":
        return kernels
    kernels["linear_two_rows"] = Kernel("linear_two_rows", two_rows(_linear))
    kernels["x_wt"] = Kernel("x_wt", _x_wt, layout="wt")
    kernels["w_xt"] = Kernel("w_xt", _w_xt)
    if _onednn_available():
        kernels["onednn"] = Kernel("onednn", _onednn)
        kernels["onednn_packed"] = Kernel("onednn_packed", _onednn_packed, layout="packed")
        kernels["onednn_packed_two_rows"] = Kernel(
            "onednn_packed_two_rows", two_rows(_onednn_packed), layout="packed"
        )
        kernels["onednn_packed_four_rows"] = Kernel(
            "onednn_packed_four_rows", four_rows(_onednn_packed), layout="packed"
        )
    return kernels


def bucket_index(buckets: Sequence[int], n: int) -> int | None:
    """Index of the smallest bucket >= n, or None past the largest."""
    for i, b in enumerate(buckets):
        if n <= b:
            return i
    return None


# timings[role][kernel][i] = seconds per call of `kernel` over all of the role's weights at
# token count buckets[i]
Timings = Mapping[str, Mapping[str, Sequence[float]]]


@dataclass(frozen=True)
class LinearPlan:
    """Per role (qkv, o, gate_up, down, lm_head) the kernel name for each token-count bucket."""

    buckets: tuple[int, ...]
    choices: dict[str, tuple[str, ...]]
    timings: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    # Per role, the kernels measured batch-invariant (see `batch_invariant_kernels`).
    invariant: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def kernel_for(self, role: str, n: int) -> str:
        if role not in self.choices:
            return BASELINE
        i = bucket_index(self.buckets, n)
        return self.past_buckets(role) if i is None else self.choices[role][i]

    def past_buckets(self, role: str) -> str:
        """The kernel past the largest bucket (prompt chunks, large trees): F.linear, unless
        every bucket of the role uses one batch-invariant kernel; then that kernel, so a token
        rounds alike in a forward of any size."""
        used = set(self.choices.get(role, ()))
        if len(used) == 1 and (only := used.pop()) in self.invariant.get(role, ()):
            return only
        return BASELINE

    def layouts(self, role: str, kernels: Mapping[str, Kernel]) -> set[str]:
        return {kernels[k].layout for k in self.choices.get(role, ()) if kernels[k].layout}

    def to_dict(self) -> dict[str, Any]:
        return {
            "buckets": list(self.buckets),
            "choices": {r: list(c) for r, c in self.choices.items()},
            "timings": {r: {k: list(t) for k, t in ts.items()} for r, ts in self.timings.items()},
            "invariant": {r: list(ks) for r, ks in self.invariant.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinearPlan:
        return cls(
            buckets=tuple(d["buckets"]),
            choices={r: tuple(c) for r, c in d["choices"].items()},
            timings={
                r: {k: tuple(t) for k, t in ts.items()} for r, ts in d.get("timings", {}).items()
            },
            invariant={r: tuple(ks) for r, ks in d.get("invariant", {}).items()},
        )

    @classmethod
    def baseline(cls, roles: Sequence[str], buckets: Sequence[int]) -> LinearPlan:
        return cls(tuple(buckets), {r: (BASELINE,) * len(buckets) for r in roles})

    def describe(self) -> str:
        lines = [f"buckets {list(self.buckets)}"]
        for role, kinds in self.choices.items():
            lines.append(f"  {role:8s} " + " ".join(f"{k:>13s}" for k in kinds))
        if self.timings:
            lines.append("median ms per call over all of a role's weights, per bucket:")
            for role, per_kernel in self.timings.items():
                stable = self.invariant.get(role, ())
                for k, t in per_kernel.items():
                    mark = " (batch-invariant)" if k in stable else ""
                    cells = " ".join(f"{x * 1e3:7.2f}" for x in t)
                    lines.append(f"  {role:8s} {k:13s} {cells}{mark}")
        return "\n".join(lines)


def _fastest(
    cost: Mapping[str, Sequence[float]], allowed: Sequence[str], order: list[str], n: int
) -> list[str]:
    return [min(allowed, key=lambda k: (cost[k][i], order.index(k))) for i in range(n)]


def choose(
    timings: Timings,
    buckets: Sequence[int],
    kernels: Mapping[str, Kernel],
    *,
    copy_gain: float = 0.10,
    invariant: Mapping[str, Iterable[str]] | None = None,
    uniform_tolerance: float = 0.10,
) -> LinearPlan:
    """The plan these timings call for; a pure function of its arguments.

    Per role and bucket: the fastest kernel that reads the weight in place, unless a kernel that
    needs a copy of the weight (one extra layout per role at most) is faster by more than
    `copy_gain` of that time in at least one bucket (`copy_gain=inf`: never copy). The extra
    layout kept is the one saving the most time summed over buckets. Then, if a kernel listed in
    `invariant[role]` (its rows do not depend on n, measured by `batch_invariant_kernels`) is
    within `uniform_tolerance` of that choice summed over the buckets, it serves all buckets
    (and past them): one token and n tokens then round the same way, so verification agrees
    with one-token decoding.
    Ties go to the earlier kernel in `kernels` (F.linear first).
    """
    buckets = tuple(buckets)
    order = list(kernels)
    choices: dict[str, tuple[str, ...]] = {}
    for role, per_kernel in timings.items():
        names = [k for k in order if k in per_kernel]
        cost = {k: per_kernel[k] for k in names}
        in_place = [k for k in names if not kernels[k].layout]
        plain = _fastest(cost, in_place, order, len(buckets))
        chosen, allowed_final, best_saving = plain, in_place, 0.0
        for layout in sorted({kernels[k].layout for k in names} - {""}):
            allowed = in_place + [k for k in names if kernels[k].layout == layout]
            pick = _fastest(cost, allowed, order, len(buckets))
            gains = [
                cost[p][i] - cost[q][i] for i, (p, q) in enumerate(zip(plain, pick, strict=True))
            ]
            pays = any(
                g > copy_gain * cost[p][i]
                for i, (p, g) in enumerate(zip(plain, gains, strict=True))
            )
            if pays and sum(gains) > best_saving:
                chosen, allowed_final, best_saving = pick, allowed, sum(gains)
        stable = set((invariant or {}).get(role, ()))
        chosen_total = sum(cost[c][i] for i, c in enumerate(chosen))
        uniform = [
            k
            for k in allowed_final
            if k in stable and sum(cost[k]) <= (1 + uniform_tolerance) * chosen_total
        ]
        if uniform:
            best = min(uniform, key=lambda k: (sum(cost[k]), order.index(k)))
            chosen = [best] * len(buckets)
        choices[role] = tuple(chosen)
    return LinearPlan(
        buckets,
        choices,
        {r: {k: tuple(t) for k, t in ts.items()} for r, ts in timings.items()},
        {r: tuple(ks) for r, ks in (invariant or {}).items()},
    )


def _prepare_all(
    ws: Sequence[tuple[torch.Tensor, torch.Tensor | None]], kernels: Mapping[str, Kernel]
) -> list[tuple[Prepared, torch.Tensor | None]]:
    prepared = []
    for w, b in ws:
        p: Prepared = {}
        for k in kernels.values():
            k.prepare(w, p)
        prepared.append((p, b))
    return prepared


# Input draws the invariance check tries (scales of activations): whether a kernel rounds one
# row otherwise than n rows depends on the values, so one draw can miss it.
INVARIANCE_SCALES = (0.1, 1.0, 1.0, 30.0)


def batch_invariant_kernels(
    weights: Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor | None]]],
    buckets: Sequence[int],
    kernels: Mapping[str, Kernel],
) -> dict[str, tuple[str, ...]]:
    """Per role, the kernels whose output rows are bitwise the same for every token count in
    `buckets` as in their own product of more rows than the largest bucket (tried on the role's
    first weight): a property of the BLAS build and CPU. Such a kernel, used for every bucket
    and past them (`LinearPlan.past_buckets`), makes a token's output independent of how many
    tokens its forward holds."""
    out: dict[str, tuple[str, ...]] = {}
    with torch.inference_mode():
        for role, ws in weights.items():
            [(p, b)] = _prepare_all(ws[:1], kernels)
            gen = torch.Generator().manual_seed(1)
            rows = 2 * max(buckets) + 1
            xs = [
                torch.randn(rows, ws[0][0].shape[1], generator=gen) * scale
                for scale in INVARIANCE_SCALES
            ]
            stable = []
            for name, k in kernels.items():
                if all(_rows_agree(k, x.to(ws[0][0].dtype), p, b, buckets) for x in xs):
                    stable.append(name)
            out[role] = tuple(stable)
    return out


def _rows_agree(
    k: Kernel, x: torch.Tensor, p: Prepared, b: torch.Tensor | None, buckets: Sequence[int]
) -> bool:
    full = k.apply(x, p, b)
    return all(torch.equal(k.apply(x[:n], p, b), full[:n]) for n in buckets)


def measure(
    weights: Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor | None]]],
    buckets: Sequence[int],
    kernels: Mapping[str, Kernel],
    *,
    rounds: int = 5,
    min_seconds: float = 0.004,
    hopeless: float = 4.0,
) -> dict[str, dict[str, tuple[float, ...]]]:
    """Median seconds per call over all of a role's weights, per kernel and bucket.

    Each round times every (bucket, kernel) pair once, interleaved, so load from other processes
    spreads over all candidates; a pair is repeated within a round until it has run
    `min_seconds`. The first round warms up; a pair slower than `hopeless` times the best of its
    bucket there is not timed again (its warm-up time stands).
    """
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for role, ws in weights.items():
        prepared = _prepare_all(ws, kernels)
        in_features = ws[0][0].shape[1]
        samples: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kernels for n in buckets}
        reps: dict[tuple[str, int], int] = {}
        gen = torch.Generator().manual_seed(0)
        xs = {n: torch.randn(n, in_features, generator=gen, dtype=ws[0][0].dtype) for n in buckets}
        with torch.inference_mode():
            for r in range(rounds + 1):
                for n in buckets:
                    x = xs[n]
                    for name, k in kernels.items():
                        if r > 0 and (name, n) not in reps:
                            continue
                        count = reps.get((name, n), 1)
                        t0 = time.perf_counter()
                        for _ in range(count):
                            for p, b in prepared:
                                k.apply(x, p, b)
                        dt = (time.perf_counter() - t0) / count
                        samples[(name, n)].append(dt)
                        if r == 0:
                            reps[(name, n)] = max(1, int(min_seconds / max(dt, 1e-9)))
                    if r == 0:
                        fastest = min(samples[(k, n)][0] for k in kernels)
                        for k in kernels:
                            if samples[(k, n)][0] > hopeless * fastest:
                                del reps[(k, n)]
                            else:
                                samples[(k, n)].clear()
        out[role] = {k: tuple(statistics.median(samples[(k, n)]) for n in buckets) for k in kernels}
    return out


class PlannedLinear:
    """One linear layer run with the kernel its plan chose for the call's token count."""

    __slots__ = ("bias", "past", "prepared", "table", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        role: str,
        plan: LinearPlan,
        kernels: Mapping[str, Kernel],
    ) -> None:
        self.weight, self.bias = weight, bias
        self.prepared: Prepared = {"w": weight}
        for name in sorted(set(plan.choices.get(role, ()))):
            kernels[name].prepare(weight, self.prepared)
        max_n = max(plan.buckets) if plan.buckets else 0
        # table[n] = kernel for n tokens, n <= the largest bucket; `past` beyond it.
        self.table: list[ApplyFn] = [_linear] + [
            kernels[plan.kernel_for(role, n)].apply for n in range(1, max_n + 1)
        ]
        self.past: ApplyFn = kernels[plan.kernel_for(role, max_n + 1)].apply

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        fn = self.table[n] if n < len(self.table) else self.past
        return fn(x, self.prepared, self.bias)

    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, t in self.prepared.items() if k != "w")
