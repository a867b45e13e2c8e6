"""`python -m services health [--live] SERVICE`: container health probes, cheap enough for a
healthcheck's few seconds. This module imports no torch and no project module that does (a
fresh Python that imports torch takes seconds before it can answer).

- **Liveness** (`--live`): a process of SERVICE on this host has touched its liveness file
  within `LIVE_MAX_AGE_S`. The file is touched by a task on the service's event loop
  (`keep_alive`), so a wedged loop reads dead, while a model service that is still loading its
  weights (on a thread) reads alive. No Redis: a Redis outage does not make every service dead.
- **Readiness** (the default): the service does its job. A scheduler, verifier or drafter is
  ready once its heartbeat is in Redis (model services start beating after their model is
  loaded and profiled); a gateway is ready when its `GET /health/ready` answers 200 (a one-token
  generation through the cell).

The probe runs in a fresh process, so it cannot know the service's replica name (host-pid by
default): it accepts any heartbeat of the service in the cell whose replica name starts with
this host's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from shared.settings import AugurySettings

SERVICE_NAMES = ("gateway", "scheduler", "verifier", "drafter")  # services.run.SERVICES
TIMEOUT_S = 3.0
LIVE_DIR = Path(tempfile.gettempdir()) / "augury-live"
LIVE_TOUCH_S = 5.0
LIVE_MAX_AGE_S = 30.0
KEY_PREFIX = "augury"  # shared.wire.streams.PREFIX (that package imports torch)


def heartbeat_match(cell: str, service: str, replica_prefix: str) -> str:
    """SCAN MATCH pattern of the heartbeat keys (`shared.wire.streams.heartbeat_key`) of a
    service's replicas whose names start with `replica_prefix`."""
    return f"{KEY_PREFIX}:{{{cell}}}:hb:{service}:{replica_prefix}*"


def host_prefix(host: str | None = None) -> str:
    return (host or socket.gethostname()).replace("/", "-")


# ---- liveness ------------------------------------------------------------------------------
def live_file(service: str, pid: int, directory: Path = LIVE_DIR) -> Path:
    return directory / f"{service}-{pid}.alive"


async def keep_alive(service: str, directory: Path = LIVE_DIR) -> None:
    """Touch this process's liveness file every `LIVE_TOUCH_S` until cancelled, then remove it."""
    path = live_file(service, os.getpid(), directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            path.touch()
            await asyncio.sleep(LIVE_TOUCH_S)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def alive(service: str, directory: Path = LIVE_DIR, max_age_s: float = LIVE_MAX_AGE_S) -> bool:
    """Whether a process of `service` (`*`: any) touched its liveness file within `max_age_s`."""
    now = time.time()
    for path in directory.glob(f"{service}-*.alive"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime <= max_age_s:
                return True
    return False


# ---- readiness -----------------------------------------------------------------------------
def ready(settings: AugurySettings, service: str, host: str | None = None) -> bool:
    if service == "gateway":
        return gateway_ready(settings)
    if settings.redis.url is None:
        return False  # an embedded server is private to its process: nothing to probe
    client = probe_client(settings)
    try:
        pattern = heartbeat_match(settings.service.cell, service, host_prefix(host))
        return next(iter(client.scan_iter(pattern, count=100)), None) is not None
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def probe_client(settings: AugurySettings) -> redis.Redis | RedisCluster:
    """A client for the heartbeat scan: on a cluster, one that scans every master (a plain
    client of the URL's node sees only the cells whose slot that node holds)."""
    assert settings.redis.url is not None
    options = {
        "socket_timeout": TIMEOUT_S,
        "socket_connect_timeout": TIMEOUT_S,
        **settings.redis.credentials,
    }
    if not settings.redis.cluster:
        return redis.Redis.from_url(settings.redis.url, **options)
    nodes = [ClusterNode(host, port) for host, port in settings.redis.cluster_addresses]
    return RedisCluster.from_url(settings.redis.url, startup_nodes=nodes or None, **options)


def gateway_ready(settings: AugurySettings) -> bool:
    url = f"http://127.0.0.1:{settings.gateway.port}/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=settings.gateway.ready_timeout_s + 1) as answer:
            return int(answer.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
