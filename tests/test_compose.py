"""compose.yaml checked against the services and the settings (no Docker engine runs here)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.__main__ import parse_args
from shared.model.model_set import ALL_DRAFT_NAMES, SERVED_DRAFT_NAMES
from shared.settings import load_settings
from shared.wire.streams import DRAFTER, SCHEDULER, VERIFIER

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def text() -> str:
    return COMPOSE.read_text()


@pytest.fixture(scope="module")
def compose(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def augury_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if name != "redis"}


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(number) * units[unit]
    return total


def test_it_has_redis_and_every_service(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    commands = {name: parse_args(s["command"]) for name, s in augury_services(services).items()}
    kinds = sorted({args.service for args in commands.values()})
    assert kinds == ["drafter", "gateway", "scheduler", "verifier"]
    assert services["redis"]["image"].startswith("redis:")
    drafts = sorted(a.name for a in commands.values() if a.service == "drafter")
    served = json.loads(compose["x-augury-env"]["AUGURY_MODELS__DRAFTS"])
    assert drafts == sorted(d["name"] for d in served)  # one drafter service per draft model
    assert served[0]["name"] == SERVED_DRAFT_NAMES[0]  # the services' default draft
    for draft in served:  # committed checkpoints, where the image copies models/
        assert draft["name"] in ALL_DRAFT_NAMES
        assert draft["dir"] == f"/app/models/drafts/{draft['name']}"
        assert (ROOT / "models" / "drafts" / draft["name"] / "config.json").is_file()


def test_one_gpu_per_model_service_and_none_for_cpu_services(
    services: dict[str, dict[str, Any]],
) -> None:
    used: list[str] = []
    for name, service in augury_services(services).items():
        kind = parse_args(service["command"]).service
        devices = gpu_devices(service)
        if kind in (VERIFIER, DRAFTER):
            [device] = devices
            assert device["capabilities"] == ["gpu"]
            assert "count" not in device  # device_ids or count, not both
            assert len(device["device_ids"]) == 1, name
            used += device["device_ids"]
            assert service.get("deploy", {}).get("replicas", 1) == 1, "replicas share GPUs"
            assert service["environment"]["AUGURY_ENGINE__DEVICE"] == "cuda"
        else:
            assert devices == [], f"{name} is a CPU service"
    assert len(used) == len(set(used)), "two services on one GPU"
    assert services["gateway"]["deploy"]["replicas"] >= 2  # CPU services scale by replicas
    assert parse_args(services["scheduler"]["command"]).service == SCHEDULER
    assert services["scheduler"].get("deploy", {}).get("replicas", 1) == 1  # one per cell


def test_anchors_instead_of_repetition(text: str, services: dict[str, dict[str, Any]]) -> None:
    assert text.count("<<: *augury\n") == len(augury_services(services))
    assert "&augury-env" in text and "&model-healthcheck" in text
    images = {s["image"] for s in augury_services(services).values()}
    assert images == {"augury:latest"}


def test_healthchecks_dependencies_and_grace_periods(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        check = service["healthcheck"]
        assert check["test"][0] == "CMD", name
        assert seconds(service["stop_grace_period"]) >= 10, name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert condition == {"condition": "service_healthy"}
            assert "healthcheck" in services[dependency]
    for service in augury_services(services).values():
        args = parse_args(service["command"])
        if args.service in (VERIFIER, DRAFTER):
            assert seconds(service["healthcheck"]["start_period"]) >= 120, "model loading"
            probe = service["healthcheck"]["test"][1:]
            assert parse_args(probe[3:]).service == "health"
            assert parse_args(probe[3:]).probe == args.service
        assert "redis" in service["depends_on"]
    assert seconds(services["gateway"]["stop_grace_period"]) >= 60  # streams drain


def test_environment_is_valid_settings(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, service in augury_services(services).items():
        with monkeypatch.context() as patch:
            for key, value in service["environment"].items():
                assert key.startswith("AUGURY_"), key
                patch.setenv(key, str(value))
            settings = load_settings()  # raises SettingsError on anything unknown or invalid
        assert settings.redis.url == "redis://redis:6379/0", name
        if name == "gateway":
            assert settings.gateway.host == "0.0.0.0"
            published = services["gateway"]["ports"][0].split(":")[-1]
            assert int(published) == settings.gateway.port


def test_redis_needs_a_password_and_never_evicts(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    command = [str(part) for part in redis["command"]]
    password = command[command.index("--requirepass") + 1]
    assert password.startswith("${AUGURY_REDIS_PASSWORD:?")  # refused to start without one
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert "--maxmemory" in command
    assert redis["environment"]["REDISCLI_AUTH"] == password  # the healthcheck authenticates
    for name, service in augury_services(services).items():
        assert service["environment"]["AUGURY_REDIS__PASSWORD"] == password, name


def test_the_env_script_makes_a_password_once(tmp_path: Path) -> None:
    import shutil
    import subprocess

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compose-env.sh", tmp_path / "scripts")
    subprocess.run(["bash", str(tmp_path / "scripts" / "compose-env.sh")], check=True)
    first = (tmp_path / ".env").read_text()
    assert first.startswith("AUGURY_REDIS_PASSWORD=") and len(first.strip()) > 40
    assert (tmp_path / ".env").stat().st_mode & 0o077 == 0  # the owner's only
    subprocess.run(["bash", str(tmp_path / "scripts" / "compose-env.sh")], check=True)
    assert (tmp_path / ".env").read_text() == first  # kept, not replaced
