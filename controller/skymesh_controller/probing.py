"""Health probing and failover: every ``probe.interval_s``, each balancer's and replica's
``/health``, judged by the balancer's own health rule (skymesh.common.health).

A balancer that turns ``up`` or ``down`` moves replicas (membership.reassign) in the
same commit as its state, then ``on_balancers`` runs (the DNS sync). Only the leader
probes (leadership.py): its loop checks ``acts`` before each round and before its commit,
and the commit carries the lease (store.FENCE). Every outbound
request checks the URL policy again: at the connector for each address DNS gives, and
on the URL itself for IP literals, which never reach the resolver; no redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from skymesh.common.health import HealthRule, Streak
from skymesh.net import urlpolicy
from skymesh.net.resolver import PolicyResolver
from skymesh.net.urlpolicy import Resolver, UrlPolicy, UrlRejected
from skymesh_controller.changes import Changes
from skymesh_controller.config import ProbeConfig
from skymesh_controller.membership import Membership
from skymesh_controller.store import Obj, Put, Store

log = logging.getLogger("skymesh.controller")


class Prober:
    def __init__(self, cfg: ProbeConfig, store: Store, changes: Changes,
                 membership: Membership, url_policy: UrlPolicy, resolver: Resolver,
                 on_balancers: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.store, self.changes, self.membership = cfg, store, changes, membership
        self.url_policy, self.resolver = url_policy, resolver
        self.on_balancers = on_balancers
        self._rule = HealthRule(cfg.failure_threshold, cfg.success_threshold)
        self._streaks: dict[tuple[str, str], Streak] = {}
        self.counts: dict[tuple[str, bool], int] = {}  # (kind, ok): for /metrics
        self._refused: set[str] = set()  # URLs whose probe refusal was logged already
        self.session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.acts: Callable[[], bool] = lambda: True  # the leader lease holds here
        self.rounds = 0  # probe rounds run, for /metrics (only a leader's grow)

    async def start(self, loop: bool = True) -> None:
        # The connector checks every address DNS gives it: a name that passed at
        # registration and resolves to a denied address now is refused at connect time.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                resolver=PolicyResolver(self.url_policy, self.resolver)),
            timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        if loop:
            self.start_loop()

    def start_loop(self) -> None:
        """Probe every interval from now on (the leader's: started in its context)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="controller-probe")

    async def stop_loop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        await self.stop_loop()
        if self.session is not None:
            await self.session.close()

    async def _loop(self) -> None:
        while True:
            if not self.acts():  # a woken leader whose lease ran out probes nothing
                return
            try:
                await self.probe_once()
            except Exception:  # a store outage must not end probing for good
                log.exception("probe round failed")
            await asyncio.sleep(self.cfg.interval_s)

    async def _healthy(self, url: str) -> bool:
        assert self.session is not None
        try:
            # Checked again at every probe: the policy may have changed since registration,
            # and IP literals never reach the connector's checking resolver.
            urlpolicy.check_static(url, self.url_policy)
            target = urlpolicy.join(url, "/health")
        except UrlRejected as exc:
            self._log_refusal(url, exc)
            return False
        try:
            # No redirects: a 3xx to another host would bypass the check above.
            async with self.session.get(target, allow_redirects=False) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if "URL policy" in str(exc):
                self._log_refusal(url, exc)
            return False

    def _log_refusal(self, url: str, exc: Exception) -> None:
        if url not in self._refused:
            self._refused.add(url)
            log.warning("not probing %s: %s", url, exc)

    async def busy(self, url: str) -> int | None:
        """Running + waiting requests from the replica's own ``/metrics`` (every
        balancer's and any direct client's); None when it cannot be read."""
        from skymesh.common.probe import ProbeParseError, parse_metrics

        assert self.session is not None
        try:
            urlpolicy.check_static(url, self.url_policy)
            async with self.session.get(urlpolicy.join(url, "/metrics"),
                                        allow_redirects=False) as r:
                if r.status != 200:
                    return None
                load = parse_metrics(await r.text())
        except (UrlRejected, ProbeParseError, aiohttp.ClientError, TimeoutError, OSError):
            return None
        return load.running + load.waiting

    def judge(self, key: tuple[str, str], ok: bool, current: str, up: str, down: str) -> str:
        """Consecutive-result thresholds, so one lost probe does not move replicas: the
        balancer's own rule, on the stored state (``up``, ``down`` or anything else,
        which the rule treats as unknown)."""
        was = True if current == up else False if current == down else None
        now = self._rule.step(self._streaks.setdefault(key, Streak()), ok, was)
        return current if now is was else up if now else down

    async def probe_once(self) -> None:
        self.rounds += 1
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        b_ok, r_ok = await asyncio.gather(
            asyncio.gather(*(self._healthy(b["url"]) for b in balancers.values())),
            asyncio.gather(*(self._healthy(r["url"]) for r in replicas.values())))
        for kind, oks in (("balancer", b_ok), ("replica", r_ok)):
            for ok in oks:
                self.counts[kind, ok] = self.counts.get((kind, ok), 0) + 1
        async with self.changes.lock:
            # Re-read under the lock: an API write may have landed while we probed.
            cur_b = await self.store.all("balancers")
            cur_r = await self.store.all("replicas")
            changed_b = self._judged(balancers, b_ok, cur_b, "b", "up", "down")
            puts: list[Put] = [("balancers", k, v) for k, v in changed_b.items()]
            live = {k: v for k, v in cur_r.items() if v.get("state") != "draining"}
            puts += [("replicas", k, v) for k, v in
                     self._judged(replicas, r_ok, live, "r", "healthy", "unhealthy").items()]
            if changed_b:
                moved = await self.membership.reassign(cur_b, cur_r)
                done = {p[1] for p in puts if p[0] == "replicas"}
                puts += [p for p in moved if p[1] not in done]
            if puts and not self.acts():
                return  # the lease ran out while we probed: the new leader judges
            if puts:
                await self.changes.commit(puts)
        if changed_b:
            self.on_balancers()

    def _judged(self, probed: dict[str, Obj], oks: list[bool], current: dict[str, Obj],
                tag: str, up: str, down: str) -> dict[str, Obj]:
        """The records of ``current`` whose state the probe results change, changed."""
        changed: dict[str, Obj] = {}
        kind = "balancer" if tag == "b" else "replica"
        for obj, ok in zip(probed.values(), oks, strict=True):
            now = current.get(obj["id"])
            if now is None:
                continue
            state = self.judge((tag, obj["id"]), ok, now.get("state", "unknown"), up, down)
            if state != now.get("state"):
                log.warning("%s %s is %s", kind, obj["id"], state)
                now["state"] = state
                changed[obj["id"]] = now
        return changed
