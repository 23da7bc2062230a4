"""sp-p's slot count: our own completions free a slot at once, before a probe shows them.

A fake clock throughout: times are plain floats handed to the bookkeeping. Every case runs
on one replica with ``max_num_seqs`` 4 and vLLM's metrics lag of 1 s, so a probe published
at ``p`` shows the engine as it was at ``p - 1``.
"""

from __future__ import annotations

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode, ReplicaLoad, is_available

LAG = 1.0


def full_replica() -> ReplicaLoad:
    """Four of ours dispatched at 0.0-0.3, started, and shown running by a probe at 2.0
    (horizon 1.0)."""
    ld = ReplicaLoad("r", max_num_seqs=4, metrics_lag_s=LAG, kv_capacity_tokens=1 << 20)
    ld.on_probe(0.0, waiting=0, running=0, kv_usage=0.0)
    for i in range(4):
        ld.on_dispatch(f"q{i}", 0.1 * i, tokens=10)
        ld.on_first_byte(f"q{i}")
    ld.on_probe(2.0, waiting=0, running=4, kv_usage=0.1)
    assert ld.slots_taken == 4 and not is_available(ld, PushMode.SP_P)
    return ld


def test_a_completion_between_probes_frees_its_slot_at_once() -> None:
    ld = full_replica()
    ld.on_complete("q0", 2.05)  # the probe of 2.0 still shows it running
    assert ld.slots_taken == 3 and is_available(ld, PushMode.SP_P)
    # The routing figure is unchanged: policies compare the probe's view as before.
    assert ld.outstanding == 4


def test_no_double_count_once_a_probe_reflects_the_completion() -> None:
    ld = full_replica()
    ld.on_complete("q0", 2.05)
    # Published within the lag of the completion: its gauges still show q0 running.
    ld.on_probe(2.5, waiting=0, running=4, kv_usage=0.1)
    assert ld.slots_taken == 3
    # Horizon 2.1 is past the completion: the gauges show it gone, we stop taking it off.
    ld.on_probe(3.1, waiting=0, running=3, kv_usage=0.1)
    assert ld.slots_taken == 3
    ld.on_probe(3.3, waiting=0, running=3, kv_usage=0.1)
    assert ld.slots_taken == 3 and is_available(ld, PushMode.SP_P)


def test_two_requests_finishing_together_free_two_slots_and_no_more() -> None:
    ld = full_replica()
    ld.on_complete("q0", 2.2)
    ld.on_complete("q1", 2.2)
    assert ld.slots_taken == 2
    ld.on_dispatch("n0", 2.2, tokens=10)
    ld.on_first_byte("n0")
    assert is_available(ld, PushMode.SP_P)
    ld.on_dispatch("n1", 2.21, tokens=10)
    ld.on_first_byte("n1")  # started: still on the replica, though no probe shows it
    assert ld.slots_taken == 4 and not is_available(ld, PushMode.SP_P)
    # A probe within the lag shows neither the two completions nor the two new ones.
    ld.on_probe(2.6, waiting=0, running=4, kv_usage=0.1)
    assert ld.slots_taken == 4 and not is_available(ld, PushMode.SP_P)
    # One past it shows the swap; counted once either way.
    ld.on_probe(3.5, waiting=0, running=4, kv_usage=0.1)
    assert (ld.slots_taken, ld.in_flight) == (4, 4)


def test_an_old_probe_neither_hides_nor_repeats_a_completion() -> None:
    ld = full_replica()
    ld.on_probe(2.0, waiting=0, running=4, kv_usage=0.1)
    # No probe for far longer than the lag (a slow /metrics): a completion frees at once.
    ld.on_complete("q3", 9.0)
    assert ld.probe_age(9.0) > LAG and ld.slots_taken == 3
    # A late answer published before the last probe cannot move the horizon back.
    ld.on_probe(1.5, waiting=0, running=4, kv_usage=0.1)
    assert ld.slots_taken == 3
    ld.on_probe(10.5, waiting=0, running=3, kv_usage=0.1)
    assert ld.slots_taken == 3


def test_only_completions_the_probe_shows_are_taken_off() -> None:
    ld = full_replica()
    # Pushed after the probe's horizon: not in its gauges, so its end frees nothing extra.
    ld.on_dispatch("late", 2.1, tokens=10)
    ld.on_first_byte("late")
    assert ld.slots_taken == 5  # over the limit by what we pushed
    ld.on_complete("late", 2.3)
    assert ld.slots_taken == 4
    # Refused before its first byte (connect error, 5xx): it may never have been inside
    # the engine, so its slot waits for a probe.
    ld.on_complete("q0", 2.4)
    ld.on_complete("q1", 2.4)
    assert ld.slots_taken == 2
    ld2 = ReplicaLoad("r", max_num_seqs=4, metrics_lag_s=LAG)
    ld2.on_dispatch("x", 0.0)
    ld2.on_probe(2.0, waiting=1, running=3, kv_usage=0.0)
    ld2.on_complete("x", 2.1)
    assert ld2.slots_taken == 4
    # Without a completion time the slot also waits for the probe (the old behaviour).
    ld.on_complete("q2")
    assert ld.slots_taken == 2


def test_the_dispatcher_refills_a_slot_when_our_request_completes() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_P, hold_s=0)
    d.set_targets({"a": ["m"]})
    d.on_probe("a", 0.0, 0, 0, 0.0, 1 << 20, max_num_seqs=4, metrics_lag_s=LAG)
    tickets = [Ticket(RouteRequest(f"r{i}", model="m"), 0.0) for i in range(6)]
    for t in tickets:
        d.offer(t, 0.0)
    sent = d.pump(0.1)
    assert len(sent) == 4 and d.queue_length() == 2
    for t in sent:
        d.first_byte(t)
    d.on_probe("a", 2.0, 0, 4, 0.1, 1 << 20, max_num_seqs=4, metrics_lag_s=LAG)
    assert d.pump(2.0) == []
    d.complete(sent[0], 2.1, ok=True)
    refill = d.pump(2.1)
    assert [t.key for t in refill] == [tickets[4].key]  # at once, no probe in between
    assert d.pump(2.2) == []  # and only one: the other three still run


def test_a_stale_waiting_count_holds_back_only_until_our_completions_cover_it() -> None:
    """The probe at 2.0 shows one request of someone else's waiting behind our four."""
    ld = ReplicaLoad("r", max_num_seqs=4, metrics_lag_s=LAG, kv_capacity_tokens=1 << 20)
    ld.on_probe(0.0, waiting=0, running=0, kv_usage=0.0)
    for i in range(4):
        ld.on_dispatch(f"q{i}", 0.1 * i, tokens=10)
        ld.on_first_byte(f"q{i}")
    ld.on_probe(2.0, waiting=1, running=4, kv_usage=0.1)
    assert not is_available(ld, PushMode.SP_P)
    ld.on_complete("q0", 2.1)  # its slot goes to the one waiting
    assert ld.freed_since_probe == 1 and not is_available(ld, PushMode.SP_P)
    ld.on_complete("q1", 2.2)  # this one is free now, not at the next probe
    assert ld.slots_taken == 3 and is_available(ld, PushMode.SP_P)
    # Without a known admission limit, a waiting count always holds pushes back.
    ld.max_num_seqs = None
    assert not is_available(ld, PushMode.SP_P)
