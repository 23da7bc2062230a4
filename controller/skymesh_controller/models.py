"""The admin API's resources (request bodies and stored objects)."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from skymesh.net.urlpolicy import UrlRejected, parse

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                            description="letters, digits, '.', '_' or '-'; at most 63")]
# No control characters (NUL, newlines): these names reach logs, metrics labels and engines.
ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
BalancerState = Literal["unknown", "up", "down"]

# Free-form documents (policy parameters) are bounded so that nothing stored can break a
# read: the JSON encoder recurses, and a deep enough document fails every GET that meets it.
MAX_PARAMS_DEPTH = 8  # policy parameters are flat in practice (virtual_nodes: 80)
MAX_PARAMS_BYTES = 16 * 1024
MAX_RECORD_DEPTH = MAX_PARAMS_DEPTH + 4  # a stored record around its parameters


def json_problem(value: Any, max_depth: int) -> str | None:
    """Why ``value`` is not a plain JSON document at most ``max_depth`` deep (finite
    numbers, string keys), or None. Iterative, so it is safe on any depth."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return "object keys must be strings"
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        elif isinstance(v, float) and not math.isfinite(v):
            return "numbers must be finite"
        elif v is None or isinstance(v, str | int | float):
            continue
        else:
            return f"not a JSON value ({type(v).__name__})"
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        todo += [(c, depth + 1) for c in children]
    return None


def _bounded_params(v: dict[str, Any]) -> dict[str, Any]:
    why = json_problem(v, MAX_PARAMS_DEPTH)
    if why is not None:
        raise ValueError(why)
    if len(json.dumps(v)) > MAX_PARAMS_BYTES:
        raise ValueError(f"over {MAX_PARAMS_BYTES} bytes as JSON")
    return v


PolicyParams = Annotated[dict[str, Any], AfterValidator(_bounded_params)]
ReplicaState = Literal["unknown", "healthy", "unhealthy", "draining"]


def _http_url(v: str | None) -> str | None:
    """The URL's shape (scheme, credentials, query, host spelling); which addresses it may
    reach depends on the deployment's url_policy and is checked by the service."""
    if v is None:
        return None
    v = v.strip()
    try:
        parse(v)
    except UrlRejected as exc:
        raise ValueError(str(exc)) from None
    return v.rstrip("/")


def _host_port(v: str | None) -> str | None:
    if v is None:
        return None
    try:
        parse(f"http://{v}")
    except UrlRejected as exc:
        raise ValueError(str(exc)) from None
    if ":" not in v.rsplit("]", 1)[-1] or "/" in v:
        raise ValueError("must be host:port")
    return v


class _In(BaseModel):
    # Strict: JSON types as the schema says (no false for a number, no "1" for an int).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RegionIn(_In):
    name: Name
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    cloud_region: str | None = Field(None, max_length=64,
                                     description="e.g. us-east-1, for DNS latency records")


URL_DOC = ("http(s) base URL: no credentials, query or fragment; its host must pass the "
           "controller's url_policy")
OWNER_DOC = "the token name that owns the record (admin only may change it)"


class BalancerUpdate(_In):
    """``PUT /v1/balancers/{bid}``: every field but the id."""

    region: Name
    url: str = Field(max_length=2048, description="the balancer's HTTP edge; " + URL_DOC)
    peer_address: str | None = Field(None, max_length=256,
                                     description="host:port of its gRPC peering listener")
    policy: str | None = Field(None, max_length=64, description="admin only")
    policy_params: PolicyParams = Field(default_factory=dict, description="admin only")
    owner: Name | None = Field(None, description=OWNER_DOC)

    _url = field_validator("url")(_http_url)
    _peer = field_validator("peer_address")(_host_port)


class BalancerIn(BalancerUpdate):
    id: Name


class BalancerPatch(_In):
    """``PATCH /v1/balancers/{bid}``: only the fields given change."""

    region: Name = Field(None, validate_default=False)  # type: ignore[assignment]
    url: str = Field(None, max_length=2048, description=URL_DOC,  # type: ignore[assignment]
                     validate_default=False)
    peer_address: str | None = Field(None, max_length=256)
    policy: str | None = Field(None, max_length=64, description="admin only")
    policy_params: PolicyParams = Field(None, validate_default=False,  # type: ignore[call-overload]
                                        description="admin only")
    owner: Name = Field(None, description=OWNER_DOC,  # type: ignore[assignment]
                        validate_default=False)

    _url = field_validator("url")(_http_url)
    _peer = field_validator("peer_address")(_host_port)


MAX_ENDPOINT_CHARS = 512


def _zmq_endpoint(v: str | None) -> str | None:
    """A ZeroMQ endpoint to connect to, as the balancer's KVEventsEndpoint accepts it. A
    balancer follows a tcp:// one only if its own url_policy allows the host, and never an
    ipc:// one from here (a path on its host is for its own config to name)."""
    if v is None:
        return None
    if not v.startswith(("tcp://", "ipc://")) or len(v) < 7:
        raise ValueError("must be tcp://HOST:PORT or ipc://PATH")
    if "*" in v:
        raise ValueError("is the publisher's bind address; give HOST:PORT to connect to")
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in v):
        raise ValueError("must not contain control characters")
    return v


class KVEventsIn(_In):
    """Where a replica publishes its KV-cache events (docs/kv-events.md)."""

    endpoint: str = Field(max_length=MAX_ENDPOINT_CHARS)
    replay_endpoint: str | None = Field(None, max_length=MAX_ENDPOINT_CHARS)

    _zmq = field_validator("endpoint", "replay_endpoint")(_zmq_endpoint)


KV_EVENTS_DOC = ("where the replica publishes KV-cache events, as its balancers reach it; "
                 "balancers follow it only if their url_policy allows its host")


class ReplicaUpdate(_In):
    """``PUT /v1/replicas/{rid}``: every field but the id."""

    url: str = Field(max_length=2048, description=URL_DOC)
    model: ModelName
    region: Name
    gpu: str = Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$",
                     description="e.g. L4, A100, H100")
    balancer: Name | None = Field(None, description="home balancer; default: one in the region")
    kind: Literal["vllm", "sglang", "skymesh"] = "vllm"
    owner: Name | None = Field(None, description=OWNER_DOC)
    kv_events: KVEventsIn | None = Field(None, description=KV_EVENTS_DOC)

    _url = field_validator("url")(_http_url)


class ReplicaIn(ReplicaUpdate):
    id: Name | None = None


class ReplicaPatch(_In):
    """``PATCH /v1/replicas/{rid}``: only the fields given change."""

    url: str = Field(None, max_length=2048, description=URL_DOC,  # type: ignore[assignment]
                     validate_default=False)
    model: ModelName = Field(None, validate_default=False)  # type: ignore[assignment]
    region: Name = Field(None, validate_default=False)  # type: ignore[assignment]
    gpu: str = Field(None, min_length=1, max_length=64,  # type: ignore[assignment]
                     pattern=r"^[^\x00-\x1f\x7f]+$", validate_default=False)
    balancer: Name | None = None
    kind: Literal["vllm", "sglang", "skymesh"] = Field(  # type: ignore[call-overload]
        None, validate_default=False)
    owner: Name = Field(None, description=OWNER_DOC,  # type: ignore[assignment]
                        validate_default=False)
    kv_events: KVEventsIn | None = Field(None, description=KV_EVENTS_DOC + "; null removes it")

    _url = field_validator("url")(_http_url)


class FieldError(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    type: str = Field(description="a stable machine-readable kind, e.g. not_found")
    message: str
    fields: list[FieldError] | None = Field(None, description="422 only: each bad field")


class ErrorOut(BaseModel):
    """Every error answer: ``{"error": {"type", "message"[, "fields"]}}``."""

    error: ErrorDetail


MAX_REPLICAS = 100_000  # per model: far past any fleet, short of a 4,000-digit number


class ModelIn(_In):
    name: ModelName
    min_replicas: int = Field(0, ge=0, le=MAX_REPLICAS)
    max_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    ttft_slo_s: float | None = Field(None, gt=0)


class PolicyIn(_In):
    policy: str = Field(min_length=1, max_length=64)
    params: PolicyParams = Field(default_factory=dict)


class ModelStats(_In):
    requests: int = Field(0, ge=0, le=10**15)
    prompt_tokens: int = Field(0, ge=0, le=10**15)
    output_tokens: int = Field(0, ge=0, le=10**15)


class TenantDemandIn(_In):
    """What a tenant offered one balancer worker (admitted or refused), smoothed."""

    requests_per_s: float = Field(0.0, ge=0, le=1e9)
    tokens_per_min: float = Field(0.0, ge=0, le=1e12)


class TelemetryIn(_In):
    window_s: float = Field(gt=0, le=3600, description="seconds these counts cover")
    # The count of models is capped again by the config (telemetry_max_models) and the
    # stored size by telemetry_max_bytes.
    models: dict[ModelName, ModelStats] = Field(default_factory=dict, max_length=1024)
    queue_length: int = Field(0, ge=0, le=10**12)
    in_flight: int = Field(0, ge=0, le=10**12)
    replicas: dict[Annotated[str, Field(max_length=2048)],
                   Literal["healthy", "unhealthy"]] = Field(default_factory=dict,
                                                            max_length=4096)
    # Per tenant the controller pushed: its demand here, by which each balancer's part of
    # its limits is split (tenants.py); ``worker``: the reporting worker of the balancer.
    # None (absent): a balancer older than the demand reports, which holds 1/n of each.
    tenants: dict[Annotated[str, Field(max_length=64)], TenantDemandIn] | None = Field(
        None, max_length=100_000)
    worker: int = Field(0, ge=0, le=1023)


class DnsSyncIn(_In):
    dry_run: bool = False


# The error responses every admin route documents (OpenAPI), in the ErrorOut shape.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": why} for status, why in (
        (400, "the body is not JSON"),
        (401, "missing or unknown token"),
        (403, "the token's role may not do this, or the record belongs to another token"),
        (404, "no such record"),
        (409, "conflicts with the current state (an id owned by another token, a URL "
              "registered twice, a region still in use...)"),
        (413, "body over max_body_bytes"),
        (422, "invalid body or parameter (including a URL the url_policy refuses); the "
              "message names the field"),
        (503, "the state store is unreachable"),
    )}
