"""``skymesh-controller`` configuration (YAML), strictly validated like the balancer's.

Example::

    listen: {host: 127.0.0.1, port: 8080}
    store: redis://127.0.0.1:6379/0        # or "memory" (the zero-setup default)
    tokens:                                 # sha256 of each token, never the token
      - {name: ops, sha256: "<hex>", role: admin}
      - {name: grafana, sha256: "<hex>", role: read}
      - {name: balancers, sha256: "<hex>", role: agent}
    probe: {interval_s: 1.0, timeout_s: 0.8, failure_threshold: 2, success_threshold: 1}
    dns: {zone: example.com., record: api.example.com, ttl: 60}
    url_policy: {allow_private: true, allow_loopback: false, allow_networks: [], allow_hosts: []}
    api_docs: false                         # true: /openapi.json, /docs, /redoc (read token)
    planner: {mode: dry-run, capacity: {llama-8b: {L4: 1500}}}   # docs/autopilot.md
    logging: {format: text, access_log: true}   # docs/operations-logs.md
    tracing: {otlp_endpoint: null}              # OTLP/HTTP collector URL: tracing on
    max_body_bytes: 1048576                 # any request body, counted as it streams
    telemetry_max_bytes: 65536              # one telemetry report as stored
    telemetry_max_models: 256               # model keys in one report
    telemetry_keep: 10000                   # reports kept per balancer ...
    telemetry_balancer_bytes: 4194304       # ... and at most about this many bytes
    max_balancers_per_agent: 64             # balancers one agent token may register
    max_tenants: 1000                       # tenants stored (each balancer gets them all)
    tenant_share_floor: 0.05                # of a limit, at most, held by idle balancers
    tenant_demand_stale_s: 20.0             # a tenant demand report counts this long
    shared_balancer_owners: []              # token names whose balancers take anyone's
                                            # replicas on failover (default: owner only)
    ha: {lease_ttl_s: 3.0, renew_interval_s: 1.0}  # leader lease: docs/operations-control-ha.md

``SKYMESH_ADMIN_TOKEN`` adds an admin token when set (quick starts, tests).
``url_policy`` decides which replica and balancer URLs may be registered and probed
(skymesh/net/urlpolicy.py, docs/security.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from skymesh.common.config import ConfigError as ConfigError  # re-exported
from skymesh.common.config import (
    ConnectionLimitsConfig,
    StrictModel,
    load_yaml,
    parse_model,
)
from skymesh.net.urlpolicy import UrlPolicyConfig
from skymesh.obs.config import LoggingConfig, TracingConfig
from skymesh_controller.autopilot.config import PlannerConfig

Role = Literal["admin", "read", "agent", "tenants"]


class ListenConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class TokenConfig(StrictModel):
    name: str = Field(min_length=1)
    sha256: str
    role: Role = "read"

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", v.lower()):
            raise ValueError("must be the 64-hex-digit sha256 of the token")
        return v.lower()


class ProbeConfig(StrictModel):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(0.8, gt=0)
    failure_threshold: int = Field(2, ge=1)
    success_threshold: int = Field(1, ge=1)


class DnsConfig(StrictModel):
    """Route53 latency records for the balancers (see controller/skymesh_controller/dns.py)."""

    zone: str | None = None
    zone_id: str | None = None
    record: str
    ttl: int = Field(60, ge=1)
    health_check_path: str = "/health"
    endpoint_url: str | None = None
    aws_region: str = "us-east-1"
    auto_sync: bool = True


class HaConfig(StrictModel):
    """Several controllers on one store: one leader (a lease in the store), the rest
    standing by (docs/operations-control-ha.md). A standby takes over at most about
    ``lease_ttl_s + renew_interval_s`` after the leader stops renewing."""

    lease_ttl_s: float = Field(3.0, gt=0)
    renew_interval_s: float = Field(1.0, gt=0)
    id: str | None = None  # this controller's name in the lease: default host-pid
    advertise_url: str | None = None  # shown to others as the leader's URL
    revision_poll_s: float = Field(0.5, gt=0)  # long polls see other controllers' writes
    writer_lock_s: float = Field(5.0, gt=0)  # the cross-process writer lock's expiry
    wait_replicas: int = Field(0, ge=0)  # Redis WAIT after each commit (0: off)
    wait_timeout_ms: int = Field(1000, ge=1)

    @field_validator("id", "advertise_url")
    @classmethod
    def _no_bar(cls, v: str | None) -> str | None:
        if v is not None and ("|" in v or not v.strip()):
            raise ValueError("must be non-empty and without '|'")
        return v

    @field_validator("renew_interval_s")
    @classmethod
    def _renew(cls, v: float, info: Any) -> float:
        ttl = info.data.get("lease_ttl_s")
        if ttl is not None and v >= ttl:
            raise ValueError("must be below lease_ttl_s (the lease would lapse between "
                             "renewals)")
        return v


class ControllerConfig(StrictModel):
    listen: ListenConfig = ListenConfig()
    store: str = "memory"
    tokens: list[TokenConfig] = Field(default_factory=list)
    probe: ProbeConfig = ProbeConfig()
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    long_poll_max_s: float = Field(60.0, gt=0)
    telemetry_keep: int = Field(10_000, ge=10)
    # One report's stored size, its model keys, and one balancer's history in bytes
    # (the number kept shrinks under telemetry_keep when reports are large).
    telemetry_max_bytes: int = Field(64 * 1024, ge=1024)
    telemetry_max_models: int = Field(256, ge=1, le=1024)
    telemetry_balancer_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)
    max_balancers_per_agent: int = Field(64, ge=1)  # admin tokens have no cap
    # Tenants (/v1/tenants): every membership answer carries them all.
    max_tenants: int = Field(1000, ge=1, le=100_000)
    # Each balancer's part of a tenant's limits follows the demand it reports (tenants.py):
    # none holds less than tenant_share_floor / n of a limit (n balancers in scope), and
    # a report older than tenant_demand_stale_s counts as no demand.
    tenant_share_floor: float = Field(0.05, gt=0, le=0.5)
    tenant_demand_stale_s: float = Field(20.0, gt=0)
    # Token names whose balancers take any owner's replicas on failover and planner
    # moves (a shared pool); otherwise a replica goes only to its owner's balancers.
    shared_balancer_owners: list[str] = Field(default_factory=list)
    limits: ConnectionLimitsConfig = ConnectionLimitsConfig()  # skymesh.net.limits
    dns: DnsConfig | None = None
    url_policy: UrlPolicyConfig = UrlPolicyConfig()
    api_docs: bool = False
    planner: PlannerConfig | None = None  # the autopilot (docs/autopilot.md): off
    logging: LoggingConfig = LoggingConfig()  # skymesh.obs: log format, access log
    tracing: TracingConfig = TracingConfig()  # skymesh.obs.tracing: off unless an endpoint
    ha: HaConfig = HaConfig()  # leader lease and store durability (operations-control-ha.md)

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://",
                                                  "redis+sentinel://")):
            raise ValueError("must be 'memory', a redis:// URL or redis+sentinel://")
        if v.startswith("redis+sentinel://"):
            from skymesh_controller.store import parse_sentinel_url

            parse_sentinel_url(v)
        return v


def parse_config(data: Any) -> ControllerConfig:
    return parse_model(ControllerConfig, data)


def load_config(path: str | Path) -> ControllerConfig:
    return parse_config(load_yaml(path))
