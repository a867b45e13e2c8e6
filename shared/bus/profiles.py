"""Cost profiles through Redis: each model service publishes the profile of the model it runs
(measured on its own machine), the scheduler assembles them into its cost model, and the gateway
exports them under /metrics. Keys live as long as the deployment (no TTL): a profile describes
hardware, not a process."""

from __future__ import annotations

from shared.bus.client import Bus
from shared.scheduling.cost_model import CostProfile, ModelProfile
from shared.wire.streams import cell_prefix, profile_key, profile_pattern

TARGET = "target"


DRAFT_PREFIX = "draft:"


def draft_role(model: str) -> str:
    return f"{DRAFT_PREFIX}{model}"


def role_name(role: str) -> str:
    """A published role as the cost model names it: a draft's model, or `target`."""
    return role.removeprefix(DRAFT_PREFIX)


async def publish_profile(bus: Bus, cell: str, role: str, profile: ModelProfile) -> None:
    await bus.redis.set(profile_key(cell, role), profile.model_dump_json())


async def read_profiles(bus: Bus, cell: str) -> dict[str, ModelProfile]:
    """Published profiles by role (`target`, `draft:<model>`)."""
    keys = [key async for key in bus.redis.scan_iter(profile_pattern(cell), 100)]
    if not keys:
        return {}
    values = await bus.redis.mget(keys)
    prefix = f"{cell_prefix(cell)}:profile:"
    out = {}
    for key, value in zip(keys, values, strict=True):
        if value is None:
            continue
        name = key.decode() if isinstance(key, bytes) else key
        out[name.removeprefix(prefix)] = ModelProfile.model_validate_json(value)
    return out


def assemble(profiles: dict[str, ModelProfile]) -> CostProfile | None:
    """One cost profile from the target's and the drafts' published ones (None: no target)."""
    target = profiles.get(TARGET)
    if target is None:
        return None
    drafts = {role_name(role): p for role, p in profiles.items() if role.startswith(DRAFT_PREFIX)}
    method = "published by the model services"
    return CostProfile(target=target, drafts=drafts, method=method)


# ---- which profile is in force -----------------------------------------------------------------
def profile_status_key(cell: str, role: str) -> str:
    return f"{cell_prefix(cell)}:profile-status:{role}"


async def publish_profile_status(
    bus: Bus, cell: str, role: str, *, source: str, detail: str, published: bool
) -> None:
    """Where a model service's profile came from (`cost_profiles.ProfileChoice.source`), what
    was wrong with a suspect one, and whether it was published for the scheduler."""
    fields = {"source": source, "detail": detail[:500], "published": int(published)}
    await bus.redis.hset(profile_status_key(cell, role), mapping=fields)


async def read_profile_statuses(bus: Bus, cell: str) -> dict[str, dict[str, str]]:
    """Role -> {source, detail, published} of every model service that published a status."""
    prefix = profile_status_key(cell, "")
    out = {}
    async for key in bus.redis.scan_iter(f"{prefix}*", 100):
        name = key.decode() if isinstance(key, bytes) else key
        raw = await bus.redis.hgetall(key)
        out[name.removeprefix(prefix)] = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
    return out
