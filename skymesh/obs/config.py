"""The ``logging:`` and ``tracing:`` sections, the same in both daemons' configs::

    logging: {format: json, access_log: true}   # skymesh-lb also: access_log_backlog: 4096
    tracing: {otlp_endpoint: "http://otel-collector:4318/v1/traces",
              service_name: skymesh-lb-us, sample_ratio: 0.1}

Tracing is on exactly when ``otlp_endpoint`` is set (``--otlp-endpoint`` on the command
line). ``service_name`` defaults to the daemon's name; ``sample_ratio`` samples new traces
(a client's ``traceparent`` keeps its own sampling decision).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from skymesh.common.config import StrictModel

LogFormat = Literal["text", "json"]


# Access lines waiting for skymesh-lb's writer thread before new ones are dropped
# (skymesh.obs.access.AccessWriter; about 1 KB each with a stream's tail: a few MB).
ACCESS_LOG_BACKLOG = 4096


class LoggingConfig(StrictModel):
    format: LogFormat = "text"
    access_log: bool = True


class LbLoggingConfig(LoggingConfig):
    """skymesh-lb's: its access lines are written by a thread whose backlog is bounded.
    The controller's access log has no such writer, so it does not take the key."""

    access_log_backlog: int = Field(ACCESS_LOG_BACKLOG, ge=1)


class TracingConfig(StrictModel):
    otlp_endpoint: str | None = None
    service_name: str | None = Field(None, min_length=1)
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over HTTP, e.g. "
                             "http://collector:4318/v1/traces)")
        return v

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None
