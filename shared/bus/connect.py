"""Redis clients from the settings: one server, or a Redis Cluster (`redis.cluster`).

Both speak the same commands; on a cluster each command goes to the node that owns its keys'
hash slot, pipelines are split by node, and a transaction (MULTI/EXEC) must keep to one slot,
which the key names see to (every key of a cell carries the cell as its hash tag).
"""

from __future__ import annotations

from typing import TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode

from shared.settings import RedisSettings

RedisClient: TypeAlias = aioredis.Redis | aioredis.RedisCluster


def connect(
    url: str,
    settings: RedisSettings,
    *,
    socket_timeout: float,
    max_connections: int | None = None,
) -> RedisClient:
    """A client of `url` (cluster mode when `settings.cluster`), bytes in and out."""
    pool = {} if max_connections is None else {"max_connections": max_connections}
    if not settings.cluster:
        return aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            decode_responses=False,
            **pool,
            **settings.credentials,
        )
    more = [ClusterNode(*_host_port(node)) for node in settings.cluster_nodes]
    return aioredis.RedisCluster.from_url(
        url,
        socket_timeout=socket_timeout,
        decode_responses=False,
        startup_nodes=more or None,
        **pool,
        **settings.credentials,
    )


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host, int(port)
