"""`python -m services health SERVICE`: exit 0 while a replica of SERVICE on this host is alive.

Container healthchecks run this in a fresh process, so it cannot know the service's own replica
name (host-pid by default); it accepts any live heartbeat of that service in the cell whose
replica name starts with this host's name.
"""

from __future__ import annotations

import socket

import redis

from shared.bus.heartbeat import SCAN_BATCH
from shared.settings import AugurySettings
from shared.wire import Heartbeat, ProtocolError
from shared.wire.streams import heartbeat_pattern

TIMEOUT_S = 3.0


def healthy(settings: AugurySettings, service: str, host: str | None = None) -> bool:
    if settings.redis.url is None:
        return False  # an embedded server is private to its process: nothing to probe
    prefix = (host or socket.gethostname()).replace("/", "-")
    client = redis.Redis.from_url(
        settings.redis.url, socket_timeout=TIMEOUT_S, **settings.redis.credentials
    )
    try:
        pattern = heartbeat_pattern(settings.service.cell, service)
        for key in client.scan_iter(pattern, count=SCAN_BATCH):
            fields = client.hgetall(key)
            try:
                beat = Heartbeat.from_entry(fields)
            except ProtocolError:
                continue
            if beat.replica.startswith(prefix):
                return True
        return False
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
