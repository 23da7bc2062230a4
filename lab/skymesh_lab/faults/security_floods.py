"""Floods for the security page's figures: each against a real local process, each with a
healthy client measured in the same run with no attack and while the attack runs.

- ``mesh_flood``: plain TCP connects held open on a ``skymesh-lb``'s peering port from 20
  loopback addresses, each reconnected when the port's guard cuts it: the balancer's file
  descriptors before, at their peak and after, the guard's refusals, and a healthy chat
  client's p50 through the balancer's HTTP port;
- ``controller_bodies``: chunked request bodies streamed at a ``skymesh-controller``
  without a token, and with a token past ``max_body_bytes``: the status, the bytes the
  client got into its socket before the cut, the controller's RSS, and a healthy admin
  client's p50;
- ``telemetry_flood``: telemetry reports of the largest accepted size from one agent token
  over several balancers, and the issue's 1 MB report: what is refused, what the
  controller keeps, its RSS, and the healthy admin client's p50.

The healthy client runs in its own process (``Healthy``), so what the attack costs this
process's event loop is not counted against the server under attack; the machine's cores
are shared all the same, which the page says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.procs import Daemon, free_port
from skymesh_lab.faults.cluster import MODEL, parse_metrics, rss_bytes, start_lb, wait_for

MB = 1 << 20
DEADLINE_S = 20.0  # a condition not met by then is reported as it stands
SOURCES = [f"127.0.0.{i}" for i in range(2, 22)]  # Linux routes all of 127/8 to loopback
CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set size of ``pid`` so far (VmHWM, Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- the healthy client, in its own process ----------------------------------------------------
def _latencies(url: str, n: int, rate: float, body: dict[str, Any] | None,
               headers: dict[str, str]) -> dict[str, Any]:
    return asyncio.run(_open_loop(url, n, rate, body, headers))


async def _open_loop(url: str, n: int, rate: float, body: dict[str, Any] | None,
                     headers: dict[str, str]) -> dict[str, Any]:
    """``n`` requests arriving at ``rate`` a second (open loop: a server that stalls shows
    in the median as the share of time it stalls), after one unmeasured warm-up."""
    method = "POST" if body is not None else "GET"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S),
                                     headers=headers) as s:
        async def one() -> float | None:
            t = time.perf_counter()
            try:
                async with s.request(method, url, json=body) as r:
                    await r.read()
                    return (time.perf_counter() - t) * 1e3 if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None

        await one()
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(1 / rate)  # the arrival process, not a wait for a condition
        done = await asyncio.gather(*tasks)
    ok = [ms for ms in done if ms is not None]
    return {"requests": n, "failed": n - len(ok),
            "p50_ms": statistics.median(ok) if ok else None}


class Healthy:
    """A client in a child process: ``await measure(url)`` is its latency summary."""

    def __init__(self, n: int, rate: float) -> None:
        self.n, self.rate = n, rate
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    async def measure(self, url: str, body: dict[str, Any] | None = None,
                      headers: dict[str, str] | None = None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, _latencies, url, self.n, self.rate,
                                          body, headers or {})

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


@contextlib.asynccontextmanager
async def running(*coros: Any) -> AsyncIterator[None]:
    """Run the attack coroutines for the body of the block, then cancel them."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield
    finally:
        # Cancelled until done: a cancellation can be lost (asyncio.wait_for in 3.11
        # swallows one that races its inner future's completion).
        while pending := [t for t in tasks if not t.done()]:
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)


async def _metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        r.raise_for_status()
        return parse_metrics(await r.text())


# -- the peering port ----------------------------------------------------------------------
async def mesh_flood(work: Path, replica: Daemon, healthy: Healthy, slots: int,
                     reconnect_s: float) -> dict[str, Any]:
    """``slots`` plain connects kept open on the peering port: one cut by the guard is
    opened again ``reconnect_s`` later, for as long as the healthy client measures."""
    from skymesh.mesh import certs

    pki = work / "pki"
    certs.create_ca(pki)
    certs.issue_cert(pki, "lb-m")
    port = free_port()
    lb = await start_lb(work, [replica], name="lb-mesh", overrides={
        "mesh": {"id": "lb-m", "certs_dir": str(pki), "listen_port": port, "peers": []}})
    try:
        return await _mesh_flood(lb, port, healthy, slots, reconnect_s)
    finally:
        await asyncio.to_thread(lb.stop)


async def _mesh_flood(lb: Daemon, port: int, healthy: Healthy, slots: int,
                      reconnect_s: float) -> dict[str, Any]:
    pid = lb.proc.pid
    chat_url = lb.url + "/v1/chat/completions"
    held: set[asyncio.StreamWriter] = set()
    counts = Counter[str]()
    # Past the guard's handshake deadline, so its cut of the admitted ones shows too.
    min_flood_s = 6.0
    fds = {"peak": 0, "held_peak": 0}

    async def accepts() -> bool:
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.close()
        return True

    await wait_for(accepts, "the peering port accepts", DEADLINE_S)
    no_attack = await healthy.measure(chat_url, CHAT)
    fds_before = open_fds(pid)

    async def slot(i: int) -> None:
        while True:
            counts["connects"] += 1  # attempted: one cancelled mid-connect counts too
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port,
                                                     local_addr=(SOURCES[i % len(SOURCES)], 0))
            except OSError:
                counts["connect_failed"] += 1
            else:
                held.add(w)
                with contextlib.suppress(OSError):
                    while await r.read(65536):  # until the guard cuts it
                        pass
                held.discard(w)
                w.close()
            await asyncio.sleep(reconnect_s)  # the attacker's pace, not a wait

    async with aiohttp.ClientSession() as s:
        async def sample() -> None:
            while True:
                fds["peak"] = max(fds["peak"], open_fds(pid))
                m = await _metrics(s, lb.url)
                fds["held_peak"] = max(fds["held_peak"], int(m.get(
                    "skymesh_mesh_connections", 0)))
                await asyncio.sleep(0.02)  # sampling cadence

        async def biting() -> bool:
            m = await _metrics(s, lb.url)
            return m.get("skymesh_mesh_connections_refused_total", 0.0) > 0

        t0 = time.monotonic()
        async with running(sample(), *(slot(i) for i in range(slots))):
            await wait_for(biting, "the guard refuses connections", DEADLINE_S)
            attack = await healthy.measure(chat_url, CHAT)
            await asyncio.sleep(max(0.0, t0 + min_flood_s - time.monotonic()))  # the length
            flood_s = time.monotonic() - t0
            for w in held:
                w.close()
        m = await _metrics(s, lb.url)

        async def released() -> bool:
            return (await _metrics(s, lb.url)).get("skymesh_mesh_connections", 0.0) == 0

        with contextlib.suppress(TimeoutError):
            await wait_for(released, "the guard holds no connection", DEADLINE_S)
        m_after = await _metrics(s, lb.url)
    refused = {k.split('reason="', 1)[1].rstrip('"}'): int(v) for k, v in m.items()
               if k.startswith("skymesh_mesh_connections_refused_total{")}
    return {"slots": slots, "sources": len(SOURCES), "reconnect_s": reconnect_s,
            "flood_seconds": flood_s, "connects": counts["connects"],
            "connect_failed": counts["connect_failed"],
            "refused": sum(refused.values()), "refused_by_reason": refused,
            "held_peak": fds["held_peak"], "held_after": int(m_after.get(
                "skymesh_mesh_connections", -1)),
            "fds": {"before": fds_before, "peak": fds["peak"], "after": open_fds(pid)},
            "healthy": {"no_attack": no_attack, "attack": attack}, "alive": lb.alive()}


# -- the controller's bodies ---------------------------------------------------------------------
async def stream_body(url: str, total: int, token: str | None) -> tuple[int, int]:
    """POST a chunked body of ``total`` bytes to the admin API: (the status answered or 0,
    the bytes of body the client's socket took before the server cut it)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    w.write(f"POST /v1/regions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{auth}Transfer-Encoding: chunked\r\n\r\n".encode())
    reply = asyncio.create_task(r.readuntil(b"\r\n\r\n"))
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * (64 * 1024))
    sent, status = 0, 0
    try:
        with contextlib.suppress(OSError):  # cut by the server: what we measure
            while sent < total and not reply.done():
                w.write(chunk)
                await w.drain()
                sent += 64 * 1024
        # 0: the connection was reset before its answer could be read (the server closed
        # it with our bytes unread, and the reset discards what it had sent)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError,
                                 ValueError, IndexError):
            async with asyncio.timeout(DEADLINE_S):
                status = int((await reply).split()[1])
    finally:
        reply.cancel()
        w.close()
    return status, sent


async def controller_bodies(ctl: Daemon, healthy: Healthy, admin: str, agent: str,
                            body_bytes: int) -> dict[str, Any]:
    """For each of no token and an agent token: a healthy admin client's p50 with no attack
    and while two clients stream ``body_bytes`` bodies one after another."""
    out: dict[str, Any] = {"body_bytes": body_bytes}
    read_url, read = ctl.url + "/v1/balancers", {"Authorization": f"Bearer {admin}"}
    for name, token in (("no_token", None), ("agent_over_cap", agent)):
        results: list[tuple[int, int]] = []

        async def attacker() -> None:
            while True:
                results.append(await stream_body(ctl.url, body_bytes, token))  # noqa: B023

        pid = ctl.proc.pid
        no_attack = await healthy.measure(read_url, headers=read)
        before = rss_bytes(pid)
        first = await stream_body(ctl.url, body_bytes, token)
        async with running(attacker(), attacker()):
            attack = await healthy.measure(read_url, headers=read)
        results.append(first)
        out[name] = {"status": first[0], "sent_bytes": first[1], "bodies": len(results),
                     "statuses": dict(Counter(str(st) for st, _ in results)),
                     "max_sent_bytes": max(sent for _, sent in results),
                     "rss_mb": {"before": before / MB, "after": rss_bytes(pid) / MB,
                                "peak": peak_rss_bytes(pid) / MB},
                     "healthy": {"no_attack": no_attack, "attack": attack}}
    out["alive"] = ctl.alive()
    return out


# -- telemetry ----------------------------------------------------------------------------------
def largest_report(limit: int, models: int) -> dict[str, Any]:
    """A report whose stored form (the controller's model with every default filled in,
    plus ``ts``, ``balancer`` and ``region``) is just under ``limit`` bytes: ``models``
    model names of 160 characters, padded with replica URLs."""
    from skymesh_controller.models import TelemetryIn

    def stored(r: dict[str, Any]) -> int:
        full = TelemetryIn.model_validate(r).model_dump()
        full.update(ts=time.time(), balancer="lb-t00", region="us")
        return len(json.dumps(full))

    report: dict[str, Any] = {"window_s": 1, "replicas": {},
                              "models": {f"m{i:03d}-" + "x" * 155: {"requests": 1}
                                         for i in range(models)}}
    i = 0
    while stored(report) < limit - 256:
        report["replicas"][f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000"] = "healthy"
        i += 1
    return report


async def telemetry_flood(ctl: Daemon, healthy: Healthy, admin: str, agent: str,
                          balancers: int, posts: int, limit: int = 65536) -> dict[str, Any]:
    """``posts`` of the largest accepted report per balancer, four at a time, from one
    agent token, and five of the issue's 1 MB reports (1,024 keys of 960 characters)."""
    pid = ctl.proc.pid
    read_url, read = ctl.url + "/v1/balancers", {"Authorization": f"Bearer {admin}"}
    ids = [f"lb-t{i:02d}" for i in range(balancers)]
    report = largest_report(limit, models=256)
    huge = {"window_s": 1, "models": {f"{i:04d}" + "m" * 956: {"requests": 1}
                                      for i in range(1024)}}
    statuses = Counter[str]()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {agent}"},
                                     timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as s:
        for bid in ids:
            async with s.post(ctl.url + "/v1/balancers", json={
                    "id": bid, "region": "us", "url": "http://127.0.0.1:9"}) as r:
                r.raise_for_status()
        # At least ``posts`` per balancer, and on until the healthy client is done.
        todo = posts * balancers
        measuring = True

        async def poster() -> None:
            nonlocal todo
            while todo > 0 or measuring:
                todo -= 1
                bid = ids[todo % balancers]
                async with s.post(f"{ctl.url}/v1/balancers/{bid}/telemetry",
                                  json=report) as r:
                    await r.read()
                    statuses[str(r.status)] += 1

        no_attack = await healthy.measure(read_url, headers=read)
        before = rss_bytes(pid)
        sent_at = time.monotonic()
        flood = asyncio.gather(*(poster() for _ in range(4)))
        attack = await healthy.measure(read_url, headers=read)
        measuring = False
        await flood
        flood_s = time.monotonic() - sent_at
        refused_huge = Counter[str]()
        for _ in range(5):
            async with s.post(f"{ctl.url}/v1/balancers/{ids[0]}/telemetry", json=huge) as r:
                await r.read()
                refused_huge[str(r.status)] += 1
        async with s.get(ctl.url + "/v1/telemetry", headers=read,
                         params={"balancer": ids[0], "limit": 10_000}) as r:
            kept = await r.json()
    return {"balancers": balancers, "posts": sum(statuses.values()),
            "report_bytes": len(json.dumps(report)), "statuses": dict(statuses),
            "flood_seconds": flood_s, "huge_report": {"bytes": len(json.dumps(huge)),
                                                      "statuses": dict(refused_huge)},
            "kept_per_balancer": len(kept),
            "kept_bytes_per_balancer": sum(len(json.dumps(x)) for x in kept),
            "rss_mb": {"before": before / MB, "after": rss_bytes(pid) / MB,
                       "peak": peak_rss_bytes(pid) / MB},
            "healthy": {"no_attack": no_attack, "attack": attack}, "alive": ctl.alive()}
