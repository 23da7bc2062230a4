"""The balancer's side of the controller: register, follow membership, report telemetry.

Membership arrives by long poll (``GET /v1/balancers/ID/membership?after=REV&wait=S``):
a change reaches the balancer as soon as the controller commits it, with no minute-long
polling. When the controller is unreachable the balancer keeps serving with what it last
received and retries; the controller is never on a request's path.

Telemetry (``POST /v1/balancers/ID/telemetry``, every ``telemetry_interval_s``) carries
the demand each pushed tenant offers here; the answer carries the tenants again with this
balancer's fractions of their limits, split by everyone's demand (docs/tenancy.md,
"Shares follow the traffic"): the shares follow the traffic one report behind, with no
revision spent on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from skymesh.balancer.config import (
    BalancerConfig,
    ControllerLinkConfig,
    KVEventsEndpoint,
    ReplicaConfig,
)
from skymesh.balancer.dispatch import Dispatcher
from skymesh.balancer.health import HealthTracker
from skymesh.mesh.outlook import OutlookParams, PeerOutlook, RegionOutlook
from skymesh.net import urlpolicy
from skymesh.net.resolver import PolicyResolver
from skymesh.net.urlpolicy import UrlRejected

if TYPE_CHECKING:
    from skymesh.balancer.mesh_link import MeshLink

log = logging.getLogger("skymesh.balancer.controller")


class ControllerRejected(RuntimeError):
    """The controller answered with a client error (bad token, unknown region...)."""


def fetch_resolver(cfg: BalancerConfig,
                   resolver: urlpolicy.Resolver = urlpolicy.system_resolver
                   ) -> PolicyResolver | None:
    """The resolver for every aiohttp session of a balancer that follows a controller, or
    None without one (the operator wrote every URL it fetches: nothing to re-check).

    Replica URLs from the controller were checked when they arrived, but their names can
    re-point to a denied address afterwards: resolving through the policy refuses that at
    connect time. Hosts the operator wrote in this config (the controller, its own
    replicas) are the operator's choice, so they skip the private/loopback test
    (``allow_hosts``), never the link-local and metadata rows."""
    if cfg.controller is None:
        return None
    urls = [cfg.controller.url, *(r.url for r in cfg.replicas)]
    own = frozenset(h.removesuffix(".") for h in (urlsplit(u).hostname for u in urls) if h)
    policy = cfg.controller.url_policy.policy()
    return PolicyResolver(replace(policy, allow_hosts=policy.allow_hosts | own), resolver)


def region_balancers(membership: dict[str, Any], region: str) -> int:
    """The live balancers sharing this one's replicas, itself included (sp-p's n for
    ``pushing.balancers_per_region: auto``); from an older controller without the count,
    this one and its live same-region peers."""
    n = membership.get("region_balancers")
    if isinstance(n, int) and n >= 1:
        return n
    return 1 + sum(1 for p in membership.get("peers", []) if p.get("region") == region)


def merge_replica(member: dict[str, Any], local: ReplicaConfig | None,
                  kv_events: KVEventsEndpoint | None = None) -> ReplicaConfig:
    """One membership replica as this balancer serves it. The controller says what the
    replica is: its model, gpu and kind win over lb.yaml's entry for the same URL. How
    this balancer reaches and reads it is local: that entry's kv_events, tokenizer,
    max_num_seqs and metrics_lag_s stay, and its kv_events wins over ``kv_events`` (the
    controller's, already checked against the URL policy), used only when the entry
    names none. Without the merge a balancer stopped following its replicas' KV events
    as soon as its controller answered."""
    what = {"kind": member.get("kind", "vllm"), "models": [member["model"]],
            "gpu": member.get("gpu", "unknown")}
    if local is None:
        return ReplicaConfig(url=member["url"], kv_events=kv_events, **what)
    merged = local.model_copy(update=what)
    if merged.kv_events is None and kv_events is not None:
        merged = merged.model_copy(update={"kv_events": kv_events})
    if merged.kind == "skymesh" and merged.tokenizer is not None:
        # A skymesh replica tokenizes as the balancer does (ReplicaConfig refuses both).
        merged = merged.model_copy(update={"tokenizer": None})
    return merged


def kv_endpoint_url(endpoint: str) -> str:
    """A controller-given KV-event endpoint as the URL the URL policy checks (same host
    and port). Only tcp:// is followed from the controller: an ipc:// path names a file
    on this balancer's host, which only its own config may do."""
    if not endpoint.startswith("tcp://"):
        raise UrlRejected("only tcp:// endpoints are followed from the controller "
                          "(an ipc:// path may be named in lb.yaml only)")
    return "http://" + endpoint.removeprefix("tcp://")


def kv_events_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("zmq", "msgspec"))


def read_token(cfg: ControllerLinkConfig) -> str:
    if cfg.token_file:
        return Path(cfg.token_file).read_text().strip()
    return os.environ.get(cfg.token_env, "")


def busiest(demand: dict[str, tuple[float, float]], limit: int
            ) -> dict[str, tuple[float, float]]:
    """The ``limit`` tenants of ``demand`` offering the most requests (then tokens): what
    a telemetry report carries, so it stays under the controller's size cap however many
    tenants are active here. The controller counts a tenant left out as offering nothing
    here (this balancer keeps the floor of its limits)."""
    if len(demand) <= limit:
        return demand
    top = sorted(demand.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:limit]
    return dict(top)


class Tally:
    """Requests and tokens per model since the last report (the telemetry the controller
    turns into demand series for forecasting)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.since = time.monotonic()

    def add(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        c = self.counts.get(model)
        if c is None:
            c = self.counts[model] = [0, 0, 0]
        c[0] += 1
        c[1] += prompt_tokens
        c[2] += output_tokens

    def take(self) -> tuple[float, dict[str, dict[str, int]]]:
        now = time.monotonic()
        window, self.since = max(now - self.since, 1e-3), now
        counts, self.counts = self.counts, {}
        return window, {m: {"requests": c[0], "prompt_tokens": c[1], "output_tokens": c[2]}
                        for m, c in counts.items()}


_RETRYABLE = (ControllerRejected, aiohttp.ClientError, TimeoutError, OSError, ValueError,
              KeyError)


def controller_problem(error: str, url: str) -> str:
    """A failed controller call as one line an operator can act on."""
    if "HTTP 422" in error and "no region named" in error:
        return (f"the controller ({url}) refused to register this balancer: {error}. "
                "Create the region first (regions, then balancers, then replicas: "
                "docs/controller.md)")
    if "HTTP 401" in error or "HTTP 403" in error:
        return f"the controller ({url}) refused this balancer's token: {error}"
    if "HTTP" in error:
        return f"the controller ({url}) refused: {error}"
    return f"the controller ({url}) is unreachable: {error}"


class ControllerLink:
    def __init__(self, cfg: ControllerLinkConfig, config: Callable[[], BalancerConfig],
                 dispatcher: Dispatcher, health: HealthTracker, mesh: MeshLink | None,
                 tally: Tally, set_replicas: Callable[[list[ReplicaConfig]], None],
                 set_policy: Callable[[str, dict[str, Any]], None],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, *,
                 set_tenants: Callable[[list[dict[str, Any]]], None] | None = None,
                 tenant_demand: Callable[[], dict[str, tuple[float, float]]] | None = None,
                 tenants_unreported: Callable[[int], None] | None = None,
                 worker: int = 0) -> None:
        self.cfg = cfg
        self.config = config  # the balancer's, as in effect (a reload changes pushing)
        self.dispatcher = dispatcher
        self.health = health  # replica models and health, for registration and telemetry
        self.mesh = mesh
        self.tally = tally
        self.set_replicas = set_replicas  # membership from the controller ...
        self.set_policy = set_policy  # ... and its policy, applied to the balancer
        self.set_tenants = set_tenants  # ... and its tenants (tenant_push)
        self.tenant_demand = tenant_demand  # per pushed tenant: (requests/s, tokens/min)
        self.tenants_unreported = tenants_unreported  # counts those a report left out
        self._unreported = 0  # left out of the last report (a warning when it starts)
        self.worker = worker  # this process's index among the balancer's workers
        self.sleep = sleep  # between retries (a fake one in tests)
        mesh_cfg = config().mesh
        self.balancer_id = cfg.balancer_id or (mesh_cfg.id if mesh_cfg is not None
                                               else config().region)
        self.revision = -1
        self.registered = False
        self.last_error: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._url = ""
        self.policy = cfg.url_policy.policy()
        self.resolver: urlpolicy.Resolver = urlpolicy.system_resolver
        self._kv_missing_told = False
        if mesh_cfg is not None and mesh_cfg.outlook.enabled:  # read from GET /v1/outlook
            o = mesh_cfg.outlook
            dispatcher.outlook = PeerOutlook(OutlookParams(o.horizon, o.slack,
                                                              o.current_weight))

    async def start(self, local_url: str) -> None:
        self._url = self.cfg.advertise_url or local_url
        token = read_token(self.cfg)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = aiohttp.ClientSession(
            base_url=self.cfg.url + "/", headers=headers,
            connector=aiohttp.TCPConnector(
                resolver=fetch_resolver(self.config(), self.resolver)),
            timeout=aiohttp.ClientTimeout(total=self.cfg.poll_wait_s + 10, sock_connect=3))
        self._tasks = [asyncio.create_task(self._follow(), name="skymesh-controller-sync"),
                       asyncio.create_task(self._report_loop(), name="skymesh-telemetry")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        assert self._session is not None
        async with self._session.request(method, path.lstrip("/"), **kw) as r:
            if r.status >= 400:
                text = (await r.text())[:300]
                err = f"{method} {path}: HTTP {r.status}: {text}"
                if r.status < 500:
                    raise ControllerRejected(err)
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                  message=err)
            return None if r.status == 204 else await r.json()

    # -- registration and membership -------------------------------------------------------
    async def register(self) -> None:
        cfg = self.config()
        body: dict[str, Any] = {"id": self.balancer_id, "region": cfg.region,
                                "url": self._url}
        if self.mesh is not None:
            body["peer_address"] = self.mesh.node.address
        await self._call("POST", "/v1/balancers", json=body)
        for rep in cfg.replicas:
            h = self.health.replicas.get(rep.url)
            known = rep.models or (sorted(h.models) if h is not None else [])
            model = known[0] if known else None
            if model is None:
                raise ControllerRejected(f"replica {rep.url}: model not known yet "
                                         "(list it under models, or wait for a probe)")
            body = {"url": rep.url, "model": model, "region": cfg.region, "gpu": rep.gpu,
                    "kind": rep.kind, "balancer": self.balancer_id}
            if rep.kv_events is not None:  # for the other balancers sharing the replica
                body["kv_events"] = rep.kv_events.model_dump()
            await self._register_replica(body)
        self.registered = True
        log.info("registered with the controller as %s", self.balancer_id)

    async def _register_replica(self, body: dict[str, Any]) -> None:
        """POST one replica; if the controller refuses its kv_events (one older than the
        field, or an endpoint past its bounds), again without: the replica is still
        served, its events followed by this balancer only."""
        try:
            await self._call("POST", "/v1/replicas", json=body)
        except ControllerRejected as exc:
            if "kv_events" not in body or "HTTP 422" not in str(exc) \
                    or "kv_events" not in str(exc):
                raise
            log.warning("the controller refused the kv_events of replica %s (%s); "
                        "registered without them", body["url"], exc)
            await self._call("POST", "/v1/replicas",
                             json={k: v for k, v in body.items() if k != "kv_events"})

    async def _allowed(self, what: str, url: str) -> bool:
        """The URL policy again on this side: the controller's store may hold a record
        written before the policy, or DNS may have changed since registration."""
        try:
            await urlpolicy.check(url, self.policy, self.resolver)
            return True
        except UrlRejected as exc:
            log.warning("ignoring %s %s from the controller: %s", what, url, exc)
            return False

    async def _kv_events(self, member: dict[str, Any]) -> KVEventsEndpoint | None:
        """The controller's KV-event endpoint of ``member`` if this balancer may follow
        it: the kv-events extra installed, every endpoint tcp:// to a host the URL policy
        allows (the rule of replica URLs)."""
        raw = member.get("kv_events")
        if not isinstance(raw, dict) or not raw.get("endpoint"):
            return None
        if not kv_events_installed():
            if not self._kv_missing_told:
                self._kv_missing_told = True
                log.warning("the controller gives KV-event endpoints (replica %s) but the "
                            "kv-events extra is not installed: pip install "
                            "'skymesh[kv-events]' to follow them", member["url"])
            return None
        what = f"kv events endpoint of replica {member['url']}:"
        try:
            ep = KVEventsEndpoint.model_validate(raw)
            urls = [kv_endpoint_url(e) for e in (ep.endpoint, ep.replay_endpoint) if e]
        except (ValidationError, UrlRejected) as exc:
            log.warning("ignoring %s %s", what, exc)
            return None
        for url in urls:
            if not await self._allowed(what, url):
                return None
        return ep

    async def apply(self, m: dict[str, Any]) -> None:
        """Membership from the controller: replicas, policy, tenants and peers."""
        self.revision = int(m["revision"])
        local = {r.url: r for r in self.config().replicas}
        replicas = []
        for r in m["replicas"]:
            if not await self._allowed("replica", r["url"]):
                continue
            own = local.get(r["url"].rstrip("/"))
            theirs = (None if own is not None and own.kv_events is not None
                      else await self._kv_events(r))
            replicas.append(merge_replica(r, own, theirs))
        self.set_replicas(replicas)
        if m.get("policy"):
            self.set_policy(m["policy"], m.get("policy_params") or {})
        # An older controller sends no tenants: those applied before stay.
        if self.set_tenants is not None and isinstance(m.get("tenants"), list):
            self.set_tenants(m["tenants"])
        if self.dispatcher.outlook is not None:
            self.dispatcher.outlook.set_regions({p["id"]: p["region"] for p in m["peers"]})
        cfg = self.config()
        if cfg.pushing.balancers_per_region == "auto":
            self.dispatcher.balancers_per_region = region_balancers(m, cfg.region)
        if self.mesh is not None and self.cfg.follow_peers:
            peers = {p["id"]: p["peer_address"] for p in m["peers"] if p.get("peer_address")
                     and await self._allowed("peer", f"http://{p['peer_address']}")}
            await self.mesh.set_peers(peers)

    async def _follow(self) -> None:
        """Register, then long-poll membership, forever. A failed call is retried after
        ``retry_s``, doubling (jittered) up to ``retry_max_s`` while calls keep failing, and
        back to ``retry_s`` after a success: a balancer told "no region named 'us'" waits
        longer and longer for an operator to create the region instead of asking once a
        second, and says so once, not at every retry."""
        while True:
            async for attempt in AsyncRetrying(
                    wait=wait_exponential_jitter(initial=self.cfg.retry_s,
                                                 max=self.cfg.retry_max_s),
                    retry=retry_if_exception_type(_RETRYABLE), sleep=self.sleep,
                    before_sleep=self._failed, reraise=True):
                with attempt:
                    await self._sync_once()
            self.last_error = None

    async def _sync_once(self) -> None:
        if not self.registered:
            await self.register()
        m = await self._call(
            "GET", f"/v1/balancers/{self.balancer_id}/membership",
            params={"after": str(self.revision), "wait": str(self.cfg.poll_wait_s)}
            if self.revision >= 0 else None)
        if int(m["revision"]) != self.revision:
            await self.apply(m)

    def _failed(self, state: RetryCallState) -> None:
        """One warning per distinct failure (the same one again is a debug line), with
        what the operator can do about it, and when the next try is."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, ControllerRejected):
            error = str(exc)
            if "HTTP 404" in error:  # forgotten (e.g. a memory store restarted)
                self.registered = False
        else:
            error = f"{type(exc).__name__}: {exc}"
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        repeated = error == self.last_error
        self.last_error = error
        log.log(logging.DEBUG if repeated else logging.WARNING, "%s; retrying in %.1f s%s",
                controller_problem(error, self.cfg.url), wait,
                " (and backing off while it lasts)" if not repeated else "")

    # -- telemetry -------------------------------------------------------------------------
    def telemetry(self) -> dict[str, Any]:
        window, models = self.tally.take()
        d = self.dispatcher
        out: dict[str, Any] = {
            "window_s": min(window, 3600.0), "models": models, "queue_length": d.queued,
            "in_flight": sum(t.load.in_flight for t in d.targets.values()),
            "replicas": {url: "healthy" if h.healthy else "unhealthy"
                         for url, h in self.health.replicas.items()},
        }
        if self.tenant_demand is not None:
            demand = self.tenant_demand()
            kept = busiest(demand, self.cfg.telemetry_max_tenants)
            self._left_out(len(demand) - len(kept), len(demand))
            out["tenants"] = {name: {"requests_per_s": round(r, 4),
                                     "tokens_per_min": round(t, 2)}
                              for name, (r, t) in sorted(kept.items())}
            out["worker"] = self.worker
        return out

    def _left_out(self, n: int, active: int) -> None:
        """Count the tenants a report left out; warn when it starts (not every report)."""
        if n > 0 and self.tenants_unreported is not None:
            self.tenants_unreported(n)
        if n > 0 and self._unreported == 0:
            log.warning("%d tenants are active here: the telemetry report carries the "
                        "demand of the busiest %d (controller.telemetry_max_tenants); the "
                        "others hold the floor of their limits here", active, active - n)
        self._unreported = n

    def apply_shares(self, answer: Any) -> None:
        """The telemetry answer: the tenants with this balancer's fractions of their
        limits. One computed before a membership this balancer applied since (a tenant
        deleted meanwhile) is ignored: the next report brings a newer one. An older
        controller answers 204 (None): membership's shares stay."""
        if not isinstance(answer, dict) or self.set_tenants is None:
            return
        tenants, rev = answer.get("tenants"), answer.get("revision")
        if isinstance(tenants, list) and isinstance(rev, int) and rev >= self.revision:
            self.set_tenants(tenants)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.telemetry_interval_s)
            if not self.registered:
                continue
            try:
                self.apply_shares(await self._call(
                    "POST", f"/v1/balancers/{self.balancer_id}/telemetry",
                    json=self.telemetry()))
            except (ControllerRejected, aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("telemetry not delivered: %s", exc)
            if self.dispatcher.outlook is not None:
                await self.refresh_outlook(self.dispatcher.outlook)

    async def refresh_outlook(self, into: PeerOutlook) -> None:
        """The planner's per-region forecast; on failure the last one stays, and its
        windows run out on their own (a stale forecast stops counting)."""
        try:
            got = await self._call("GET", "/v1/outlook")
            into.update(RegionOutlook.from_json(o) for o in got["regions"])
        except (ControllerRejected, aiohttp.ClientError, TimeoutError, OSError, ValueError,
                KeyError, TypeError) as exc:
            log.warning("outlook not read: %s", exc)
