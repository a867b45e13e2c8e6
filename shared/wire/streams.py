"""Redis key names: one place, so every service agrees.

| key | entries | writer -> reader (group) |
|---|---|---|
| `augury:{cell}:requests` | Submit, Cancel | gateways -> scheduler |
| `augury:{cell}:draft:{model}:{replica}` | DraftJob | scheduler -> that drafter replica |
| `augury:{cell}:candidates` | CandidateTrees | drafters -> scheduler |
| `augury:{cell}:verify` | VerifyJob | scheduler -> verifier |
| `augury:{cell}:results` | VerifyResult | verifier -> scheduler |
| `augury:out:{gateway}` | Tokens, RequestError | schedulers of any cell -> one gateway replica |
| `{stream}:dead` | dead letters of `{stream}` | bus -> operators |
| `augury:{cell}:hb:{service}:{replica}` | a Heartbeat hash with a TTL | each replica |
| `augury:{cell}:recorded` | one JSON record per finished request | gateways -> replay tools |
| `augury:{cell}:scheduler:lease` | the scheduler serving the cell (TTL) | scheduler |
| `augury:{cell}:scheduler:{submits,progress,finished}` | its requests | scheduler -> successor |
| `augury:{cell}:scheduler:{output,accepted}:{id}` | its tokens, appended | scheduler -> successor |

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


def requests_stream(cell: str) -> str:
    return f"{PREFIX}:{cell}:requests"


def draft_stream(cell: str, model: str, replica: str) -> str:
    return f"{PREFIX}:{cell}:draft:{model}:{replica}"


def candidates_stream(cell: str) -> str:
    return f"{PREFIX}:{cell}:candidates"


def verify_stream(cell: str) -> str:
    return f"{PREFIX}:{cell}:verify"


def results_stream(cell: str) -> str:
    return f"{PREFIX}:{cell}:results"


def output_stream(gateway_replica: str) -> str:
    return f"{PREFIX}:out:{gateway_replica}"


def is_output_stream(name: str) -> bool:
    """Whether `name` is a gateway replica's output stream (a Submit's `reply_to` must be)."""
    prefix = output_stream("")
    return name.startswith(prefix) and len(name) > len(prefix) and ":" not in name[len(prefix) :]


def dead_letter_stream(stream: str) -> str:
    return stream + DEAD_LETTER_SUFFIX


def heartbeat_key(cell: str, service: str, replica: str) -> str:
    return f"{PREFIX}:{cell}:hb:{service}:{replica}"


def heartbeat_pattern(cell: str, service: str) -> str:
    """SCAN MATCH pattern of a service's heartbeat keys (cell and service are key-safe names)."""
    return f"{PREFIX}:{cell}:hb:{service}:*"


def recorded_stream(cell: str) -> str:
    """Requests the gateways accepted, one JSON record each (when gateway.record_requests)."""
    return f"{PREFIX}:{cell}:recorded"


def profile_key(cell: str, role: str) -> str:
    """A model service's cost profile (JSON): role `target`, or `draft:<model>`."""
    return f"{PREFIX}:{cell}:profile:{role}"


def profile_pattern(cell: str) -> str:
    return f"{PREFIX}:{cell}:profile:*"


def preemptions_key(cell: str) -> str:
    """Hash of the cell's preemption totals by kind (kept, swapped, recomputed)."""
    return f"{PREFIX}:{cell}:preemptions"


def scheduler_lease_key(cell: str) -> str:
    """Names the one scheduler serving the cell; expires unless that scheduler renews it."""
    return f"{PREFIX}:{cell}:scheduler:lease"


def scheduler_submits_key(cell: str) -> str:
    """Hash: request id -> the accepted Submit and what the scheduler resolved for it."""
    return f"{PREFIX}:{cell}:scheduler:submits"


def scheduler_progress_key(cell: str) -> str:
    """Hash: request id -> its step, statistics and how many committed tokens it has (written with
    its Tokens; the tokens themselves are in `scheduler_output_key`)."""
    return f"{PREFIX}:{cell}:scheduler:progress"


def scheduler_output_key(cell: str, request_id: str) -> str:
    """String: a running request's committed output, packed int32, only ever extended (SETRANGE at
    the end), so a step writes its new tokens rather than the whole output again."""
    return f"{PREFIX}:{cell}:scheduler:output:{request_id}"


def scheduler_accepted_key(cell: str, request_id: str) -> str:
    """String: a running request's accepted length per speculative step, packed int32, extended
    like `scheduler_output_key`."""
    return f"{PREFIX}:{cell}:scheduler:accepted:{request_id}"


def scheduler_finished_key(cell: str) -> str:
    """Sorted set of the latest finished request ids (by time): a redelivered Submit of one is
    recognised after a restart."""
    return f"{PREFIX}:{cell}:scheduler:finished"
