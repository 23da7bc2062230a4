"""OpenTelemetry tracing of requests, on when ``tracing.otlp_endpoint`` is set.

Each request gets a SERVER span (``POST /v1/chat/completions``), continuing the client's
trace when it sent a W3C ``traceparent``; each attempt on a replica or peer gets a CLIENT
span under it, and the request to the replica carries that span's ``traceparent`` (vLLM
and SGLang continue it). Spans go to an OTLP/HTTP collector in batches.

The SDK is the ``tracing`` extra and is imported only here, only when tracing is on. The
provider is our own, not OpenTelemetry's global one: nothing else in the process (or a
second balancer in the same test) shares or replaces it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from skymesh.obs.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span


class TracingUnavailable(RuntimeError):
    """Tracing is configured but the ``tracing`` extra is not installed."""


class Tracing:
    """A tracer with its provider and the W3C propagator; see :func:`from_config`."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("skymesh")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(cls, service: str, cfg: TracingConfig | None = None,
               exporter: SpanExporter | None = None) -> Tracing:
        """Spans of ``service`` to ``exporter`` (each span as it ends: tests), else in
        batches to ``cfg.otlp_endpoint``."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        cfg = cfg or TracingConfig()
        provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name or service}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            # Ends (and flushes) with the process unless the daemon shuts it down first.
            shutdown_on_exit=exporter is None)
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
        return cls(provider)

    @contextlib.contextmanager
    def server_span(self, name: str, headers: Mapping[str, str],
                    attributes: dict[str, Any]) -> Iterator[Span]:
        """The request's span, current inside the block; the parent is the client's
        ``traceparent`` when it sent a valid one (an invalid one starts a new trace)."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers)
        # The outcome is the caller's to set: an HTTPException passing through (a 404) is
        # an answer, not a failure of the server.
        with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                                attributes=attributes, record_exception=False,
                                                set_status_on_exception=False) as span:
            yield span

    @contextlib.contextmanager
    def client_span(self, name: str, attributes: dict[str, Any]) -> Iterator[Span]:
        """A child of the current span (an upstream attempt), current inside the block."""
        from opentelemetry.trace import SpanKind

        with self._tracer.start_as_current_span(name, kind=SpanKind.CLIENT,
                                                attributes=attributes) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
        self._propagator.inject(headers)

    def shutdown(self) -> None:
        """Export what is buffered and stop; later spans are dropped."""
        self.provider.shutdown()


def trace_id(span: Span) -> str | None:
    """The span's trace id as 32 hex digits (for log lines), or None when not sampled."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.trace_flags.sampled else None


def set_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))


def from_config(cfg: TracingConfig, service: str) -> Tracing | None:
    """The daemon's tracing, or None when ``cfg`` leaves it off."""
    if not cfg.enabled:
        return None
    from skymesh.util.extras import install_hint, missing

    absent = missing("tracing")
    if absent:
        raise TracingUnavailable(f"tracing.otlp_endpoint is set but tracing "
                                 f"{install_hint('tracing', absent)}")
    return Tracing.create(service, cfg)
