"""SLO classes end to end: the API body, resolving a class to its TPOT objective, the in-process
engine, and the services through HTTP (final statistics and the attainment counter)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.gateway.body import APIError, parse_generation
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.bus.profiles import TARGET, publish_profile
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel, CostProfile, ForwardCurve, ModelProfile
from shared.scheduling.slo_classes import baseline_latency_ms, effective_class, resolve_tpot_slo
from shared.settings import SloSettings
from shared.values.sampling import SamplingParams
from tests.test_cost_model import key
from tests.test_replay import MODEL, models, post, serving, stream_events
from tests.test_services_support import until

__all__ = ["models"]  # a fixture shared with the replay tests

# The baseline is one forward of 8 tokens at context 96: halfway between contexts 0 and 192 of
# the 8-token row, (20 + 30) / 2 = 25 ms.
BASELINE_MS = 25.0
TARGET_PROFILE = ModelProfile(
    key=key(),
    curve=ForwardCurve(tokens=[1, 8], contexts=[0, 192], ms_grid=[[10, 14], [20, 30]]),
)


@pytest.fixture
def cost() -> CostModel:
    return CostModel(CostProfile(target=TARGET_PROFILE))


# ---- resolving a class -------------------------------------------------------------------------
def test_the_profile_gives_the_baseline(cost: CostModel) -> None:
    assert cost.baseline_latency_ms() == pytest.approx(BASELINE_MS)
    assert baseline_latency_ms(SloSettings(), cost) == pytest.approx(BASELINE_MS)
    assert baseline_latency_ms(SloSettings(baseline_latency_ms=7.0), cost) == 7.0
    assert baseline_latency_ms(SloSettings(), None) is None


def test_a_class_is_its_multiple_of_the_baseline(cost: CostModel) -> None:
    slo = SloSettings()
    assert resolve_tpot_slo("urgent", None, slo, cost) == pytest.approx(25.0)
    assert resolve_tpot_slo("standard", None, slo, cost) == pytest.approx(60.0)
    assert resolve_tpot_slo("relaxed", None, slo, cost) == pytest.approx(200.0)
    custom = SloSettings(classes={"gold": 1.5})
    assert resolve_tpot_slo("gold", None, custom, cost) == pytest.approx(37.5)


def test_an_explicit_objective_wins(cost: CostModel) -> None:
    slo = SloSettings(default_class="relaxed")
    assert resolve_tpot_slo("urgent", 50.0, slo, cost) == 50.0
    assert resolve_tpot_slo(None, 50.0, slo, cost) == 50.0  # not the default class's
    assert resolve_tpot_slo("urgent", 50.0, SloSettings(), None) == 50.0  # no baseline needed
    assert effective_class("urgent", 50.0, slo) == "urgent"
    assert effective_class(None, 50.0, slo) is None


def test_the_default_class_applies_to_requests_naming_neither(cost: CostModel) -> None:
    slo = SloSettings(default_class="relaxed")
    assert resolve_tpot_slo(None, None, slo, cost) == pytest.approx(200.0)
    assert effective_class(None, None, slo) == "relaxed"
    assert resolve_tpot_slo(None, None, SloSettings(), cost) is None  # best effort
    assert effective_class(None, None, SloSettings()) is None


def test_the_setting_overrides_the_profile(cost: CostModel) -> None:
    slo = SloSettings(baseline_latency_ms=10.0)
    assert resolve_tpot_slo("standard", None, slo, cost) == pytest.approx(24.0)
    assert resolve_tpot_slo("standard", None, slo, None) == pytest.approx(24.0)


def test_a_class_without_a_baseline_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="baseline latency") as refused:
        resolve_tpot_slo("urgent", None, SloSettings(), None)
    assert refused.value.param == "augury.slo_class"
    with pytest.raises(InvalidRequestError, match="baseline latency"):
        resolve_tpot_slo(None, None, SloSettings(default_class="urgent"), None)


def test_an_unknown_class_is_refused(cost: CostModel) -> None:
    for explicit in (None, 50.0):
        with pytest.raises(InvalidRequestError, match=r"unknown SLO class 'gold'.*relaxed"):
            resolve_tpot_slo("gold", explicit, SloSettings(), cost)


# ---- the API body --------------------------------------------------------------------------------
class NoTokenizer:
    """Prompts are token ids here: nothing to tokenize."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("not used")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise AssertionError("not used")

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise AssertionError("not used")


def parse(augury: Any, **options: Any) -> Any:
    body = {"model": "m", "prompt": [1, 2, 3], "augury": augury}
    return parse_generation(
        body,
        chat=False,
        tokenizer=NoTokenizer(),
        model_name="m",
        vocab_size=100,
        max_context=64,
        **options,
    )


def test_the_body_takes_a_known_class() -> None:
    gen = parse({"slo_class": "standard"})
    assert (gen.slo_class, gen.tpot_slo_ms) == ("standard", None)
    both = parse({"slo_class": "urgent", "tpot_slo_ms": 40})
    assert (both.slo_class, both.tpot_slo_ms) == ("urgent", 40.0)
    assert parse({}).slo_class is None
    assert parse({"slo_class": "gold"}, slo_classes=("gold",)).slo_class == "gold"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("platinum", "unknown SLO class 'platinum'; known: relaxed, standard, urgent"),
        ("Urgent", "unknown SLO class"),
        ("", "unknown SLO class"),
        (3, "must be a string"),
        (["urgent"], "must be a string"),
        (True, "must be a string"),
    ],
)
def test_the_body_refuses_a_bad_class(value: Any, message: str) -> None:
    with pytest.raises(APIError) as refused:
        parse({"slo_class": value})
    assert refused.value.status == 400 and refused.value.param == "augury.slo_class"
    assert message in refused.value.message


def test_the_configured_classes_decide_what_is_known() -> None:
    with pytest.raises(APIError, match="known: gold"):
        parse({"slo_class": "urgent"}, slo_classes=("gold",))


# ---- the in-process engine -----------------------------------------------------------------------
def make_engine(target_dir: Path, cost: CostModel | None, **slo: Any) -> SpecEngine:
    runner = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=1 << 20)
    return SpecEngine(Verifier(runner), config=SchedulerConfig(slo=SloSettings(**slo)), cost=cost)


def test_the_engine_resolves_a_class(tiny_target_dir: Path, cost: CostModel) -> None:
    engine = make_engine(tiny_target_dir, cost)
    params = SamplingParams(max_tokens=4)
    rid = engine.add_request([1, 2, 3], params, slo_class="standard")
    explicit = engine.add_request([4, 5], params, slo_class="urgent", tpot_slo_ms=1e6)
    request, pinned = engine.requests[rid], engine.requests[explicit]
    assert (request.slo_class, request.tpot_slo_ms) == ("standard", pytest.approx(60.0))
    assert (pinned.slo_class, pinned.tpot_slo_ms) == ("urgent", 1e6)
    with pytest.raises(InvalidRequestError, match="unknown SLO class"):
        engine.add_request([1], params, slo_class="gold")
    while engine.has_unfinished():
        engine.step()
    assert pinned.tpot_ms is not None and pinned.is_on_track is True


def test_the_engine_without_a_cost_model(tiny_target_dir: Path) -> None:
    params = SamplingParams(max_tokens=2)
    engine = make_engine(tiny_target_dir, None)
    with pytest.raises(InvalidRequestError, match="baseline latency"):
        engine.add_request([1, 2], params, slo_class="urgent")
    assert engine.add_request([1, 2], params) == "req-0"  # best effort needs no baseline
    configured = make_engine(
        tiny_target_dir, None, baseline_latency_ms=10.0, default_class="relaxed"
    )
    rid = configured.add_request([1, 2], params)
    assert (configured.requests[rid].slo_class, configured.requests[rid].tpot_slo_ms) == (
        "relaxed",
        80.0,
    )


# ---- the services, through HTTP ------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_class_through_the_services(server: EmbeddedRedis, models: ModelPaths) -> None:
    async with serving(server, models, "slo") as (stack, base), aiohttp.ClientSession() as http:
        url = f"{base}/v1/completions"
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}

        # no cost profile yet, no baseline setting: a class alone cannot be resolved ...
        refused = await post(http, url, {**body, "augury": {"slo_class": "standard"}})
        assert refused["status"] == 400, refused
        assert refused["error"]["param"] == "augury.slo_class"
        assert "baseline latency" in refused["error"]["message"]
        # ... but an explicit objective wins, and the class still names the request's class
        pinned = await post(
            http, url, {**body, "augury": {"slo_class": "urgent", "tpot_slo_ms": 1e6}}
        )
        assert pinned["status"] == 200, pinned
        stats = pinned["augury"]
        assert (stats["slo_class"], stats["tpot_slo_ms"], stats["slo_met"]) == (
            "urgent",
            1e6,
            True,
        )

        # the target's profile arrives: a class is its multiple of the profile's baseline
        scheduler = stack.scheduler
        assert scheduler is not None
        await publish_profile(scheduler.bus, scheduler.cell, TARGET, TARGET_PROFILE)
        await until(lambda: scheduler.core.cost is not None, what="the cost model")
        streamed = {**body, "stream": True, "augury": {"slo_class": "standard"}}
        events = await stream_events(http, url, streamed)
        [final] = [e for e in events if "augury" in e]
        assert final["choices"][0]["finish_reason"] == "length"
        stats = final["augury"]
        assert stats["slo_class"] == "standard"
        assert stats["tpot_slo_ms"] == pytest.approx(2.4 * BASELINE_MS)
        assert stats["tpot_ms"] > 0  # 6 tokens: a TPOT exists
        assert stats["slo_met"] is (stats["tpot_ms"] <= stats["tpot_slo_ms"])

        async with http.get(f"{base}/metrics") as response:
            text = await response.text()
    attained = str(stats["slo_met"]).lower()
    counted = re.findall(r"^augury_slo_requests_total\{(.*)\} (\S+)$", text, re.MULTILINE)
    assert sorted(counted) == sorted(
        [
            ('attained="true",slo_class="urgent"', "1.0"),
            (f'attained="{attained}",slo_class="standard"', "1.0"),
        ]
    )
