"""Traffic the gateways recorded in Redis (`gateway.record_requests`), read back as a trace.

The gateway appends one entry per finished request to `augury:{cell}:recorded` (the record's
fields: `services/gateway/recording.py`). `read_recorded` turns them into `TraceRequest`s in
arrival order, with arrivals relative to the first one; the output length is what the request
generated (at least 1, so that a request cancelled before its first token still replays as
one), and `max_tokens` is left unset so that a replay with `ignore_eos` generates exactly that.

A recording is named by a Redis URL with the stream as a query parameter, which `split_trace_url`
takes apart:

    redis://host:6379/0?stream=augury:{0}:recorded
    unix:///run/redis.sock?db=0&stream=augury:{0}:recorded
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis

from tools.load.trace import TraceError, TraceRequest

log = logging.getLogger(__name__)

RECORD_VERSIONS = ("1",)
REDIS_SCHEMES = ("redis", "rediss", "unix")
STREAM_PARAM = "stream"
PAGE = 1000  # entries per XRANGE


def is_redis_url(text: str) -> bool:
    return urlsplit(text).scheme in REDIS_SCHEMES and "://" in text


def split_trace_url(url: str) -> tuple[str, str | None]:
    """`redis://h:6379/0?stream=S` -> ("redis://h:6379/0", "S"); other parameters stay."""
    # (not urlunsplit: it writes unix:///path back as unix:/path)
    base, _, query = url.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    streams = [value for name, value in params if name == STREAM_PARAM]
    rest = [(name, value) for name, value in params if name != STREAM_PARAM]
    stripped = f"{base}?{urlencode(rest)}" if rest else base
    return stripped, streams[-1] if streams else None


def read_recorded(redis_url: str, stream: str, *, count: int | None = None) -> list[TraceRequest]:
    """The recorded requests of `stream` in arrival order: all, or the first `count` entries
    (the stream is in the order requests ended).

    Entries of an unknown record version are skipped with a warning; a malformed record raises
    TraceError naming the entry; Redis failures raise redis' own errors.
    """
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        records = [
            (entry_id, record)
            for entry_id, record in _records(client, stream, count)
            if record is not None
        ]
    finally:
        client.close()
    records.sort(key=lambda item: float(item[1]["arrival_time"]))
    if not records:
        return []
    start = float(records[0][1]["arrival_time"])
    return [_to_request(stream, entry_id, record, start) for entry_id, record in records]


def _records(
    client: redis.Redis, stream: str, count: int | None
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(entry id, record) in stream order; None for a skipped entry. Pages through XRANGE."""
    seen, low, skipped = 0, "-", 0
    while count is None or seen < count:
        page = client.xrange(stream, min=low, max="+", count=PAGE)
        if not page:
            break
        for entry_id, fields in page:
            if count is not None and seen >= count:
                break
            record = _decode(stream, entry_id, fields)
            if record is None:
                skipped += 1
            else:
                seen += 1
            yield entry_id, record
        low = "(" + page[-1][0]
    if skipped:
        log.warning(
            "%s: skipped %d entries of an unknown record version (known: %s)",
            stream,
            skipped,
            ", ".join(RECORD_VERSIONS),
        )


def _decode(stream: str, entry_id: str, fields: dict[str, str]) -> dict[str, Any] | None:
    version = fields.get("v")
    if version not in RECORD_VERSIONS:
        return None
    try:
        record = json.loads(fields["record"])
    except (KeyError, json.JSONDecodeError) as error:
        raise TraceError(f"{stream} {entry_id}: malformed record ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("arrival_time"), int | float):
        raise TraceError(f"{stream} {entry_id}: malformed record (no arrival_time)")
    return record


def _to_request(stream: str, entry_id: str, record: dict[str, Any], start: float) -> TraceRequest:
    try:
        return TraceRequest(
            arrival_s=float(record["arrival_time"]) - start,
            input_length=int(record["input_length"]),
            output_length=max(1, int(record["output_length"])),
            prompt=record.get("prompt"),
            messages=_messages(record.get("messages")),
            tpot_slo_ms=_optional_float(record.get("tpot_slo_ms")),
            slo_class=record.get("slo_class"),
            priority=int(record.get("priority") or 0),
            temperature=_optional_float(record.get("temperature")),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise TraceError(f"{stream} {entry_id}: malformed record ({error!r})") from None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _messages(value: Any) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return None
    return tuple((str(m["role"]), str(m["content"])) for m in value)
