"""A running skymesh-replica, skymesh-lb and skymesh-controller, their /metrics scraped
once traffic and a probe round have given every labelled series a child: the ground
truth the dashboard and the alert rules are checked against."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from controller_support import ADMIN, token_config
from support import http_call as _call
from support import wait_for as _wait

from skymesh.mesh import certs
from skymesh.util.procs import free_port, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Scrape:
    text: dict[str, str]  # daemon (lb, replica, controller) -> its /metrics body






@contextmanager
def running_stack(tmp: Path) -> Iterator[Scrape]:
    started = []
    try:
        replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                               log_path=tmp / "replica.log")
        started.append(replica)
        # Two balancers peered over the mesh, so the peer series have children too.
        pki = tmp / "pki"
        certs.create_ca(pki)
        ports = {name: free_port() for name in ("lb-us", "lb-eu")}
        lbs = []
        for me, peer, region in (("lb-us", "lb-eu", "us-east"), ("lb-eu", "lb-us", "eu-west")):
            certs.issue_cert(pki, me)
            path = tmp / f"{me}.yaml"
            path.write_text(yaml.safe_dump({
                "region": region, "listen": {"port": 0}, "replicas": [{"url": replica.url}],
                "mesh": {"id": me, "certs_dir": str(pki), "listen_port": ports[me],
                         "heartbeat_interval_s": 0.1,
                         "peers": [{"id": peer, "address": f"127.0.0.1:{ports[peer]}"}]},
                "tenants": {}}))  # the per-tenant series (docs/tenancy.md)
            lbs.append(start_daemon("skymesh-lb", ["--config", str(path)],
                                    log_path=tmp / f"{me}.log"))
            started.append(lbs[-1])
        lb = lbs[0]
        cfg = tmp / "controller.yaml"
        cfg.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
            "url_policy": {"allow_loopback": True},
            "probe": {"interval_s": 0.1, "timeout_s": 1.0}}))
        ctl = start_daemon("skymesh-controller", ["--config", str(cfg)],
                           log_path=tmp / "controller.log")
        started.append(ctl)

        _wait(lambda: _call(lb.url + "/ready")[0] == 200, "the balancer sees its replica")

        def peer_measured() -> bool:
            status, body = _call(lb.url + "/status")
            return status == 200 and all(
                p["liveness"] == "alive" and p["rtt_s"] is not None
                for p in json.loads(body)["mesh"]["peers"])

        _wait(peer_measured, "lb-us hears lb-eu and measures its round trip")
        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        status, body = _call(lb.url + "/v1/chat/completions", chat)
        assert status == 200, body
        for path, obj in (("/v1/regions", {"name": "us-east", "latitude": 1, "longitude": 2}),
                          ("/v1/balancers", {"id": "lb-us", "region": "us-east",
                                             "url": lb.url}),
                          ("/v1/replicas", {"url": replica.url, "model": MODEL,
                                            "region": "us-east", "gpu": "L4"})):
            status, body = _call(ctl.url + path, obj, ADMIN)
            assert status == 201, body

        def probed() -> bool:
            status, body = _call(ctl.url + "/v1/replicas", token=ADMIN)
            return status == 200 and json.loads(body)[0]["state"] == "healthy"

        _wait(probed, "the controller's probes mark the replica healthy")
        text = {}
        for name, d in (("replica", replica), ("lb", lb), ("controller", ctl)):
            status, body = _call(d.url + "/metrics")
            assert status == 200, (name, body[:200])
            text[name] = body.decode()
        yield Scrape(text)
    finally:
        for d in reversed(started):
            d.stop()
