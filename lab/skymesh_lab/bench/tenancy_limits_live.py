"""A tenant at 3x its request rate through two live balancers of one region (issue #37).

Lab code, not product. Two ``skymesh-lb`` processes of one region (``pushing.
balancers_per_region: 2``, one worker each, so each holds half the tenant's
``requests_per_s``) in front of emulated replicas (``skymesh-replica``). One tenant, named
by its API key, sends non-streamed completions open-loop at ``--offered-x`` times its
limit for ``--duration`` seconds, evenly spaced, and never retries (every refusal is
counted, with the ``Retry-After`` and ``retry-after-ms`` it carried). Two arms on the same
processes:

- ``even``: the requests alternate between the two balancers (round-robin DNS, an L4
  balancer);
- ``one``: all go to the first balancer (the tolerance's bad case: it admits its half);
- ``sdk``: ``--sdk-clients`` closed-loop clients of the OpenAI SDK (``AsyncOpenAI``,
  ``max_retries`` ``--sdk-retries``), half on each balancer, each sending its next request
  when the last one ends, the SDK retrying every 429 after the ``retry-after-ms`` it
  carried: what clients that honour Retry-After get (requests served, attempts each,
  requests that ran out of retries).

With a controller (``--controller-arms``, default ``even,90/10,one``): two more balancers
of the region that take the tenant from a ``skymesh-controller`` instead of ``lb.yaml``,
reporting telemetry every ``--report-s`` seconds, so each holds the part of the limit the
controller splits by the demand they report (docs/tenancy.md, "Shares follow the
traffic"). Each arm first sends its spread for ``--warmup-reports`` reports (the shares
settle), then is measured as above; ``90/10`` sends every tenth request to the second
balancer.

Per arm: the requests the balancers admitted (the added ``skymesh_tenant_admitted_total``
of both), their rate over the run against the limit, the 429s, and the Retry-After
values. The first second of a run spends each balancer's burst (one second of its share),
so the admitted rate is also given from the second second on (by the client's send time of
the admitted requests).

    python -m skymesh_lab.bench.tenancy_limits_live --json out.json [--duration 30]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.procs import Daemon
from skymesh_lab.faults.cluster import (
    MODEL,
    healthy_replicas,
    metrics,
    start_controller,
    start_lb,
    start_replicas,
    wait_for,
)

KEY = "sk-bench-capped"
TENANT = "capped"
BALANCERS = 2
BURST_S = 1.0  # a requests_per_s bucket holds one second's worth (docs/tenancy.md)


def _target(spread: str, i: int) -> int:
    """Which balancer request ``i`` goes to."""
    if spread == "even":
        return i % 2
    if spread == "90/10":
        return int(i % 10 == 9)
    return 0


def tenant_config(limit: float) -> dict[str, Any]:
    return {"members": [{"name": TENANT, "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                         "requests_per_s": limit}]}


async def _admitted(s: aiohttp.ClientSession, lbs: Sequence[Daemon]) -> list[float]:
    series = f'skymesh_tenant_admitted_total{{priority="standard",tenant="{TENANT}"}}'
    return [(await metrics(s, lb.url)).get(series, 0.0) for lb in lbs]


async def run_arm(s: aiohttp.ClientSession, lbs: Sequence[Daemon], spread: str, *,
                  limit: float, offered_x: float, duration: float) -> dict[str, Any]:
    rate = offered_x * limit
    n = int(rate * duration)
    before = await _admitted(s, lbs)
    records: list[tuple[float, int, str, str, int]] = []  # sent_at, status, RA, RA-ms, lb

    async def one(i: int, at: float) -> None:
        lb = _target(spread, i)
        body = {"model": MODEL, "max_tokens": 4, "prompt": f"request {i}"}
        async with s.post(lbs[lb].url + "/v1/completions", json=body) as r:
            await r.read()
            records.append((at, r.status, r.headers.get("Retry-After", ""),
                            r.headers.get("retry-after-ms", ""), lb))

    t0 = time.monotonic()
    tasks = []
    lag = 0.0  # how far behind its schedule the client sent
    for i in range(n):  # open loop: request i goes at t0 + i / rate, whatever came back
        at = i / rate
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, -delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    late = time.monotonic() - t0 - duration  # how far the last answers came after the run
    after = await _admitted(s, lbs)
    admitted = sum(after) - sum(before)
    statuses = Counter(r[1] for r in records)
    ms = sorted(int(r[3]) for r in records if r[1] == 429 and r[3])
    steady = sum(1 for r in records if r[1] != 429 and r[0] >= BURST_S)
    return {
        "spread": spread, "offered_per_s": rate, "sent": n,
        "admitted": int(admitted), "admitted_per_s": round(admitted / duration, 3),
        "admitted_over_limit": round(admitted / duration / limit, 4),
        "admitted_per_s_after_burst": round(steady / (duration - BURST_S), 3),
        "limited_429": statuses.get(429, 0), "ok_200": statuses.get(200, 0),
        "other": {str(k): v for k, v in statuses.items() if k not in (200, 429)},
        "admitted_per_balancer": [int(a - b) for a, b in zip(after, before, strict=True)],
        "retry_after_s": dict(sorted(Counter(r[2] for r in records if r[1] == 429).items())),
        "retry_after_ms": {"min": ms[0], "p50": int(statistics.median(ms)), "max": ms[-1]}
        if ms else None,
        "answers_done_s_after_run": round(late, 2), "send_lag_max_s": round(lag, 3),
    }


async def run_sdk_arm(s: aiohttp.ClientSession, lbs: Sequence[Daemon], *, limit: float,
                      duration: float, clients: int, retries: int) -> dict[str, Any]:
    """Closed-loop OpenAI SDK clients; every attempt seen through an httpx2 event hook."""
    import openai  # the lab's own dependency, only this arm needs it

    attempts: Counter[int] = Counter()
    waits: list[float] = []  # retry-after-ms of each 429, seconds

    async def seen(r: Any) -> None:  # an httpx2.Response
        attempts[r.status_code] += 1
        if r.status_code == 429 and r.headers.get("retry-after-ms"):
            waits.append(int(r.headers["retry-after-ms"]) / 1000)

    before = await _admitted(s, lbs)
    served = exhausted = 0
    end = time.monotonic() + duration

    async def client(k: int) -> None:
        nonlocal served, exhausted
        http = openai.DefaultAsyncHttpx2Client(event_hooks={"response": [seen]})
        sdk = openai.AsyncOpenAI(base_url=lbs[k % len(lbs)].url + "/v1", api_key=KEY,
                                 max_retries=retries, http_client=http)
        async with sdk:
            while time.monotonic() < end:
                try:
                    await sdk.completions.create(model=MODEL, prompt=f"client {k}",
                                                 max_tokens=4)
                    served += 1
                except openai.RateLimitError:
                    exhausted += 1

    await asyncio.gather(*(client(k) for k in range(clients)))
    after = await _admitted(s, lbs)
    admitted = sum(after) - sum(before)
    total = sum(attempts.values())
    return {
        "spread": "sdk", "clients": clients, "max_retries": retries,
        "admitted": int(admitted), "admitted_per_s": round(admitted / duration, 3),
        "admitted_over_limit": round(admitted / duration / limit, 4),
        "served": served, "out_of_retries": exhausted, "attempts": total,
        "limited_429": attempts.get(429, 0),
        "attempts_per_served": round(total / served, 2) if served else None,
        "other": {str(k): v for k, v in attempts.items() if k not in (200, 429)},
        "admitted_per_balancer": [int(a - b) for a, b in zip(after, before, strict=True)],
        "retry_after_ms": {"min": round(1000 * min(waits)),
                           "p50": round(1000 * statistics.median(waits)),
                           "max": round(1000 * max(waits))} if waits else None,
    }


async def measure(workdir: Path, *, limit: float, offered_x: float, duration: float,
                  replicas: int, time_scale: float, arms: Sequence[str], sdk_clients: int,
                  sdk_retries: int, controller_arms: Sequence[str] = (),
                  report_s: float = 1.0, warmup_reports: int = 5) -> dict[str, Any]:
    reps = await start_replicas(workdir, replicas, time_scale=time_scale)
    lbs: list[Daemon] = []
    env = {"SKYMESH_API_KEYS": KEY}
    try:
        for i in range(BALANCERS):
            lbs.append(await start_lb(workdir, reps, name=f"lb{i}", env=env, overrides={
                "region": "us", "pushing": {"balancers_per_region": BALANCERS},
                "logging": {"access_log": False}, "tenants": tenant_config(limit)}))
        connector = aiohttp.TCPConnector(limit=0)
        # The tenant's key on every request (/status wants a key too, once keys are set).
        async with aiohttp.ClientSession(connector=connector,
                                         headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=aiohttp.ClientTimeout(total=60)) as s:
            for lb in lbs:
                async def up(url: str = lb.url) -> bool:
                    return await healthy_replicas(s, url) == replicas
                await wait_for(up, "the replicas healthy at every balancer", 60)
            runs = []
            for arm in arms:
                # Idle for more than a burst's refill: each arm starts with full buckets.
                await asyncio.sleep(2 * BURST_S)
                if arm == "sdk":
                    runs.append(await run_sdk_arm(s, lbs, limit=limit, duration=duration,
                                                  clients=sdk_clients, retries=sdk_retries))
                else:
                    runs.append(await run_arm(s, lbs, arm, limit=limit,
                                              offered_x=offered_x, duration=duration))
        if controller_arms:
            runs += await measure_controlled(workdir, reps, limit=limit, offered_x=offered_x,
                                             duration=duration, arms=controller_arms,
                                             report_s=report_s, warmup=warmup_reports)
    finally:
        for d in (*lbs, *reps):
            d.stop()
    return {"runs": runs}


ADMIN = "bench-admin-" + "b" * 24  # the throwaway controller's token (also the agents')


async def measure_controlled(workdir: Path, reps: Sequence[Daemon], *, limit: float,
                             offered_x: float, duration: float, arms: Sequence[str],
                             report_s: float, warmup: int) -> list[dict[str, Any]]:
    """The arms again through two balancers that take the tenant from a controller."""
    ctl = await start_controller(workdir, ADMIN, name="controller")
    lbs: list[Daemon] = []
    auth = {"Authorization": f"Bearer {ADMIN}"}
    runs = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as c:
            async with c.post(ctl.url + "/v1/regions", headers=auth, json={
                    "name": "us", "latitude": 38.9, "longitude": -77.0}) as r:
                r.raise_for_status()
            async with c.put(f"{ctl.url}/v1/tenants/{TENANT}", headers=auth, json={
                    "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                    "requests_per_s": limit}) as r:
                r.raise_for_status()
        for i in range(BALANCERS):
            lbs.append(await start_lb(workdir, list(reps), name=f"ctl-lb{i}", env={
                "SKYMESH_API_KEYS": KEY, "SKYMESH_AGENT_TOKEN": ADMIN}, overrides={
                "region": "us", "logging": {"access_log": False},
                "controller": {"url": ctl.url, "balancer_id": f"ctl-lb{i}", "retry_s": 0.2,
                               "poll_wait_s": 5, "telemetry_interval_s": report_s,
                               "url_policy": {"allow_loopback": True}}}))
        series = f'skymesh_tenant_queue_waiting{{priority="standard",tenant="{TENANT}"}}'
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=aiohttp.ClientTimeout(total=60)) as s:
            for lb in lbs:
                async def pushed(url: str = lb.url) -> bool:
                    return (await healthy_replicas(s, url) == len(reps)
                            and series in await metrics(s, url))
                await wait_for(pushed, "the controller's tenant at every balancer", 60)
            for arm in arms:
                await run_arm(s, lbs, arm, limit=limit, offered_x=offered_x,
                              duration=warmup * report_s)  # the shares settle
                runs.append({**await run_arm(s, lbs, arm, limit=limit, offered_x=offered_x,
                                             duration=duration), "controller": True})
    finally:
        for d in (*lbs, ctl):
            d.stop()
    return runs


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tenancy_limits_live", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--limit", type=float, default=10.0, help="requests_per_s of the tenant")
    ap.add_argument("--offered-x", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--arms", default="even,one,sdk")
    ap.add_argument("--sdk-clients", type=int, default=6)
    ap.add_argument("--sdk-retries", type=int, default=4)
    # Through balancers fed by a controller ('' for none), reporting every --report-s,
    # each arm measured after --warmup-reports reports.
    ap.add_argument("--controller-arms", default="even,90/10,one")
    ap.add_argument("--report-s", type=float, default=1.0)
    ap.add_argument("--warmup-reports", type=int, default=5)
    a = ap.parse_args(argv)
    ctl_arms = [x for x in a.controller_arms.split(",") if x]
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tenancy-limits-") as tmp:
        out = asyncio.run(measure(Path(tmp), limit=a.limit, offered_x=a.offered_x,
                                  duration=a.duration, replicas=a.replicas,
                                  time_scale=a.time_scale, arms=a.arms.split(","),
                                  sdk_clients=a.sdk_clients, sdk_retries=a.sdk_retries,
                                  controller_arms=ctl_arms, report_s=a.report_s,
                                  warmup_reports=a.warmup_reports))
    doc = {"setup": {"limit_per_s": a.limit, "offered_x": a.offered_x,
                     "duration_s": a.duration, "balancers": BALANCERS,
                     "workers_per_balancer": 1, "replicas": a.replicas,
                     "time_scale": a.time_scale, "burst_s": BURST_S, "max_tokens": 4,
                     "sdk_clients": a.sdk_clients, "sdk_max_retries": a.sdk_retries,
                     "controller_arms": ctl_arms, "report_s": a.report_s,
                     "warmup_reports": a.warmup_reports,
                     "load_average_1m_at_start": round(load0, 2),
                     "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                     "cpus": os.cpu_count(), "commit": _commit()},
           **out}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1) + "\n")
    json.dump(out["runs"], sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
