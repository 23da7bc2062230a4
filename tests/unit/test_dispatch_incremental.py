"""The dispatcher's incremental state decides exactly as rescanning everything would.

``Reference`` is the dispatcher as it was before it kept state between pumps (commit
8061ca5): every pump rescans every replica for every queued request and asks the policy
again. Random event sequences (offers, retries, probes, first bytes, completions with
faults, cache records, health, membership, settings, the clock) drive it and the real
dispatcher side by side, with identically seeded policies; at every step both must have
the same candidates for every queued request, dispatch the same requests to the same
replicas, and leave the policy's RNG in the same state (a skipped evaluation that had
drawn would shift every later draw).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.breaker import BreakerState
from skymesh.balancer.dispatch import Dispatcher, Target, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode, is_available, takes_preferred


class Reference(Dispatcher):
    """Candidates and picks recomputed from scratch (the pre-incremental code)."""

    def candidates(self, ticket: Ticket, now: float) -> list[str]:
        model = ticket.route.model
        mode, cap, room = self.mode, self.max_outstanding, self.kv_headroom
        tokens, n = ticket.route.prompt_len, self.balancers_per_region
        routable = [(tid, t) for tid, t in self.targets.items()
                    if model in t.models and t.healthy and tid not in ticket.excluded]
        out = [tid for tid, t in routable
               if is_available(t.load, mode, cap, room, tokens, n) and t.breaker.allows(now)]
        if mode is PushMode.SP_P and ticket.route.prefix_keys and self._prefer_on(routable):
            usable = [tid for tid, t in routable if t.breaker.allows(now)]
            pref = self.policy.preferred(ticket.route, usable, self)
            if pref is not None and pref not in out:
                load = self.targets[pref].load
                if takes_preferred(load, self.prefer_queue_of(load), room, tokens):
                    out.append(pref)
        return out

    def _prefer_on(self, routable: list[tuple[str, Target]]) -> bool:
        return self._names_preferred and any(
            self.prefer_queue_of(t.load) > 0 for _, t in routable)

    def _pick(self, q: deque[Ticket], now: float) -> tuple[int, Ticket, str, bool] | None:
        depth = min(len(q), self.window) if self.hold_s > 0 else 1
        for i in range(depth):
            ticket = q[i]
            cands = self.candidates(ticket, now)
            if not cands:
                if self.hold_s > 0:
                    continue
                return None
            route = ticket.route_at(now)
            holds = self._prefers and (self.hold_queue_max is None
                                       or len(q) <= self.hold_queue_max)
            if holds and (ticket.held_since is None
                          or now - ticket.held_since < self.hold_s):
                serving = [tid for tid, t in self.targets.items()
                           if route.model in t.models and t.healthy]
                pref = self.policy.preferred(route, serving, self)
                # Never for a replica it failed on or whose breaker lets nothing through.
                b = self.targets[pref].breaker if pref is not None else None
                if pref is not None and pref not in cands \
                        and pref not in ticket.excluded and b is not None \
                        and (b.state is BreakerState.CLOSED or not (
                            b.shut(now) or (b.state is BreakerState.HALF_OPEN
                                            and b.trial_in_flight))):
                    if ticket.held_since is None:
                        ticket.held_since = now
                    continue
            target = self.policy.select(route, cands, self)
            if target is not None:
                return i, ticket, target, False
        return None


POLICIES = [("prefix-tree", PushMode.SP_P), ("least-load", PushMode.SP_P),
            ("round-robin", PushMode.BP), ("consistent-hash", PushMode.SP_P),
            ("prefix-tree", PushMode.SP_O)]
TARGETS = ("a", "b", "c", "d")
MODELS = ("m1", "m2")
# Three shared "system prompts" and their continuations: chained keys.
FAMILIES = [[f * 1000 + k for k in range(1, 9)] for f in range(1, 4)]

offer = st.tuples(st.just("offer"), st.integers(0, 1), st.integers(0, 2), st.integers(1, 8),
                  st.integers(1, 3000), st.integers(0, 3))
first = st.tuples(st.just("first"), st.integers(0, 50))
done = st.tuples(st.just("done"), st.integers(0, 50),
                 st.sampled_from(["ok", "ok", "ok", "fault", "neutral"]))
# Retries, probes, cache reports, health and membership: in every sequence below.
state_changes = [
    st.tuples(st.just("retry"), st.integers(0, 50)),
    st.tuples(st.just("probe"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 6),
              st.sampled_from([None, 8000, 100_000]), st.sampled_from([None, 2, 4]),
              st.sampled_from([None, 0, 2])),
    st.tuples(st.just("cached"), st.integers(0, 50), st.integers(0, 4)),
    st.tuples(st.just("health"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("members"), st.integers(1, 15)),
]
# Offers, first bytes and completions weigh more: they make the queues the memos are for.
event = st.one_of(
    offer, offer, offer, first, first, done, done, *state_changes,
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("setting"), st.sampled_from(["mode", "n", "hold", "prefer", "room"]),
              st.integers(0, 2)),
    st.tuples(st.just("clock"), st.sampled_from([0.01, 0.5, 3.0, 11.0])),
)


def _pair(policy: str, mode: PushMode, hold_s: float) -> list[Dispatcher]:
    out: list[Dispatcher] = []
    for cls in (Dispatcher, Reference):
        d = cls(build_policy(policy, rng=random.Random(7)), mode, hold_s=hold_s,
                prefer_queue=2, hold_queue_max=6, window=4, breaker_threshold=2,
                breaker_open_s=10.0, max_outstanding=2)
        d.set_targets({t: MODELS if t != "d" else ("m2",) for t in TARGETS})
        out.append(d)
    return out


def _apply(d: Dispatcher, ev: tuple[Any, ...], tickets: list[Ticket], now: float) -> None:
    kind = ev[0]
    sent = [t for t in tickets if t.target is not None]
    queued = [t for t in tickets if t.queued]
    if kind == "offer":
        _, m, fam, depth, tokens, exact = ev
        keys = tuple(FAMILIES[fam][:depth])
        # Half the offers carry the engines' exact match (KV events), taken at arrival.
        held = ({t: (fam + i * exact) % (depth + 1) for i, t in enumerate(TARGETS)}
                if exact >= 2 else None)
        t = Ticket(RouteRequest(f"r{len(tickets)}", model=MODELS[m], prompt_len=tokens,
                                prefix_keys=keys, exact_prefix=held,
                                exact_blocks=depth if held else 0), now)
        d.offer(t, now)
        tickets.append(t)
    elif kind == "retry" and sent:
        t = sent[ev[1] % len(sent)]
        failed = t.target or ""
        d.complete(t, now, ok=False, replica_fault=True)
        t.excluded = t.excluded | {failed}
        d.offer(t, now, front=True)
    elif kind == "probe":
        _, ti, waiting, running, cap, seqs, pq = ev
        d.on_probe(TARGETS[ti], now, waiting, running, 0.3, cap, max_num_seqs=seqs,
                   prefer_queue=pq)
    elif kind == "first" and sent:
        d.first_byte(sent[ev[1] % len(sent)])
    elif kind == "done" and sent:
        t = sent[ev[1] % len(sent)]
        d.complete(t, now, ok=ev[2] == "ok", replica_fault=ev[2] == "fault")
    elif kind == "cached" and tickets:
        t = tickets[ev[1] % len(tickets)]
        target = TARGETS[ev[2] % len(TARGETS)]
        keys = tuple(t.route.prefix_keys)
        if keys:  # prompt and output: one more key, chained on the prompt's
            d.cached(t.route, target, (*keys, keys[-1] * 10 + ev[2]))
    elif kind == "health":
        d.set_healthy(TARGETS[ev[1]], ev[2])
    elif kind == "members":
        keep = [t for i, t in enumerate(TARGETS) if ev[1] >> i & 1]
        d.set_targets({t: MODELS if t != "d" else ("m2",) for t in keep})
    elif kind == "cancel" and queued:
        d.cancel(queued[ev[1] % len(queued)])
    elif kind == "setting":
        _, what, v = ev
        if what == "mode":
            d.mode = (PushMode.SP_P, PushMode.SP_O, PushMode.BP)[v]
        elif what == "n":
            d.balancers_per_region = v + 1
        elif what == "hold":
            d.hold_s = (0.0, 2.0, 5.0)[v]
        elif what == "prefer":
            d.prefer_queue = v
        else:
            d.kv_headroom = (0.9, 0.5, 0.99)[v]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(POLICIES), st.sampled_from([0.0, 2.0]),
       st.lists(event, min_size=60, max_size=150))
def test_incremental_dispatcher_decides_as_a_full_rescan(
        policy: tuple[str, PushMode], hold_s: float, events: list[tuple[Any, ...]]) -> None:
    new, ref = _pair(policy[0], policy[1], hold_s)
    tickets: dict[int, list[Ticket]] = {id(new): [], id(ref): []}
    now = 0.0
    for ev in events:
        if ev[0] == "clock":
            now += ev[1]
            continue
        for d in (new, ref):
            if ev[0] != "pump":
                _apply(d, ev, tickets[id(d)], now)
        sent_new = [(t.route.request_id, t.target) for t in new.pump(now)]
        sent_ref = [(t.route.request_id, t.target) for t in ref.pump(now)]
        assert sent_new == sent_ref, ev
        assert new.policy.rng.getstate() == ref.policy.rng.getstate(), ev
        for tn, tr in zip(tickets[id(new)], tickets[id(ref)], strict=True):
            assert tn.queued == tr.queued and tn.held_since == tr.held_since
            if tn.queued:
                assert new.candidates(tn, now) == ref.candidates(tr, now), ev
        assert new.policy.rng.getstate() == ref.policy.rng.getstate(), ev


def test_a_pump_with_nothing_changed_asks_the_policy_nothing() -> None:
    """The point of the memos: a queue blocked on busy replicas costs no policy calls
    until something it depends on changes. Replica "a" could take a request holding its
    prefix there (one waiting, ``prefer_queue`` 2), so each request needs a look."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   prefer_queue=2)
    d.set_targets({"a": ("m",), "b": ("m",)})
    for tid, waiting in (("a", 1), ("b", 2)):
        d.on_probe(tid, 0.0, waiting=waiting, running=4, kv_usage=0.5,
                   kv_capacity_tokens=10_000, max_num_seqs=4)
    for i in range(5):
        d.offer(Ticket(RouteRequest(f"r{i}", model="m", prompt_len=10,
                                    prefix_keys=(1, 2, 3 + i)), 0.0), 0.0)
    calls = 0
    real = d.policy.preferred

    def counting(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    d.policy.preferred = counting  # type: ignore[method-assign]
    assert d.pump(0.1) == []
    first = calls
    assert first > 0
    assert d.pump(0.2) == [] and d.pump(0.3) == []
    assert calls == first
    # A probe showing a replica free: every request is looked at again, one goes.
    d.on_probe("a", 0.4, waiting=0, running=0, kv_usage=0.0, max_num_seqs=4)
    assert len(d.pump(0.4)) >= 1
    assert calls > first


class CountingDeque(deque):  # type: ignore[type-arg]
    reads = 0

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return super().__getitem__(i)


def test_an_arrival_behind_the_window_leaves_a_quiet_queue_quiet() -> None:
    """A blocked queue longer than the window: the pump at each arrival behind it reads
    the head only (the quiet record stands), while one inside the window is looked at."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   prefer_queue=2, window=4)
    d.set_targets({"a": ("m",), "b": ("m",)})
    for tid, waiting in (("a", 1), ("b", 2)):  # "a" may take a request for its prefix
        d.on_probe(tid, 0.0, waiting=waiting, running=4, kv_usage=0.5,
                   kv_capacity_tokens=10_000, max_num_seqs=4)

    def ticket(i: int) -> Ticket:
        return Ticket(RouteRequest(f"r{i}", model="m", prompt_len=10,
                                   prefix_keys=(1, 2, 3 + i)), 0.0)

    q = d.queues["m"] = CountingDeque()
    for i in range(4):
        d.offer(ticket(i), 0.0)
    assert d.pump(0.1) == []
    for i in range(4, 8):
        q.reads = 0
        d.offer(ticket(i), 0.0)
        assert d.pump(0.1 + i / 100) == []
        assert q.reads <= 2  # q[0]: the model and its view, nothing behind it
    d.offer(ticket(99), 0.2, front=True)  # a retry at the head: looked at
    q.reads = 0
    assert d.pump(0.3) == []
    assert q.reads > 2


def test_a_request_held_for_its_replica_goes_there_once_it_frees() -> None:
    """A hold is remembered without watching the other replicas, but its preferred
    replica's load is watched: when that replica frees, the request goes to it."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   hold_s=2.0)
    d.set_targets({"a": ("m",), "b": ("m",)})
    keys = (11, 12, 13, 14)
    first = Ticket(RouteRequest("r0", model="m", prompt_len=10, prefix_keys=keys), 0.0)
    d.offer(first, 0.0)
    assert [t.target for t in d.pump(0.0)] in (["a"], ["b"])
    home = first.target
    held = Ticket(RouteRequest("r1", model="m", prompt_len=10, prefix_keys=keys), 0.0)
    d.offer(held, 0.1)
    assert d.pump(0.1) == [] and held.held_since == 0.1  # its replica is busy: held
    assert d.pump(0.2) == []
    d.first_byte(first)  # started: its replica may take another
    assert [t.target for t in d.pump(0.3)] == [home]


def test_an_insert_straight_into_the_trie_ends_a_hold_it_changes() -> None:
    """A sibling worker's decision reaches the policy's trie directly (not through the
    dispatcher's own dispatches): a request held for the only replica holding its prefix
    goes to the other once that one holds it too and is free, as a full rescan would."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   hold_s=2.0)
    d.set_targets({"a": ("m",), "b": ("m",)})
    keys = (11, 12, 13, 14)
    first = Ticket(RouteRequest("r0", model="m", prompt_len=10, prefix_keys=keys), 0.0)
    d.offer(first, 0.0)
    assert [t.target for t in d.pump(0.0)] in (["a"], ["b"])
    away = "b" if first.target == "a" else "a"
    held = Ticket(RouteRequest("r1", model="m", prompt_len=10, prefix_keys=keys), 0.0)
    d.offer(held, 0.1)
    assert d.pump(0.1) == [] and held.held_since == 0.1
    d.policy.trie.insert(list(keys), away)  # type: ignore[attr-defined]
    assert [t.target for t in d.pump(0.2)] == [away]


def test_a_request_whose_prompt_did_not_fit_goes_once_the_replica_admits_the_last() -> None:
    """A request without a candidate is remembered, and a replica where it may go if its
    prompt fits is rechecked when its load changes (not only when its availability
    rises): the first byte of the request ahead admits it, and this one fits now."""
    d = Dispatcher(build_policy("least-load", rng=random.Random(1)), PushMode.SP_P,
                   hold_s=0.0)
    d.set_targets({"a": ("m",)})
    d.on_probe("a", 0.0, waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=100_000)
    ahead = Ticket(RouteRequest("r0", model="m", prompt_len=1500), 0.0)
    d.offer(ahead, 0.0)
    assert [t.target for t in d.pump(0.0)] == ["a"]
    big = Ticket(RouteRequest("r1", model="m", prompt_len=1000), 0.0)
    d.offer(big, 0.1)
    assert d.pump(0.1) == []  # 1,500 + 1,000 tokens exceed one scheduler step
    assert d.pump(0.2) == []
    d.first_byte(ahead)
    assert [t.target for t in d.pump(0.3)] == ["a"]


def test_a_request_held_on_its_exact_match_follows_the_holders_loads() -> None:
    """With the engines' exact match (KV events), the preferred replica is the least
    loaded of the holders: a held request must be looked at again when another holder
    frees, not only when the one it was held for does."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   hold_s=2.0)
    d.set_targets({"a": ("m",), "b": ("m",), "c": ("m",)})

    def ticket(rid: str, held: dict[str, int]) -> Ticket:
        return Ticket(RouteRequest(rid, model="m", prompt_len=10, prefix_keys=(1, 2, 3),
                                   exact_prefix=held, exact_blocks=3), 0.0)

    on_a, on_b = ticket("r0", {"a": 3, "b": 0, "c": 0}), ticket("r1", {"a": 0, "b": 3, "c": 0})
    for t in (on_a, on_b):
        d.offer(t, 0.0)
    assert sorted(t.target or "" for t in d.pump(0.0)) == ["a", "b"]
    held = ticket("r2", {"a": 3, "b": 3, "c": 0})
    d.offer(held, 0.1)
    assert d.pump(0.1) == [] and held.held_since == 0.1  # both holders busy, c is free
    assert d.pump(0.2) == []
    d.complete(on_b, 0.3, ok=True)  # b is now the less loaded holder, and free
    assert [t.target for t in d.pump(0.3)] == ["b"]


# Faults, health and membership weigh more here: they end the parts of the state kept per
# generation (a model's serving replicas and whether every breaker is closed, which lets
# candidates skip asking each breaker) and bring the breakers' clock-driven half-open in.
churn = st.one_of(
    offer, offer, first, done,
    st.tuples(st.just("done"), st.integers(0, 50), st.just("fault")), *state_changes,
    st.tuples(st.just("clock"), st.sampled_from([0.5, 11.0])),
)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([("prefix-tree", PushMode.SP_P), ("least-load", PushMode.SP_P)]),
       st.lists(churn, min_size=60, max_size=150))
def test_breakers_health_and_membership_change_candidates_as_a_full_rescan(
        policy: tuple[str, PushMode], events: list[tuple[Any, ...]]) -> None:
    test_incremental_dispatcher_decides_as_a_full_rescan.hypothesis.inner_test(  # type: ignore[attr-defined]
        policy, 2.0, events)
