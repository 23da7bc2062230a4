"""Simulated replicas and regional balancers, driven by the event loop in virtual time.

``SimReplica`` runs the same :class:`~skymesh.engine.core.Engine` as ``skymesh-replica``;
only the clock differs. It fast-forwards through steady decoding and cuts a fast-forwarded
batch short when a request arrives, so batches stay step-exact.

``SimBalancer`` is the regional balancer of the simulator: a FCFS queue per model, a
probe of every replica each ``probe_interval`` (what the live balancer sees over HTTP),
per-replica bookkeeping between probes (:class:`~skymesh.policies.load.ReplicaLoad`), a
pushing mode, and a routing policy from the shared registry. Requests wait at the head of
the queue until a probe or a completion frees a replica.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from skymesh.engine.core import Batch, Engine, Sequence, StepEvent
from skymesh.engine.profiles import Profile
from skymesh.policies.base import Policy, RouteRequest
from skymesh.policies.load import PushMode, ReplicaLoad, is_available
from skymesh.sim.events import EventLoop
from skymesh.sim.network import Network
from skymesh.sim.workload import WorkItem


@dataclass(slots=True)
class RequestRecord:
    item: WorkItem
    route: RouteRequest
    t_arrival: float  # client sends
    t_first: float = -1.0  # client receives the first token
    t_done: float = -1.0  # client receives the last token
    replica: str = ""
    hit_tokens: int = 0
    ok: bool = False
    error: str = ""


class SimReplica:
    def __init__(
        self,
        rid: str,
        region: str,
        profile: Profile,
        loop: EventLoop,
        on_event: Callable[[SimReplica, RequestRecord, StepEvent], None],
        max_fast_forward: int = 4096,
    ) -> None:
        self.id = rid
        self.region = region
        self.profile = profile
        self.engine = Engine(profile)
        self.loop = loop
        self._on_event = on_event
        self._max_ff = max_fast_forward
        self._batch: Batch | None = None
        self._start = 0.0
        self._gen = 0

    def submit(self, rec: RequestRecord) -> str | None:
        """Hand a request to the engine now; an error message if the engine refuses it."""
        item = rec.item
        seq = Sequence(item.request_id, item.prompt_len, item.output_len, item.block_hashes)
        seq.payload = rec
        try:
            self.engine.add(seq)
        except ValueError as exc:
            return str(exc)
        batch = self._batch
        if batch is None:
            self._start_step()
        elif batch.num_steps > 1:
            old = batch.duration
            new = self.engine.truncate(batch, self.loop.now - self._start)
            if new < old:
                self._gen += 1
                self.loop.at(self._start + new, self._end_step, self._gen)
        return None

    def _start_step(self) -> None:
        batch = self.engine.schedule(self._max_ff)
        self._batch = batch
        if batch is None:
            return
        self._start = self.loop.now
        self._gen += 1
        self.loop.at(self._start + batch.duration, self._end_step, self._gen)

    def _end_step(self, gen: int) -> None:
        if gen != self._gen or self._batch is None:
            return  # superseded by a truncation
        events = self.engine.complete(self._batch)
        self._batch = None
        for ev in events:
            self._on_event(self, ev.seq.payload, ev)  # type: ignore[arg-type]
        self._start_step()


class SimBalancer:
    def __init__(
        self,
        name: str,
        region: str,
        replicas: list[SimReplica],
        policy: Policy,
        loop: EventLoop,
        net: Network,
        mode: PushMode = PushMode.SP_P,
        max_outstanding: int = 16,
        probe_interval: float = 0.1,
        is_active: Callable[[], bool] = lambda: True,
        on_rejected: Callable[[RequestRecord], None] = lambda rec: None,
    ) -> None:
        self.name = name
        self.region = region
        self.replicas = {r.id: r for r in replicas}
        self.policy = policy
        self.loop = loop
        self.net = net
        self.mode = mode
        self.max_outstanding = max_outstanding
        self.probe_interval = probe_interval
        self.loads = {r.id: ReplicaLoad(r.id) for r in replicas}
        self.queues: dict[str, deque[RequestRecord]] = {}
        self._is_active = is_active
        self._on_rejected = on_rejected
        self._probing = False
        self.max_queue = 0
        policy.on_membership(sorted(self.replicas))

    # LoadView for the policies.
    @property
    def now(self) -> float:
        return self.loop.now

    def load(self, target: str) -> ReplicaLoad:
        return self.loads[target]

    def arrive(self, rec: RequestRecord) -> None:
        q = self.queues.setdefault(rec.item.model, deque())
        q.append(rec)
        if not self._probing:
            self._probing = True
            self._probe()
        else:
            self._pump(q)
        if len(q) > self.max_queue:
            self.max_queue = len(q)

    def _probe(self) -> None:
        now = self.loop.now
        for rid, rep in self.replicas.items():
            e = rep.engine
            self.loads[rid].on_probe(now, e.num_waiting, e.num_running, e.kv_usage)
        self._pump_all()
        if self._is_active():
            self.loop.after(self.probe_interval, self._probe)
        else:
            self._probing = False

    def _pump_all(self) -> None:
        for q in self.queues.values():
            self._pump(q)

    def _pump(self, q: deque[RequestRecord]) -> None:
        loads, mode, cap = self.loads, self.mode, self.max_outstanding
        while q:
            cands = [rid for rid, ld in loads.items() if is_available(ld, mode, cap)]
            if not cands:
                return
            rec = q[0]
            target = self.policy.select(rec.route, cands, self)
            if target is None:
                return
            q.popleft()
            self._dispatch(rec, target)

    def _dispatch(self, rec: RequestRecord, target: str) -> None:
        rec.replica = target
        self.loads[target].on_dispatch(rec.item.request_id, self.loop.now)
        self.policy.on_dispatch(rec.route, target, self)
        rep = self.replicas[target]
        self.loop.after(self.net.one_way(self.region, rep.region), self._deliver, rec, rep)

    def _deliver(self, rec: RequestRecord, rep: SimReplica) -> None:
        err = rep.submit(rec)
        if err is not None:
            # The replica answers 4xx at once (e.g. longer than the model's context).
            rec.error = err
            back = self.net.one_way(rep.region, self.region)
            self.loop.after(back, self.on_replica_done, rec, False)
            self.loop.after(back, self._on_rejected, rec)

    def on_first_byte(self, rec: RequestRecord) -> None:
        self.loads[rec.replica].on_first_byte(rec.item.request_id)
        self._pump_all()

    def on_replica_done(self, rec: RequestRecord, ok: bool) -> None:
        self.loads[rec.replica].on_complete(rec.item.request_id)
        self.policy.on_complete(rec.route, rec.replica, ok)
        self._pump_all()
