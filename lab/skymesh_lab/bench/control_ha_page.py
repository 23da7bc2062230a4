"""The results page of ``skymesh_lab.bench.control_ha``: leader takeover after SIGKILL and
SIGSTOP, and acknowledged writes across a Redis primary's death under Sentinel.

Kept apart from the measurement so the results registry imports no daemon machinery.
"""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table


def _takeover(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[float, float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["ttl_s"], r["renew_s"], r["signal"]), []).append(r)
    out = []
    for (ttl, renew, sig), rs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][2])):
        took = [r["takeover_s"] for r in rs]
        woke = [r for r in rs if "probe_rounds_after_wake" in r]
        acted = ("-" if not woke else
                 f"{sum(r['probe_rounds_after_wake'] for r in woke):.0f} probe rounds, "
                 f"leader gauge {max(r['leader_after_wake'] for r in woke):.0f}")
        out.append([{"kill": "SIGKILL", "stop": "SIGSTOP"}[sig], num(ttl, ".1f", suffix=" s"),
                    num(renew, ".1f", suffix=" s"), str(len(rs)),
                    num(statistics.fmean(took), ".2f", suffix=" s"),
                    f"{min(took):.2f}-{max(took):.2f} s",
                    num(ttl + renew, ".1f", suffix=" s"), acted])
    return table(["leader", "lease TTL", "renew every", "runs", "takeover, mean", "range",
                  "design bound (TTL + renew)", "woken leader acted (after it woke)"], out,
                 [False, True, True, True, True, True, True, False])


def _failover(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in sorted(rows, key=lambda r: r["wait_replicas"]):
        errs = ", ".join(f"{n} x {k}" for k, n in sorted(r["errors"].items())) or "none"
        out.append([str(r["wait_replicas"]), str(r["acked"]), str(r["lost"]),
                    num(r["unavailable_s"], ".2f", suffix=" s"), errs])
    return table(["`ha.wait_replicas`", "acknowledged writes", "acknowledged, then lost",
                  "unavailable (kill to next ack)", "answers while unavailable"], out,
                 [True, True, True, True, False])


def _mid_move(sec: dict[str, Any]) -> str:
    out = []
    for r in sorted(sec["runs"], key=lambda r: -r["ttl_s"]):
        client = r["client"]
        applied = r["rounds"].get("applied", 0)
        out.append([num(r["ttl_s"], ".1f", suffix=" s"), num(r["renew_s"], ".1f", suffix=" s"),
                    num(r["takeover_s"], ".2f", suffix=" s"),
                    num(r["settled_s"], ".2f", suffix=" s"),
                    f"{r['round_status']}, {r['round_actions']} actions, settled "
                    f"{r['settled_times']}x", str(applied),
                    f"{r['replica']['region']}, {r['replica']['state']}",
                    f"{r['r1_served_before_drain']:.0f} / {r['r1_served_after_undrain']:.0f}",
                    str(client["completed"]), str(r["failed_requests"])])
    return table(["lease TTL", "renew every", "takeover", "round settled after",
                  "the killed leader's round", "rounds applied in all",
                  "moved replica at the end", "its requests before drain / after undrain",
                  "client requests completed", "client requests failed"], out,
                 [True, True, True, True, False, True, False, True, True, True])


def _mid_move_section(sec: dict[str, Any] | None) -> list[str]:
    if not sec:
        return []
    return [
        "## The leader killed mid-round and mid-move", "",
        "Two controllers (planner `auto`, `local` actuator) on one `redis-server`, a "
        "`skymesh-lb` per region (`listen.workers: 1`, following membership from the "
        "standby) and emulated replicas. A round applied by the leader started r1 in us; "
        "r2 is registered in us by hand; a client sends requests back to back through "
        "lb-us all along. Half the demand moves to eu and the leader applies a round that "
        "moves r1 there: once the store shows the round `applying` with the move "
        "`draining`, the leader is SIGKILLed (`drain_poll_s` is longer than the run, so "
        "the move cannot have finished). Takeover: from the signal until the standby's "
        "`skymesh_controller_leader` is 1; settled: until the round's record left "
        "`applying`. \"Settled 1x\" counts the new leader's log lines for the round.", "",
        _mid_move(sec), "",
        f"Measured {sec['date']} on {sec['cpus']} CPUs shared with other jobs (load "
        f"average {sec['load_average_1m_at_start']:.2f} at start), "
        f"{sec['wall_seconds']:.0f} s of wall time; `--scenarios mid-move`. Runs that "
        f"failed before the kill (a process not started in time): "
        f"{sec.get('setup_failures', 0)}.", ""]


def _mid_round_section(sec: dict[str, Any] | None) -> list[str]:
    if not sec:
        return []
    out = []
    for r in sorted(sec["runs"], key=lambda r: -r["ttl_s"]):
        out.append([num(r["ttl_s"], ".1f", suffix=" s"), num(r["renew_s"], ".1f", suffix=" s"),
                    num(r["takeover_s"], ".2f", suffix=" s"),
                    num(r["settled_s"], ".2f", suffix=" s"),
                    f"{r['round_status']}, {r['round_actions']} actions, settled "
                    f"{r['settled_times']}x", r["next_round_status"],
                    str(r["replicas_started"]), str(len(r["replicas_registered"]))])
    return [
        "## The leader killed while its actuator starts a replica", "",
        "The same two controllers; demand in us, nothing running. The run takes the "
        "store's writer lock (`skymesh:writer`), asks the leader to apply a round, and "
        "once the round is `applying` and the leader's `local` actuator has started a "
        "replica (whose registration waits for the lock), SIGKILLs the leader and lets "
        "the lock go. The new leader settles the round, then applies a round of its own "
        "(the plan: one replica in us). Started: replica processes the two actuators "
        "started; registered: replicas in the store at the end (the killed leader's "
        "half-started one was never registered; the run stops it).", "",
        table(["lease TTL", "renew every", "takeover", "round settled after",
               "the killed leader's round", "the new leader's round",
               "replicas started", "registered"], out,
              [True, True, True, True, False, False, True, True]), "",
        f"Measured {sec['date']} on {sec['cpus']} CPUs shared with other jobs (load "
        f"average {sec['load_average_1m_at_start']:.2f} at start), "
        f"{sec['wall_seconds']:.0f} s of wall time; `--scenarios mid-round`. Runs that "
        f"failed before the kill: {sec.get('setup_failures', 0)}.", ""]


def control_ha(doc: dict[str, Any]) -> str:
    return "\n".join([
        "## Leader takeover", "",
        "Two controllers on one `redis-server`; the leader is signalled, the standby's "
        "`/metrics` polled every 20 ms until `skymesh_controller_leader` is 1. A SIGSTOPped "
        "leader is woken (SIGCONT) once the standby leads; its probe rounds are counted "
        "over ten probe intervals after it woke.", "",
        _takeover(doc["takeover"]), "",
        "## The Redis primary killed under admin writes", "",
        "One controller on `redis+sentinel://` (a primary and two replicas with "
        "`appendonly yes`, `appendfsync always`, `min-replicas-to-write 1`; three "
        "sentinels, quorum 2, `down-after-milliseconds 500`). One client posts regions "
        "one at a time; the primary is SIGKILLed mid-stream; every acknowledged region is "
        "read back after the failover.", "",
        _failover(doc["redis_failover"]), "", *_mid_move_section(doc.get("mid_move")),
        *_mid_round_section(doc.get("mid_round"))])
