"""The admin API's resources (request bodies and stored objects)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                            description="letters, digits, '.', '_' or '-'; at most 63")]
BalancerState = Literal["unknown", "up", "down"]
ReplicaState = Literal["unknown", "healthy", "unhealthy", "draining"]


def _http_url(v: str) -> str:
    v = v.strip()
    if not v.startswith(("http://", "https://")) or len(v) < 10 or any(c.isspace() for c in v):
        raise ValueError("must be an http:// or https:// URL")
    return v.rstrip("/")


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegionIn(_In):
    name: Name
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    cloud_region: str | None = Field(None, max_length=64,
                                     description="e.g. us-east-1, for DNS latency records")


class BalancerIn(_In):
    id: Name
    region: Name
    url: str = Field(max_length=2048, description="the balancer's HTTP edge")
    peer_address: str | None = Field(None, max_length=256,
                                     description="host:port of its gRPC peering listener")
    policy: str | None = Field(None, max_length=64)
    policy_params: dict[str, Any] = Field(default_factory=dict)

    _url = field_validator("url")(_http_url)


class ReplicaIn(_In):
    url: str = Field(max_length=2048)
    model: str = Field(min_length=1, max_length=256)
    region: Name
    gpu: str = Field(min_length=1, max_length=64, description="e.g. L4, A100, H100")
    id: Name | None = None
    balancer: Name | None = Field(None, description="home balancer; default: one in the region")
    kind: Literal["vllm", "sglang", "skymesh"] = "vllm"

    _url = field_validator("url")(_http_url)


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
