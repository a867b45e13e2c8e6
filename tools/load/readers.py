"""Reading and writing traces: our JSONL, the Azure LLM inference CSV, ShareGPT JSON.

`read_trace` picks the reader by the file's suffix and returns `TraceRequest`s sorted by
arrival; `write_trace` writes our JSONL, which `read_trace` reads back to equal requests.

Our JSONL is the Mooncake trace format (one object a line: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids`) with optional fields of our own: `prompt` or `messages`
([{role, content}]), `kind`, `tpot_slo_ms`, `slo_class`, `priority`, `max_tokens`,
`temperature`, `app`. Unknown fields are ignored.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from shared.datasets import iter_json_array
from tools.load.arrivals import arrival_times
from tools.load.trace import TraceError, TraceRequest

CountTokens = Callable[[str], int]

SHAREGPT_DEFAULT_OUTPUT = 128  # output tokens of a conversation without an answer
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

_STAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}(?::?\d{2})?)?"
)
_HUMAN = {"human", "user"}
_NOT_ANSWER = _HUMAN | {"system"}


def read_trace(
    path: Path,
    *,
    rate: float | None = None,
    seed: int = 0,
    limit: int | None = None,
    count_tokens: CountTokens | None = None,
) -> list[TraceRequest]:
    """The requests of a trace file, sorted by arrival (ties keep file order).

    `.jsonl`: our JSONL; `.csv`: Azure LLM inference trace; `.json`: ShareGPT conversations,
    whose arrivals are synthesized as a Poisson process of `rate` requests/s (with `seed`), and
    whose answer lengths are measured with `count_tokens` (default: characters / 4).
    `limit` keeps the first requests of the file. Raises `TraceError` naming file and line.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    suffix = path.suffix.lower()
    if suffix == ".json":
        if rate is None:
            raise TraceError(
                f"{path}: a ShareGPT trace has no timestamps: give a rate (requests/s) "
                "to synthesize arrivals"
            )
        return _read_sharegpt(path, rate, seed, limit, count_tokens or chars_to_tokens)
    if suffix not in (".jsonl", ".csv"):
        raise TraceError(f"{path}: unknown trace format {suffix!r} (use .jsonl, .csv or .json)")
    if rate is not None:
        raise TraceError(f"{path}: has its own timestamps; rate applies to ShareGPT (.json) only")
    requests = _read_jsonl(path, limit) if suffix == ".jsonl" else _read_azure(path, limit)
    return sorted(requests, key=lambda r: r.arrival_s)


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> None:
    """Write requests as our JSONL (timestamps in ms, only fields that differ from defaults)."""
    lines = []
    for index, request in enumerate(requests):
        obj = request_to_json(request)
        try:
            parse_request(obj)  # what cannot be read back is not written
        except ValueError as e:
            raise TraceError(f"request {index}: {e}") from None
        lines.append(_dumps(obj) + "\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")


# ---- our JSONL ---------------------------------------------------------------------------------


def parse_request(obj: Any) -> TraceRequest:
    """One request from a decoded JSONL object; ValueError says what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    request = TraceRequest(
        arrival_s=_arrival_s(obj),
        input_length=_count(obj, "input_length"),
        output_length=_count(obj, "output_length"),
        prompt=_text(obj, "prompt"),
        messages=_messages(obj.get("messages")),
        kind=_text(obj, "kind"),
        tpot_slo_ms=_number(obj, "tpot_slo_ms", positive=True),
        slo_class=_text(obj, "slo_class"),
        priority=_integer(obj, "priority") or 0,
        max_tokens=_count(obj, "max_tokens"),
        temperature=_number(obj, "temperature"),
        app=_text(obj, "app"),
        hash_ids=_hash_ids(obj.get("hash_ids")),
    )
    _check_complete(request)
    return request


def _hash_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError("hash_ids must be a list of non-negative integers")
    return tuple(value)


def request_to_json(request: TraceRequest) -> dict[str, Any]:
    """The JSONL object of a request: `timestamp` (ms), then the fields not at their defaults.

    The timestamp is a `Decimal` (the shortest decimal of `arrival_s`, times 1000) so that it
    reads back to exactly `arrival_s`.
    """
    obj: dict[str, Any] = {"timestamp": _ms(request.arrival_s)}
    for name in (
        "input_length",
        "output_length",
        "prompt",
        "messages",
        "kind",
        "tpot_slo_ms",
        "slo_class",
        "max_tokens",
        "temperature",
        "app",
    ):
        value = getattr(request, name)
        if value is not None:
            obj[name] = value
    if request.hash_ids is not None:
        obj["hash_ids"] = list(request.hash_ids)
    if request.messages is not None:
        obj["messages"] = [{"role": role, "content": text} for role, text in request.messages]
    if request.priority != 0:
        obj["priority"] = request.priority
    return obj


def _read_jsonl(path: Path, limit: int | None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    out.append(parse_request(_decode(line)))
            except ValueError as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
    return out


def _decode(line: str) -> Any:
    try:
        return json.loads(line, parse_float=Decimal)  # exact timestamps (see `_ms`)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} (column {e.colno})") from None


def _check_complete(request: TraceRequest) -> None:
    if request.prompt is not None and request.messages is not None:
        raise ValueError("give prompt or messages, not both")
    if request.input_length is None and request.prompt is None and request.messages is None:
        raise ValueError("needs input_length, prompt or messages")
    if request.output_length is None and request.max_tokens is None:
        raise ValueError("needs output_length or max_tokens")


def _arrival_s(obj: dict[str, Any]) -> float:
    ms = _raw_number(obj, "timestamp")
    if ms is None:
        raise ValueError("missing timestamp (ms)")
    return float(ms / 1000)


def _number(obj: dict[str, Any], name: str, *, positive: bool = False) -> float | None:
    value = _raw_number(obj, name, positive=positive)
    return None if value is None else float(value)


def _raw_number(
    obj: dict[str, Any], name: str, *, positive: bool = False
) -> int | float | Decimal | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _integer(obj: dict[str, Any], name: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, float | Decimal) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value}")
    return value


def _count(obj: dict[str, Any], name: str) -> int | None:
    """A token count: a positive integer, or None when absent."""
    try:
        value = _integer(obj, name)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {obj[name]!r}") from None
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _text(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _messages(value: Any) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages must be a non-empty list, got {value!r}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {content!r}")
        out.append((role, content))
    return tuple(out)


def _ms(arrival_s: float) -> Decimal:
    """`arrival_s` in ms, exactly: its shortest decimal shifted by 3 places (no rounding)."""
    return Decimal(repr(float(arrival_s))).scaleb(3).normalize()


def _dumps(obj: dict[str, Any]) -> str:
    """One JSONL line; the Decimal timestamp goes out digit for digit (json would quote it)."""
    rest = json.dumps({k: v for k, v in obj.items() if k != "timestamp"}, ensure_ascii=False)
    head = f'{{"timestamp": {format(obj["timestamp"], "f")}'
    return head + ("}" if rest == "{}" else ", " + rest[1:])


# ---- Azure LLM inference trace (CSV) -----------------------------------------------------------


def _read_azure(path: Path, limit: int | None) -> list[TraceRequest]:
    """Rows of TIMESTAMP,ContextTokens,GeneratedTokens; arrivals from the earliest row."""
    rows: list[tuple[tuple[datetime | None, float], int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        columns = _azure_columns(path, next(reader, None))
        for row in reader:
            if limit is not None and len(rows) >= limit:
                break
            if not any(cell.strip() for cell in row):
                continue
            try:
                rows.append(_azure_row(row, columns))
                if (rows[-1][0][0] is None) != (rows[0][0][0] is None):
                    raise ValueError("TIMESTAMP mixes date-times and numbers")
            except ValueError as e:
                raise TraceError(f"{path}:{reader.line_num}: {e}") from None
    first = min((moment for moment, _, _ in rows), default=None)
    return [
        TraceRequest(
            arrival_s=_seconds_since(first, moment), input_length=n_in, output_length=n_out
        )
        for moment, n_in, n_out in rows
    ]


def _azure_columns(path: Path, header: list[str] | None) -> tuple[int, int, int]:
    if header is None:
        raise TraceError(f"{path}: empty; expected the header {','.join(AZURE_COLUMNS)}")
    names = [cell.strip().lower() for cell in header]
    if not all(column.lower() in names for column in AZURE_COLUMNS):
        raise TraceError(
            f"{path}:1: expected the header {','.join(AZURE_COLUMNS)}, got {','.join(header)}"
        )
    stamp, context, generated = (names.index(column.lower()) for column in AZURE_COLUMNS)
    return stamp, context, generated


def _azure_row(
    row: list[str], columns: tuple[int, int, int]
) -> tuple[tuple[datetime | None, float], int, int]:
    if len(row) <= max(columns):
        raise ValueError(f"expected {max(columns) + 1} fields, got {len(row)}")
    stamp, context, generated = (row[i].strip() for i in columns)
    return (
        _moment(stamp),
        _token_cell("ContextTokens", context),
        _token_cell("GeneratedTokens", generated),
    )


def _token_cell(name: str, cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {cell!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def _moment(cell: str) -> tuple[datetime | None, float]:
    """A TIMESTAMP as (whole seconds, fraction), or (None, seconds) for a plain number.

    Azure writes 7 fractional digits (`2023-11-16 18:15:46.6805900`), more than `datetime`
    holds, so the fraction is kept apart as a float. Date-times without an offset are UTC.
    """
    try:
        seconds = float(cell)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"TIMESTAMP must be finite, got {cell!r}")
        return None, seconds
    match = _STAMP.fullmatch(cell)
    if match is None:
        raise ValueError(f"TIMESTAMP {cell!r} is neither a date-time nor a number")
    date, time, fraction, offset = match.groups()
    try:
        whole = datetime.strptime(f"{date} {time}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise ValueError(f"TIMESTAMP {cell!r} is not a valid date-time") from None
    return whole.replace(tzinfo=_zone(offset)), float(f"0.{fraction or 0}")


def _zone(offset: str | None) -> timezone:
    if offset is None or offset == "Z":
        return UTC
    digits = offset[1:].replace(":", "")
    delta = timedelta(hours=int(digits[:2]), minutes=int(digits[2:] or 0))
    return timezone(-delta if offset[0] == "-" else delta)


def _seconds_since(
    first: tuple[datetime | None, float] | None, moment: tuple[datetime | None, float]
) -> float:
    assert first is not None
    if moment[0] is None or first[0] is None:
        return moment[1] - first[1]
    return (moment[0] - first[0]).total_seconds() + (moment[1] - first[1])


# ---- ShareGPT (JSON) ---------------------------------------------------------------------------


def _read_sharegpt(
    path: Path, rate: float, seed: int, limit: int | None, count_tokens: CountTokens
) -> list[TraceRequest]:
    """The first human turn of each conversation, answered at the length of the reply."""
    _check_json_array(path)
    exchanges = []
    for index, item in enumerate(iter_json_array(path)):
        if limit is not None and len(exchanges) >= limit:
            break
        try:
            exchange = _first_exchange(item)
        except ValueError as e:
            raise TraceError(f"{path}: item {index}: {e}") from None
        if exchange is not None:
            exchanges.append(exchange)
    arrivals = arrival_times(rate, count=len(exchanges), seed=seed)
    return [
        TraceRequest(
            arrival_s=float(arrival),
            output_length=SHAREGPT_DEFAULT_OUTPUT if answer is None else count_tokens(answer),
            messages=(("user", question),),
            kind="chat",
        )
        for arrival, (question, answer) in zip(arrivals, exchanges, strict=True)
    ]


def _check_json_array(path: Path) -> None:
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        raise TraceError(f"{path}: not a ShareGPT trace (expected a JSON array of conversations)")


def _first_exchange(item: Any) -> tuple[str, str | None] | None:
    """(first human message, the reply that follows it or None); None without a human turn."""
    if not isinstance(item, dict):
        raise ValueError(f"expected an object, got {type(item).__name__}")
    turns = item.get("conversations") or []
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError("conversations must be a list of {from, value} objects")
    for i, turn in enumerate(turns):
        if turn.get("from") in _HUMAN and isinstance(turn.get("value"), str) and turn["value"]:
            return turn["value"], _answer(turns[i + 1 : i + 2])
    return None


def _answer(following: list[dict[str, Any]]) -> str | None:
    for turn in following:
        value = turn.get("value")
        if turn.get("from") not in _NOT_ANSWER and isinstance(value, str) and value:
            return value
    return None


def chars_to_tokens(text: str) -> int:
    """A token count estimate for text without a tokenizer: 4 characters a token."""
    return max(1, round(len(text) / 4))
