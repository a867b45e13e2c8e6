"""Quick cost profiles that can be trusted: a measurement spoiled by interference (issue 39: a
draft measured at 82.8 ms per forward while another model loaded, its target at 42) is checked,
measured again, and never cached or published while it stays suspect.

The interference is simulated deterministically: the measurement function is replaced by one
that returns given numbers (the real one is exercised by the services tests)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest

import services.run
from services.gateway.metrics import GatewayMetrics, export_profile_statuses
from services.run import Stack, publish_own_profile
from services.runtime import load_runner
from shared.bus import Bus, EmbeddedRedis
from shared.bus.profiles import TARGET, draft_role, read_profile_statuses, read_profiles
from shared.model.cost_profiles import MEASURED, NONE, STORED, SUSPECT, choose_profile
from shared.model.profile_files import DEFAULT_PROFILES_DIR
from shared.model.profile_trust import check_profile, combine, committed_target
from shared.model.profiling import profile_key
from shared.scheduling.cost_model import (
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.settings import EngineSettings
from tests.conftest import make_tiny_checkpoint
from tests.test_services_support import make_settings

pytestmark = pytest.mark.anyio
TOKENS = [1, 2, 4, 16, 64]
CONTEXTS = [0, 512]
TARGET_MS = [[42.0, 44.0], [42.5, 44.5], [43.0, 45.0], [46.0, 49.0], [58.0, 63.0]]


def curve(ms: list[list[float]], spread: float = 0.05) -> ForwardCurve:
    return ForwardCurve(
        tokens=TOKENS,
        contexts=CONTEXTS,
        ms_grid=ms,
        rel_spread=[[spread] * len(CONTEXTS) for _ in TOKENS],
        repeats=3,
    )


def profile(key: ProfileKey, ms: list[list[float]], spread: float = 0.05) -> ModelProfile:
    return ModelProfile(key=key, curve=curve(ms, spread), single=curve(ms, spread))


def scaled(factor: float) -> list[list[float]]:
    return [[factor * v for v in row] for row in TARGET_MS]


KEY = ProfileKey(model="m", fingerprint="f", device="cuda: H100", dtype="bfloat16", threads=0)


def test_the_issues_draft_at_twice_its_targets_cost_is_refused() -> None:
    target = profile(KEY.model_copy(update={"model": "target"}), TARGET_MS)
    spoiled = profile(KEY, scaled(82.8 / 42.0))
    verdict = check_profile(spoiled, target)
    assert not verdict.trusted and "1.97x its target target's forward" in str(verdict)
    assert check_profile(profile(KEY, scaled(0.2)), target).trusted  # a real draft's cost
    other_machine = target.model_copy(update={"key": KEY.model_copy(update={"device": "cpu"})})
    assert check_profile(spoiled, other_machine).trusted  # no comparison across machine kinds


def test_spread_and_monotonicity_are_checked() -> None:
    assert not check_profile(profile(KEY, TARGET_MS, spread=1.2)).trusted
    dip = [row[:] for row in TARGET_MS]
    dip[3][0] = 15.0  # 16 tokens at a third of the cost of 4: a burst of load hit the 4
    verdict = check_profile(profile(KEY, dip))
    assert not verdict.trusted and "16 tokens cost 15.00 ms" in str(verdict)
    flat = [[42.0, 44.0], [41.0, 44.0], [40.0, 43.5], [41.0, 44.0], [43.0, 45.0]]  # flat start
    assert check_profile(profile(KEY, flat)).trusted


def test_the_committed_profiles_pass_their_own_checks() -> None:
    for path in sorted(DEFAULT_PROFILES_DIR.glob("*.json")):
        committed = CostProfile.load(path)
        assert check_profile(committed.target).trusted, path.name
        for name, draft in committed.drafts.items():
            assert check_profile(draft, committed.target).trusted, (path.name, name)


def test_combining_keeps_the_fastest_of_each_point() -> None:
    spoiled, quiet = profile(KEY, scaled(2.0)), profile(KEY, scaled(0.2))
    quiet.curve.ms_grid[0][0] = 100.0  # one point spoiled in the second measurement
    both = combine([spoiled, quiet])
    assert both.curve.ms_grid[0][0] == pytest.approx(84.0)
    assert both.curve.ms_grid[2][1] == pytest.approx(9.0) and both.curve.repeats == 6


def test_a_committed_target_is_found_for_the_same_machine_kind() -> None:
    h200 = CostProfile.load(
        DEFAULT_PROFILES_DIR / "SmolLM2-135M-Instruct-cuda-nvidia-h200-bfloat16-t0.json"
    )
    key = h200.drafts["draft-s"].key
    found = committed_target([DEFAULT_PROFILES_DIR], key, h200.target.key.fingerprint)
    assert found is not None and found.key.fingerprint == h200.target.key.fingerprint
    assert found.key.device == key.device
    cpu_key = key.model_copy(update={"device": "cpu: nothing like it", "threads": 2})
    assert committed_target([DEFAULT_PROFILES_DIR], cpu_key, h200.target.key.fingerprint) is None


@pytest.fixture(scope="module")
def draft_runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), seed=1, num_layers=1)
    return load_runner(path, EngineSettings(kv_memory_bytes=1 << 20, block_size=4))


class Interference:
    """Stands in for the quick measurement: returns the given numbers, one set per call."""

    def __init__(self, *measurements: list[list[float]]) -> None:
        self.measurements = list(measurements)
        self.calls = 0

    def __call__(
        self, runner: Any, name: str, max_tokens: int, layouts: list[tuple[int, tuple[int, ...]]]
    ) -> tuple[ModelProfile, tuple[int, tuple[int, ...]]]:
        ms = self.measurements[min(self.calls, len(self.measurements) - 1)]
        self.calls += 1
        return profile(profile_key(runner, name), ms), layouts[0]


def target_like(runner: Any) -> ModelProfile:
    return profile(profile_key(runner, "target"), TARGET_MS)


def test_a_suspect_draft_is_measured_again_and_kept_once_quiet(
    draft_runner: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Interference(scaled(2.0), scaled(0.2))  # spoiled while the target loads, then quiet
    caplog.set_level(logging.INFO, "shared.model.cost_profiles")
    choice = choose_profile(
        draft_runner,
        "draft-m",
        directory=tmp_path / "none",
        cache_dir=tmp_path / "cache",
        plan_kernels=False,
        reference=target_like(draft_runner),
        retry_wait_s=0.0,
        measure_quick=measure,
    )
    assert measure.calls == 2 and choice.source == MEASURED and choice.profile is not None
    assert choice.profile.curve.ms_grid == scaled(0.2)
    assert "is suspect" in caplog.text and "checked and kept" in caplog.text
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    again = choose_profile(
        draft_runner, "draft-m", directory=tmp_path / "none", cache_dir=tmp_path / "cache"
    )
    assert again.source == STORED  # the next start loads the kept one


def test_a_cached_profile_that_never_measured_two_tokens_is_measured_again(
    draft_runner: Any, tmp_path: Path
) -> None:
    """Quick profiles cached before 2 joined the grid went from 1 token to 4: a lone draft
    token's price was a guess there, so they are not loaded."""

    def old_grid(runner: Any, name: str, max_tokens: int, layouts: list) -> tuple:
        rows = [row for n, row in zip(TOKENS, scaled(0.2), strict=True) if n != 2]
        old = ForwardCurve(
            tokens=[n for n in TOKENS if n != 2],
            contexts=CONTEXTS,
            ms_grid=rows,
            rel_spread=[[0.05] * len(CONTEXTS) for _ in rows],
            repeats=3,
        )
        return ModelProfile(key=profile_key(runner, name), curve=old, single=old), layouts[0]

    where = {"directory": tmp_path / "none", "cache_dir": tmp_path / "cache"}
    first = choose_profile(
        draft_runner, "draft-m", **where, plan_kernels=False, measure_quick=old_grid
    )
    assert first.source == MEASURED and len(list((tmp_path / "cache").glob("*.json"))) == 1
    assert choose_profile(draft_runner, "draft-m", **where, measure=False).source == NONE
    quiet = Interference(scaled(0.2))
    again = choose_profile(
        draft_runner, "draft-m", **where, plan_kernels=False, measure_quick=quiet
    )
    assert again.source == MEASURED and again.profile is not None
    assert again.profile.curve.tokens == TOKENS


def test_a_draft_that_stays_suspect_is_neither_cached_nor_published(
    draft_runner: Any,
    tmp_path: Path,
    server: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    measure = Interference(scaled(82.8 / 42.0))  # every measurement spoiled
    settings = make_settings(
        server.url,
        "trust",
        engine={
            "measure_profile": True,
            "profile_dir": tmp_path / "none",
            "profile_cache_dir": tmp_path / "cache",
            "plan_kernels": False,
        },
    )
    quick = functools.partial(choose_profile, retry_wait_s=0.0, measure_quick=measure)
    monkeypatch.setattr(services.run, "choose_profile", quick)
    caplog.set_level(logging.INFO)

    async def start() -> tuple[Any, dict[str, ModelProfile], dict[str, dict[str, str]]]:
        stack = Stack(settings, server.url)
        bus = Bus(server.url, settings.redis, "trust")
        try:
            stack.target_profile = target_like(draft_runner)  # this process's verifier's
            choice = await publish_own_profile(
                stack, bus, draft_runner, "draft-m", draft_role("draft-m")
            )
            return (
                choice,
                await read_profiles(bus, "trust"),
                await read_profile_statuses(bus, "trust"),
            )
        finally:
            await bus.close()

    choice, published, statuses = asyncio.run(start())
    assert choice.source == SUSPECT and measure.calls == 3  # the first and two more
    assert "NOT kept" in caplog.text and "1.97x its target" in caplog.text
    assert "prices draft-m as free" in caplog.text
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.json"))
    assert draft_role("draft-m") not in published and TARGET not in published
    status = statuses[draft_role("draft-m")]
    assert (status["source"], status["published"]) == ("suspect", "0")
    assert "1.97x" in status["detail"]
    metrics = GatewayMetrics()
    export_profile_statuses(metrics, {"trust": statuses})
    value = metrics.registry.get_sample_value(
        "augury_cost_profile_info",
        {"cell": "trust", "role": "draft:draft-m", "source": "suspect", "published": "0"},
    )
    assert value == 1.0


# ---- the real quick measurement on a device a neighbour keeps busy -------------------------------
class BusyDevice:
    """Wraps a runner's forward: the forwards `waits` picks first wait `wait_s` (a neighbour
    holding the device, as another model loading did in issue 39), then run for real. Keyed by
    a forward's request group (its context column) and token count, with a call count."""

    def __init__(self, runner: Any, wait_s: float, waits: Any) -> None:
        self.runner, self.wait_s, self.waits = runner, wait_s, waits
        self.forward = runner.forward
        self.calls: dict[tuple[str, int], int] = {}
        self.waited = 0

    def __call__(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        import time

        key = (items[0].request_id.rsplit("_", 1)[0], sum(len(item.tokens) for item in items))
        count = self.calls[key] = self.calls.get(key, -1) + 1
        if self.waits(key[1], count):
            self.waited += 1
            time.sleep(self.wait_s)
        return self.forward(items, *args, **kwargs)


@pytest.mark.parametrize(
    ("case", "waits", "why"),
    [
        # the few-token forwards land while the neighbour loads: cheaper with more tokens
        ("small forwards delayed", lambda tokens, count: tokens <= 4, "tokens cost"),
        # one repeat in three of every point delayed (count 0 is the warm-up): spread
        ("one repeat in three delayed", lambda tokens, count: count % 4 == 2, "spread"),
    ],
)
def test_a_quick_profile_measured_on_a_busy_device_is_refused_and_not_cached(
    draft_runner: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    waits: Any,
    why: str,
) -> None:
    """The real quick measurement (`measure_curve` timing the model's forwards), with the device
    busy for some forwards throughout: every measurement is suspect, the profile is refused
    (source suspect), the log says what was measured and that it was NOT kept, and nothing is
    cached for the next start."""
    busy = BusyDevice(draft_runner, 0.05, waits)
    monkeypatch.setattr(draft_runner, "forward", busy)
    caplog.set_level(logging.INFO, "shared.model.cost_profiles")
    choice = choose_profile(
        draft_runner,
        "busy",
        directory=tmp_path / "none",
        cache_dir=tmp_path / "cache",
        plan_kernels=False,
        retry_wait_s=0.0,
    )
    assert busy.waited > 0, case
    assert choice.source == SUSPECT and not choice.trusted, (case, choice)
    assert why in choice.detail, (case, choice.detail)
    assert "measured 3 times" in caplog.text and "NOT kept" in caplog.text, case
    assert "ms per forward by tokens at context 0" in caplog.text  # what it measured
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.json"))
    monkeypatch.undo()
    again = choose_profile(
        draft_runner, "busy", directory=tmp_path / "none", cache_dir=tmp_path / "cache",
        measure=False,
    )  # fmt: skip
    assert again.source == NONE  # the next start finds nothing cached and measures again


def test_a_stored_profile_from_another_machine_is_scaled_to_this_one(
    draft_runner: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored profile matches by the machine's name; one measured where forwards took 42 ms
    (a one-layer tiny model takes about a millisecond here) is scaled to what a few forwards
    take on this machine, unless asked to stand as stored (a simulation of that machine)."""
    stored = CostProfile(target=profile(profile_key(draft_runner, "draft-m"), TARGET_MS))
    stored.save(tmp_path / "stored.json")
    where = {"directory": tmp_path, "cache_dir": tmp_path / "cache", "measure": False}
    caplog.set_level(logging.WARNING, "shared.model.cost_profiles")
    choice = choose_profile(draft_runner, "draft-m", **where)
    assert choice.source == STORED and choice.profile is not None
    assert "scaled" in choice.detail and "scaled" in caplog.text
    one_token = choice.profile.curve.ms_grid[0][0]
    assert one_token < 10.0  # not the stored 42 ms
    ratio = one_token / TARGET_MS[0][0]
    for row, stored_row in zip(choice.profile.curve.ms_grid, TARGET_MS, strict=True):
        assert row == pytest.approx([ratio * v for v in stored_row])  # every point alike
    as_stored = choose_profile(draft_runner, "draft-m", **where, check_stored=False)
    assert as_stored.profile is not None and as_stored.profile.curve.ms_grid == TARGET_MS
