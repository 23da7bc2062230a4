"""The admin API's resources (request bodies and stored objects)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skymesh.net.urlpolicy import UrlRejected, parse

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                            description="letters, digits, '.', '_' or '-'; at most 63")]
BalancerState = Literal["unknown", "up", "down"]
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
    model_config = ConfigDict(extra="forbid", strict=True)


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
    policy: str | None = Field(None, max_length=64)
    policy_params: dict[str, Any] = Field(default_factory=dict)
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
    policy: str | None = Field(None, max_length=64)
    policy_params: dict[str, Any] = Field(None, validate_default=False)  # type: ignore[call-overload]
    owner: Name = Field(None, description=OWNER_DOC,  # type: ignore[assignment]
                        validate_default=False)

    _url = field_validator("url")(_http_url)
    _peer = field_validator("peer_address")(_host_port)


class ReplicaUpdate(_In):
    """``PUT /v1/replicas/{rid}``: every field but the id."""

    url: str = Field(max_length=2048, description=URL_DOC)
    model: str = Field(min_length=1, max_length=256)
    region: Name
    gpu: str = Field(min_length=1, max_length=64, description="e.g. L4, A100, H100")
    balancer: Name | None = Field(None, description="home balancer; default: one in the region")
    kind: Literal["vllm", "sglang", "skymesh"] = "vllm"
    owner: Name | None = Field(None, description=OWNER_DOC)

    _url = field_validator("url")(_http_url)


class ReplicaIn(ReplicaUpdate):
    id: Name | None = None


class ReplicaPatch(_In):
    """``PATCH /v1/replicas/{rid}``: only the fields given change."""

    url: str = Field(None, max_length=2048, description=URL_DOC,  # type: ignore[assignment]
                     validate_default=False)
    model: str = Field(None, min_length=1, max_length=256,  # type: ignore[assignment]
                       validate_default=False)
    region: Name = Field(None, validate_default=False)  # type: ignore[assignment]
    gpu: str = Field(None, min_length=1, max_length=64,  # type: ignore[assignment]
                     validate_default=False)
    balancer: Name | None = None
    kind: Literal["vllm", "sglang", "skymesh"] = Field(  # type: ignore[call-overload]
        None, validate_default=False)
    owner: Name = Field(None, description=OWNER_DOC,  # type: ignore[assignment]
                        validate_default=False)

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


class ModelIn(_In):
    name: str = Field(min_length=1, max_length=256)
    min_replicas: int = Field(0, ge=0)
    max_replicas: int | None = Field(None, ge=0)
    ttft_slo_s: float | None = Field(None, gt=0)


class PolicyIn(_In):
    policy: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = Field(default_factory=dict)


class ModelStats(_In):
    requests: int = Field(0, ge=0)
    prompt_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)


class TelemetryIn(_In):
    window_s: float = Field(gt=0, le=3600, description="seconds these counts cover")
    models: dict[str, ModelStats] = Field(default_factory=dict, max_length=1024)
    queue_length: int = Field(0, ge=0)
    in_flight: int = Field(0, ge=0)
    replicas: dict[str, Literal["healthy", "unhealthy"]] = Field(
        default_factory=dict, max_length=4096)


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
