"""The dispatcher's answer to "may the replica holding the prefix take this request"
(``DispatchView._takes``), read from the takers ``_refresh`` keeps, equals
``takes_preferred`` asked afresh, for any load and any prompt."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode, takes_preferred

TARGETS = ("a", "b", "c")

probe = st.tuples(st.just("probe"), st.integers(0, 2), st.integers(0, 3), st.integers(0, 6),
                  st.sampled_from([0.0, 0.3, 0.85]), st.sampled_from([None, 4000, 100_000]),
                  st.sampled_from([None, 2, 4]), st.sampled_from([None, 0, 1, 3]))
push = st.tuples(st.just("push"), st.integers(0, 2), st.integers(1, 3000))
first = st.tuples(st.just("first"), st.integers(0, 30))
done = st.tuples(st.just("done"), st.integers(0, 30))
setting = st.tuples(st.just("setting"), st.sampled_from(["prefer", "room"]),
                    st.integers(0, 2))
event = st.one_of(probe, push, push, first, done, setting)


def _apply(d: Dispatcher, ev: tuple[Any, ...], sent: list[Ticket], now: float) -> None:
    kind = ev[0]
    if kind == "probe":
        _, ti, waiting, running, usage, cap, seqs, pq = ev
        d.on_probe(TARGETS[ti], now, waiting, running, usage, cap, max_num_seqs=seqs,
                   prefer_queue=pq)
    elif kind == "push":  # a dispatch as _assign records it, whatever sp-p says
        t = Ticket(RouteRequest(f"r{len(sent)}", model="m", prompt_len=ev[2]), now)
        t.target = TARGETS[ev[1]]
        d.targets[t.target].load.on_dispatch(t.key, now, ev[2])
        sent.append(t)
    elif kind == "first" and sent:
        d.first_byte(sent[ev[1] % len(sent)])
    elif kind == "done" and sent:
        t = sent.pop(ev[1] % len(sent))
        d.complete(t, now, ok=True)
    elif kind == "setting":
        if ev[1] == "prefer":
            d.prefer_queue = ev[2] * 2
        else:
            d.kv_headroom = (0.9, 0.5, 0.99)[ev[2]]


@settings(max_examples=300, deadline=None)
@given(st.lists(event, min_size=1, max_size=40),
       st.lists(st.integers(1, 4000), min_size=1, max_size=4))
def test_takes_from_the_kept_takers_equals_asking_afresh(
        events: list[tuple[Any, ...]], prompts: list[int]) -> None:
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(0)), PushMode.SP_P,
                   prefer_queue=2)
    d.set_targets({t: ("m",) for t in TARGETS})
    sent: list[Ticket] = []
    for i, ev in enumerate(events):
        _apply(d, ev, sent, now=i * 0.01)
        d._refresh()  # as every pump does before it asks
        for tid in TARGETS:
            load = d.targets[tid].load
            for tokens in prompts:
                want = takes_preferred(load, d.prefer_queue_of(load), d.kv_headroom, tokens)
                assert d._takes(tid, tokens) == want, (ev, tid, tokens)


def test_a_prompt_too_large_for_the_kv_room_is_not_taken_by_a_taker() -> None:
    """A replica that takes a request holding its prefix when the prompt is small (so
    ``_refresh`` counts it among the takers) still refuses one whose prompt would pass
    its KV headroom: the kept answer is for a prompt of no tokens."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(0)), PushMode.SP_P,
                   prefer_queue=3)
    d.set_targets({"a": ("m",)})
    d.on_probe("a", 0.0, 0, 1, 0.5, 10_000)
    d.targets["a"].load.on_dispatch("x", 1.0, 100)  # unadmitted: sp-p finds it busy
    d._refresh()
    assert "a" in d._takers
    assert d._takes("a", 100)
    assert not d._takes("a", 4_000)  # 0.5 x 10,000 + 100 + 4,000 > 0.9 x 10,000
