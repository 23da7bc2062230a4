"""The exact prefix summary across a real mesh: three skymesh-lb processes peered over
mTLS on loopback, each region one emulated replica publishing KV-cache events.

A prompt cached on eu's replica by traffic no balancer saw (sent to the engine directly)
reaches us's peer choice only through eu's exact summary; us forwards it to eu. Once eu's
engine clears its cache, eu's next summary says so, and with the prompt cached in ap
instead, us forwards it to ap, although us's own forwarding history and eu's trie still
point at eu. Once ap clears too, it stays in us.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import until

from skymesh.mesh import certs
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

pytestmark = pytest.mark.timeout(180)

MODEL = get_profile(DEFAULT_PROFILE).model
REGIONS = ("us", "eu", "ap")
TAG = "skymesh/16"  # the emulated replica's scoring key and block size
# The sender builds its summary at most every 2 s (heartbeat.DEFAULT_SUMMARY_INTERVAL_S);
# a change must show within a few of those.
SUMMARY_WAIT_S = 20.0


def start_region(tmp: Path, region: str, mesh: dict[str, Any]) -> tuple[Daemon, Daemon]:
    pub, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{pub}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01",
                                           "--metrics-lag-s", "0",
                                           "--kv-events-config", json.dumps(events)],
                       log_path=tmp / f"{region}-replica.log")
    cfg = {"region": region, "listen": {"host": "127.0.0.1", "port": 0},
           "policy": {"name": "prefix-tree"}, "probe": {"interval_s": 0.05},
           "kv_events": {"heartbeat_s": 0.2, "stale_after_s": 3.0},
           "replicas": [{"url": rep.url, "kind": "skymesh", "kv_events": {
               "endpoint": events["endpoint"], "replay_endpoint": events["replay_endpoint"]}}],
           "mesh": mesh}
    path = tmp / f"{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lb = start_daemon("skymesh-lb", ["--config", str(path)],
                      log_path=tmp / f"{region}-lb.log")
    return lb, rep


async def test_forwarded_requests_follow_the_peers_exact_summaries(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    certs.create_ca(pki)
    ids = {r: f"lb-{r}" for r in REGIONS}
    for name in ids.values():
        certs.issue_cert(pki, name)
    grpc = {r: free_port() for r in REGIONS}

    def mesh(me: str) -> dict[str, Any]:
        # balanced, no margin: us lends every request to an idle peer, and the peer that
        # holds its prefix wins by the locality margin.
        return {"id": ids[me], "certs_dir": str(pki), "listen_port": grpc[me],
                "heartbeat_interval_s": 0.1, "forwarding_rule": "balanced",
                "balance_margin": 0.0, "rtt_weight": 0.0, "locality_margin": 12.0,
                "peers": [{"id": ids[p], "address": f"127.0.0.1:{grpc[p]}"}
                          for p in REGIONS if p != me]}

    daemons = {r: start_region(tmp_path, r, mesh(r)) for r in REGIONS}
    lb = {r: d[0] for r, d in daemons.items()}
    replica = {r: d[1] for r, d in daemons.items()}
    try:
        async with aiohttp.ClientSession() as s:
            async def status(region: str) -> dict[str, Any]:
                async with s.get(lb[region].url + "/status") as r:
                    out: dict[str, Any] = await r.json()
                    return out

            async def peer_view(of: str) -> dict[str, Any]:
                view: dict[str, Any] = next(p for p in (await status("us"))["mesh"]["peers"]
                                            if p["id"] == ids[of])
                return view

            async def chat(url: str, text: str) -> int:
                body = {"model": MODEL, "max_tokens": 1,
                        "messages": [{"role": "user", "content": text}]}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    cached: int = (await r.json())["usage"]["prompt_tokens_details"][
                        "cached_tokens"]
                    return cached

            async def forwarded_in() -> dict[str, int]:
                return {r: (await status(r))["mesh"]["forwarded_in"] for r in ("eu", "ap")}

            def exact_keys(of: str, cond: Callable[[int], bool]
                           ) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    n = (await peer_view(of))["exact_summary"].get(TAG)
                    return n is not None and cond(n)
                return check

            async def ready() -> bool:
                st = await status("us")
                return all(p["forwardable"] for p in st["mesh"]["peers"]) and \
                    all(v["kv_exact"] for v in st["replicas"].values())

            # Every engine caches something first: its index learns the block size, which
            # tags the region's summary (and, in us, sizes the request's block keys).
            for r in REGIONS:
                await chat(replica[r].url, f"warm-up for {r}: " + "hello " * 40)
            await until(ready, "peers forwardable, us's events live, tokenizer loaded")
            for r in ("eu", "ap"):
                await until(exact_keys(r, lambda n: n > 0), f"us holds {r}'s exact summary",
                            timeout=SUMMARY_WAIT_S)
            before = {r: (await peer_view(r))["exact_summary"][TAG] for r in ("eu", "ap")}

            words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
            doc = "document: " + " ".join(words[(i * 7) % 8] + str(i % 13) for i in range(400))
            assert await chat(replica["eu"].url, doc) == 0  # eu's engine, directly
            await until(exact_keys("eu", lambda n: n > before["eu"]),
                        "eu's next summary holds the document", timeout=SUMMARY_WAIT_S)
            seen = await forwarded_in()
            cached = await chat(lb["us"].url, doc)
            assert await forwarded_in() == {"eu": seen["eu"] + 1, "ap": seen["ap"]}
            assert cached >= 256  # eu's engine hit its cache

            # eu's engine loses its cache; ap's engine gets the document (directly).
            async with s.post(replica["eu"].url + "/reset_prefix_cache") as r:
                assert r.status == 200
            await until(exact_keys("eu", lambda n: n == 0), "eu's summary: nothing held",
                        timeout=SUMMARY_WAIT_S)
            await chat(replica["ap"].url, doc)
            await until(exact_keys("ap", lambda n: n > before["ap"]),
                        "ap's next summary holds the document", timeout=SUMMARY_WAIT_S)
            seen = await forwarded_in()
            cached = await chat(lb["us"].url, doc)
            assert await forwarded_in() == {"eu": seen["eu"], "ap": seen["ap"] + 1}
            assert cached >= 256

            # ap's engine clears too. us's forwarding history and both peers' tries still
            # say eu and ap hold the document; their exact summaries say neither does, so
            # nothing pulls it abroad and it stays in us (balanced: no peer wins by load).
            async with s.post(replica["ap"].url + "/reset_prefix_cache") as r:
                assert r.status == 200
            await until(exact_keys("ap", lambda n: n == 0), "ap's summary: nothing held",
                        timeout=SUMMARY_WAIT_S)
            seen = await forwarded_in()
            assert await chat(lb["us"].url, doc) == 0
            assert await forwarded_in() == seen
    finally:
        for lb_d, rep in daemons.values():
            lb_d.stop()
            rep.stop()
