"""Soak: the three-region mesh under steady load for a long time (``make soak``).

    python -m skymesh_lab.faults.soak [--minutes M] [--interval S] [--json PATH]

The mesh of ``skymesh demo`` (emulated L4 replicas in real time, delay proxies, a
controller) with steady closed-loop streaming clients in every region. Every interval it
samples each balancer's RSS and the latency of the requests completed in that interval,
and at the end prints per-interval rows and the drift (last interval against the first):
a leak shows as RSS growing interval after interval, a slow degradation as p50/p99
creeping up. Every request is classified as in the fault suite (lost must stay 0).
``--minutes`` defaults to ``$SKYMESH_SOAK_MINUTES``, else 30.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh.util.stats import fmt, percentile
from skymesh_lab.faults import client as fc
from skymesh_lab.faults.cluster import REGIONS, Mesh, drained, rss_bytes, wait_for

CLIENTS = {"us": 8, "eu": 4, "asia": 4}


async def soak(minutes: float, interval_s: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="skymesh-soak-") as tmp:
        mesh = Mesh(Path(tmp), forwarding=True, controller=True)
        try:
            await mesh.start()
            tally = fc.Tally()
            async with fc.session() as s:
                await mesh.wait_ready(s)
                t0 = time.monotonic()
                stop_at = t0 + minutes * 60
                load = [asyncio.create_task(fc.closed_loop(
                    s, mesh.lbs[r].url, tally, stop_at=stop_at, deadline_s=120,
                    max_tokens=48, stream=True, tag=f"{r}{i}", prompt_words=300))
                    for r in REGIONS for i in range(CLIENTS[r])]
                seen = 0
                while time.monotonic() < stop_at:
                    await asyncio.sleep(min(interval_s, max(0.0, stop_at - time.monotonic())))
                    lat = tally.latencies[seen:]
                    seen += len(lat)
                    rows.append({
                        "t_s": round(time.monotonic() - t0),
                        "completed": len(lat),
                        # None for an interval in which nothing completed (JSON null).
                        "p50_s": _round(percentile(lat, 50), 3),
                        "p99_s": _round(percentile(lat, 99), 3),
                        "rss_mb": {r: round(rss_bytes(lb.proc.pid) / 2**20, 1)
                                   for r, lb in mesh.lbs.items()},
                        "failed_explicit": tally.failed_explicit, "lost": tally.lost})
                    print(_row(rows[-1]), flush=True)
                await asyncio.gather(*load)
                urls = [lb.url for lb in mesh.lbs.values()]

                async def all_drained() -> bool:
                    return all([await drained(s, u) for u in urls])
                await wait_for(all_drained, "in-flight back to zero", 60)
        finally:
            await mesh.stop()
    first, last = rows[0], rows[-1]
    drift = {"p50_s": _change(first["p50_s"], last["p50_s"]),
             "p99_s": _change(first["p99_s"], last["p99_s"]),
             "rss_mb": {r: round(last["rss_mb"][r] - first["rss_mb"][r], 1) for r in REGIONS}}
    return {"minutes": minutes, "interval_s": interval_s, "intervals": rows, "drift": drift,
            "totals": {k: v for k, v in tally.row().items() if k not in ("statuses",)}}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _change(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None else round(last - first, 3)


def _row(r: dict[str, Any]) -> str:
    rss = " ".join(f"{k}={v:.0f}" for k, v in r["rss_mb"].items())
    return (f"  t={r['t_s']:>6}s  done {r['completed']:>5}  p50 {fmt(r['p50_s'], '6.2f')}s  "
            f"p99 {fmt(r['p99_s'], '6.2f')}s  RSS MB {rss}  failed {r['failed_explicit']}  "
            f"lost {r['lost']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.faults.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float,
                    default=float(os.environ.get("SKYMESH_SOAK_MINUTES", "30")))
    ap.add_argument("--interval", type=float, default=None,
                    help="seconds per sample (default: a tenth of the run, 10..300)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    interval = args.interval or min(300.0, max(10.0, args.minutes * 6))
    print(f"== soak: three-region mesh, {args.minutes:g} min, sample every {interval:g} s ==",
          flush=True)
    report = asyncio.run(soak(args.minutes, interval))
    d = report["drift"]
    print(f"drift (last - first interval): p50 {fmt(d['p50_s'], '+.3f')} s, "
          f"p99 {fmt(d['p99_s'], '+.3f')} s, "
          f"RSS MB " + ", ".join(f"{r} {v:+.1f}" for r, v in d["rss_mb"].items()))
    print(f"totals: {report['totals']}")
    write_json(args.json, report)
    return 0 if report["totals"]["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
