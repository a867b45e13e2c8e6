"""Redis clients from the settings: one server, or a Redis Cluster (`redis.cluster`).

Both speak the same commands; on a cluster each command goes to the node that owns its keys'
hash slot and pipelines are split by node. A transaction (MULTI/EXEC) must keep to one slot,
which the key names see to (every key of a cell carries the cell as its hash tag), and runs on
a plain client of the node that owns the slot (`SlotTransactions`): redis-py's cluster pipeline
in transaction mode runs each queued command through `asyncio.run` on a new thread, and the
first one on a fresh client binds its connections to that thread's short-lived event loop.
"""

from __future__ import annotations

from typing import TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode
from redis.crc import key_slot

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
    more = [ClusterNode(host, port) for host, port in settings.cluster_addresses]
    return aioredis.RedisCluster.from_url(
        url,
        socket_timeout=socket_timeout,
        decode_responses=False,
        startup_nodes=more or None,
        **pool,
        **settings.credentials,
    )


class SlotTransactions:
    """MULTI/EXEC pipelines of keys in one hash slot, on a server or on a cluster."""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._nodes: dict[str, aioredis.Redis] = {}  # cluster node name -> a client of it

    async def pipeline(self, key: str) -> Pipeline:
        """A transaction pipeline for commands on keys in `key`'s hash slot."""
        if not isinstance(self.client, aioredis.RedisCluster):
            return self.client.pipeline(transaction=True)
        await self.client.initialize()  # once; later calls return at once
        node = self.client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        client = self._nodes.get(node.name)
        if client is None:
            pool = aioredis.ConnectionPool(
                connection_class=node.connection_class, **node.connection_kwargs
            )
            client = self._nodes[node.name] = aioredis.Redis(connection_pool=pool)
        return client.pipeline(transaction=True)

    async def aclose(self) -> None:
        for client in self._nodes.values():
            await client.aclose()
        self._nodes.clear()
