"""prefix-tree on the engines' exact prefix state (KV-cache events), and the scorer that
puts that state on a request."""

from __future__ import annotations

import random

import pytest
from support import View

from skymesh.balancer.config import KVEventsConfig, ReplicaConfig
from skymesh.balancer.intake import parse_request
from skymesh.balancer.kv_feed import ExactScorer, KVFeeds
from skymesh.policies import RouteRequest
from skymesh.policies.prefix_tree import PrefixTree, exact_match
from skymesh.prefix.prompt import FallbackTokenizer
from skymesh.util.procs import free_port

ALL = ["a", "b", "c"]


def req(exact: dict[str, int] | None, blocks: int = 10, keys: tuple[int, ...] = ()
        ) -> RouteRequest:
    return RouteRequest("r", prefix_keys=keys, exact_prefix=exact, exact_blocks=blocks)


@pytest.mark.parametrize(
    ("exact", "blocks", "cands", "want"),
    [
        (None, 10, ALL, None),
        ({"a": 3, "b": 9}, 10, ALL, None),  # c has no live events: the trie decides
        ({"a": 3, "b": 9, "c": 9}, 10, ALL, (0.9, ["b", "c"])),
        ({"a": 0, "b": 0, "c": 0}, 10, ALL, None),  # cached nowhere yet: the trie decides
        ({"a": 4, "b": 9, "c": 1}, 0, ALL, None),  # no full block
        ({"a": 4, "b": 9, "c": 1}, 10, ["a", "c"], (0.4, ["a"])),
    ],
)
def test_exact_match(exact: dict[str, int] | None, blocks: int, cands: list[str],
                     want: tuple[float, list[str]] | None) -> None:
    assert exact_match(req(exact, blocks), cands) == want


def test_select_follows_the_engines_over_the_trie() -> None:
    p = PrefixTree(rng=random.Random(0))
    view = View().set(a=5, b=0, c=0)
    keys = tuple(range(10))
    p.trie.insert(keys, "c")  # the trie believes c holds it; the engines say a does
    assert p.select(req({"a": 10, "b": 0, "c": 0}, keys=keys), ALL, view) == "a"
    assert p.preferred(req({"a": 10, "b": 0, "c": 0}, keys=keys), ALL, view) == "a"
    # Held nowhere per the events: the trie's word, which knows the requests this balancer
    # sent that no engine has published yet (an in-flight prefill).
    assert p.select(req({"a": 0, "b": 0, "c": 0}, keys=keys), ALL, view.set(b=1)) == "c"
    assert p.preferred(req({"a": 0, "b": 0, "c": 0}, keys=keys), ALL, view) == "c"
    fresh = tuple(range(100, 110))
    assert p.select(req({"a": 0, "b": 0, "c": 0}, keys=fresh), ALL,
                    View().set(a=5, b=1, c=9)) == "b"  # nothing known anywhere: least loaded
    # Below the threshold: the least loaded candidate, as with the trie.
    assert p.select(req({"a": 5, "b": 0, "c": 0}, keys=keys), ALL, view) == "c"
    # One candidate without live events: the trie decides.
    assert p.select(req({"a": 10, "b": 0}, keys=keys), ALL, view) == "c"


def test_the_trie_is_not_believed_for_a_prompt_its_target_lost() -> None:
    """Evicted from a (or a restarted): the events hold it nowhere, and the trie's record
    of a is stale; the prompt is scored by load, not sent back to a."""
    p = PrefixTree(rng=random.Random(0))
    view = View().set(a=0, b=1, c=1)
    keys = tuple(range(10))
    p.trie.insert(keys, "a")
    nowhere = {"a": 0, "b": 0, "c": 0}
    lost = RouteRequest("r", prefix_keys=keys, exact_prefix=nowhere, exact_blocks=10,
                        exact_lost=frozenset({"a"}))
    busy_a = View().set(a=3, b=1, c=0)
    assert p.select(lost, ALL, busy_a) == "c"
    assert p.preferred(lost, ALL, busy_a) is None  # no prefix preference: load decides
    # Not lost (in flight, unpublished): the trie's word stands, loaded or not.
    assert p.select(req(nowhere, keys=keys), ALL, busy_a) == "a"
    # Another target the trie knows of (sent there since) is still followed.
    p.trie.insert(keys, "b")
    assert p.select(lost, ALL, busy_a) == "b"
    assert p.preferred(lost, ALL, view) == "b"


def live_feeds(clock: list[float]) -> tuple[KVFeeds, str, str]:
    feeds = KVFeeds(KVEventsConfig(heartbeat_s=60.0), clock=lambda: clock[0])
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    reps = [ReplicaConfig.model_validate(
        {"url": u, "kind": "skymesh",
         "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}) for u in (a, b)]
    reps.append(ReplicaConfig.model_validate(
        {"url": "http://127.0.0.1:3", "kind": "vllm",
         "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}))
    feeds.set_replicas(reps)
    for url in (a, b, "http://127.0.0.1:3"):
        feeds._subs[url][1].last_heard = clock[0]
    return feeds, a, b


async def test_scorer_counts_cached_blocks_of_the_rendered_prompt() -> None:
    clock = [10.0]
    feeds, a, b = live_feeds(clock)
    tok = FallbackTokenizer()
    scorer = ExactScorer(feeds, load_tokenizer=lambda: tok)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + \
        b" ".join(b"word%d" % i for i in range(80)) + b'"}]}'
    intake = parse_request("chat", body, {})
    route = RouteRequest("r")
    try:
        # Nothing loaded yet: the request goes on unannotated while the tokenizer loads.
        assert (await scorer.annotate(route, intake)).exact_prefix is None
        assert scorer._loading
        await scorer.loaded()
        ids = tok.encode(intake.prompt_text)
        assert len(ids) >= 48
        ia = feeds.index(a)
        assert ia is not None
        ia.stored([1, 2, 3], None, ids[:48], 16)
        out = await scorer.annotate(route, intake)
        # vLLM replicas without a tokenizer folder are followed but not scored.
        assert out.exact_prefix == {a: 3, b: 0}
        assert out.exact_blocks == len(ids) // 16
        assert out.exact_lost == frozenset()
        ia.removed([1])  # evicted: a holds none of it, and says so
        out = await scorer.annotate(route, intake)
        assert out.exact_prefix == {a: 0, b: 0}
        assert out.exact_lost == {a}
        ia.stored([1, 2, 3], None, ids[:48], 16)
        assert scorer.figures(a) == {"kv_events": "live", "kv_blocks": 3, "kv_exact": True}
        assert scorer.figures("http://127.0.0.1:3")["kv_exact"] is False
        clock[0] += 60  # stale: back to the trie
        assert (await scorer.annotate(route, intake)).exact_prefix is None
        assert scorer.figures(a)["kv_exact"] is False
    finally:
        await feeds.stop()
