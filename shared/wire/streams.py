"""Redis key names: one place, so every service agrees.

| key | entries | writer -> reader (group) |
|---|---|---|
| `augury:{cell}:requests` | Submit, Cancel | gateways -> scheduler |
| `augury:{cell}:draft:{model}:{replica}` | DraftJob | scheduler -> that drafter replica |
| `augury:{cell}:candidates` | CandidateTrees | drafters -> scheduler |
| `augury:{cell}:verify` | VerifyJob | scheduler -> verifier |
| `augury:{cell}:results` | VerifyResult | verifier -> scheduler |
| `augury:{cell}:out:{gateway}` | Tokens, RequestError | the scheduler -> one gateway replica |
| `{stream}:dead` | dead letters of `{stream}` | bus -> operators |
| `augury:{cell}:hb:{service}:{replica}` | a Heartbeat hash with a TTL | each replica |
| `augury:{cell}:recorded` | one JSON record per finished request | gateways -> replay tools |
| `augury:{cell}:scheduler:lease` | the scheduler serving the cell (TTL) | scheduler |
| `augury:{cell}:scheduler:{submits,progress,finished}` | its requests | scheduler -> successor |
| `augury:{cell}:scheduler:{output,accepted}:{id}` | its tokens, appended | scheduler -> successor |

`{cell}` is written with its braces: a Redis Cluster hash tag, so that every key of a cell is in
one hash slot (the scheduler's transactions, a consumer's multi-stream reads and a dead letter's
copy-and-ack stay on one node), and different cells spread over the cluster's nodes. A gateway
that serves several cells reads one output stream per cell for the same reason.

Draft jobs go to one replica's stream, not a shared one, because the scheduler keeps a request
on the same replica (its draft KV stays warm). Outputs go to one stream per gateway replica,
named by `Submit.reply_to`, instead of one stream per request: a gateway then has a single
blocking read for all its requests, a new request needs no new read, and no per-request keys
are left to expire. Readers pick out their request by `request_id` and drop repeats by offset.
"""

from __future__ import annotations

PREFIX = "augury"
DEAD_LETTER_SUFFIX = ":dead"

SCHEDULER = "scheduler"
DRAFTER = "drafter"
VERIFIER = "verifier"
GATEWAY = "gateway"


def cell_prefix(cell: str) -> str:
    """`augury:{cell}`: what every key of the cell starts with (the braces are its hash tag)."""
    return f"{PREFIX}:{{{cell}}}"


def cell_pattern(cell: str) -> str:
    """SCAN MATCH pattern of every key of a cell (braces are literal in Redis's glob)."""
    return cell_prefix(cell) + ":*"


def requests_stream(cell: str) -> str:
    return f"{cell_prefix(cell)}:requests"


def draft_stream(cell: str, model: str, replica: str) -> str:
    return f"{cell_prefix(cell)}:draft:{model}:{replica}"


def candidates_stream(cell: str) -> str:
    return f"{cell_prefix(cell)}:candidates"


def verify_stream(cell: str) -> str:
    return f"{cell_prefix(cell)}:verify"


def results_stream(cell: str) -> str:
    return f"{cell_prefix(cell)}:results"


def output_stream(cell: str, gateway_replica: str) -> str:
    """Where the cell's scheduler writes the outputs of a gateway replica's requests."""
    return f"{cell_prefix(cell)}:out:{gateway_replica}"


def output_stream_replica(cell: str, name: str) -> str | None:
    """The gateway replica whose output stream of `cell` is `name`; None if `name` is not one (a
    Submit's `reply_to` must be one of its own cell: another cell's key is on another node)."""
    prefix = output_stream(cell, "")
    replica = name[len(prefix) :]
    return replica if name.startswith(prefix) and replica and ":" not in replica else None


def dead_letter_stream(stream: str) -> str:
    return stream + DEAD_LETTER_SUFFIX


def heartbeat_key(cell: str, service: str, replica: str) -> str:
    return f"{cell_prefix(cell)}:hb:{service}:{replica}"


def heartbeat_pattern(cell: str, service: str) -> str:
    """SCAN MATCH pattern of a service's heartbeat keys (cell and service are key-safe names)."""
    return f"{cell_prefix(cell)}:hb:{service}:*"


def recorded_stream(cell: str) -> str:
    """Requests the gateways accepted, one JSON record each (when gateway.record_requests)."""
    return f"{cell_prefix(cell)}:recorded"


def profile_key(cell: str, role: str) -> str:
    """A model service's cost profile (JSON): role `target`, or `draft:<model>`."""
    return f"{cell_prefix(cell)}:profile:{role}"


def profile_pattern(cell: str) -> str:
    return f"{cell_prefix(cell)}:profile:*"


def preemptions_key(cell: str) -> str:
    """Hash of the cell's preemption totals by kind (kept, swapped, recomputed)."""
    return f"{cell_prefix(cell)}:preemptions"


def scheduler_lease_key(cell: str) -> str:
    """Names the one scheduler serving the cell; expires unless that scheduler renews it."""
    return f"{cell_prefix(cell)}:scheduler:lease"


def scheduler_submits_key(cell: str) -> str:
    """Hash: request id -> the accepted Submit and what the scheduler resolved for it."""
    return f"{cell_prefix(cell)}:scheduler:submits"


def scheduler_progress_key(cell: str) -> str:
    """Hash: request id -> its step, statistics and how many committed tokens it has (written with
    its Tokens; the tokens themselves are in `scheduler_output_key`)."""
    return f"{cell_prefix(cell)}:scheduler:progress"


def scheduler_output_key(cell: str, request_id: str) -> str:
    """String: a running request's committed output, packed int32, only ever extended (SETRANGE at
    the end), so a step writes its new tokens rather than the whole output again."""
    return f"{cell_prefix(cell)}:scheduler:output:{request_id}"


def scheduler_accepted_key(cell: str, request_id: str) -> str:
    """String: a running request's accepted length per speculative step, packed int32, extended
    like `scheduler_output_key`."""
    return f"{cell_prefix(cell)}:scheduler:accepted:{request_id}"


def scheduler_finished_key(cell: str) -> str:
    """Sorted set of the latest finished request ids (by time): a redelivered Submit of one is
    recognised after a restart."""
    return f"{cell_prefix(cell)}:scheduler:finished"
