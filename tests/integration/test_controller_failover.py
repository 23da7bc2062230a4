"""Balancer failure end to end with real processes: the controller moves a dead balancer's
replicas to the nearest live one and hands them back when it returns; no request lost."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from controller_support import ADMIN, AGENT, auth, start_controller
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROBE_S = 0.3  # controller probe interval


def start_lb(tmp: Path, name: str, region: str, controller: str, replicas: list[Daemon],
             port: int = 0) -> Daemon:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "region": region, "listen": {"host": "127.0.0.1", "port": port},
        "policy": {"name": "least-load"}, "probe": {"interval_s": 0.05},
        "replicas": [{"url": r.url, "models": [MODEL], "gpu": "L4"} for r in replicas],
        "controller": {"url": controller, "balancer_id": name, "poll_wait_s": 10,
                       "retry_s": 0.2, "telemetry_interval_s": 0.5,
                       "url_policy": {"allow_loopback": True}}}))
    env = {**os.environ, "SKYMESH_AGENT_TOKEN": AGENT}
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "info"],
                        log_path=tmp / f"{name}.log", env=env)


async def lb_replicas(s: aiohttp.ClientSession, lb: Daemon) -> set[str]:
    try:
        async with s.get(lb.url + "/status") as r:
            st = await r.json()
    except aiohttp.ClientError:
        return set()
    return {u for u, v in st["replicas"].items() if v["healthy"]}


async def served(s: aiohttp.ClientSession, rep: Daemon) -> float:
    return (await get_metrics(s, rep.url)).get("vllm:request_success_total", 0.0)


async def test_failed_balancer_replicas_move_to_nearest_and_come_back(tmp_path: Path) -> None:
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05",
                                             "--seed", str(i)], log_path=tmp_path / f"r{i}.log")
            for i in range(4)]
    us_reps, eu_reps, asia_reps = reps[:2], reps[2:3], reps[3:]
    ctl = start_controller(tmp_path, probe_s=PROBE_S, timeout_s=0.25)
    daemons: list[Daemon] = [*reps, ctl]
    results: list[tuple[int, str]] = []
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for region in ({"name": "us-east", "latitude": 38.9, "longitude": -77.0},
                           {"name": "eu-west", "latitude": 53.3, "longitude": -6.3},
                           {"name": "ap-northeast", "latitude": 35.7, "longitude": 139.7}):
                async with s.post(ctl.url + "/v1/regions", json=region, headers=auth()) as r:
                    assert r.status == 201
            lb_us = start_lb(tmp_path, "lb-us", "us-east", ctl.url, us_reps)
            lb_eu = start_lb(tmp_path, "lb-eu", "eu-west", ctl.url, eu_reps)
            lb_asia = start_lb(tmp_path, "lb-asia", "ap-northeast", ctl.url, asia_reps)
            daemons += [lb_us, lb_eu, lb_asia]
            us_urls = {r.url for r in us_reps}
            eu_urls = {r.url for r in eu_reps}
            await until(lambda: _has(s, lb_us, us_urls), "lb-us serves its replicas")
            await until(lambda: _has(s, lb_eu, eu_urls), "lb-eu serves its replica")
            await until(lambda: _states(s, ctl.url, {"up"}), "the controller sees 3 up")

            # A policy switched at the controller reaches the balancer (long poll), live.
            async with s.put(ctl.url + "/v1/balancers/lb-eu/policy", headers=auth(),
                             json={"policy": "round-robin"}) as r:
                assert r.status == 200
            await until(lambda: _policy(s, lb_eu, "round-robin"), "lb-eu switches policy")

            async def client(i: int) -> None:
                body = {"model": MODEL, "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"client {i} says hi"}]}
                while not stop.is_set():
                    try:
                        async with s.post(lb_eu.url + "/v1/chat/completions",
                                          json=body) as r:
                            text = await r.text()
                            results.append((r.status, text[:200]))
                    except aiohttp.ClientError as exc:
                        results.append((-1, repr(exc)))

            load = [asyncio.create_task(client(i)) for i in range(4)]
            before = [await served(s, r) for r in us_reps]

            lb_us.kill()
            killed = time.monotonic()
            # Dublin is nearer Washington than Tokyo: lb-eu takes lb-us's replicas.
            await until(lambda: _has(s, lb_eu, us_urls | eu_urls),
                        "lb-eu serves lb-us's replicas", timeout=3 * PROBE_S + 5)
            moved_after = time.monotonic() - killed
            await until(lambda: _served_more(s, us_reps, before),
                        "lb-us's replicas serve requests arriving at lb-eu")
            assert await lb_replicas(s, lb_asia) == {asia_reps[0].url}

            lb_us2 = start_lb(tmp_path, "lb-us", "us-east", ctl.url, us_reps)
            daemons.append(lb_us2)
            await until(lambda: _has(s, lb_us2, us_urls), "lb-us gets its replicas back",
                        timeout=20)
            await until(lambda: _exactly(s, lb_eu, eu_urls), "lb-eu hands them back")
            stop.set()
            await asyncio.gather(*load)
            print(f"replicas moved {moved_after:.2f} s after the kill "
                  f"(probe interval {PROBE_S} s); {len(results)} requests through lb-eu")
            async with s.get(ctl.url + "/v1/status", headers=auth(ADMIN)) as r:
                st = await r.json()
            assert st["moved_replicas"] == [] and st["balancers"] == {"up": 3}
    finally:
        stop.set()
        for d in daemons:
            d.stop()
    failed = [r for r in results if r[0] != 200]
    assert results and not failed, failed[:5]


async def _has(s: aiohttp.ClientSession, lb: Daemon, urls: set[str]) -> bool:
    return urls <= await lb_replicas(s, lb)


async def _policy(s: aiohttp.ClientSession, lb: Daemon, name: str) -> bool:
    async with s.get(lb.url + "/status") as r:
        return bool((await r.json())["policy"] == name)


async def _exactly(s: aiohttp.ClientSession, lb: Daemon, urls: set[str]) -> bool:
    async with s.get(lb.url + "/status") as r:
        return set((await r.json())["replicas"]) == urls


async def _states(s: aiohttp.ClientSession, ctl: str, want: set[str]) -> bool:
    async with s.get(ctl + "/v1/balancers", headers=auth()) as r:
        bs: list[dict[str, Any]] = await r.json()
    return len(bs) == 3 and {b["state"] for b in bs} == want


async def _served_more(s: aiohttp.ClientSession, reps: list[Daemon], before: list[float]
                       ) -> bool:
    return all([await served(s, r) > b for r, b in zip(reps, before, strict=True)])
