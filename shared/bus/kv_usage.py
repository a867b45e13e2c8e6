"""KV cache occupancy through Redis: each model service writes its cache's block counts after a
job that changed them, and the gateway exports them under /metrics, as
`augury_kv_cache_usage_perc{role}` and `augury_prefix_cache_kept_blocks{role}`.

Role: `target`, or `draft:<model>:<replica>` (each drafter replica has its own cache)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.client import Bus
from shared.model.kv_cache import PagedKVCache
from shared.wire.streams import kv_usage_key

FIELDS = ("blocks", "held", "kept")


@dataclass(frozen=True)
class KVUsage:
    blocks: int  # the cache's blocks
    held: int  # blocks requests hold
    kept: int  # blocks no request holds, kept for the prefix cache

    @classmethod
    def of(cls, cache: PagedKVCache) -> KVUsage:
        allocator = cache.allocator
        held = allocator.num_blocks - allocator.num_free
        return cls(allocator.num_blocks, held, allocator.num_kept)


class KVUsageReporter:
    """Writes one service's cache counts when they changed (one HSET: small beside a job)."""

    def __init__(self, bus: Bus, cell: str, role: str) -> None:
        self.bus = bus
        self.key = kv_usage_key(cell)
        self.role = role
        self._last: KVUsage | None = None

    async def report(self, usage: KVUsage) -> None:
        if usage == self._last:
            return
        mapping = {f"{self.role}|{name}": getattr(usage, name) for name in FIELDS}
        await self.bus.redis.hset(self.key, mapping=mapping)
        self._last = usage


async def read_kv_usage(bus: Bus, cell: str) -> dict[str, KVUsage]:
    raw = await bus.redis.hgetall(kv_usage_key(cell))
    values: dict[str, dict[str, int]] = {}
    for key, value in raw.items():
        text = key.decode() if isinstance(key, bytes) else key
        role, _, name = text.rpartition("|")
        if name in FIELDS:
            values.setdefault(role, {})[name] = int(value)
    return {role: KVUsage(**v) for role, v in values.items() if set(v) == set(FIELDS)}
