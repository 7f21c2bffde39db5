"""Typed configuration: one model per process, from defaults, then env vars, then CLI flags.

Every field has a default and a docstring. The env var of a field is its path joined with ``_``
under the ``MESH_`` prefix: ``nats.url`` -> ``MESH_NATS_URL``, ``worker.model.path`` ->
``MESH_WORKER_MODEL_PATH``. ``mesh config`` prints them all.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mesh.env_names import env_value, refuse_unknown, set_path
from protocol.codec import RequestLimits
from protocol.errors import InvalidRequestError
from protocol.subjects import TOKEN_PATTERN

ENV_PREFIX = "MESH_"
DEFAULT_MODEL_NAME = "smollm2"


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this machine only (``127.0.0.1``, ``::1``, ``localhost``)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or every interface ("0.0.0.0", "::")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class NatsSettings(_Section):
    url: str | None = None
    """NATS server URL(s), comma-separated. Unset: `mesh up`/`demo` start a local nats-server,
    other commands use nats://127.0.0.1:4222."""
    creds_file: str | None = None
    """NATS credentials file (user JWT + NKey seed), for decentralized auth."""
    token: str | None = None
    """Token auth."""
    user: str | None = None
    """User for user/password auth."""
    password: str | None = None
    """Password for user/password auth."""
    tls_ca_file: str | None = None
    """CA bundle to verify the server's TLS certificate (enables TLS)."""
    tls_cert_file: str | None = None
    """Client certificate for mutual TLS (with tls_key_file)."""
    tls_key_file: str | None = None
    """Client private key for mutual TLS."""
    scope: str | None = Field(default=None, pattern=TOKEN_PATTERN)
    """Who this process queues requests as: the <scope> in mesh.v1.infer.<model>.<scope> and in
    its token subjects mesh.v1.tok.<scope>.<id>. Unset: an edge uses its edge_id, other senders
    'anon'. Under `mesh creds` permissions it must be the user's own scope."""
    inbox_prefix: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
    """Prefix of this connection's reply inboxes (default _INBOX). Under `mesh creds` each user
    may only subscribe below its own prefix, so no one reads another's replies."""
    hub_domain: str | None = Field(default=None, pattern=TOKEN_PATTERN)
    """JetStream domain of the hub, for an edge on its site's leaf node that runs JetStream of
    its own: hub calls go to $JS.<hub_domain>.API, and the site keeps requests that can wait
    (outbox) and their answers in its own streams, across uplink outages."""
    least_privilege: bool = False
    """This process runs under `mesh creds` permissions: use only the calls its role is allowed
    (answer repairs read through the workers, no queue deletes when a request is withdrawn:
    its cancel covers that)."""
    connect_timeout: float = Field(default=5.0, gt=0)
    """Seconds to wait for the first connection."""
    request_timeout: float = Field(default=5.0, gt=0)
    """Seconds to wait for a JetStream API call or a publish ack."""
    reconnect_wait: float = Field(default=0.5, gt=0)
    """Seconds between reconnect attempts (a server restart or a dropped link costs about this
    much more than the outage itself)."""
    ping_interval: float = Field(default=1.0, gt=0)
    """Seconds between pings to the server. A link that answers none of three in a row (lost
    without a reset: a host gone, a partition, a NAT's drop) is dialled again: in 3 to 4 s."""
    max_reconnect_attempts: int = -1
    """Reconnect attempts before giving up; -1 tries forever."""
    drain_timeout: float = Field(default=5.0, gt=0)
    """Seconds to drain subscriptions and flush on shutdown."""
    write_gap_ms: float | None = Field(default=None, ge=0, le=100)
    """Answer events after the first few are written together, at most once per this many ms
    while busy; after a quiet spell one goes at once (0: when the loop comes round). Unset: 4 ms
    for a worker, 1 ms elsewhere (:data:`mesh.write_batch.SOURCE_GAP_MS` says why)."""
    local_port: int = Field(default=4222, ge=-1, le=65535)
    """Port of the nats-server that `mesh up` starts (-1 picks a free one)."""
    store_dir: str | None = None
    """JetStream store of the local nats-server; a temporary directory when unset."""

    def scope_or(self, default: str) -> str:
        return self.scope or default

    def servers(self) -> list[str]:
        return [s.strip() for s in (self.url or "nats://127.0.0.1:4222").split(",") if s.strip()]


class StreamSettings(_Section):
    name: str = "MESH_INFER"
    """Work-queue stream holding escalated requests."""
    storage: Literal["file", "memory"] = "file"
    """Where the stream keeps messages."""
    replicas: int = Field(default=1, ge=1, le=5)
    """Copies of every hub stream and of the registry bucket (MESH_INFER, MESH_TOK,
    MESH_ANSWERS, mesh_nodes), on as many servers of a JetStream cluster. 1 (the embedded
    default): a lost server loses its queue. 3 on a 3-node cluster: any one server can die and
    the queue, answers in flight and the registry carry on after a leader election (seconds);
    each write then waits for a quorum (2 of 3), a few hundred microseconds more on a LAN.
    Provisioning moves existing streams to a new count."""
    answer_replicas: int | None = Field(default=None, ge=1, le=5)
    """Copies of MESH_TOK alone (default: replicas). Every answer event is a write to it: at
    3, each is a Raft round on 3 servers, several times the server CPU per token of 1 (see
    `mesh bench fleet`). 1 keeps the queue and the kept answers replicated while answers in
    flight on a lost server must start over instead of continuing."""
    placement_cluster: str | None = None
    """Put the streams in this JetStream cluster (a supercluster's member); unset: the
    provisioning server's own."""
    placement_tags: list[str] = Field(default_factory=list)
    """Put the streams only on servers with all these tags (server_tags in their config), for
    example a zone or the servers with fast disks."""
    max_msgs: int = Field(default=10_000, ge=1)
    """Queued requests (all models) beyond which publishers get 'overloaded'."""
    max_msgs_per_scope: int = Field(default=2_500, ge=-1)
    """Queued requests one sender (one <scope>, for one model) may hold at once; beyond them its
    next gets 'overloaded' while other senders still get in, so no one sender fills the queue.
    JetStream's own per-subject limit (discard new per subject); -1: no limit."""
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    """Queued bytes beyond which publishers get 'overloaded'."""
    max_age: float = Field(default=3600.0, gt=0)
    """Seconds a queued request is kept at most."""
    duplicate_window: float = Field(default=120.0, gt=0)
    """Seconds during which a re-published request id is dropped as a duplicate (its sender then
    reads the answer from the token store)."""
    ack_wait: float = Field(default=5.0, gt=0)
    """Seconds without ack or progress after which a request is redelivered to another worker,
    which continues the answer. Workers report progress every ack_wait x progress_fraction."""
    max_deliver: int = Field(default=3, ge=1)
    """Deliveries of one request before it fails for good (a typed max_deliveries error)."""
    max_ack_pending: int = Field(default=1024, ge=1)
    """Fleet-wide ceiling on requests in flight per model."""
    retry_after: float = Field(default=2.0, gt=0)
    """Seconds suggested to clients when the queue is full."""
    heartbeat: float = Field(default=1.0, gt=0)
    """Seconds between a worker's announcements in the node registry (KV mesh_nodes)."""
    node_ttl: float = Field(default=3.0, gt=0)
    """Seconds without an announcement after which a worker counts as gone."""
    answer_stream: str = "MESH_TOK"
    """Stream that keeps answer events a while (catch-up, continuation, answering again)."""
    answer_storage: Literal["file", "memory", "off"] = "file"
    """Where MESH_TOK keeps events; file survives a server restart. off: no catch-up or
    continuation (a gap becomes a typed error, a worker's death a restart)."""
    answer_max_age: float = Field(default=120.0, gt=0)
    """Seconds answer events are kept; at most duplicate_window, so an id queued again later
    never meets an older answer's events."""
    answer_max_bytes: int = Field(default=512 * 1024 * 1024, ge=1024 * 1024)
    """Bytes MESH_TOK keeps at most (oldest events go first)."""
    kept_max_age: float = Field(default=7 * 86400.0, gt=0)
    """Seconds the answers of requests that can wait are kept, on the hub (MESH_ANSWERS, until
    their site collects them) and at the site (MESH_KEPT, for clients asking again by id)."""
    kept_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024 * 1024)
    """Bytes the hub's MESH_ANSWERS keeps at most (oldest first): what every site's requests
    that could wait may hold there, together."""
    outbox_max_age: float = Field(default=7 * 86400.0, gt=0)
    """Seconds an edge site holds a request that can wait while its uplink is down."""
    outbox_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    """Bytes an edge site's outbox (MESH_OUTBOX) holds at most: past it, a new request that can
    wait is refused ``overloaded`` (the site's own MESH_KEPT keeps at most ``kept_max_bytes``,
    oldest first, and its claims an eighth of that)."""

    @model_validator(mode="after")
    def _consistent(self) -> StreamSettings:
        if self.answer_max_age > self.duplicate_window:
            raise ValueError(
                "answer_max_age must not exceed duplicate_window: an id queued again after the "
                "window would meet the older answer's events"
            )
        return self


class ModelSettings(_Section):
    backend: Literal["llama_cpp", "openai", "vllm", "deterministic"] = "llama_cpp"
    """Inference engine: in-process llama.cpp, an OpenAI-compatible HTTP server, or vLLM;
    deterministic is a scripted test and benchmark backend, not a model."""
    name: str = DEFAULT_MODEL_NAME
    """Model name clients use; it names the queue subject mesh.v1.infer.<name>."""
    path: str | None = None
    """GGUF file for llama_cpp (default: the bundled SmolLM2-135M), or the vLLM model id/path."""
    n_ctx: int = Field(default=2048, ge=128)
    """Context window in tokens (llama_cpp, vllm)."""
    n_threads: int | None = Field(default=None, ge=1)
    """CPU threads for llama_cpp; half the cores when unset (more stalls under contention)."""
    n_gpu_layers: int = Field(default=0, ge=-1)
    """Layers llama_cpp offloads to the GPU (-1: all); needs llama-cpp-python built with CUDA
    or Metal. 0 runs on the CPU."""
    slots: int = Field(default=1, ge=1, le=1024)
    """Requests generated at once (llama_cpp: model instances; openai/vllm: concurrency)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the OpenAI-compatible server (openai backend)."""
    api_key: str | None = None
    """Bearer token for the OpenAI-compatible server."""
    remote_model: str | None = None
    """Model name to send to the OpenAI-compatible server; `name` when unset."""
    http_timeout: float = Field(default=30.0, gt=0)
    """Seconds to wait for the HTTP server's headers or for its next streamed chunk."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """vLLM: share of GPU memory the engine may take."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """vLLM: GPUs one model replica is split over."""
    enable_prefix_caching: bool | None = None
    """vLLM: reuse the KV cache of shared prompt prefixes (vLLM's default when unset)."""
    quantization: str | None = None
    """vLLM: weight quantization method (awq, gptq, fp8, ...); from the model when unset."""
    speculative_config: dict[str, Any] | None = None
    """vLLM: speculative decoding, as vLLM's speculative_config (JSON in the env var)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """vLLM: any other AsyncEngineArgs, as JSON (e.g. {"max_num_batched_tokens": 8192})."""
    logprobs: bool = False
    """llama_cpp: keep every position's logits so that requests may ask for logprobs (prompt
    processing gets slower); vllm and openai serve logprobs whatever this says."""
    metrics_interval: float = Field(default=1.0, gt=0)
    """openai backend: seconds between reads of the server's vLLM /metrics (engine load)."""
    continuation: Literal["auto", "vllm", "off"] = "auto"
    """openai backend: how to continue an answer another worker began. vllm: vLLM's
    continue_final_message; auto: that, when the server says it is vLLM; off: start over."""
    prefill_delay_ms: float = Field(default=0.0, ge=0)
    """deterministic backend: delay before the first token."""
    token_delay_ms: float = Field(default=0.0, ge=0)
    """deterministic backend: delay between tokens."""
    token_lockstep: bool = False
    """deterministic backend: every answer's tokens on one clock, ``token_delay_ms`` apart, as a
    batching engine (vLLM) makes a token of each running answer per step; else each its own."""
    faults: bool = True
    """deterministic backend: act on fault directives ([hang], [fail-after:K]...) in prompts."""


class LimitSettings(_Section):
    max_payload_bytes: int = Field(default=256 * 1024, ge=1024)
    """Largest request payload accepted, in bytes."""
    max_tokens: int = Field(default=4096, ge=1)
    """Largest max_tokens a request may ask for."""

    def request_limits(self) -> RequestLimits:
        return RequestLimits(max_payload_bytes=self.max_payload_bytes, max_tokens=self.max_tokens)


class WorkerSettings(_Section):
    node_id: str = Field(default_factory=lambda: f"worker-{socket.gethostname()}-{os.getpid()}")
    """Identifies this worker in logs and in `served_by`."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """Engine this worker generates with."""
    also_serve: list[str] = Field(default_factory=list)
    """More models the same engine serves, each ``NAME`` or ``NAME=REMOTE`` (the name the
    server knows it by), e.g. an OpenAI-compatible server with several models or LoRA adapters.
    The worker takes each from its own pool (consumer), as node ``<node_id>-<name>``; the
    engine's own load figures pace them all. Only for the openai and deterministic backends:
    a llama_cpp or vllm engine holds one model."""
    fetch_batch: int = Field(default=16, ge=1)
    """Most requests one pull asks for (at least slots / 8: a worker keeps 8 pulls waiting)."""

    @model_validator(mode="after")
    def _one_engine_many_models(self) -> WorkerSettings:
        if self.also_serve and self.model.backend not in {"openai", "deterministic"}:
            raise ValueError(
                "worker.also_serve needs an engine that serves several models (openai, "
                f"deterministic); a {self.model.backend} engine holds one model: run one "
                "worker per model"
            )
        names = [self.model.name] + [e.partition("=")[0] for e in self.also_serve]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"worker models must be distinct and named: {names}")
        return self

    fetch_timeout: float = Field(default=0.5, gt=0)
    """Seconds a pull request waits for work; also bounds how fast intake stops on shutdown.
    Short, because JetStream hands a request to whichever pull request waits longest: one a
    frozen worker left behind would swallow the delivery of a request handed back from it
    (``cloud_node.orphans`` hands back after about 0.8 s; 2 s here once did that)."""
    progress_fraction: float = Field(default=0.2, gt=0, le=0.5)
    """Tell JetStream 'in progress' every ack_wait x this while generating (1 s by default: a
    link that drops for a few seconds does not cost a redelivery, a dead worker is noticed after
    ack_wait). At most 0.5: a worker that goes ack_wait x 0.8 without a report takes its
    delivery for lost (:mod:`cloud_node.progress`)."""
    stall_timeout: float = Field(default=30.0, gt=0)
    """Seconds the engine may go without producing a token before the worker gives the request
    up as hung and hands it to another worker."""
    coalesce_tokens: int = Field(default=16, ge=1)
    """Most tokens per token message."""
    coalesce_ms: float = Field(default=5.0, ge=0)
    """Wait up to this long to batch tokens into one message (never for the first token)."""
    report_stall_after: float = Field(default=2.0, gt=0)
    """Seconds an answer may go without a token mid-answer, while no other answer of the
    engine got one either, before the worker tells the answer's reader that its engine stands
    still (an edge then answers locally). A long prefill is not covered (the edge's first-token
    timeout is), nor an engine busy with other answers (it moves): only an engine that makes no
    progress at all for this long."""
    drain_grace: float = Field(default=30.0, ge=0)
    """Seconds in-flight requests get to finish on shutdown before they are handed back to the
    queue (another worker continues each from the answer store)."""
    hand_over: bool = True
    """On shutdown, hand in-flight requests over at once when another worker of the pool has
    free slots (the registry says so): it continues each answer from the store within
    milliseconds, so a rolling restart waits for nothing. Without such a worker, or with this
    off, in-flight requests get ``drain_grace`` to finish here."""
    publish_timeout: float = Field(default=5.0, gt=0)
    """Seconds to wait for the end message to be flushed before acking."""
    metrics_port: int = Field(default=-1, ge=-1, le=65535)
    """Port of the worker's Prometheus /metrics (-1: off, 0: any free port)."""


class ConfidenceSettings(_Section):
    enabled: bool = False
    """Mid-answer escalation (opt-in): a request the router keeps local starts on the local
    model; the edge holds its first ``window_tokens`` tokens and, when the model was unsure of
    them, drops them and escalates, so the client sees only the cloud's answer. Needs a backend
    that scores tokens (llama_cpp, deterministic)."""
    window_tokens: int = Field(default=8, ge=1, le=256)
    """Tokens held before deciding; each adds one local token time to the local TTFT."""
    max_mean_entropy: float = Field(default=2.5, ge=0)
    """Escalate when the mean entropy (nats) of the window's next-token distributions is above
    this."""


class RouterSettings(_Section):
    kind: Literal["heuristic", "learned"] = "learned"
    """Router deciding local vs cloud: the trained classifier, or a transparent heuristic."""
    threshold: float | None = Field(default=None, ge=0, le=1)
    """Escalate when the router's score (probability the local model fails) is at or above
    this; when unset, the threshold comes from cloud_share."""
    cloud_share: float = Field(default=0.3, ge=0, le=1)
    """Share of router-decided requests to escalate (the hardest-rated ones) when no threshold
    is set. The threshold tracks recent scores, so the share holds when the traffic shifts."""
    budget_window: int = Field(default=30, ge=10, le=100_000)
    """Recent router scores whose quantile sets the cloud_share threshold (seeded with the
    training prompts' scores)."""
    cloud_cap_per_minute: int | None = Field(default=None, ge=0)
    """Hard cap on router-decided escalations in any 60 s; beyond it the local model answers.
    Forced routes (route=cloud) are not capped. Unset: no cap."""
    budget_state: str | None = None
    """JSON file that keeps the cloud budget (recent scores, shares, cap) across restarts,
    e.g. ~/.local/state/mesh/router-budget.json; not kept when unset."""
    weights: str | None = None
    """Router weights file; the ones shipped with the project when unset."""
    data_dir: str | None = None
    """Labelled routing data for `mesh router train/eval/score`; ../shared/routing when unset."""
    confidence: ConfidenceSettings = Field(default_factory=ConfidenceSettings)
    """Mid-answer escalation from the local model's own confidence."""


class EdgeSettings(_Section):
    edge_id: str = "local"
    """Names the edge's entry subject mesh.v1.edge.<edge_id>.infer."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """The on-device model."""
    cloud_model: str = DEFAULT_MODEL_NAME
    """Cloud model that escalated requests go to unless they name one."""
    cloud_fallbacks: list[str] = Field(default_factory=list)
    """Further cloud pools to try, in order, when the cloud model's pool cannot serve a
    request that names no model (no pool, no live worker, not started in time, a cloud error
    before any token): for example a smaller, less busy model. Each step's reason is kept; the
    answer's end names them in ``fallback``. Past the last, the edge answers locally."""
    router: RouterSettings = Field(default_factory=RouterSettings)
    """The on-device classifier."""
    cloud_start_timeout: float = Field(default=10.0, gt=0)
    """Seconds an escalation may wait in the queue for a worker to start it; then the edge
    withdraws it and answers locally. Sooner when the registry shows no live worker."""
    cloud_first_token_timeout: float = Field(default=3.0, gt=0)
    """Seconds from a worker's start to its first token, for a short prompt; then the edge
    withdraws the request and answers locally (a hung engine)."""
    cloud_prefill_rate: float = Field(default=500.0, gt=0)
    """Prompt tokens per second a working cloud engine prefills at least: the first-token wait
    grows by prompt tokens (and a continuation's kept answer) / this rate."""
    cloud_min_budget: float = Field(default=2.0, ge=0)
    """A request whose deadline leaves less than this many seconds is answered locally."""
    cloud_idle_timeout: float = Field(default=15.0, gt=0)
    """Seconds without any event from a live worker, once tokens flow, before the edge gives up
    on the cloud."""
    replay_window: float = Field(default=60.0, ge=0)
    """Seconds a finished answer is kept for its sender to fetch missed events or ask again."""
    request_timeout: float = Field(default=300.0, gt=0)
    """Longest an answer may take when the request sets no deadline."""
    max_concurrent: int = Field(default=64, ge=1)
    """Requests the edge answers at once, NATS and HTTP together; more get 'overloaded' (429)."""
    local_queue: int = Field(default=8, ge=0)
    """Requests that may wait for the local model beyond its slots; more get 'overloaded'."""
    drain_grace: float = Field(default=1.5, ge=0)
    """Seconds answers in flight get to finish when the edge stops (SIGTERM); the rest end in a
    typed ``unavailable`` (retry elsewhere). Requests that can wait are safe in the site's
    outbox meanwhile. With this the edge stops within about 2 s, whatever its uplink."""
    http_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible HTTP API."""
    http_port: int = Field(default=8080, ge=-1, le=65535)
    """Port of the OpenAI-compatible HTTP API (which also serves /metrics, /health, /ready);
    -1 turns it off, 0 picks a free port."""
    metrics_port: int = Field(default=-1, ge=-1, le=65535)
    """Prometheus /metrics on a port of its own, besides the HTTP API's (-1: off)."""
    api_keys_file: str | None = None
    """``<app> <key>`` per line: ``/v1`` requests then need ``Authorization: Bearer <key>``, the
    key naming its app. Required beyond loopback; read again when the file changes."""

    @model_validator(mode="after")
    def _keys_beyond_loopback(self) -> EdgeSettings:
        if self.http_port == -1 or self.api_keys_file or is_loopback(self.http_host):
            return self
        raise ValueError(
            f"the HTTP API would listen on {self.http_host!r}, beyond loopback, without API "
            "keys: set MESH_EDGE_API_KEYS_FILE (`mesh creds` writes one) or listen on 127.0.0.1"
        )


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto: console on a terminal, JSON otherwise."""
    otel: bool = False
    """Record an OpenTelemetry span per request, exported over OTLP (the otel extra)."""


class MeshSettings(_Section):
    """Configuration of one mesh process (worker, edge, local mesh or client)."""

    nats: NatsSettings = Field(default_factory=NatsSettings)
    """Connection to NATS."""
    stream: StreamSettings = Field(default_factory=StreamSettings)
    """The escalation work queue."""
    limits: LimitSettings = Field(default_factory=LimitSettings)
    """What nodes accept."""
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    """The cloud worker."""
    edge: EdgeSettings = Field(default_factory=EdgeSettings)
    """The edge daemon."""
    log: LogSettings = Field(default_factory=LogSettings)
    """Logging."""
    strict_decode: bool = False
    """Reject unknown fields instead of ignoring them (tests use this)."""


def iter_fields(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(path, FieldInfo)`` for every leaf setting, depth first."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from iter_fields(annotation, (*prefix, name))
        else:
            yield (*prefix, name), info


def env_name(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def load_settings(
    overrides: Mapping[tuple[str, ...], Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> MeshSettings:
    """Defaults, then ``MESH_*`` env vars, then ``overrides`` (CLI flags) keyed by field path.

    Raises :class:`InvalidRequestError` naming the env var or flag whose value is invalid.
    """
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    fields = [(path, env_name(path), info) for path, info in iter_fields(MeshSettings)]
    refuse_unknown(environ, ENV_PREFIX, (name for _path, name, _info in fields))
    for path, name, info in fields:
        if name in environ and environ[name] != "":
            set_path(tree, path, env_value(environ[name], info.annotation))
    for path, value in (overrides or {}).items():
        if value is not None:
            set_path(tree, path, value)
    try:
        return MeshSettings.model_validate(tree)
    except ValidationError as exc:
        problems = "; ".join(
            f"{env_name(tuple(str(p) for p in err['loc']))}: {err['msg']}" for err in exc.errors()
        )
        raise InvalidRequestError(f"invalid configuration: {problems}") from None


def describe_settings() -> list[tuple[str, str, str]]:
    """``(env var, default, description)`` for every setting, for ``mesh config``."""
    defaults = MeshSettings()
    rows = []
    for path, info in iter_fields(MeshSettings):
        value: Any = defaults
        for key in path:
            value = getattr(value, key)
        rows.append((env_name(path), "" if value is None else str(value), info.description or ""))
    return rows
