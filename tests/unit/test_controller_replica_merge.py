"""Membership replicas and lb.yaml's entries for the same URL (issue #36): the controller
says what a replica is (model, gpu, kind), the balancer's config how it reads it
(kv_events, tokenizer, max_num_seqs, metrics_lag_s). A KV-event endpoint from the
controller is followed only through the URL policy, never as an ipc:// path, and only
with the kv-events extra. The resolver is injected: no real DNS."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp import web
from support import eventually, serving
from test_controller_link_backoff import FakeController

from skymesh.balancer import controller_link
from skymesh.balancer.config import KVEventsEndpoint, ReplicaConfig, parse_config
from skymesh.balancer.controller_link import kv_endpoint_url, merge_replica
from skymesh.balancer.server import Balancer
from skymesh.net.urlpolicy import UrlRejected

URL = "http://10.0.0.5:8000"
OWN_EP = KVEventsEndpoint(endpoint="ipc:///run/vllm/kv.sock")
MEMBER = {"id": "r1", "url": URL, "model": "new-model", "gpu": "H100", "kind": "sglang"}
ANSWERS = {"vpc.example": ["10.0.0.7"], "loop.example": ["127.0.0.1"],
           "meta.example": ["169.254.169.254"]}


async def fake_dns(host: str, port: int) -> list[str]:
    return ANSWERS.get(host, [host])


def test_the_lb_yaml_entry_keeps_its_settings_and_the_controller_says_what_it_is() -> None:
    own = ReplicaConfig(url=URL, kind="vllm", models=["old-model"], gpu="L4",
                        kv_events=OWN_EP, tokenizer="/models/llama", max_num_seqs=64,
                        metrics_lag_s=0.5)
    got = merge_replica(MEMBER, own,
                        KVEventsEndpoint(endpoint="tcp://10.0.0.5:5557"))
    assert (got.kind, got.models, got.gpu) == ("sglang", ["new-model"], "H100")
    # local config wins for how the balancer reaches and reads it
    assert got.kv_events == OWN_EP
    assert (got.tokenizer, got.max_num_seqs, got.metrics_lag_s) == ("/models/llama", 64, 0.5)


def test_the_controller_endpoint_fills_in_when_lb_yaml_names_none() -> None:
    theirs = KVEventsEndpoint(endpoint="tcp://10.0.0.5:5557")
    own = ReplicaConfig(url=URL, tokenizer="/models/llama")
    assert merge_replica(MEMBER, own, theirs).kv_events == theirs
    fresh = merge_replica(MEMBER, None, theirs)
    assert (fresh.url, fresh.kv_events, fresh.tokenizer) == (URL, theirs, None)
    assert merge_replica(MEMBER, None).kv_events is None


def test_a_skymesh_kind_from_the_controller_drops_a_local_tokenizer() -> None:
    own = ReplicaConfig(url=URL, tokenizer="/models/llama")
    assert merge_replica({**MEMBER, "kind": "skymesh"}, own).tokenizer is None


def test_only_tcp_endpoints_come_from_the_controller() -> None:
    assert kv_endpoint_url("tcp://vpc.example:5557") == "http://vpc.example:5557"
    with pytest.raises(UrlRejected, match="ipc://"):
        kv_endpoint_url("ipc:///tmp/kv.sock")


def balancer(**controller: Any) -> tuple[Balancer, list[list[ReplicaConfig]]]:
    cfg = parse_config({
        "region": "us",
        "replicas": [{"url": URL, "models": ["old-model"], "kv_events": OWN_EP.model_dump(),
                      "max_num_seqs": 8}],
        "controller": {"url": "http://127.0.0.1:9", "balancer_id": "lb-us", **controller}})
    lb = Balancer(cfg)
    assert lb.controller is not None
    got: list[list[ReplicaConfig]] = []
    lb.controller.set_replicas = got.append
    lb.controller.resolver = fake_dns
    return lb, got


def membership(*replicas: dict[str, Any]) -> dict[str, Any]:
    return {"revision": 3, "replicas": list(replicas), "peers": []}


async def test_membership_keeps_the_lb_yaml_kv_events() -> None:
    """The defect: membership rebuilt every replica from the controller's record alone,
    so the lb.yaml entry's kv_events (and max_num_seqs) vanished."""
    lb, got = balancer()
    assert lb.controller is not None
    await lb.controller.apply(membership(MEMBER))
    (rep,) = got[-1]
    assert rep.kv_events == OWN_EP and rep.max_num_seqs == 8 and rep.models == ["new-model"]


@pytest.mark.parametrize(("endpoint", "follows"), [
    ("tcp://vpc.example:5557", True),    # private: the replica URL rule allows it
    ("tcp://loop.example:5557", False),  # loopback from the controller: denied by default
    ("tcp://meta.example:5557", False),  # the metadata address: always denied
    ("ipc:///tmp/kv.sock", False),       # a path on this host: lb.yaml only
    ("udp://vpc.example:5557", False),   # not an endpoint the subscriber takes
])
async def test_a_controller_endpoint_passes_the_url_policy(
        endpoint: str, follows: bool, caplog: pytest.LogCaptureFixture) -> None:
    lb, got = balancer()
    assert lb.controller is not None
    other = {**MEMBER, "url": "http://10.0.0.6:8000", "kv_events": {"endpoint": endpoint}}
    with caplog.at_level(logging.WARNING, logger="skymesh.balancer.controller"):
        await lb.controller.apply(membership(other))
    (rep,) = got[-1]
    assert (rep.kv_events is not None) == follows
    if follows:
        assert rep.kv_events == KVEventsEndpoint(endpoint=endpoint)
    else:
        assert "kv events endpoint of replica http://10.0.0.6:8000" in caplog.text


async def test_a_refused_replay_endpoint_refuses_the_feed() -> None:
    lb, got = balancer()
    assert lb.controller is not None
    other = {**MEMBER, "url": "http://10.0.0.6:8000",
             "kv_events": {"endpoint": "tcp://vpc.example:5557",
                           "replay_endpoint": "tcp://meta.example:5558"}}
    await lb.controller.apply(membership(other))
    assert got[-1][0].kv_events is None


async def test_without_the_extra_one_warning_and_no_feed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(controller_link, "kv_events_installed", lambda: False)
    lb, got = balancer()
    assert lb.controller is not None
    others = [{**MEMBER, "url": f"http://10.0.0.{i}:8000",
               "kv_events": {"endpoint": f"tcp://10.0.0.{i}:5557"}} for i in (6, 7)]
    with caplog.at_level(logging.WARNING, logger="skymesh.balancer.controller"):
        await lb.controller.apply(membership(*others))
        await lb.controller.apply(membership(*others))
    assert all(r.kv_events is None for r in got[-1]) and len(got[-1]) == 2
    assert caplog.text.count("kv-events extra is not installed") == 1


class OlderController(FakeController):
    """A controller from before the kv_events field: its replica model forbids the key
    (422 in the admin error shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.region_created = True
        self.seen: list[dict[str, Any]] = []

    async def replicas(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "kv_events" in body:
            return web.json_response({"error": {
                "type": "invalid", "message": "kv_events: Extra inputs are not permitted",
                "fields": [{"field": "kv_events", "message": "Extra inputs"}]}}, status=422)
        self.seen.append(body)
        return web.json_response(body, status=201)


async def test_an_older_controller_gets_the_replica_without_its_kv_events(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = OlderController()
    async with serving(fake.app()) as port:
        cfg = parse_config({
            "region": "us",
            "replicas": [{"url": URL, "models": ["m"],
                          "kv_events": {"endpoint": "tcp://10.0.0.5:5557"}}],
            "controller": {"url": f"http://127.0.0.1:{port}", "balancer_id": "lb-us",
                           "url_policy": {"allow_loopback": True}}})
        link = Balancer(cfg).controller
        assert link is not None
        with caplog.at_level(logging.WARNING, logger="skymesh.balancer.controller"):
            await link.start("http://127.0.0.1:1")
            try:
                await eventually(lambda: link.registered, "registered")
            finally:
                fake.done.set()
                await link.stop()
    assert [r["url"] for r in fake.seen] == [URL]
    assert "refused the kv_events of replica" in caplog.text
