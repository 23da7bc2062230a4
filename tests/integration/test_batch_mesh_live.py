"""Batch across the mesh (docs/tenancy.md) on two real ``skymesh-lb`` processes peered
over mTLS, each with one emulated replica admitting one request at a time, both with
``tenants.batch_mesh``. us's replica is held by a long interactive request:

- a batch request to us goes to eu, which reports an idle replica, and finishes while the
  long request still runs; eu knows it as batch (its access log says so);
- a batch request past its deadline (``X-SkyMesh-Batch-Deadline-Ms: 1``) is served where
  it is: not forwarded although eu is idle, it finishes after the long request (plain
  overflow forwarding, SkyLB's, would have sent it to eu).

Order of events, never seconds."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, mesh_pair, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(180)

WEB_KEY, BULK_KEY = "sk-web-1", "sk-bulk-1"
_ENV = {**{k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"},
        "SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY}"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS: dict[str, Any] = {
    "members": [
        {"name": "web", "keys_sha256": [sha(WEB_KEY)], "default_class": "interactive"},
        {"name": "bulk", "keys_sha256": [sha(BULK_KEY)], "classes": ["batch"],
         "default_class": "batch"},
    ],
    # One replica a region: the default reserve (0.25, rounded down) keeps none of it.
    "batch_mesh": {"deadline_h": 2},
}


def start_region(tmp: Path, region: str, mesh: dict[str, Any]) -> list[Daemon]:
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.2",
                                           "--max-num-seqs", "1"],
                       log_path=tmp / f"{region}-rep.log")
    cfg = {"region": region, "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
           "probe": {"interval_s": 0.05}, "queue": {"timeout_s": 120},
           "pushing": {"mode": "sp-p", "max_num_seqs": 1, "max_outstanding": 1},
           "replicas": [{"url": rep.url, "kind": "skymesh", "max_num_seqs": 1}],
           "tenants": TENANTS, "mesh": mesh}
    path = tmp / f"{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lb = start_daemon("skymesh-lb", ["--config", str(path)],
                      log_path=tmp / f"{region}-lb.log", env=_ENV)
    return [lb, rep]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_batch_goes_to_the_idle_peer_and_stays_home_past_its_deadline(
        tmp_path: Path) -> None:
    mesh = mesh_pair(tmp_path)
    us = start_region(tmp_path, "us", mesh("lb-us", "lb-eu"))
    eu = start_region(tmp_path, "eu", mesh("lb-eu", "lb-us"))
    lb_us, lb_eu = us[0], eu[0]
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                async with s.get(lb_us.url + "/status", headers=bearer(WEB_KEY)) as r:
                    st = await r.json()
                peers = st["mesh"]["peers"]
                async with s.get(lb_us.url + "/v1/models", headers=bearer(WEB_KEY)) as r:
                    models = (await r.json()).get("data") if r.status == 200 else None
                return bool(models) and all(p["liveness"] == "alive" for p in peers)

            await until(ready, "us sees eu alive and its replica's model")
            async with s.get(lb_us.url + "/v1/models", headers=bearer(WEB_KEY)) as r:
                model = (await r.json())["data"][0]["id"]
            order: list[str] = []

            async def send(name: str, key: str, max_tokens: int,
                           extra: dict[str, str] | None = None, lb: Daemon = lb_us) -> None:
                body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                        "prompt": f"{name} tell me"}
                async with s.post(lb.url + "/v1/completions", json=body,
                                  headers={**bearer(key), **(extra or {})}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                order.append(name)

            def full(lb: Daemon) -> Any:
                async def check() -> bool:
                    m = await get_metrics(s, lb.url)
                    return sum(v for k, v in m.items()
                               if k.startswith("skymesh_replica_in_flight_requests")) >= 1
                return check

            us_full = full(lb_us)

            long = asyncio.create_task(send("long", WEB_KEY, 1500))
            await until(us_full, "the long request on us's only replica")
            await send("batch", BULK_KEY, 8)
            assert order == ["batch"]  # done at eu while the long one still runs
            out = (await get_metrics(s, lb_us.url))["skymesh_forwarded_out_total"]
            assert out == 1

            def eu_seen(free: bool) -> Any:
                async def check() -> bool:  # as us's heartbeats from eu say
                    async with s.get(lb_us.url + "/status", headers=bearer(WEB_KEY)) as r:
                        peer = (await r.json())["mesh"]["peers"][0]
                    load = (peer.get("models") or {}).get(model) or {}
                    return (load.get("available", 0) >= 1) == free and load.get("queue") == 0
                return check

            await until(eu_seen(free=True), "eu reporting its replica free again")
            # eu busy with its own client's request while the late batch request arrives
            # and passes its deadline at us; then eu frees, and the late one stays home.
            eu_own = asyncio.create_task(send("eu-own", WEB_KEY, 300, lb=lb_eu))
            await until(eu_seen(free=False), "eu reporting its replica busy")
            late = asyncio.create_task(send("late", BULK_KEY, 8,
                                            {"X-SkyMesh-Batch-Deadline-Ms": "1"}))
            await asyncio.wait_for(asyncio.gather(long, late, eu_own), 150)
            assert order == ["batch", "eu-own", "long", "late"]
            assert (await get_metrics(s, lb_us.url))["skymesh_forwarded_out_total"] == 1
            bad = {"model": model, "max_tokens": 2, "prompt": "x"}
            async with s.post(lb_us.url + "/v1/completions", json=bad,
                              headers={**bearer(BULK_KEY),
                                       "X-SkyMesh-Batch-Deadline-Ms": "soon"}) as r:
                assert r.status == 400
                assert "X-SkyMesh-Batch-Deadline-Ms" in (await r.json())["error"]["message"]
    finally:
        for d in [*us, *eu]:
            d.stop()
    eu_log = (tmp_path / "eu-lb.log").read_text()
    assert "priority=batch" in eu_log  # the forwarded request was batch at eu too
