"""The pure parts of skymesh-lb's workers: how many, sp-p's share, restarts, the merged
/metrics view and the trie-share datagrams."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import eventually

from skymesh.balancer.config import MAX_AUTO_WORKERS, ConfigError, parse_config
from skymesh.balancer.siblings import decode_inserts, encode_inserts, merge_expositions
from skymesh.balancer.workers import (
    GIVE_UP_DEATHS,
    RESTART_DELAY_MAX_S,
    RESTART_DELAY_S,
    STABLE_AFTER_S,
    RestartBudget,
    pushing_share,
    resolve_workers,
)


@pytest.mark.parametrize(("setting", "cores", "mesh", "want"), [
    ("auto", 2, False, 2),
    ("auto", 1, False, 1),
    ("auto", 64, False, MAX_AUTO_WORKERS),
    ("auto", 4, True, 1),  # one mesh identity: a mesh or controller keeps one process
    (3, 1, False, 3),  # a number is taken as given
    (1, 8, False, 1),
])
def test_worker_count(setting: int | str, cores: int, mesh: bool, want: int) -> None:
    assert resolve_workers(setting, cores, mesh_or_controller=mesh) == want


def test_config_key() -> None:
    assert parse_config({}).listen.workers == "auto"
    assert parse_config({"listen": {"workers": 4}}).listen.workers == 4
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ConfigError, match=r"listen\.workers"):
            parse_config({"listen": {"workers": bad}})
    with pytest.raises(ConfigError, match=r"listen\.workers: more than 1 worker"):
        parse_config({"listen": {"workers": 2}, "mesh": {"id": "a", "certs_dir": "certs"}})


def test_share_counts_every_worker_of_every_balancer() -> None:
    assert pushing_share(1, 1) == 1
    assert pushing_share(1, 2) == 2
    assert pushing_share(3, 4) == 12


def test_balancer_pushes_as_one_of_its_workers() -> None:
    from skymesh.balancer.server import Balancer

    cfg = parse_config({"pushing": {"balancers_per_region": 2}})
    assert Balancer(cfg).dispatcher.balancers_per_region == 2
    assert Balancer(cfg, workers=3).dispatcher.balancers_per_region == 6


def test_sighup_keeps_the_workers_share() -> None:
    from skymesh.balancer.reload import apply_config
    from skymesh.balancer.server import Balancer

    lb = Balancer(parse_config({}), workers=2)
    apply_config(lb, parse_config({"pushing": {"balancers_per_region": 3}}))
    assert lb.dispatcher.balancers_per_region == 6


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_restart_delays_grow_then_reset_after_a_stable_run() -> None:
    clock = Clock()
    budget = RestartBudget(clock)
    delays = []
    for _ in range(GIVE_UP_DEATHS - 1):
        clock.t += 100.0  # far apart: never too many in the window
        delays.append(budget.on_death(uptime_s=1.0))
    assert delays[0] == RESTART_DELAY_S
    assert delays == sorted(delays) and delays[-1] > delays[0]
    assert all(d is not None and d <= RESTART_DELAY_MAX_S for d in delays)
    clock.t += 100.0
    assert budget.on_death(uptime_s=STABLE_AFTER_S) == RESTART_DELAY_S


def test_restarts_give_up_when_workers_keep_dying() -> None:
    clock = Clock()
    budget = RestartBudget(clock)
    got = []
    for _ in range(GIVE_UP_DEATHS):
        clock.t += 1.0
        got.append(budget.on_death(uptime_s=0.5))
    assert None not in got[:-1] and got[-1] is None


def _exposition(requests: int, observed: float) -> str:
    r = CollectorRegistry()
    c = Counter("skymesh_requests_total", "Requests", ["model", "outcome"], registry=r)
    c.labels("m", "ok").inc(requests)
    h = Histogram("skymesh_queue_wait_seconds", "Wait", ["model"], registry=r,
                  buckets=(0.1, 1.0))
    h.labels("m").observe(observed)
    return generate_latest(r).decode()


def test_merge_labels_each_worker_and_keeps_types() -> None:
    text = merge_expositions({"0": _exposition(3, 0.05), "1": _exposition(4, 0.5),
                              "2": None}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    req = fams["skymesh_requests"]
    assert req.type == "counter"
    totals = {s.labels["worker"]: s.value for s in req.samples
              if s.name == "skymesh_requests_total"}
    assert totals == {"0": 3.0, "1": 4.0}
    assert fams["skymesh_queue_wait_seconds"].type == "histogram"
    buckets = {(s.labels["worker"], s.labels["le"]): s.value
               for s in fams["skymesh_queue_wait_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets[("0", "0.1")] == 1.0 and buckets[("1", "0.1")] == 0.0
    up = {s.labels["worker"]: s.value for s in fams["skymesh_worker_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert text.count("# TYPE skymesh_requests_total counter") == 1  # one family


def test_trie_inserts_round_trip_and_split_by_size() -> None:
    big = (1 << 64) - 1
    inserts = [([1, 2, big], "http://a"), (list(range(100, 300)), "http://b"),
               (list(range(7)), "http://a")]
    (one,) = encode_inserts(inserts)
    assert decode_inserts(one) == inserts
    small = encode_inserts(inserts, limit=16 * 205)  # room for 205 keys per datagram
    assert len(small) == 2 and all(len(m) < 16 * 205 for m in small)
    assert [x for m in small for x in decode_inserts(m)] == inserts


def test_a_prompt_longer_than_a_datagram_keeps_its_head() -> None:
    (msg,) = encode_inserts([(list(range(10_000)), "http://a")], limit=1600)
    ((keys, target),) = decode_inserts(msg)
    assert keys == list(range(100)) and target == "http://a"


async def test_siblings_apply_each_others_trie_inserts(tmp_path: Path) -> None:
    """Two workers' trie shares over real unix datagrams: what one routes, the other
    learns (and does not echo back); a target the receiver does not know is skipped."""
    from prometheus_client import Counter as PromCounter

    from skymesh.balancer.siblings import TrieShare
    from skymesh.prefix.trie import PrefixTrie

    tries = [PrefixTrie(), PrefixTrie()]
    r = CollectorRegistry()
    dropped = PromCounter("dropped", "d", registry=r)
    shares = [TrieShare(tmp_path, i, 2, lambda i=i: tries[i],
                        lambda t: t != "http://unknown", dropped) for i in (0, 1)]
    for s in shares:
        s.start()
    try:
        tries[0].insert([1, 2, 3], "http://a")
        tries[0].insert([9, 8], "http://unknown")
        tries[1].insert([5, 6], "http://b")
        await eventually(lambda: tries[1].depth_of([1, 2, 3]) == 3
                         and tries[0].depth_of([5, 6]) == 2, "inserts shared both ways")
        assert tries[1].match([1, 2, 3], ["http://a", "http://b"]) == (3, ("http://a",))
        assert tries[1].depth_of([9, 8]) == 0
        assert shares[0].applied == 1 and shares[1].applied == 1  # no echo
        assert dropped._value.get() == 0
    finally:
        for s in shares:
            await s.stop()
