"""The chaos run's verdict: each request classified and attributed to a kill, a table per phase.

A request's phase is the services whose kill window (from the SIGKILL until the new replica's
heartbeat) overlapped its life, from its first try to its end, joined by `+` in kill order;
"none" when it overlapped no kill. Its result is one of:

- completed identical: the stream finished and its text and token count are the reference's;
- completed different: it finished with other output (a bug);
- failed with a clear error: an HTTP error status, an error event or a dropped connection;
- hung: nothing from the server for the client's bound.

Only a request whose gateway died under it (a gateway kill while its connection was open) may
fail. Anything else failing, any different or hung request, and any lost, repeated or wrong
token is a problem, and the run exits non-zero.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools.chaos.client import COMPLETED, FAILED, HUNG, Received
from tools.chaos.compare import Comparison, Reference, compare
from tools.chaos.faults import Kill

IDENTICAL = "completed identical"
DIFFERENT = "completed different"
FAILED_CLEARLY = "failed with a clear error"
HUNG_RESULT = "hung"
NO_KILL = "none"


@dataclass
class Outcome:
    """One request's result, as the report counts it."""

    index: int
    phase: str
    result: str
    gateway_died: bool  # a gateway kill while its connection was open
    lost: int
    duplicated: int
    wrong: int
    reference_tokens: int
    received: Received

    @property
    def failure_allowed(self) -> bool:
        return self.result == FAILED_CLEARLY and self.gateway_died

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["received"] = self.received.to_json()
        return out


@dataclass
class PhaseRow:
    phase: str
    requests: int = 0
    identical: int = 0
    different: int = 0
    failed: int = 0
    failed_on_killed_gateway: int = 0
    hung: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    connect_retries: int = 0  # requests that found the gateway down and tried again

    def add(self, outcome: Outcome) -> None:
        self.requests += 1
        self.identical += outcome.result == IDENTICAL
        self.different += outcome.result == DIFFERENT
        self.failed += outcome.result == FAILED_CLEARLY
        self.failed_on_killed_gateway += outcome.failure_allowed
        self.hung += outcome.result == HUNG_RESULT
        self.lost += outcome.lost
        self.duplicated += outcome.duplicated
        self.wrong += outcome.wrong
        self.connect_retries += outcome.received.connect_retries > 0


def phase_of(received: Received, kills: Sequence[Kill]) -> str:
    end = received.ended_at_s if received.ended_at_s is not None else float("inf")
    hit = [k.service for k in kills if k.overlaps(received.sent_at_s, end)]
    return "+".join(dict.fromkeys(hit)) or NO_KILL


def gateway_died(received: Received, kills: Sequence[Kill]) -> bool:
    if received.connected_at_s is None:
        return False  # never reached a gateway
    end = received.ended_at_s if received.ended_at_s is not None else float("inf")
    return any(
        k.service == "gateway" and received.connected_at_s <= k.killed_at_s <= end for k in kills
    )


def classify(received: Received, reference: Reference) -> tuple[str, Comparison]:
    if received.status == HUNG:
        return HUNG_RESULT, _received_part(received, reference)
    if received.status == FAILED:
        return FAILED_CLEARLY, _received_part(received, reference)
    assert received.status == COMPLETED, received.status
    comparison = compare(received.text, received.completion_tokens, reference, complete=True)
    return (IDENTICAL if comparison.identical else DIFFERENT), comparison


def _received_part(received: Received, reference: Reference) -> Comparison:
    """What a request that did not complete had received, against the reference's start."""
    return compare(received.text, received.completion_tokens, reference, complete=False)


def evaluate(
    received: Sequence[Received], references: Sequence[Reference], kills: Sequence[Kill]
) -> list[Outcome]:
    outcomes = []
    for got in received:
        reference = references[got.index]
        result, comparison = classify(got, reference)
        outcomes.append(
            Outcome(
                index=got.index,
                phase=phase_of(got, kills),
                result=result,
                gateway_died=gateway_died(got, kills),
                lost=comparison.lost,
                duplicated=comparison.duplicated,
                wrong=comparison.wrong,
                reference_tokens=len(reference.ids),
                received=got,
            )
        )
    return outcomes


def phase_rows(outcomes: Sequence[Outcome], kills: Sequence[Kill]) -> list[PhaseRow]:
    """One row per phase ("none" first, then in kill order), and the total."""
    rows: dict[str, PhaseRow] = {NO_KILL: PhaseRow(NO_KILL)}
    for kill in kills:
        rows.setdefault(kill.service, PhaseRow(kill.service))
    for outcome in sorted(outcomes, key=lambda o: o.index):
        rows.setdefault(outcome.phase, PhaseRow(outcome.phase)).add(outcome)
    total = PhaseRow("all")
    for outcome in outcomes:
        total.add(outcome)
    return [*rows.values(), total]


def service_rows(outcomes: Sequence[Outcome], kills: Sequence[Kill]) -> list[PhaseRow]:
    """One row per killed service: every request that lived through its kill (a request that
    lived through several is counted under each)."""
    rows = {kill.service: PhaseRow(kill.service) for kill in kills}
    for outcome in sorted(outcomes, key=lambda o: o.index):
        for service in outcome.phase.split("+"):
            if service in rows:
                rows[service].add(outcome)
    return list(rows.values())


def problems(outcomes: Sequence[Outcome], kills: Sequence[Kill], planned: int) -> list[str]:
    """Everything that makes the run fail, one line each (none: it passed)."""
    found = []
    for o in sorted(outcomes, key=lambda o: o.index):
        what = f"request {o.index} ({o.phase})"
        if o.result == DIFFERENT:
            found.append(f"{what}: completed with different output")
        elif o.result == HUNG_RESULT:
            found.append(f"{what}: hung: {o.received.error}")
        elif o.result == FAILED_CLEARLY and not o.gateway_died:
            found.append(f"{what}: failed without its gateway dying: {o.received.error}")
        if o.lost or o.duplicated or o.wrong:
            found.append(f"{what}: {o.lost} lost, {o.duplicated} repeated, {o.wrong} wrong tokens")
    if len(kills) < planned:
        found.append(f"only {len(kills)} of the {planned} planned kills happened")
    for kill in kills:
        if kill.back_at_s is None:
            found.append(f"{kill.service} did not come back after its kill")
    return found


COLUMNS = (
    ("phase", "phase"),
    ("requests", "requests"),
    ("identical", "completed identical"),
    ("different", "completed different"),
    ("failed", "failed (clear error)"),
    ("failed_on_killed_gateway", "of which on a killed gateway"),
    ("hung", "hung"),
    ("lost", "lost tokens"),
    ("duplicated", "duplicated tokens"),
    ("wrong", "wrong tokens"),
    ("connect_retries", "retried connecting"),
)


def markdown_table(rows: Sequence[PhaseRow]) -> str:
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "|".join("---" if name == "phase" else "---:" for name, _ in COLUMNS) + "|",
    ]
    for row in rows:
        values = asdict(row)
        lines.append("| " + " | ".join(str(values[name]) for name, _ in COLUMNS) + " |")
    return "\n".join(lines)


def kills_table(kills: Sequence[Kill]) -> str:
    lines = [
        "| service | killed | at (s) | restarted as | at (s) | back at (s) | down (s) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for k in kills:
        down = f"{k.back_at_s - k.killed_at_s:.1f}" if k.back_at_s is not None else "never"
        lines.append(
            f"| {k.service} | {k.killed_replica} | {k.killed_at_s:.1f} | "
            f"{k.restarted_replica or '-'} | {_seconds(k.restarted_at_s)} | "
            f"{_seconds(k.back_at_s)} | {down} |"
        )
    return "\n".join(lines)


def steps_table(steps: dict[str, dict[str, int]]) -> str:
    """Steps drafted per draft model, by phase: where the draft choice put the requests."""
    models = sorted({m for by_model in steps.values() for m in by_model})
    lines = [
        "| phase | " + " | ".join(f"steps on {m}" for m in models) + " |",
        "|---|" + "---:|" * len(models),
    ]
    for phase, by_model in steps.items():
        lines.append(f"| {phase} | " + " | ".join(str(by_model.get(m, 0)) for m in models) + " |")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass
class Report:
    settings: dict[str, Any]
    kills: list[Kill]
    outcomes: list[Outcome]
    planned_kills: int
    exits: list[str] = field(default_factory=list)  # processes that died without being killed
    rows: list[PhaseRow] = field(init=False)
    found: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = phase_rows(self.outcomes, self.kills)
        self.found = problems(self.outcomes, self.kills, self.planned_kills) + self.exits

    @property
    def passed(self) -> bool:
        return not self.found

    def markdown(self) -> str:
        parts = [
            "# Chaos run",
            "",
            "## Per service killed",
            "",
            "A request counts under every service that was killed while it was in flight.",
            "",
            markdown_table(service_rows(self.outcomes, self.kills)).replace(
                "| phase |", "| killed |", 1
            ),
            "",
            "## Per phase (the services down during a request's life)",
            "",
            markdown_table(self.rows),
            "",
            self.speculation(),
            "",
            "## Kills",
            "",
            kills_table(self.kills),
            "",
            "## Verdict",
            "",
        ]
        if self.passed:
            parts.append(
                "passed: no request completed different, hung, lost or repeated tokens, "
                "and only requests on a killed gateway failed"
            )
        else:
            parts += [f"- {line}" for line in self.found]
        return "\n".join(parts) + "\n"

    def speculation(self) -> str:
        drafted = sum(o.received.draft_tokens for o in self.outcomes)
        accepted = sum(o.received.accepted_tokens for o in self.outcomes)
        line = f"Speculation (completed requests): {accepted} of {drafted} draft tokens accepted."
        steps = self.steps_by_draft()
        if len(steps) > 1 or any(len(by) > 1 for by in steps.values()):
            line += "\n\n" + steps_table(steps)
        return line

    def steps_by_draft(self) -> dict[str, dict[str, int]]:
        """Per phase: the speculative steps each draft model drafted for its requests."""
        out: dict[str, dict[str, int]] = {}
        for o in sorted(self.outcomes, key=lambda o: o.index):
            by_model = out.setdefault(o.phase, {})
            for model, count in o.received.steps_by_draft.items():
                by_model[model] = by_model.get(model, 0) + count
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "kills": [k.to_json() for k in self.kills],
            "phases": [asdict(row) for row in self.rows],
            "problems": self.found,
            "passed": self.passed,
            "requests": [o.to_json() for o in sorted(self.outcomes, key=lambda o: o.index)],
        }

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "chaos.json").write_text(json.dumps(self.to_json(), indent=1) + "\n")
        (out / "chaos.md").write_text(self.markdown())
