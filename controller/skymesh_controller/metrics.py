"""The controller's Prometheus exposition, ``GET /metrics`` (open, like ``/health``: it
holds counts and states, no URL, token or key).

State is read from the store at scrape time (the store is the truth; a restarted
controller reports the same numbers), counters from the controller's own tallies. Every
state is listed for every region, with 0 where nothing is in it, so an alert such as
"no healthy replica" sees a 0 rather than a missing series.

    skymesh_controller_store_up                              1 if the store answered
    skymesh_controller_regions                               regions registered
    skymesh_controller_balancers{region,state}               up, down, unknown
    skymesh_controller_replicas{region,model,state}          healthy, unhealthy, draining, unknown
    skymesh_controller_telemetry_age_seconds{balancer}       since its last telemetry report
    skymesh_controller_probes_total{kind,result}             /health probes, ok or failed
    skymesh_controller_refused_total{reason}                 requests a limit refused
    skymesh_controller_http_requests_total{method,route,status}
    skymesh_controller_http_request_duration_seconds{route}  histogram
    skymesh_controller_leader                                1 while this controller leads
    skymesh_controller_lease_epoch                           the lease's epoch (the store's)
    skymesh_controller_lease_age_seconds                     since the current leader won
    skymesh_controller_leader_elections_total                times this one won the lease
    skymesh_controller_leader_stood_down_total               times this one lost it
    skymesh_controller_fenced_writes_total                   writes refused: lease gone
    skymesh_controller_probe_rounds_total                    probe rounds this one ran

``route`` is the route's template (``/v1/replicas/{rid}``), never the raw path, so a
client cannot grow the series set; unmatched paths count as ``(unmatched)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skymesh_controller.store import Obj, Store, StoreError

BALANCER_STATES = ("up", "down", "unknown")
REPLICA_STATES = ("healthy", "unhealthy", "draining", "unknown")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNMATCHED = "(unmatched)"


class _Http:
    """Request counts and a duration histogram per route, kept as plain numbers."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.buckets: dict[str, list[int]] = {}  # per route: count per bucket, then +Inf
        self.sums: dict[str, float] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        counts = self.buckets.setdefault(route, [0] * (len(BUCKETS) + 1))
        counts[next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))] += 1
        self.sums[route] = self.sums.get(route, 0.0) + seconds

    def families(self) -> Iterator[Metric]:
        req = CounterMetricFamily("skymesh_controller_http_requests",
                                  "Admin API requests by route template and status",
                                  labels=["method", "route", "status"])
        for (method, route, status), n in sorted(self.requests.items()):
            req.add_metric([method, route, status], n)
        yield req
        dur = HistogramMetricFamily("skymesh_controller_http_request_duration_seconds",
                                    "Admin API request duration", labels=["route"])
        for route, counts in sorted(self.buckets.items()):
            acc, cumulative = 0, []
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                acc += n
                cumulative.append((bound, acc))
            dur.add_metric([route], cumulative, self.sums[route])
        yield dur


class _MetricsMiddleware:
    """Pure ASGI (no response buffering): times each HTTP request, notes its status."""

    def __init__(self, app: ASGIApp, http: _Http) -> None:
        self.app, self.http = app, http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # an exception before the response started is a 500 to the client

        async def note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, note)
        finally:
            # The router writes the matched route into this same scope.
            route = getattr(scope.get("route"), "path", UNMATCHED)
            self.http.observe(scope["method"], route, status, time.perf_counter() - t0)


class _State:
    """The last snapshot the /metrics handler read, as metric families."""

    def __init__(self, store: Store, latest: Mapping[str, Obj],
                 probes: Mapping[tuple[str, bool], int], refusals: Mapping[str, int],
                 http: _Http, ctl: Any = None) -> None:
        self.store, self.latest, self.probes, self.refusals = store, latest, probes, refusals
        self.http, self.ctl = http, ctl
        self.snapshot: dict[str, Any] = {}
        self.control: dict[str, Any] = {}

    async def refresh(self) -> None:
        store = self.store
        try:
            self.snapshot = {"regions": await store.all("regions"),
                             "balancers": await store.all("balancers"),
                             "replicas": await store.all("replicas")}
        except StoreError:
            self.snapshot = {}
        if self.ctl is not None:
            try:
                self.control = await self.ctl.leadership.info()
            except StoreError:
                self.control = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield GaugeMetricFamily("skymesh_controller_store_up",
                                "1 if the store answered this scrape", value=int(bool(snap)))
        if snap:
            yield from _inventory(snap["regions"], snap["balancers"], snap["replicas"])
        age = GaugeMetricFamily("skymesh_controller_telemetry_age_seconds",
                                "Seconds since the balancer's last telemetry report",
                                labels=["balancer"])
        now = time.time()
        for bid, sample in sorted(self.latest.items()):
            age.add_metric([bid], max(0.0, now - sample["ts"]))
        yield age
        probes = CounterMetricFamily("skymesh_controller_probes",
                                     "Health probes of balancers and replicas, by result",
                                     labels=["kind", "result"])
        counts = self.probes
        for kind in ("balancer", "replica"):
            for ok, result in ((True, "ok"), (False, "failed")):
                probes.add_metric([kind, result], counts.get((kind, ok), 0))
        yield probes
        refused = CounterMetricFamily("skymesh_controller_refused",
                                      "Requests a limit refused, by reason",
                                      labels=["reason"])
        for reason, n in sorted(self.refusals.items()):
            refused.add_metric([reason], n)
        yield refused
        yield from self.http.families()
        if self.ctl is not None:
            yield from _control(self.ctl, self.control)


def _control(ctl: Any, info: Mapping[str, Any]) -> Iterator[Metric]:
    lead = ctl.leadership
    yield GaugeMetricFamily("skymesh_controller_leader",
                            "1 while this controller holds the leader lease",
                            value=int(lead.leader))
    if info.get("epoch") is not None:
        yield GaugeMetricFamily("skymesh_controller_lease_epoch",
                                "The leader lease's epoch in the store", value=info["epoch"])
    if info.get("lease_age_s") is not None:
        yield GaugeMetricFamily("skymesh_controller_lease_age_seconds",
                                "Seconds since the current leader won the lease",
                                value=info["lease_age_s"])
    yield CounterMetricFamily("skymesh_controller_leader_elections",
                              "Times this controller won the lease",
                              value=lead.state.elections)
    yield CounterMetricFamily("skymesh_controller_leader_stood_down",
                              "Times this controller lost or gave up the lease",
                              value=lead.state.losses)
    yield CounterMetricFamily("skymesh_controller_fenced_writes",
                              "Writes the store refused: the lease they were made under "
                              "was gone", value=ctl.store.fenced_total)
    yield CounterMetricFamily("skymesh_controller_probe_rounds",
                              "Probe rounds this controller ran (only the leader probes)",
                              value=ctl.prober.rounds)


def _inventory(regions: dict[str, Obj], balancers: dict[str, Obj],
               replicas: dict[str, Obj]) -> Iterator[Metric]:
    yield GaugeMetricFamily("skymesh_controller_regions", "Regions registered",
                            value=len(regions))
    bal = GaugeMetricFamily("skymesh_controller_balancers", "Balancers by region and state",
                            labels=["region", "state"])
    names = sorted(set(regions) | {b["region"] for b in balancers.values()})
    states = set(BALANCER_STATES) | {b.get("state", "unknown") for b in balancers.values()}
    for region in names:
        for state in sorted(states):
            bal.add_metric([region, state], sum(
                1 for b in balancers.values()
                if b["region"] == region and b.get("state", "unknown") == state))
    yield bal
    rep = GaugeMetricFamily("skymesh_controller_replicas", "Replicas by region, model and state",
                            labels=["region", "model", "state"])
    states = set(REPLICA_STATES) | {r.get("state", "unknown") for r in replicas.values()}
    for region, model in sorted({(r["region"], r["model"]) for r in replicas.values()}):
        for state in sorted(states):
            rep.add_metric([region, model, state], sum(
                1 for r in replicas.values() if r["region"] == region
                and r["model"] == model and r.get("state", "unknown") == state))
    yield rep


def install_metrics(app: FastAPI, store: Store, latest: Mapping[str, Obj],
                    probes: Mapping[tuple[str, bool], int], refusals: Mapping[str, int],
                    ctl: Any = None) -> None:
    """Serve ``GET /metrics`` and count every HTTP request (call before the app starts):
    the records from ``store`` at each scrape, the newest telemetry per balancer
    (``latest``), probe results by (kind, ok) and refusals by reason as they stand."""
    http = _Http()
    state = _State(store, latest, probes, refusals, http, ctl)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(state)
    planner = getattr(app.state, "planner", None)  # skymesh_controller.autopilot
    if planner is not None:
        registry.register(planner)
    app.add_middleware(_MetricsMiddleware, http=http)

    async def metrics() -> Response:
        # The connection guard (skymesh_controller.serve) wraps the app after it is built, so its
        # series join the registry at the first scrape that finds it.
        guard = getattr(app.state, "connection_guard", None)
        if guard is not None and not getattr(app.state, "connection_guard_registered", False):
            registry.register(guard)
            app.state.connection_guard_registered = True
        await state.refresh()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
