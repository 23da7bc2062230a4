"""sp-p's queue for the replica holding the prefix (``takes_preferred``, the dispatcher's
``prefer_queue``) and the queue length above which nothing is held (``hold_queue_max``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.config import ConfigError, parse_config
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies.base import LoadView, Policy, RouteRequest
from skymesh.policies.load import PushMode, ReplicaLoad, is_available, takes_preferred

CAP = 10_000


def _load(waiting: int = 0, running: int = 0, kv: float = 0.0, seqs: int | None = None,
          engine_queue: int = 0) -> ReplicaLoad:
    load = ReplicaLoad("r", max_num_seqs=seqs, engine_queue=engine_queue)
    load.on_probe(0.0, waiting, running, kv, kv_capacity_tokens=CAP)
    return load


@pytest.mark.parametrize(("load", "allowance", "tokens", "expected"), [
    (_load(), 0, 10, False),  # allowance 0: strict sp-p, never
    (_load(waiting=3), 4, 10, True),  # 3 pending < 4
    (_load(waiting=4), 4, 10, False),  # 4 pending: full
    (_load(waiting=1, kv=0.89), 4, 200, False),  # past the KV headroom (0.9)
    (_load(waiting=1, kv=0.5), 4, 200, True),
    (_load(running=6, seqs=4), 4, 10, True),  # 6 < 4 + max(0, 4)
    (_load(running=8, seqs=4), 4, 10, False),  # 8 = 4 + 4
    (_load(running=8, seqs=4, engine_queue=6), 4, 10, True),  # engine_queue is larger
])
def test_the_preferred_replica_takes_a_request_while_its_queue_has_room(
        load: ReplicaLoad, allowance: int, tokens: int, expected: bool) -> None:
    assert takes_preferred(load, allowance, request_tokens=tokens) is expected


def test_ours_pushed_since_the_probe_count_and_completions_free_their_share() -> None:
    load = _load(waiting=1, running=2)
    load.on_dispatch("a", 0.5)
    load.on_dispatch("b", 0.5)
    assert load.pending == 3 and not takes_preferred(load, 3)
    load.on_first_byte("a")  # admitted: no longer pending
    assert load.pending == 2 and takes_preferred(load, 3)


@settings(max_examples=200, deadline=None)
@given(seqs=st.one_of(st.none(), st.integers(1, 8)), engine_queue=st.integers(0, 3),
       allowance=st.integers(0, 8),
       events=st.lists(st.tuples(st.sampled_from(["push", "start", "done", "probe"]),
                                 st.integers(0, 20)), max_size=60))
def test_pushes_never_pass_the_limit_plus_the_allowance(
        seqs: int | None, engine_queue: int, allowance: int,
        events: list[tuple[str, int]]) -> None:
    """Whatever the order of probes, pushes, admissions and completions, a replica that
    only gets requests when sp-p or ``takes_preferred`` allows never holds more of ours
    than ``max_num_seqs + max(engine_queue, allowance)``, and never more than
    ``allowance`` pending beyond what strict sp-p let through."""
    load = ReplicaLoad("r", max_num_seqs=seqs, engine_queue=engine_queue)
    now, n = 0.0, 0
    started: list[str] = []
    unstarted: list[str] = []
    load.on_probe(now, 0, 0, 0.0, kv_capacity_tokens=CAP)
    for kind, k in events:
        now += 0.05
        if kind == "push":
            strict = is_available(load, PushMode.SP_P, request_tokens=10)
            extra = takes_preferred(load, allowance, request_tokens=10)
            if strict or extra:
                if not strict:
                    assert load.pending < allowance
                rid = f"q{n}"
                n += 1
                load.on_dispatch(rid, now, 10)
                unstarted.append(rid)
        elif kind == "start" and unstarted:
            rid = unstarted.pop(k % len(unstarted))
            load.on_first_byte(rid)
            started.append(rid)
        elif kind == "done" and started:
            load.on_complete(started.pop(k % len(started)), now)
        elif kind == "probe":
            # What the engine would report: ours are all it has; within its limit run.
            mine = len(started) + len(unstarted)
            run = mine if seqs is None else min(mine, seqs)
            load.on_probe(now, mine - run, run, 0.0, kv_capacity_tokens=CAP)
        if seqs is not None:
            assert load.in_flight <= seqs + max(engine_queue, allowance)


class _Prefer(Policy):
    """Prefers ``a`` for requests named ``cached-*``; picks the first candidate."""

    def select(self, request: RouteRequest, candidates: Sequence[str], view: LoadView
               ) -> str | None:
        return "a" if "a" in candidates else sorted(candidates)[0]

    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        return "a" if request.request_id.startswith("cached") and "a" in targets else None


def _dispatcher(**kw: object) -> Dispatcher:
    d = Dispatcher(_Prefer(), PushMode.SP_P, hold_s=2.0, **kw)  # type: ignore[arg-type]
    d.set_targets({"a": ["m"], "b": ["m"]})
    d.on_probe("a", 0.0, waiting=2, running=4, kv_usage=0.2, kv_capacity_tokens=CAP)
    d.on_probe("b", 0.0, waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=CAP)
    return d


def _cached(i: int) -> Ticket:
    return Ticket(RouteRequest(f"cached-{i}", model="m", prompt_len=10, prefix_keys=(1, 2)),
                  0.0)


def _offer_cached(d: Dispatcher, n: int) -> list[Ticket]:
    ts = [_cached(i) for i in range(n)]
    for t in ts:
        d.offer(t, 0.0)
    return ts


def test_without_a_prefer_queue_a_request_is_held_for_its_busy_replica() -> None:
    d = _dispatcher()
    t = _cached(0)
    d.offer(t, 0.0)
    assert d.pump(0.1) == []  # a shows 2 waiting: held, although b is free


def test_the_prefer_queue_sends_it_to_its_replica_up_to_the_allowance() -> None:
    d = _dispatcher(prefer_queue=4)
    ts = _offer_cached(d, 3)
    out = d.pump(0.1)
    # a had 2 pending: two more fit under 4; the third is held (b is free but not its own).
    assert [t.target for t in out] == ["a", "a"]
    assert d.load("a").pending == 4 and ts[2].queued


def test_a_replicas_own_queue_from_its_probe_overrides_the_dispatchers() -> None:
    d = _dispatcher()  # the dispatcher's own: 0, strict
    d.on_probe("a", 0.05, waiting=2, running=4, kv_usage=0.2, kv_capacity_tokens=CAP,
               prefer_queue=3)  # a's kind's default arrives with its probe
    ts = _offer_cached(d, 2)
    out = d.pump(0.1)
    assert [t.target for t in out] == ["a"] and ts[1].queued  # 2 pending + 1 = 3
    d.on_probe("a", 0.2, waiting=2, running=4, kv_usage=0.2, kv_capacity_tokens=CAP,
               prefer_queue=0)  # reconfigured to strict: held again
    assert d.pump(0.25) == [] and ts[1].queued


def test_a_long_queue_stops_holding_and_spills_to_free_replicas() -> None:
    d = _dispatcher(hold_queue_max=2)
    _offer_cached(d, 3)
    out = d.pump(0.1)
    # Three queued (> 2): nothing is held; b takes them while strict sp-p lets it.
    assert out and all(t.target == "b" for t in out)


def test_the_config_keys_default_by_kind_and_refuse_bad_values() -> None:
    replicas = [{"url": f"http://127.0.0.1:80{i}1", "kind": k}
                for i, k in enumerate(("vllm", "sglang", "skymesh"))]
    cfg = parse_config({"replicas": replicas})
    assert (cfg.pushing.prefer_queue, cfg.pushing.hold_queue_max) == (None, 48)
    assert [r.prefer_queue(cfg.pushing) for r in cfg.replicas] == [3, 8, 3]
    cfg = parse_config({"replicas": replicas,
                        "pushing": {"prefer_queue": 6, "hold_queue_max": 24}})
    assert (cfg.pushing.prefer_queue, cfg.pushing.hold_queue_max) == (6, 24)
    assert [r.prefer_queue(cfg.pushing) for r in cfg.replicas] == [6, 6, 6]
    strict = parse_config({"replicas": replicas,
                           "pushing": {"prefer_queue": 0, "hold_queue_max": None}})
    assert [r.prefer_queue(strict.pushing) for r in strict.replicas] == [0, 0, 0]
    assert strict.pushing.hold_queue_max is None
    with pytest.raises(ConfigError, match=r"pushing\.prefer_queue"):
        parse_config({"pushing": {"prefer_queue": -1}})


def test_a_reload_applies_both_keys_to_the_running_dispatcher() -> None:
    from types import SimpleNamespace

    from skymesh.balancer.reload import _set_pushing

    d = _dispatcher()
    pushing = parse_config({"pushing": {"prefer_queue": 3, "hold_queue_max": 5}}).pushing
    _set_pushing(SimpleNamespace(dispatcher=d, workers=1), pushing)  # type: ignore[arg-type]
    assert (d.prefer_queue, d.hold_queue_max) == (3, 5)
    # By kind: the dispatcher's own is off, each replica's comes with its probe.
    _set_pushing(SimpleNamespace(dispatcher=d, workers=1), parse_config({}).pushing)  # type: ignore[arg-type]
    assert (d.prefer_queue, d.hold_queue_max) == (0, 48)
