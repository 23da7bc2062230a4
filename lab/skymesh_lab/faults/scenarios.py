"""The fault scenarios: one async function each, real processes on loopback.

Each takes a scratch directory and ``short`` (the CI form: fewer requests, shorter load
phases) and returns a :class:`Result`: the client-side :class:`~skymesh_lab.faults.client.Tally`
of every request sent, the scenario's invariants (each a named bool) and some detail.
Every scenario ends by waiting for in-flight counts at every balancer to return to zero
(``/status``), which is itself an invariant. Durations are named constants: they are
the length of a load phase, not waits for a condition (those poll with a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.procs import Daemon
from skymesh_lab.faults import client as fc
from skymesh_lab.faults.cluster import (
    LOCATIONS,
    Mesh,
    RedisProcess,
    drained,
    free_port,
    healthy_replicas,
    metrics,
    rss_bytes,
    start_controller,
    start_lb,
    start_replicas,
    status,
    wait_for,
)

TIME_SCALE = 0.1  # replicas run ten times faster than the L4 profile: short scenarios
DEADLINE_S = 30.0  # a client's per-request deadline: no answer by then is a hang
SETTLE_S = 30.0  # deadline for a daemon or the mesh to reach a state


@dataclass
class Result:
    tally: fc.Tally
    checks: dict[str, bool] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _phase(short: bool, short_s: float, full_s: float) -> float:
    return short_s if short else full_s


async def _retries(s: aiohttp.ClientSession, urls: list[str]) -> int:
    total = 0.0
    for u in urls:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            total += (await metrics(s, u)).get("skymesh_retries_total", 0.0)
    return int(total)


async def _served(s: aiohttp.ClientSession, rep: Daemon) -> int:
    return int((await metrics(s, rep.url)).get("vllm:request_success_total", 0.0))


async def _all_drained(s: aiohttp.ClientSession, urls: list[str]) -> bool:
    for u in urls:
        try:
            ok = await drained(s, u)
        except (aiohttp.ClientError, OSError):
            return False
        if not ok:
            return False
    return True


async def _check_drained(res: Result, s: aiohttp.ClientSession, urls: list[str]) -> None:
    try:
        await wait_for(lambda: _all_drained(s, urls), "in-flight counts back to zero",
                       SETTLE_S)
        res.checks["in_flight_back_to_zero"] = True
    except TimeoutError:
        res.checks["in_flight_back_to_zero"] = False


async def _ready(s: aiohttp.ClientSession, lb: Daemon, n: int) -> None:
    async def ok() -> bool:
        return await healthy_replicas(s, lb.url) >= n
    await wait_for(ok, f"{n} healthy replicas behind {lb.url}", SETTLE_S)


def _stop_all(daemons: list[Daemon]) -> None:
    for d in daemons:
        d.stop()


# -- 1. a replica killed mid-stream ---------------------------------------------------------
async def replica_killed_mid_stream(workdir: Path, short: bool) -> Result:
    """Streams on three replicas; one replica is SIGKILLed once every stream has started,
    and a burst follows at once (before probes notice). Streams on the dead replica must
    end with an SSE error event; the burst is retried before its first byte."""
    n_streams, n_burst = (9, 12) if short else (30, 60)
    reps = await start_replicas(workdir, 3, time_scale=TIME_SCALE)
    lb = await start_lb(workdir, reps, overrides={
        "pushing": {"mode": "bp"}, "probe": {"interval_s": 0.05, "failure_threshold": 3}})
    res = Result(fc.Tally())
    try:
        async with fc.session() as s:
            await _ready(s, lb, 3)
            streams = [asyncio.create_task(fc.send(
                s, lb.url, fc.chat_body(f"story {i}", 400, True), res.tally, DEADLINE_S))
                for i in range(n_streams)]

            async def started() -> bool:
                m = await metrics(s, lb.url)
                return m.get("skymesh_time_to_first_byte_seconds_count", 0) >= n_streams
            await wait_for(started, "every stream's first byte", SETTLE_S)
            reps[0].kill()
            burst = fc.Tally()
            await asyncio.gather(*(fc.send(s, lb.url, fc.chat_body(f"after {i}", 5, False),
                                           burst, DEADLINE_S) for i in range(n_burst)))
            await asyncio.gather(*streams)
            res.checks["burst_after_kill_all_completed"] = burst.completed == n_burst
            res.checks["dead_replica_streams_ended_explicitly"] = \
                res.tally.failed_explicit >= 1
            for k in ("accepted", "completed", "failed_explicit", "lost", "refused"):
                setattr(res.tally, k, getattr(res.tally, k) + getattr(burst, k))
            res.tally.reasons.update(burst.reasons)
            res.tally.statuses.update(burst.statuses)
            res.tally.retried = await _retries(s, [lb.url])
            await _check_drained(res, s, [lb.url])
    finally:
        await asyncio.to_thread(_stop_all, [lb, *reps])
    return res


# -- 2. a replica slowed tenfold ------------------------------------------------------------
async def replica_slow_10x(workdir: Path, short: bool) -> Result:
    """Two replicas, one running ten times slower (``--time-scale``), under closed-loop
    streaming load: every request completes and the fast replica takes most of them."""
    load_s = _phase(short, 4.0, 60.0)
    clients = 6 if short else 16
    fast = await start_replicas(workdir, 1, time_scale=TIME_SCALE, name="fast")
    slow = await start_replicas(workdir, 1, time_scale=TIME_SCALE * 10, name="slow")
    lb = await start_lb(workdir, [*fast, *slow])
    res = Result(fc.Tally())
    try:
        async with fc.session() as s:
            await _ready(s, lb, 2)
            stop_at = time.monotonic() + load_s
            await asyncio.gather(*(fc.closed_loop(
                s, lb.url, res.tally, stop_at=stop_at, deadline_s=DEADLINE_S, max_tokens=32,
                stream=True, tag=f"c{i}") for i in range(clients)))
            served_fast, served_slow = await _served(s, fast[0]), await _served(s, slow[0])
            res.info.update(served_fast=served_fast, served_slow=served_slow)
            res.checks["every_request_completed"] = res.tally.completed == res.tally.sent > 0
            res.checks["fast_replica_served_most"] = served_fast > 2 * served_slow
            res.tally.retried = await _retries(s, [lb.url])
            await _check_drained(res, s, [lb.url])
    finally:
        await asyncio.to_thread(_stop_all, [lb, *fast, *slow])
    return res


# -- 3. the balancer killed and restarted ---------------------------------------------------
async def balancer_restart(workdir: Path, short: bool) -> Result:
    """Closed-loop streaming clients against one balancer address; the balancer gets
    SIGTERM mid-load and a new one starts on the same address (what DNS would point to).
    Streams in flight on the stopped one must end, not hang; clients refused while it
    is down retry; the restarted one serves the rest."""
    phase_s = _phase(short, 3.0, 30.0)
    clients = 8 if short else 24
    reps = await start_replicas(workdir, 2, time_scale=TIME_SCALE)
    port = free_port()
    lb = await start_lb(workdir, reps, port=port, name="lb-1")
    url = lb.url
    res = Result(fc.Tally())
    new: Daemon | None = None
    try:
        async with fc.session() as s:
            await _ready(s, lb, 2)
            # The load runs a phase past the restart, however long the restart takes.
            stop = asyncio.Event()
            stop_at = time.monotonic() + 2 * phase_s + SETTLE_S
            load = [asyncio.create_task(fc.closed_loop(
                s, url, res.tally, stop_at=stop_at, deadline_s=DEADLINE_S, max_tokens=150,
                stream=True, tag=f"c{i}", retry_refused=True, stop=stop))
                for i in range(clients)]
            await asyncio.sleep(phase_s)
            retried_old = await _retries(s, [url])
            before = res.tally.completed
            t_stop = time.monotonic()
            code = await asyncio.to_thread(lb.stop)
            res.info["old_exit_code"] = code
            res.info["stop_seconds"] = round(time.monotonic() - t_stop, 2)
            new = await start_lb(workdir, reps, port=port, name="lb-2")
            res.info["down_seconds"] = round(time.monotonic() - t_stop, 2)
            await asyncio.sleep(phase_s)
            stop.set()
            await asyncio.gather(*load)
            res.checks["restarted_on_same_address"] = new.url == url
            res.checks["restarted_balancer_served"] = res.tally.completed > before
            res.checks["old_balancer_exited_cleanly"] = code == 0
            res.tally.retried = retried_old + await _retries(s, [new.url])
            await _check_drained(res, s, [new.url])
    finally:
        await asyncio.to_thread(_stop_all, [d for d in (lb, new) if d is not None] + reps)
    return res


# -- 4. a peer partitioned ------------------------------------------------------------------
async def peer_partition(workdir: Path, short: bool) -> Result:
    """The three-region mesh with us saturated (it forwards to eu and asia); the us-eu
    link's delay proxies black-hole both directions, then heal. lb-us must see lb-eu go
    DOWN and stop forwarding there; requests forwarded over the link when it went dark
    end with an explicit error; after healing the peers are ALIVE again."""
    phase_s = _phase(short, 3.0, 30.0)
    clients = 8 if short else 16
    mesh = Mesh(workdir, forwarding=True, replicas={"us": 1, "eu": 1, "asia": 1},
                time_scale=TIME_SCALE)
    res = Result(fc.Tally())
    try:
        await mesh.start()
        lbs = [lb.url for lb in mesh.lbs.values()]
        us = mesh.lbs["us"].url
        async with fc.session() as s:
            await mesh.wait_ready(s, SETTLE_S)

            async def eu_liveness() -> str:
                st = await status(s, us)
                return next(str(p["liveness"]) for p in st["mesh"]["peers"]
                            if p["id"] == "lb-eu")

            # The load lasts until the healed phase is over, however long the waits on
            # the mesh take on a slow machine; the bound only stops a scenario gone wrong.
            stop = asyncio.Event()
            stop_at = time.monotonic() + 3 * phase_s + 3 * SETTLE_S
            load = [asyncio.create_task(fc.closed_loop(
                s, us, res.tally, stop_at=stop_at, deadline_s=DEADLINE_S, max_tokens=300,
                stream=True, tag=f"u{i}", prompt_words=1500, stop=stop))
                for i in range(clients)]
            await asyncio.sleep(phase_s)
            out_before = (await status(s, us))["mesh"]["forwarded_out"]

            async def eu_serving_forwarded() -> bool:
                st = await status(s, mesh.lbs["eu"].url)
                return any(r["in_flight"] for r in st["replicas"].values())
            # Cut the link while a forwarded stream is on it: the hard case.
            try:
                await wait_for(eu_serving_forwarded, "a request forwarded to eu in flight",
                               SETTLE_S)
            except TimeoutError as e:
                st = await status(s, us)
                raise TimeoutError(f"{e}; lb-us forwarded {st['mesh']['forwarded_out']}, "
                                   f"its peers: {st['mesh']['peers']}") from e
            mesh.partition("us", "eu")
            t_part = time.monotonic()

            async def eu_down() -> bool:
                return await eu_liveness() == "down"
            try:
                await wait_for(eu_down, "lb-us to see lb-eu DOWN", SETTLE_S)
                res.checks["partitioned_peer_marked_down"] = True
                res.info["down_after_s"] = round(time.monotonic() - t_part, 2)
            except TimeoutError:
                res.checks["partitioned_peer_marked_down"] = False
            await asyncio.sleep(max(0.0, phase_s - (time.monotonic() - t_part)))
            mesh.partition("us", "eu", on=False)
            t_heal = time.monotonic()

            async def eu_alive() -> bool:
                return await eu_liveness() == "alive"
            try:
                await wait_for(eu_alive, "lb-us to see lb-eu ALIVE again", SETTLE_S)
                res.checks["healed_peer_alive_again"] = True
                res.info["alive_after_heal_s"] = round(time.monotonic() - t_heal, 2)
            except TimeoutError:
                res.checks["healed_peer_alive_again"] = False
            await asyncio.sleep(max(0.0, phase_s - (time.monotonic() - t_heal)))
            stop.set()
            await asyncio.gather(*load)
            st = await status(s, us)
            res.info["forwarded_out"] = st["mesh"]["forwarded_out"]
            res.checks["us_forwarded_before_partition"] = out_before > 0
            res.tally.retried = await _retries(s, lbs)
            await _check_drained(res, s, lbs)
    finally:
        await mesh.stop()
    return res


# -- 5. the controller restarted ------------------------------------------------------------
async def _create_region(s: aiohttp.ClientSession, ctl: str, token: str, name: str) -> None:
    lat, lon = LOCATIONS["us"]
    async with s.post(ctl + "/v1/regions", json={"name": name, "latitude": lat,
                                                 "longitude": lon},
                      headers={"Authorization": f"Bearer {token}"}) as r:
        r.raise_for_status()


async def controller_restart(workdir: Path, short: bool) -> Result:
    """A balancer registered with a controller (Redis store) serves steady load while the
    controller is stopped and restarted: no request notices; the balancer re-syncs."""
    phase_s = _phase(short, 2.0, 20.0)
    clients = 4 if short else 12
    token = "fault-" + "a" * 32
    redis = RedisProcess(workdir)
    await asyncio.to_thread(redis.start)
    port = free_port()
    ctl = await start_controller(workdir, token, store=redis.url, port=port, name="ctl-1")
    reps = await start_replicas(workdir, 2, time_scale=TIME_SCALE)
    res = Result(fc.Tally())
    new_ctl: Daemon | None = None
    lb: Daemon | None = None
    try:
        async with fc.session() as s:
            await _create_region(s, ctl.url, token, "local")
            lb = await start_lb(workdir, reps, env={"SKYMESH_AGENT_TOKEN": token}, overrides={
                "controller": {"url": ctl.url, "balancer_id": "lb-local", "retry_s": 0.2,
                               "poll_wait_s": 2, "telemetry_interval_s": 0.5,
                               "url_policy": {"allow_loopback": True}}})  # a local mesh
            lb_url = lb.url

            async def synced() -> bool:
                c = (await status(s, lb_url))["controller"]
                return bool(c["registered"]) and c["error"] is None and c["revision"] >= 0
            await wait_for(synced, "the balancer registered with the controller", SETTLE_S)
            await _ready(s, lb, 2)
            # The load runs until the balancer has re-synced, however long that takes.
            stop = asyncio.Event()
            stop_at = time.monotonic() + 3 * phase_s + 3 * SETTLE_S
            load = [asyncio.create_task(fc.closed_loop(
                s, lb_url, res.tally, stop_at=stop_at, deadline_s=DEADLINE_S, max_tokens=32,
                stream=True, tag=f"c{i}", stop=stop)) for i in range(clients)]
            await asyncio.sleep(phase_s)
            await asyncio.to_thread(ctl.stop)
            during = res.tally.completed

            async def noticed() -> bool:
                return (await status(s, lb_url))["controller"]["error"] is not None
            await wait_for(noticed, "the balancer to notice the controller is gone", SETTLE_S)
            await asyncio.sleep(phase_s)
            res.checks["served_while_controller_down"] = res.tally.completed > during
            new_ctl = await start_controller(workdir, token, store=redis.url, port=port,
                                             name="ctl-2")
            try:
                await wait_for(synced, "the balancer re-synced with the new controller",
                               SETTLE_S)
                res.checks["balancer_resynced"] = True
            except TimeoutError:
                res.checks["balancer_resynced"] = False
            stop.set()
            await asyncio.gather(*load)
            res.checks["every_request_completed"] = res.tally.completed == res.tally.sent > 0
            res.tally.retried = await _retries(s, [lb_url])
            await _check_drained(res, s, [lb_url])
    finally:
        await asyncio.to_thread(_stop_all, [d for d in (lb, ctl, new_ctl) if d is not None]
                                + reps)
        await asyncio.to_thread(redis.stop)
    return res


# -- 6. Redis restarted ---------------------------------------------------------------------
async def redis_restart(workdir: Path, short: bool) -> Result:
    """Admin reads against a controller on Redis while Redis is stopped and restarted:
    the controller stays up (``/health``), answers 503 ``store_unavailable`` while Redis
    is down, and serves the same state again once it is back (AOF)."""
    phase_s = _phase(short, 1.0, 10.0)
    readers = 4
    token = "fault-" + "b" * 32
    redis = RedisProcess(workdir)
    await asyncio.to_thread(redis.start)
    ctl = await start_controller(workdir, token, store=redis.url)
    res = Result(fc.Tally())
    auth = {"Authorization": f"Bearer {token}"}
    try:
        async with fc.session() as s:
            await _create_region(s, ctl.url, token, "faultland")

            def has_region(doc: Any) -> bool:
                return any(r.get("name") == "faultland" for r in doc)

            stop = asyncio.Event()
            statuses_down: list[int] = []
            down = asyncio.Event()

            async def reader() -> None:
                while not stop.is_set():
                    t = fc.Tally()
                    await fc.probe_get(s, ctl.url + "/v1/regions", t, DEADLINE_S, auth,
                                       has_region)
                    for k in ("accepted", "completed", "failed_explicit", "lost", "refused"):
                        setattr(res.tally, k, getattr(res.tally, k) + getattr(t, k))
                    res.tally.reasons.update(t.reasons)
                    res.tally.statuses.update(t.statuses)
                    if down.is_set():
                        statuses_down.extend(t.statuses)
                    await asyncio.sleep(READ_EVERY_S)

            tasks = [asyncio.create_task(reader()) for _ in range(readers)]
            await asyncio.sleep(phase_s)
            await asyncio.to_thread(redis.stop)
            down.set()

            async def saw_503() -> bool:
                return 503 in statuses_down
            try:
                await wait_for(saw_503, "a 503 while Redis is down", SETTLE_S)
                res.checks["503_while_redis_down"] = True
            except TimeoutError:
                res.checks["503_while_redis_down"] = False
            async with s.get(ctl.url + "/health") as r:
                res.checks["health_ok_while_redis_down"] = r.status == 200
            await asyncio.sleep(phase_s)
            down.clear()
            await asyncio.to_thread(redis.start)
            t_up = time.monotonic()

            async def recovered() -> bool:
                t = fc.Tally()
                await fc.probe_get(s, ctl.url + "/v1/regions", t, DEADLINE_S, auth,
                                   has_region)
                return t.completed == 1
            try:
                await wait_for(recovered, "the controller serving from Redis again",
                               SETTLE_S)
                res.checks["recovered_with_state"] = True
                res.info["recovered_after_s"] = round(time.monotonic() - t_up, 2)
            except TimeoutError:
                res.checks["recovered_with_state"] = False
            await asyncio.sleep(phase_s)
            stop.set()
            await asyncio.gather(*tasks)
            res.checks["controller_alive"] = ctl.alive()
    finally:
        await asyncio.to_thread(ctl.stop)
        await asyncio.to_thread(redis.stop)
    return res


READ_EVERY_S = 0.02  # each admin reader's pacing


# -- 7. overload at ten times capacity ------------------------------------------------------
async def overload_10x(workdir: Path, short: bool) -> Result:
    """Measure what one replica sustains (closed loop), then offer ten times that rate
    open loop: the excess gets 429 with Retry-After (queue full) or 503 (queue timeout),
    the queue never exceeds its bound, and the balancer's memory stays flat."""
    warm_s = _phase(short, 2.0, 10.0)
    load_s = _phase(short, 4.0, 60.0)
    max_queue = 16
    # An admission limit of 4 keeps the replica's capacity well under what one client
    # process can send even on a busy machine (uncapped, the emulated replica outran a
    # flood that fell behind its schedule, and nothing queued).
    reps = await start_replicas(workdir, 1, time_scale=TIME_SCALE,
                                extra=["--max-num-seqs", "4"])
    lb = await start_lb(workdir, reps, overrides={
        "queue": {"max_length": max_queue, "timeout_s": 2.0}})
    res = Result(fc.Tally())
    try:
        async with fc.session() as s:
            await _ready(s, lb, 1)
            warm = fc.Tally()
            stop_at = time.monotonic() + warm_s
            # Enough clients that the replica, not the clients, limits throughput.
            await asyncio.gather(*(fc.closed_loop(
                s, lb.url, warm, stop_at=stop_at, deadline_s=DEADLINE_S, max_tokens=128,
                stream=True, tag=f"w{i}") for i in range(WARM_CLIENTS)))
            capacity = max(1.0, warm.completed / warm_s)
            rate = 10 * capacity
            rss_before = rss_bytes(lb.proc.pid)
            queued: list[int] = []
            sampling = True

            async def sample() -> None:
                while sampling:
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        queued.append(int((await status(s, lb.url))["queued"]))
                    await asyncio.sleep(SAMPLE_EVERY_S)

            sampler = asyncio.create_task(sample())
            tasks: list[asyncio.Task[str]] = []
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < load_s:
                due = t0 + i / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(fc.send(
                    s, lb.url, fc.chat_body(f"flood {i}", 128, True), res.tally, DEADLINE_S)))
                i += 1
            await asyncio.gather(*tasks)
            sampling = False
            await sampler
            await _check_drained(res, s, [lb.url])
            rss_after = rss_bytes(lb.proc.pid)
            # The client may fall behind the schedule on a busy machine: report what it sent.
            res.info.update(capacity_rps=round(capacity, 1), offered_rps=round(rate, 1),
                            sent_rps=round(len(tasks) / load_s, 1),
                            max_queued=max(queued, default=0), max_queue=max_queue,
                            rss_before_mb=round(rss_before / 2**20, 1),
                            rss_after_mb=round(rss_after / 2**20, 1))
            res.checks["excess_got_429"] = res.tally.statuses.get(429, 0) > 0
            res.checks["every_429_has_retry_after"] = res.tally.missing_retry_after == 0
            res.checks["queue_bounded"] = max(queued, default=0) <= max_queue
            res.checks["rss_bounded"] = rss_after - rss_before < RSS_GROWTH_BOUND
            res.tally.retried = await _retries(s, [lb.url])
    finally:
        await asyncio.to_thread(_stop_all, [lb, *reps])
    return res


WARM_CLIENTS = 48
SAMPLE_EVERY_S = 0.05  # queue-length sampling cadence
RSS_GROWTH_BOUND = 64 * 2**20  # a leak of state per request would exceed this quickly

Scenario = Callable[[Path, bool], Awaitable[Result]]

SCENARIOS: dict[str, Scenario] = {
    "replica_killed_mid_stream": replica_killed_mid_stream,
    "replica_slow_10x": replica_slow_10x,
    "balancer_restart": balancer_restart,
    "peer_partition": peer_partition,
    "controller_restart": controller_restart,
    "redis_restart": redis_restart,
    "overload_10x": overload_10x,
}

__all__ = ["SCENARIOS", "Result", "Scenario"]
