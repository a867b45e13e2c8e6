"""Redis-streams bus: publish, consume in groups with acks after the next hop's
write, XAUTOCLAIM sweeping, dead letters, heartbeats, and an embedded Redis for one machine.
"""

from shared.bus.client import Bus
from shared.bus.consumer import DeadLetterError, Delivery, Handler, StreamConsumer
from shared.bus.embedded import EmbeddedRedis, redis_url
from shared.bus.heartbeat import Heartbeater, live_replicas

__all__ = [
    "Bus",
    "DeadLetterError",
    "Delivery",
    "EmbeddedRedis",
    "Handler",
    "Heartbeater",
    "StreamConsumer",
    "live_replicas",
    "redis_url",
]
