"""The control plane with a standby, on real processes over loopback.

Lab code, not product: it measures what an operator gets from running two or three
``skymesh-controller`` on one Redis (docs/operations-control-ha.md).
``python -m skymesh_lab.bench.control_ha --json PATH`` runs:

- ``takeover``: two controllers on one ``redis-server``; the leader is SIGKILLed (or
  SIGSTOPped, then woken once the standby leads) ``--repeats`` times per lease setting.
  Takeover is the time from the signal until the standby's ``/metrics`` says it leads
  (polled every 20 ms). For SIGSTOP, the woken leader's probe rounds after it woke, and
  the store's refused (fenced) writes, show whether it acted.
- ``redis-failover``: one controller on ``redis+sentinel://`` (a primary, two replicas,
  three sentinels, the durability of control_ha_procs); a client posts regions one after
  another through the admin API; the primary is SIGKILLed after ``--before`` acknowledged
  writes, and the client goes on until ``--after`` more are acknowledged. Then every
  acknowledged region is read back: those missing were lost. The unavailable window is
  from the kill to the first acknowledged write after it. Two arms: ``ha.wait_replicas``
  0 (asynchronous replication) and 1 (each commit waits for a replica, Redis ``WAIT``).
- ``mid-move``: the leader SIGKILLed while its planner round is ``applying`` and its move
  of a replica ``draining``, under a client stream through the replica's balancer
  (``skymesh_lab.bench.control_ha_move``): takeover, the round settled once, the client's
  failed requests.
- ``mid-round``: the leader SIGKILLed while its round is ``applying`` and its actuator
  has started a replica whose registration waits on the store's writer lock (held by the
  run): takeover, the round settled once, replicas started and registered after the new
  leader's round.

``--scenarios`` picks some (comma-separated); with ``--json`` naming an existing file, the
sections not run are kept from it.

``--markdown PATH`` prints the page's tables (``skymesh_lab.bench.control_ha_page``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from skymesh.util.procs import Daemon
from skymesh_lab.bench.control_ha_procs import SentinelCluster, start_controller, stop_all
from skymesh_lab.faults.cluster import RedisProcess, parse_metrics

TOKEN = "control-ha-bench-admin"


def _tokens() -> list[dict[str, str]]:
    from skymesh_controller.auth import digest

    return [{"name": "ops", "sha256": digest(TOKEN), "role": "admin"}]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def metrics(d: Daemon) -> dict[str, float]:
    try:
        return parse_metrics(httpx.get(d.url + "/metrics", timeout=2).text)
    except httpx.HTTPError:
        return {}


def leads(d: Daemon) -> bool:
    return metrics(d).get("skymesh_controller_leader") == 1.0


def _until(cond: Any, what: str, timeout: float, poll: float = 0.02) -> float:
    """Poll ``cond`` until true; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(poll)  # polling cadence; the deadline bounds the wait
    return time.monotonic()


def takeover_once(work: Path, how: str, ttl_s: float, renew_s: float) -> dict[str, Any]:
    redis = RedisProcess(work)
    redis.start()
    ds: list[Daemon] = []
    try:
        ds = [start_controller(work, f"ctl-{i}", redis.url, _tokens(), ttl_s=ttl_s,
                               renew_s=renew_s) for i in range(2)]
        _until(lambda: any(leads(d) for d in ds), "a leader", 30)
        old = next(d for d in ds if leads(d))
        new = next(d for d in ds if d is not old)
        t0 = time.monotonic()
        if how == "kill":
            old.kill()
        else:
            os.kill(old.proc.pid, signal.SIGSTOP)
        took = _until(lambda: leads(new), "the standby to lead", 60) - t0
        row: dict[str, Any] = {"signal": how, "ttl_s": ttl_s, "renew_s": renew_s,
                               "takeover_s": round(took, 3)}
        if how == "stop":
            os.kill(old.proc.pid, signal.SIGCONT)
            woke = _until(lambda: bool(metrics(old)), "the woken leader", 30)
            m0 = metrics(old)
            _until(lambda: metrics(old).get("skymesh_controller_leader_stood_down_total",
                                            0) >= 1, "the woken leader to stand down", 30)
            time.sleep(10 * 0.1)  # ten probe intervals: would it probe again?
            m1 = metrics(old)
            row.update(stood_down_s=round(time.monotonic() - woke, 3),
                       probe_rounds_after_wake=m1["skymesh_controller_probe_rounds_total"]
                       - m0["skymesh_controller_probe_rounds_total"],
                       fenced_writes=m1["skymesh_controller_fenced_writes_total"],
                       leader_after_wake=m1["skymesh_controller_leader"])
        return row
    finally:
        stop_all(ds)
        redis.stop()


def write_stream(ctl: Daemon, cluster: SentinelCluster, before: int, after: int,
                 timeout_s: float = 60.0) -> dict[str, Any]:
    """Regions posted one at a time; the primary SIGKILLed after ``before`` acks."""
    acked: list[str] = []
    errors: dict[str, int] = {}
    killed_at = first_after = None
    old = None
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=ctl.url, headers=_auth(), timeout=10) as c:
        i = 0
        while time.monotonic() < deadline:
            if killed_at is None and len(acked) == before:
                old = cluster.kill_primary()
                killed_at = time.monotonic()
            name = f"r{i}"
            i += 1
            try:
                r = c.post("/v1/regions", json={"name": name, "latitude": 0, "longitude": 0})
                code = str(r.status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            if code == "201":
                acked.append(name)
                if killed_at is not None and first_after is None:
                    first_after = time.monotonic()
                if killed_at is not None and len(acked) >= before + after:
                    break
            else:
                errors[code] = errors.get(code, 0) + 1
        new = cluster.wait_failover(old) if old is not None else None
        stored = {r["name"] for r in c.get("/v1/regions").json()}
    lost = [n for n in acked if n not in stored]
    return {"acked": len(acked), "lost": len(lost), "lost_names": lost[:20],
            "errors": errors, "attempts": i, "old_primary": old, "new_primary": new,
            "unavailable_s": None if first_after is None or killed_at is None
            else round(first_after - killed_at, 3)}


def failover_once(work: Path, wait_replicas: int, before: int, after: int) -> dict[str, Any]:
    cluster = SentinelCluster(work)
    cluster.start()
    ds: list[Daemon] = []
    try:
        ds = [start_controller(work, "ctl", cluster.url, _tokens(),
                               extra={"ha": {"id": "ctl", "wait_replicas": wait_replicas,
                                             "wait_timeout_ms": 1000}})]
        row = write_stream(ds[0], cluster, before, after)
        row["wait_replicas"] = wait_replicas
        return row
    finally:
        stop_all(ds)
        cluster.stop()


SCENARIOS = ("takeover", "redis-failover", "mid-move", "mid-round")
LEASES = ((3.0, 1.0), (0.6, 0.2))
# Mid-move runs last tens of seconds on a loaded host: 0.6 s leases change hands
# between their rounds there (not the case measured), so the short one is 2 s.
MOVE_LEASES = ((3.0, 1.0), (2.0, 0.4))


def run(repeats: int, before: int, after: int, scenarios: tuple[str, ...] = SCENARIOS,
        doc: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = dict(doc or {})
    if "takeover" in scenarios:
        doc["takeover"] = []
        for ttl_s, renew_s in LEASES:
            for how in ("kill", "stop"):
                for _ in range(repeats):
                    with tempfile.TemporaryDirectory(prefix="control-ha-") as tmp:
                        row = takeover_once(Path(tmp), how, ttl_s, renew_s)
                    print(json.dumps(row), file=sys.stderr)
                    doc["takeover"].append(row)
    if "redis-failover" in scenarios:
        doc["redis_failover"] = []
        for _ in range(repeats):
            for wait in (0, 1):
                with tempfile.TemporaryDirectory(prefix="control-ha-") as tmp:
                    row = failover_once(Path(tmp), wait, before, after)
                print(json.dumps({k: v for k, v in row.items() if k != "lost_names"}),
                      file=sys.stderr)
                doc["redis_failover"].append(row)
    if "mid-move" in scenarios:
        doc["mid_move"] = mid_move(repeats)
    if "mid-round" in scenarios:
        doc["mid_round"] = mid_move(repeats, "mid-round")
    doc["summary"] = summary(doc)
    return doc


def mid_move(repeats: int, which: str = "mid-move") -> dict[str, Any]:
    from skymesh_lab.bench.control_ha_move import midmove_once, midround_once

    once = midmove_once if which == "mid-move" else midround_once

    load, t0 = os.getloadavg()[0], time.monotonic()
    rows: list[dict[str, Any]] = []
    setup_failures = 0
    for ttl_s, renew_s in MOVE_LEASES:
        done = 0
        while done < repeats and setup_failures < 2 * repeats:
            with tempfile.TemporaryDirectory(prefix="control-ha-move-") as tmp:
                try:
                    row = once(Path(tmp), ttl_s, renew_s)
                except RuntimeError as exc:
                    # Counted, not hidden: a process that did not start in time on a
                    # loaded host, before anything measured began.
                    setup_failures += 1
                    print(f"{which} run failed: {exc}", file=sys.stderr)
                    continue
            row.update(ttl_s=ttl_s, renew_s=renew_s)
            print(json.dumps({k: v for k, v in row.items() if k != "client"}),
                  file=sys.stderr)
            rows.append(row)
            done += 1
    return {"runs": rows, "setup_failures": setup_failures,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "load_average_1m_at_start": round(load, 2), "cpus": os.cpu_count(),
            "wall_seconds": round(time.monotonic() - t0, 1)}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in doc.get("takeover", []):
        key = f"{row['signal']} ttl={row['ttl_s']} renew={row['renew_s']}"
        out.setdefault(key, []).append(row["takeover_s"])
    return {k: {"mean_s": round(statistics.fmean(v), 3), "max_s": max(v), "n": len(v)}
            for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.control_ha",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", type=int, default=200, help="acked writes before the kill")
    ap.add_argument("--after", type=int, default=100, help="acked writes after it")
    ap.add_argument("--markdown", type=Path, help="print the page's tables from this JSON")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)}")
    args = ap.parse_args(argv)
    scenarios = tuple(x.strip() for x in args.scenarios.split(",") if x.strip())
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenario {unknown[0]!r}; one of {', '.join(SCENARIOS)}")
    if args.markdown is not None:
        from skymesh_lab.bench.control_ha_page import control_ha

        sys.stdout.write(control_ha(json.loads(args.markdown.read_text())) + "\n")
        return 0
    kept = (json.loads(args.json.read_text())
            if args.json is not None and args.json.exists() else None)
    doc = run(args.repeats, args.before, args.after, scenarios, kept)
    text = json.dumps(doc, indent=2, sort_keys=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
