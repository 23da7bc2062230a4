"""Two real skymesh-lb processes peered over mTLS gRPC, each with its own replicas."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from support import mesh_pair, until

from skymesh.mesh import certs
from skymesh.util.procs import Daemon, free_port, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def start_region(tmp: Path, region: str, n_replicas: int, mesh: dict[str, Any],
                 api_key: str | None = None, tls: dict[str, str] | None = None
                 ) -> list[Daemon]:
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.1", "--seed",
                                             "7"], log_path=tmp / f"{region}-r{i}.log")
            for i in range(n_replicas)]
    listen: dict[str, Any] = {"port": 0, **({"tls": tls} if tls else {})}
    cfg = {"region": region, "listen": listen, "policy": {"name": "least-load"},
           "probe": {"interval_s": 0.05}, "replicas": [{"url": r.url} for r in reps],
           "mesh": mesh}
    path = tmp / f"{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "SKYMESH_API_KEYS": api_key} if api_key else None
    lb = start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / f"{region}-lb.log",
                      env=env)
    return [lb, *reps]


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def status(s: aiohttp.ClientSession, lb: Daemon, key: str | None = None
                 ) -> dict[str, Any]:
    async with s.get(lb.url + "/status", headers=bearer(key)) as r:
        out: dict[str, Any] = await r.json()
        return out


async def test_a_saturated_region_forwards_and_streams_arrive_intact(tmp_path: Path) -> None:
    mesh = mesh_pair(tmp_path)
    pki = tmp_path / "pki"

    # Each region has its own client keys: a request us forwards is served by eu without
    # eu's key (the peer link is authenticated by certificate). eu's clients come over
    # HTTPS, which eu's replay of forwarded requests on its own edge must get through.
    us = start_region(tmp_path, "us", 1, mesh("lb-us", "lb-eu"), api_key="sk-us")
    eu = start_region(tmp_path, "eu", 2, mesh("lb-eu", "lb-us"), api_key="sk-eu",
                      tls={"cert_file": str(pki / "lb-eu.crt"),
                           "key_file": str(pki / "lb-eu.key")})
    assert eu[0].url.startswith("https://") and us[0].url.startswith("http://")
    trust = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=trust),
                                         headers=bearer("sk-us")) as s:
            async def peers_alive() -> bool:
                st_us, st_eu = await status(s, us[0]), await status(s, eu[0], "sk-eu")
                return all(p["liveness"] == "alive"
                           for st in (st_us, st_eu) for p in st["mesh"]["peers"])

            await until(peers_alive, "both balancers see each other alive")
            # Only eu's own mesh link may skip its client keys: a guessed marker may not.
            async with s.get(eu[0].url + "/v1/models",
                             headers={"Authorization": "", "X-SkyMesh-Forwarded": "0" * 32}
                             ) as r:
                assert r.status == 401
            # Long prompts fill the one us replica's KV cache: us must lend to eu.
            long = "word " * 3000
            bodies = [{"model": MODEL, "stream": True, "max_tokens": 200, "ignore_eos": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"{i} {long}"}]}
                      for i in range(40)]

            async def one(b: dict[str, Any]) -> int:
                async with s.post(us[0].url + "/v1/chat/completions", json=b) as r:
                    assert r.status == 200
                    tokens = 0
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if '"usage"' in line and '"completion_tokens"' in line:
                            tokens = int(line.split('"completion_tokens":')[1].split(",")[0]
                                         .strip(" }"))
                    return tokens

            counts = await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), 90)
            assert counts == [200] * len(bodies)  # every stream whole, wherever it ran
            st_us, st_eu = await status(s, us[0]), await status(s, eu[0], "sk-eu")
            assert st_us["mesh"]["forwarded_out"] > 0
            assert st_eu["mesh"]["forwarded_in"] == st_us["mesh"]["forwarded_out"]
            assert st_eu["mesh"]["forwarded_out"] == 0  # one hop: eu never sends them on
            assert all(p["rtt_s"] is not None for p in st_us["mesh"]["peers"])
            async with s.get(us[0].url + "/metrics") as r:
                text = await r.text()
            assert 'skymesh_peer_state{peer="lb-eu"} 0.0' in text
            assert "skymesh_peer_rtt_seconds" in text and "skymesh_forwarded_out_total" in text
            sent = [line for line in text.splitlines()
                    if line.startswith("skymesh_peer_heartbeat_bytes_total{")
                    and 'direction="sent"' in line]
            assert sent and float(sent[0].rsplit(" ", 1)[1]) > 0
            # A killed peer is DOWN within three heartbeat intervals (plus probe slack),
            # and nothing more is forwarded to it.
            eu[0].kill()

            async def eu_down() -> bool:
                return (await status(s, us[0]))["mesh"]["peers"][0]["liveness"] == "down"

            await until(eu_down, "eu seen DOWN", timeout=5)
            before = (await status(s, us[0]))["mesh"]["forwarded_out"]
            counts = await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies[:4])), 90)
            assert counts == [200] * 4
            assert (await status(s, us[0]))["mesh"]["forwarded_out"] == before
    finally:
        for d in [*us, *eu]:
            d.stop()


async def test_a_partitioned_peer_goes_down_and_comes_back(tmp_path: Path) -> None:
    from skymesh_lab.netproxy import DelayProxy

    pki = tmp_path / "pki"
    certs.create_ca(pki)
    for name in ("lb-us", "lb-eu"):
        certs.issue_cert(pki, name)
    grpc = {"lb-us": free_port(), "lb-eu": free_port()}
    # Each side reaches the other through its own delayed link (20 ms each way).
    links = {"lb-us": DelayProxy("127.0.0.1", grpc["lb-eu"], 0.02),
             "lb-eu": DelayProxy("127.0.0.1", grpc["lb-us"], 0.02)}
    for p in links.values():
        await p.start()

    def mesh(me: str, peer: str) -> dict[str, Any]:
        return {"id": me, "certs_dir": str(pki), "listen_port": grpc[me],
                "heartbeat_interval_s": 0.1,
                "peers": [{"id": peer, "address": links[me].address}]}

    us = start_region(tmp_path, "us", 1, mesh("lb-us", "lb-eu"))
    eu = start_region(tmp_path, "eu", 1, mesh("lb-eu", "lb-us"))
    try:
        async with aiohttp.ClientSession() as s:
            async def eu_is(state: str) -> bool:
                return (await status(s, us[0]))["mesh"]["peers"][0]["liveness"] == state

            await until(lambda: eu_is("alive"), "peered")

            async def rtt_known() -> bool:
                return (await status(s, us[0]))["mesh"]["peers"][0]["rtt_s"] is not None

            await until(rtt_known, "an RTT measured from heartbeats")
            rtt = (await status(s, us[0]))["mesh"]["peers"][0]["rtt_s"]
            assert rtt >= 0.04  # the link's 2 x 20 ms shows up
            for p in links.values():
                p.blackhole = True
            # DOWN after three silent heartbeat intervals (0.3 s), plus the stream's slack.
            await until(lambda: eu_is("down"), "partitioned peer DOWN", timeout=3)
            body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "still here?"}]}
            async with s.post(us[0].url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200  # served locally meanwhile
            assert (await status(s, us[0]))["mesh"]["forwarded_out"] == 0
            for p in links.values():
                p.blackhole = False
            await until(lambda: eu_is("alive"), "healed peer ALIVE again", timeout=15)
    finally:
        for d in [*us, *eu]:
            d.stop()
        for p in links.values():
            await p.stop()


async def test_the_balanced_rule_lends_to_a_lighter_peer_while_local_replicas_admit(
        tmp_path: Path) -> None:
    """Short requests never fill the one us replica, so SkyLB's overflow rule would keep
    them all at home; the balanced rule sends some to the idle eu region, learning eu's
    load from its heartbeats over gRPC."""
    mesh = mesh_pair(tmp_path, forwarding_rule="balanced", balance_margin=0.5,
                     locality_margin=0.0, rtt_weight=0.0)
    us = start_region(tmp_path, "us", 1, mesh("lb-us", "lb-eu"))
    eu = start_region(tmp_path, "eu", 1, mesh("lb-eu", "lb-us"))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def eu_ready() -> bool:
                # Our channel to eu is up, and its heartbeats say its replica is up and
                # how loaded it is.
                peer = (await status(s, us[0]))["mesh"]["peers"][0]
                m = peer["models"].get(MODEL)
                return peer["forwardable"] and m is not None and \
                    m["available"] >= 1 and m["outstanding"] == 0

            await until(eu_ready, "us has heard eu's load")
            bodies = [{"model": MODEL, "stream": True, "max_tokens": 60, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"short question {i}"}]}
                      for i in range(12)]

            async def one(b: dict[str, Any]) -> int:
                async with s.post(us[0].url + "/v1/chat/completions", json=b) as r:
                    assert r.status == 200
                    return sum(1 for raw in [x async for x in r.content]
                               if raw.startswith(b"data: {"))

            chunks = await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), 60)
            assert all(n >= 60 for n in chunks)  # every stream whole, wherever it ran
            st_us, st_eu = await status(s, us[0]), await status(s, eu[0], "sk-eu")
            assert st_us["mesh"]["forwarded_out"] > 0
            assert st_eu["mesh"]["forwarded_in"] == st_us["mesh"]["forwarded_out"]
            # Some, not all: the us replica kept admitting, so the rule weighed each one.
            assert st_us["mesh"]["forwarded_out"] < len(bodies)
    finally:
        for d in [*us, *eu]:
            d.stop()
