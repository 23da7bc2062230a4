"""The control plane's parts, wired together, started and stopped as one.

All state lives in the store; the parts hold only caches rebuilt from it (probe streaks,
the newest telemetry), so a restarted controller picks up where it was. Each part owns
one kind of state or behaviour:

=================  ====================================================================
``changes``        the one writer at a time, and waking long polls (changes.py)
``records``        reading records; regions, models; ownership and URL rules (records.py)
``balancers``      balancer registration, updates, policy (balancers.py)
``replicas``       replica registration, updates, draining (replicas.py)
``members``        replica assignment and failover, each balancer's membership and what
                   it applied (membership.py)
``telemetry``      balancer reports in, within bounds; their history (telemetry.py)
``prober``         health probes and the state changes they cause (probing.py)
``dns``            DNS sync, on demand and after failover (dns_sync.py)
``moves``          drain and re-home, for the planner's moves (relocation.py)
``tenants``        tenants and their limits, pushed with membership (tenants.py)
``leadership``     the leader lease: only the leader probes, fails over, syncs DNS and
                   plans; standbys serve the API (leadership.py, lease.py)
=================  ====================================================================

The admin API (api.py) calls the part each route needs. The calls kept on
:class:`Controller` itself are those made in-process of the control plane as a whole:
the planner and its actuators (autopilot/), and tests.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from skymesh.net import urlpolicy
from skymesh.net.urlpolicy import Resolver, UrlPolicy
from skymesh_controller import placement
from skymesh_controller.balancers import Balancers
from skymesh_controller.changes import Changes
from skymesh_controller.config import ControllerConfig
from skymesh_controller.dns_sync import DnsHook, DnsSync
from skymesh_controller.leadership import Leadership
from skymesh_controller.membership import Membership
from skymesh_controller.probing import Prober
from skymesh_controller.records import ADMIN, Records
from skymesh_controller.refusals import Refusals
from skymesh_controller.relocation import Relocations
from skymesh_controller.replicas import Replicas
from skymesh_controller.status import mesh_status
from skymesh_controller.store import Obj, Store
from skymesh_controller.telemetry import Telemetry
from skymesh_controller.tenants import Tenants

__all__ = ["ADMIN", "Controller"]


class Controller:
    def __init__(self, cfg: ControllerConfig, store: Store, dns: DnsHook | None = None,
                 resolver: Resolver = urlpolicy.system_resolver) -> None:
        self.cfg, self.store = cfg, store
        self.started = time.time()
        url_policy = cfg.url_policy.policy()
        # Placement mixes owners only where an admin allowed it (placement.Trust).
        trust = placement.Trust(
            admins=frozenset({t.name for t in cfg.tokens if t.role == "admin"}
                             | {ADMIN.name, "env-admin"}),
            shared=frozenset(cfg.shared_balancer_owners))
        self.refusals = Refusals()
        self.changes = Changes(store, cfg.long_poll_max_s, cfg.ha.revision_poll_s)
        self.records = Records(store, self.changes, self.refusals, url_policy, resolver)
        self.members = Membership(store, self.records, trust,
                                  share_floor=cfg.tenant_share_floor,
                                  demand_stale_s=cfg.tenant_demand_stale_s)
        self.balancers = Balancers(cfg, store, self.changes, self.records, self.members,
                                   self.refusals)
        self.replicas = Replicas(store, self.changes, self.records, self.members)
        self.telemetry = Telemetry(cfg, store, self.refusals)
        self.dns = DnsSync(cfg, dns, self.records)
        self.prober = Prober(cfg.probe, store, self.changes, self.members, url_policy,
                             resolver, on_balancers=self.dns.schedule)
        self.moves = Relocations(store, self.changes, self.records, self.replicas,
                                 self.members, self.prober, trust)
        self.leadership = Leadership(store, cfg.ha)
        self.tenants = Tenants(store, self.changes, self.records, self.refusals,
                               cfg.max_tenants)
        self.prober.acts = self.dns.acts = self.leadership.acts
        # In-process calls (the planner's actuators, tests): the parts' own methods.
        self.get, self.put_region = self.records.get, self.records.put_region
        self.register_balancer = self.balancers.register
        self.add_replica, self.remove_replica = self.replicas.add, self.replicas.remove
        self.probe_once, self._judge = self.prober.probe_once, self.prober.judge
        self.note_poll = self.members.note_poll
        self.move_home, self.move_replica = self.moves.move_home, self.moves.move_replica
        self.begin_drain = self.moves.begin_drain

    async def start(self, probe: bool = True) -> None:
        await self.store.ping()
        await self.prober.start(loop=False)
        if probe:  # the leader's loops start when it wins the lease, stop when it loses
            async def lead() -> None:
                self.prober.start_loop()

            self.leadership.on_elected.insert(0, lead)
            self.leadership.on_lost.insert(0, self.prober.stop_loop)
        await self.leadership.start()

    async def stop(self) -> None:
        await self.leadership.stop()
        await self.prober.stop()
        await self.dns.stop()
        await self.store.close()

    async def membership(self, bid: str) -> Obj:
        return await self.members.view(bid)

    async def status(self) -> Obj:
        return await mesh_status(self.store, self.telemetry.latest, self.dns.last, self.started,
                                 self.leadership)

    @property
    def url_policy(self) -> UrlPolicy:
        """The outbound URL policy: registrations are checked on it, and every probe."""
        return self.records.url_policy

    @url_policy.setter
    def url_policy(self, policy: UrlPolicy) -> None:
        self.records.url_policy = self.prober.url_policy = policy

    @property
    def polled(self) -> dict[str, int]:
        return self.members.polled

    @property
    def _session(self) -> aiohttp.ClientSession | None:
        return self.prober.session

    @property
    def _dns_task(self) -> asyncio.Task[None] | None:
        return self.dns.task
