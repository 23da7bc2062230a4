"""The leader SIGKILLed in the middle of a planner round that moves a replica, with real
processes on loopback (issue #38): two ``skymesh-controller`` on one ``redis-server``
(planner ``auto``, ``local`` actuator), a ``skymesh-lb`` per region (one worker, following
membership from the standby, as behind a Service that routes to a live controller), and
emulated ``skymesh-replica`` processes.

One run (:func:`midmove_once`):

1. A round applied by the leader starts r1 in us (its actuator's child, so its move);
   the run registers a second replica, r2, in us by hand.
2. A client sends requests back to back through lb-us for the whole run.
3. The demand shifts to eu (half of it), and a round applied by the leader moves r1 to eu:
   its record says ``applying`` with the move ``draining``, and the replica drains.
   ``drain_poll_s`` is longer than the run: the move cannot finish before the kill (the
   deterministic hold: two quiet observations ``drain_poll_s`` apart are needed).
4. The leader is SIGKILLed as soon as the store shows the move draining. Takeover: from
   the signal until the standby's ``/metrics`` says it leads. The new leader settles the
   round (``failed``, r1 undrained in us) once; r1 serves at lb-us again.

The row counts the client's failures (the goal is 0), the rounds applied and settled,
and the requests r1 served before the drain and after its undrain.
``skymesh_lab.bench.control_ha`` runs it for the results page; the integration test
``tests/integration/test_controller_ha_kill.py`` asserts on one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from skymesh.util.procs import Daemon, start_daemon
from skymesh_lab.bench.control_ha_procs import start_controller, stop_all
from skymesh_lab.faults.client import Tally, closed_loop, session
from skymesh_lab.faults.cluster import MODEL, RedisProcess, parse_metrics

ADMIN, AGENT = "control-ha-move-admin", "control-ha-move-agent"
MARK = "SKYMESH_CONTROL_HA_RUN"  # in the leader's environment: finds its orphaned children
TPS = 800.0  # one instance serves 1000 tokens/s: one replica per region with demand
START_S = 90.0  # process start-ups on a loaded machine


def tokens() -> list[dict[str, str]]:
    from skymesh_controller.auth import digest

    return [{"name": "ops", "sha256": digest(ADMIN), "role": "admin"},
            {"name": "lbs", "sha256": digest(AGENT), "role": "agent"}]


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def planner(work: Path) -> dict[str, Any]:
    return {"mode": "auto", "epsilon": 1.0, "capacity": {MODEL: {"L4": 1000.0}},
            "bounds": {MODEL: {"*": {"min": 0, "max": 1}}},
            # Rounds run only when the run asks (POST /v1/plans): the standby, once it
            # leads, starts no round of its own, so every round is counted.
            "schedule": {"window_s": 1, "horizon": 2, "interval_s": 3600, "tick_s": 3600,
                         "first_round_s": 1e6, "min_history_windows": 3,
                         "stale_windows": 3},
            "forecaster": {"headroom": 0.0},
            # A start that failed on a loaded machine is planned again at the next
            # asked-for round, not held for the retry cooldown.
            "cooldowns": {"hold_s": 0, "retry_s": 0.1},
            "drain_timeout_s": 600, "drain_poll_s": 300,
            "actuator": {"kind": "local", "local": {
                "log_dir": str(work), "replica_args": ["--metrics-lag-s", "0.1"],
                "start_timeout_s": START_S}}}


def leads(d: Daemon) -> bool:
    try:
        m = parse_metrics(httpx.get(d.url + "/metrics", timeout=2).text)
    except httpx.HTTPError:
        return False
    return m.get("skymesh_controller_leader") == 1.0


def until(cond: Callable[[], Any], what: str, timeout: float, poll: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something true (errors count as not yet); that."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError, StopIteration):
            got = cond()
            if got:
                return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)  # polling cadence; the deadline bounds the wait


class Feeder:
    """Telemetry as lb-REGION reports it: ``tps[region]`` prompt tokens/s of the model
    every 0.25 s, from a thread (the planner's demand)."""

    def __init__(self, base: str, tps: dict[str, float]) -> None:
        self.base, self.tps = base, tps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, headers=auth(AGENT), timeout=5) as c:
            while not self._stop.wait(0.25):
                for region, tps in list(self.tps.items()):
                    with contextlib.suppress(httpx.HTTPError):  # the next report follows
                        c.post(f"/v1/balancers/lb-{region}/telemetry", json={
                            "window_s": 0.25, "models": {MODEL: {
                                "requests": 1, "prompt_tokens": int(tps * 0.25),
                                "output_tokens": 0}}})

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def start_lb(work: Path, ctl: Daemon, region: str) -> Daemon:
    cfg = {"region": region, "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
           "policy": {"name": "least-load"}, "probe": {"interval_s": 0.1},
           "controller": {"url": ctl.url, "balancer_id": f"lb-{region}", "retry_s": 0.2,
                          "telemetry_interval_s": 0.5,
                          "url_policy": {"allow_loopback": True}}}
    path = work / f"lb-{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "warning"],
                        log_path=work / f"lb-{region}.log", timeout=START_S,
                        env={**os.environ, "SKYMESH_AGENT_TOKEN": AGENT})


def marked(mark: str) -> list[int]:
    """Processes whose environment carries ``MARK=mark``: the leader's replica children,
    orphaned when it was SIGKILLed (only this user's processes are readable)."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def reap(pids: list[int], timeout: float = 10.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # an orphan is not our child: no wait(); poll until it goes
        with contextlib.suppress(ProcessLookupError):
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def daemons() -> Iterator[list[Daemon]]:
    ds: list[Daemon] = []
    try:
        yield ds
    finally:
        stop_all(ds)


def served(url: str) -> float:
    """Requests the replica finished (its own count: every balancer and client)."""
    m = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
    return m.get("vllm:request_success_total", 0.0)


def midmove_once(work: Path, ttl_s: float = 2.0, renew_s: float = 0.4) -> dict[str, Any]:
    """One run. The lease is longer than the takeover bench's short one: on a loaded
    machine 0.6 s lets the lease change hands between rounds, which is not this run."""
    mark = uuid.uuid4().hex
    redis = RedisProcess(work)
    redis.start()
    try:
        with daemons() as ds, httpx.Client(headers=auth(), timeout=60) as c:
            try:
                return _run(work, redis, ds, c, mark, ttl_s, renew_s)
            except RuntimeError as exc:
                # Say what the controllers said: a run that fails on a loaded machine
                # is otherwise a bare timeout.
                tails = "".join(f"\n--- {d.name} {d.url}:\n" + d.log()[-1500:]
                                for d in ds if d.name == "skymesh-controller")
                raise RuntimeError(f"{exc}{tails}") from None
    finally:
        reap(marked(mark))
        redis.stop()


def _run(work: Path, redis: RedisProcess, ds: list[Daemon], c: httpx.Client, mark: str,
         ttl_s: float, renew_s: float) -> dict[str, Any]:
    env = {**os.environ, MARK: mark}
    # Started side by side: each start-up is seconds of imports on a loaded machine.
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(start_controller, work, name, redis.url, tokens(), ttl_s=ttl_s,
                            renew_s=renew_s, extra={"planner": planner(work)}, env=env)
                for name in ("ctl-a", "ctl-b")]
        for f in futs:
            with contextlib.suppress(RuntimeError):  # the one that failed: raised below
                ds.append(f.result())
    if len(ds) < 2:
        raise RuntimeError("a controller did not start")
    leader = until(lambda: next(d for d in ds if leads(d)), "a leader", 30)
    # The balancers follow the standby (and the run reads through it): the run's end
    # needs them on a live controller, as a Service in front of both would route them.
    standby = next(d for d in ds if d is not leader)
    ctls = list(ds)
    for name, lat, lon in (("us", 38.9, -77.0), ("eu", 53.3, -6.3)):
        r = c.post(f"{standby.url}/v1/regions",
                   json={"name": name, "latitude": lat, "longitude": lon})
        assert r.status_code == 201, r.text
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(start_lb, work, standby, region) for region in ("us", "eu")]
        lbs = []
        for f in started:
            with contextlib.suppress(RuntimeError):  # the one that failed: raised below
                lbs.append(f.result())
    ds.extend(lbs)
    if len(lbs) < 2:
        raise RuntimeError("a balancer did not start")
    until(lambda: {b["id"] for b in c.get(f"{standby.url}/v1/balancers").json()}
          == {"lb-us", "lb-eu"}, "both balancers registered", START_S)
    with Feeder(standby.url, {"us": TPS, "eu": 0.0}) as feed:
        # Round 1: the leader starts r1 in us (the history needs three windows first).
        r1 = until(lambda: _apply_until(c, ctls, lambda rec: rec["status"] == "applied"),
                   "a round that starts a replica in us", START_S, poll=0.5)
        rid1 = next(r["id"] for r in c.get(f"{standby.url}/v1/replicas").json()
                    if r["kind"] == "skymesh")
        url1 = c.get(f"{standby.url}/v1/replicas/{rid1}").json()["url"]
        # r2: a replica of nobody's actuator, the one lb-us keeps while r1 drains.
        r2 = start_daemon("skymesh-replica", ["--port", "0", "--model", MODEL,
                                              "--metrics-lag-s", "0.1",
                                              "--log-level", "warning"],
                          log_path=work / "r2.log", timeout=START_S)
        ds.append(r2)
        r = c.post(f"{standby.url}/v1/replicas", json={
            "id": "r2", "url": r2.url, "model": MODEL, "region": "us", "gpu": "L4",
            "balancer": "lb-us"})
        assert r.status_code == 201, r.text
        until(lambda: _healthy_at(lbs[0], {url1, r2.url}), "r1 and r2 serving at lb-us",
              START_S)
        return asyncio.run(_under_load(c, ctls, standby, lbs[0], feed, rid1, url1,
                                       r1["id"]))


def _leader(ctls: list[Daemon]) -> Daemon | None:
    return next((d for d in ctls if leads(d)), None)


def _apply_until(c: httpx.Client, ctls: list[Daemon], ok: Callable[[dict[str, Any]], bool]
                 ) -> dict[str, Any] | None:
    """One dry run; if it would act, the same round applied by the leader (a 409 from
    a leader that just lost its lease: the next try). The applied record if ``ok``."""
    leader = _leader(ctls)
    if leader is None:
        return None
    dry = c.post(f"{leader.url}/v1/plans", json={"dry_run": True}).json()
    if not dry.get("changes"):
        return None
    r = c.post(f"{leader.url}/v1/plans", json={"dry_run": False})
    rec = r.json() if r.status_code == 201 else {}
    return rec if rec and ok(rec) else None


def _healthy_at(lb: Daemon, urls: set[str]) -> bool:
    reps = httpx.get(lb.url + "/status", timeout=5).json()["replicas"]
    return all(reps.get(u, {}).get("healthy") for u in urls)


async def _under_load(c: httpx.Client, ctls: list[Daemon], standby: Daemon, lb_us: Daemon,
                      feed: Feeder, rid1: str, url1: str, round1: str) -> dict[str, Any]:
    tally, stop = Tally(), asyncio.Event()
    async with session() as s:
        client = asyncio.create_task(closed_loop(
            s, lb_us.url, tally, stop_at=time.monotonic() + 300, deadline_s=30,
            max_tokens=8, stream=False, tag="through the kill", stop=stop))
        try:
            row = await _kill_mid_move(c, ctls, standby, lb_us, feed, rid1, url1, round1,
                                       tally)
        finally:
            stop.set()
            await client
    row["client"] = tally.row()
    row["failed_requests"] = tally.failed_explicit + tally.lost + tally.refused
    return row


async def _wait(cond: Callable[[], Any], what: str, timeout: float) -> Any:
    return await asyncio.to_thread(until, cond, what, timeout)


async def _kill_mid_move(c: httpx.Client, ctls: list[Daemon], standby: Daemon, lb_us: Daemon,
                         feed: Feeder, rid1: str, url1: str, round1: str,
                         tally: Tally) -> dict[str, Any]:
    await _wait(lambda: tally.completed >= 5, "the client served through lb-us", 60)
    await _wait(lambda: served(url1) >= 1, "r1 serving the client", 60)
    feed.tps.update(us=TPS, eu=TPS)  # half the demand now in eu: a move of r1 pays

    def would_move() -> Daemon | None:
        leader = _leader(ctls)
        if leader is None:
            return None
        dry = c.post(f"{leader.url}/v1/plans", json={"dry_run": True}).json()
        return leader if any((m["from"]["region"], m["to"]["region"]) == ("us", "eu")
                             for m in dry.get("moves", [])) else None

    def draining() -> dict[str, Any] | None:
        for rec in c.get(f"{standby.url}/v1/plans").json():
            if rec["status"] == "applying" and any(
                    m["replica"] == rid1 and m["state"] == "draining"
                    for m in rec.get("moves", [])):
                return rec
        return None

    for _ in range(10):
        leader = await _wait(would_move, "a plan that moves r1 to eu", 60)
        # The round that moves r1, applied by the leader: the request dies with it.
        applying = asyncio.create_task(asyncio.to_thread(_post_quietly, c, leader))
        # It drains r1, or answered at once (a 409 from a leader that lost its lease
        # just then): then again, with whichever leads.
        def drained_or_refused(task: asyncio.Task[None] = applying) -> Any:
            return draining() or task.done()

        rec = await _wait(drained_or_refused, "the leader's round draining r1", 60)
        if rec is not True:
            break
    else:
        raise RuntimeError("no leader applied the round that moves r1")
    assert leader is not standby, "the balancers follow the standby: it must survive"
    before_drain = served(url1)
    epoch = c.get(f"{standby.url}/v1/status").json()["control"]["epoch"]
    t0 = time.monotonic()
    leader.kill()  # SIGKILL
    completed_at_kill = tally.completed
    await _wait(lambda: leads(standby), "the standby to lead", 60)
    takeover = time.monotonic() - t0
    epoch_after = c.get(f"{standby.url}/v1/status").json()["control"]["epoch"]
    await applying

    def settled() -> dict[str, Any] | None:
        got = c.get(f"{standby.url}/v1/plans/{rec['id']}").json()
        return got if got["status"] != "applying" else None

    final = await _wait(settled, "the new leader to settle the round", 60)
    settle_s = time.monotonic() - t0
    await _wait(lambda: _healthy_at(lb_us, {url1}), "r1 back at lb-us", 60)
    back = served(url1)
    await _wait(lambda: served(url1) >= back + 3, "r1 serving again", 60)
    after = served(url1)
    # What the store holds at the end, and what each controller did.
    reps = {r["id"]: r for r in c.get(f"{standby.url}/v1/replicas").json()}
    recs = c.get(f"{standby.url}/v1/plans").json()
    log = standby.log()
    return {
        "ttl_s": None, "renew_s": None,  # filled by the caller that knows them
        "takeover_s": round(takeover, 3), "settled_s": round(settle_s, 3),
        "epoch_before": epoch,
        "epoch_after": epoch_after,
        "round": rec["id"], "round_status": final["status"],
        "round_reason": final.get("reason"), "round_actions": len(final["actions"]),
        "move_state": [m["state"] for m in final.get("moves", [])],
        "round1": round1,
        "rounds": {st: sum(r["status"] == st for r in recs)
                   for st in sorted({r["status"] for r in recs})},
        "settled_times": log.count(f"planner round {rec['id']}: "),
        "replica": {k: reps[rid1].get(k) for k in ("region", "state", "balancer", "url")},
        "replicas": sorted(reps),
        "r1_served_before_drain": before_drain, "r1_served_after_undrain": after - back,
        "r1_url_unchanged": reps[rid1]["url"] == url1,
        "client_completed_at_kill": completed_at_kill,
    }


def _post_quietly(c: httpx.Client, leader: Daemon) -> None:
    # The leader dies under this request: its connection error is the expected answer.
    with contextlib.suppress(httpx.HTTPError):
        c.post(f"{leader.url}/v1/plans", json={"dry_run": False}, timeout=120)



# -- mid-round: the leader killed while its actuator starts a replica -------------------------

WRITER_LOCK_S = 60.0  # ha.writer_lock_s: the held registration waits twice this at most


def replica_pids(mark: str) -> list[int]:
    """Marked ``skymesh-replica`` processes: the actuators' children."""
    out = []
    for pid in marked(mark):
        with contextlib.suppress(OSError):
            if b"skymesh-replica" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def midround_once(work: Path, ttl_s: float = 2.0, renew_s: float = 0.4) -> dict[str, Any]:
    """The leader SIGKILLed while its round is ``applying`` and its actuator is starting
    a replica. The hold: the run takes the store's writer lock (``skymesh:writer``)
    before the round, so the replica the actuator started cannot be registered (its
    commit waits for the lock) until the leader is dead; then the lock is let go. The
    new leader settles the round; a round it applies then starts the one replica the
    plan wants. Counts: replica processes started (the actuators' log files), replicas
    registered."""
    import redis as redis_lib

    mark = uuid.uuid4().hex
    redis = RedisProcess(work)
    redis.start()
    extra = {"planner": planner(work)}
    try:
        with daemons() as ds:
            env = {**os.environ, MARK: mark}
            with ThreadPoolExecutor(2) as pool:
                futs = [pool.submit(start_controller, work, name, redis.url, tokens(),
                                    ttl_s=ttl_s, renew_s=renew_s, env=env,
                                    extra={**extra, "ha": {
                                        "id": name, "lease_ttl_s": ttl_s,
                                        "renew_interval_s": renew_s, "revision_poll_s": 0.1,
                                        "writer_lock_s": WRITER_LOCK_S}})
                        for name in ("ctl-a", "ctl-b")]
                ds.extend(f.result() for f in futs)
            r = redis_lib.Redis.from_url(redis.url)
            try:
                with httpx.Client(headers=auth(), timeout=60) as c:
                    return _midround(work, ds, c, r, mark)
            finally:
                r.close()
    finally:
        reap(marked(mark))
        redis.stop()


def _midround(work: Path, ctls: list[Daemon], c: httpx.Client, r: Any, mark: str
              ) -> dict[str, Any]:
    leader = until(lambda: _leader(ctls), "a leader", 30)
    standby = next(d for d in ctls if d is not leader)
    for name, lat, lon in (("us", 38.9, -77.0), ("eu", 53.3, -6.3)):
        assert c.post(f"{standby.url}/v1/regions", json={
            "name": name, "latitude": lat, "longitude": lon}).status_code == 201
        # Balancers as records only: the replica needs a home; nothing is served here.
        assert c.post(f"{standby.url}/v1/balancers", headers=auth(AGENT), json={
            "id": f"lb-{name}", "region": name,
            "url": "http://127.0.0.1:9"}).status_code == 201
    with Feeder(standby.url, {"us": TPS, "eu": 0.0}):
        def would_start() -> bool:
            dry = c.post(f"{leader.url}/v1/plans", json={"dry_run": True}).json()
            return bool(dry.get("changes"))

        until(would_start, "a plan that starts a replica in us", START_S, poll=0.5)
        lock = r.lock("skymesh:writer", timeout=120)
        assert lock.acquire(blocking_timeout=30)
        released = False
        try:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(_post_quietly, c, leader)

                def applying() -> dict[str, Any] | None:
                    return next((rec for rec in c.get(f"{standby.url}/v1/plans").json()
                                 if rec["status"] == "applying"), None)

                rec = until(applying, "the leader's round applying", 60)
                until(lambda: replica_pids(mark), "the leader's actuator starting a replica",
                      START_S)
                epoch = c.get(f"{standby.url}/v1/status").json()["control"]["epoch"]
                t0 = time.monotonic()
                leader.kill()  # SIGKILL, while the registration waits for the lock
                lock.release()
                released = True
        finally:
            if not released:
                with contextlib.suppress(redis_lib_errors()):
                    lock.release()
        until(lambda: leads(standby), "the standby to lead", 60)
        takeover = time.monotonic() - t0
        epoch_after = c.get(f"{standby.url}/v1/status").json()["control"]["epoch"]

        def settled() -> dict[str, Any] | None:
            got = c.get(f"{standby.url}/v1/plans/{rec['id']}").json()
            return got if got["status"] != "applying" else None

        final = until(settled, "the new leader to settle the round", 60)
        settle_s = time.monotonic() - t0
        registered_at_settle = [x["id"] for x in c.get(f"{standby.url}/v1/replicas").json()]
        # The new leader's round: plans from what runs (nothing registered) and starts one.
        again = until(lambda: _apply_until(c, [standby],
                                           lambda x: x["status"] == "applied"),
                      "the new leader's round", START_S, poll=0.5)
    reps = c.get(f"{standby.url}/v1/replicas").json()
    recs = c.get(f"{standby.url}/v1/plans").json()
    started = sorted(p.name for p in work.glob("us-*.log"))
    return {
        "takeover_s": round(takeover, 3), "settled_s": round(settle_s, 3),
        "epoch_before": epoch, "epoch_after": epoch_after,
        "round": rec["id"], "round_status": final["status"],
        "round_reason": final.get("reason"), "round_actions": len(final["actions"]),
        "registered_at_settle": registered_at_settle,
        "next_round_status": again["status"],
        "rounds": {st: sum(x["status"] == st for x in recs)
                   for st in sorted({x["status"] for x in recs})},
        "settled_times": standby.log().count(f"planner round {rec['id']}: "),
        "replicas_started": len(started),
        "replicas_registered": [{k: x[k] for k in ("id", "region")} for x in reps],
    }


def redis_lib_errors() -> type[Exception]:
    import redis as redis_lib

    return redis_lib.RedisError
