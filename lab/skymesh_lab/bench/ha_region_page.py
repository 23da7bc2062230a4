"""The results page of ``skymesh_lab.bench.ha_region``: its burst and kill tables.

Kept apart from the measurement so the results registry (``results_pages``) imports no
daemon machinery to render a page.
"""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.faults.client import COMPLETED, FAILED, LOST, REFUSED

US_LBS = ("lb-us-a", "lb-us-b")
EU_LB = "lb-eu"
CUT = "cut"  # a connection error from the killed balancer for a request it had accepted
ARM_ORDER = {("sp-p", 1, 1): 0, ("sp-p", 2, 1): 1, ("sp-p", 2, 2): 2}


def _arm(r: dict[str, Any]) -> tuple[str, int, int]:
    # Rows written before the margin existed ran with the default, 1.
    return r["mode"], r["balancers"], r.get("balancers_per_region", 1)


def burst_table(doc: dict[str, Any]) -> str:
    out = ["| pushing | balancers | `balancers_per_region` | runs | replica waiting, mean "
           "| replica waiting, max | balancer queue, max | completed / streams "
           "| burst wall, mean s (range) |",
           "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in doc["burst"]:
        groups.setdefault(_arm(r), []).append(r)
    for arm, rs in sorted(groups.items(), key=lambda kv: (ARM_ORDER.get(kv[0], 9), kv[0])):
        mode, n, margin = arm
        walls = [r["wall_s"] for r in rs]
        mean = statistics.fmean(r["replica_waiting_mean"] for r in rs)
        out.append(f"| {mode} | {n} | {margin} | {len(rs)} | {mean:.2f} "
                   f"| {max(r['replica_waiting_max'] for r in rs)} "
                   f"| {max(r['balancer_queue_max'] for r in rs)} "
                   f"| {sum(r['completed'] for r in rs)} / {sum(r['streams'] for r in rs)} "
                   f"| {statistics.fmean(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) |")
    missed = sum(r.get("samples_missed", 0) for r in doc["burst"])
    if missed:
        out += ["", "Snapshots skipped because a gauge read timed out on the loaded "
                f"machine: {missed}."]
    return "\n".join(out)


def kill_rows(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The kill experiment's table rows (what, figure)."""
    k = doc["kill"]
    us, eu = k["us"], k["eu"]
    first = us["first_attempts"]
    victim, survivor = US_LBS

    def count(key: str) -> int:
        return int(first.get(key, 0))

    lost = sum(v for key, v in first.items() if key.endswith(f" {LOST}"))
    eu_failed = eu["first_attempts"].get(f"{EU_LB} {FAILED}", 0)
    view = k["eu_view"][victim]
    rows = [
        ("us: completed on " + victim + " (before the kill)", count(f"{victim} {COMPLETED}")),
        ("us: completed on " + survivor, count(f"{survivor} {COMPLETED}")),
        (f"us: cut on {victim} by the kill (it had {us['in_flight_at_kill']} in flight)",
         count(f"{victim} {CUT}")),
        (f"us: refused by {victim} after the kill (no process saw them)",
         count(f"{victim} {REFUSED}")),
        ("us: error answers", count(f"{victim} {FAILED}") + count(f"{survivor} {FAILED}")),
        ("us: lost", lost),
        ("us: retries on the other address, completed / sent",
         f"{us['retries'].get(COMPLETED, 0)} / {sum(us['retries'].values())}"),
        ("eu: completed", eu["first_attempts"].get(f"{EU_LB} {COMPLETED}", 0)),
        ("eu: SSE error event (a forward in flight on the killed balancer)", eu_failed),
        ("eu: retries, completed / sent",
         f"{eu['retries'].get(COMPLETED, 0)} / {sum(eu['retries'].values())}"),
        ("controller: balancer states", ", ".join(
            f"{b} {s}" for b, s in sorted(k["controller_balancers"].items()))),
        (f"controller: {victim}'s replicas assigned to", ", ".join(k["replicas_assigned_to"])),
        (f"{EU_LB}'s mesh view of {victim}",
         f"{view['liveness']}, {'' if view['forwardable'] else 'not '}forwardable"),
        (f"{EU_LB}'s peers in its controller membership", ", ".join(k["eu_membership_peers"])),
    ]
    return rows


def kill_table(doc: dict[str, Any]) -> str:
    out = [f"| kill (SIGKILL of {US_LBS[0]}) | |", "|---|---|"]
    out += [f"| {what} | {v} |" for what, v in kill_rows(doc)]
    return "\n".join(out)


def setup_line(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    line = (f"{s['us_replicas']} replicas of `max_num_seqs` {s['max_num_seqs']} (time scale "
            f"{s['time_scale']}, metrics lag: {s['metrics_lag']}); bursts of {s['streams']} "
            f"streams, {s['repeats']} repeats of every arm.")
    if "load_average_1m_at_start" in s:
        line += (f" Load average at the start: {s['load_average_1m_at_start']} on "
                 f"{s['cpus']} CPUs.")
    return line


def ha_region(doc: dict[str, Any]) -> str:
    return "\n".join([
        setup_line(doc), "", "## Burst: where the queue forms", "",
        "Replica waiting: the replicas' own count (`/get_load`, live), sampled through the "
        "burst; means over every sample, maxima over every run. Balancer queue: the "
        "balancers' queued requests together.", "",
        burst_table(doc), "", "## One balancer SIGKILLed under load", "",
        kill_table(doc)]) + "\n"
