"""The balancer's KV-event feeds: config, membership, and the live/stale/off rule."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from skymesh.balancer.config import KVEventsConfig, ReplicaConfig, parse_config
from skymesh.balancer.kv_feed import LIVE, OFF, STALE, KVFeeds
from skymesh.util.procs import free_port


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def replica(url: str, port: int | None) -> ReplicaConfig:
    ev = None if port is None else {"endpoint": f"tcp://127.0.0.1:{port}",
                                    "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}
    return ReplicaConfig.model_validate({"url": url, "kv_events": ev})


@pytest.mark.parametrize(
    ("ev", "message"),
    [
        ({"endpoint": "http://x:1"}, "tcp://HOST:PORT"),
        ({"endpoint": "tcp://*:5557"}, "bind address"),
        ({"endpoint": "tcp://h:1", "replay_endpoint": "udp://h:2"}, "tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:1", "extra": 1}, "extra"),
    ],
)
def test_bad_endpoints_are_refused_naming_the_field(ev: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ReplicaConfig.model_validate({"url": "http://127.0.0.1:1", "kv_events": ev})


def test_config_section_defaults_and_bounds() -> None:
    cfg = parse_config({"replicas": [{"url": "http://127.0.0.1:9",
                                      "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}}]})
    assert cfg.kv_events.max_blocks == 100_000
    assert cfg.replicas[0].kv_events is not None
    with pytest.raises(ValidationError, match="max_blocks"):
        KVEventsConfig.model_validate({"max_blocks": 0})


async def test_live_until_silent_for_stale_after_then_off_when_removed() -> None:
    clock = Clock()
    feeds = KVFeeds(KVEventsConfig(stale_after_s=5.0, heartbeat_s=60.0), clock)
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    feeds.set_replicas([replica(a, free_port()), replica(b, None)])
    try:
        assert feeds.state(a) == STALE  # nothing heard yet
        assert feeds.state(b) == OFF
        sub = feeds._subs[a][1]
        sub.last_heard = clock.t
        assert feeds.state(a) == LIVE and list(feeds.live_indexes([a, b])) == [a]
        clock.t += 5.0
        assert feeds.state(a) == LIVE
        clock.t += 0.1
        assert feeds.state(a) == STALE and feeds.live_indexes([a, b]) == {}
        task = feeds._subs[a][2]
        feeds.set_replicas([replica(b, None)])
        assert feeds.state(a) == OFF and feeds.index(a) is None
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await feeds.stop()


async def test_changed_endpoint_restarts_the_feed_with_an_empty_index() -> None:
    feeds = KVFeeds(KVEventsConfig(heartbeat_s=60.0))
    a = "http://127.0.0.1:1"
    feeds.set_replicas([replica(a, free_port())])
    try:
        first = feeds.index(a)
        assert first is not None
        first.stored([1], None, [1] * 16, 16)
        feeds.set_replicas([replica(a, free_port())])
        second = feeds.index(a)
        assert second is not None and second is not first and len(second) == 0
    finally:
        await feeds.stop()


async def test_metrics_per_replica_and_the_cap_log(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from skymesh.prefix.kv_events import BlockStored, encode_batch

    clock = Clock()
    feeds = KVFeeds(KVEventsConfig(max_blocks=2, heartbeat_s=60.0), clock)
    a = "http://127.0.0.1:1"
    feeds.set_replicas([replica(a, free_port())])
    reg = CollectorRegistry()
    reg.register(feeds)
    try:
        sub = feeds._subs[a][1]
        toks = list(range(48))
        sub._apply(0, encode_batch(0.0, [BlockStored([1, 2, 3], None, toks, 16)]))
        sub.last_heard = clock.t
        text = generate_latest(reg).decode()
        assert f'skymesh_kv_events_live{{replica="{a}"}} 1.0' in text
        assert f'skymesh_kv_index_blocks{{replica="{a}"}} 2.0' in text
        assert f'skymesh_kv_index_evicted_total{{replica="{a}"}} 1.0' in text
        assert f'skymesh_kv_events_total{{outcome="applied",replica="{a}"}} 1.0' in text
        assert "index at its cap of 2 blocks" in caplog.text
    finally:
        await feeds.stop()


def test_events_without_the_extra_name_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "zmq" else real(name, *a))
    with pytest.raises(ValidationError, match=r"skymesh\[kv-events\]"):
        replica("http://127.0.0.1:1", 5557)
