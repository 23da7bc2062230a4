"""What ``skymesh demo --autopilot`` measured: per arm and region, as JSON, text and a plot.

Definitions (all over the live day, [00:00, 24:00) UTC of the compressed day):

- GPU-hours: replicas registered with the arm's controller, sampled every 0.5 s,
  integrated over the day and scaled from the compressed day to 24 hours (a replica is
  counted from its registration; its few seconds of process start-up before that are
  not).
- SLO attainment: share of the day's requests (by scheduled send time) that streamed a
  first token within ``slo_ttft_s`` and completed without error.
- need: instances an hour's demand needs as the planner sizes it, ``ceil(curve req/s x
  (1 + headroom) / capacity_rps)``, from the curve the arrivals follow (the hour's mean
  rate), not the hour's few dozen requests; *short hours*: (region, hour) pairs whose
  mean instances stayed under it; *rises met*: hours whose need exceeds the previous
  hour's and whose region already ran that many instances when the hour began.
- forecast (autopilot): per region and hour, the newest round made *before* the hour
  began, its forecast for that hour (tokens/s over the tokens of one request); its error
  (mean APE) is against the curve's rate for the hour.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.util.stats import percentiles
from skymesh_lab.demos.autopilot_load import MODEL, TRACE, tokens_per_request

ARM_STYLE = {"autopilot": ("tab:blue", "-"), "reactive": ("tab:orange", "-"),
             "fixed": ("tab:gray", "--")}


def _count_at(samples: list[tuple[float, dict[str, int]]], region: str, t: float) -> int:
    last = samples[0][1].get(region, 0) if samples else 0
    for ts, c in samples:
        if ts > t:
            break
        last = c.get(region, 0)
    return last


def _mean_count(samples: list[tuple[float, dict[str, int]]], region: str, a: float,
                b: float) -> float:
    """Time-weighted mean of the (step) instance count over [a, b)."""
    grid = np.linspace(a, b, 25)[:-1]
    return float(np.mean([_count_at(samples, region, t) for t in grid]))


def _forecasts(plans: list[dict[str, Any]], t0_unix: float, hour_s: float, region: str,
               tokens: int) -> tuple[list[float | None], list[str | None]]:
    rounds = sorted((p for p in plans if p.get("forecast")), key=lambda p: p["ts"])
    values: list[float | None] = []
    used: list[str | None] = []
    for h in range(24):
        start = t0_unix + h * hour_s
        best = None
        for p in rounds:
            if p["ts"] >= start:
                break
            for f in p["forecast"]:
                if f["model"] == MODEL and f["region"] == region:
                    i = round((start - f["start"]) / hour_s)
                    if 0 <= i < len(f["tokens_per_s"]):
                        best = (f["tokens_per_s"][i] / tokens, f["forecaster"])
        values.append(None if best is None else round(best[0], 3))
        used.append(None if best is None else best[1])
    return values, used


def summarise(raw: dict[str, Any], o: Any) -> dict[str, Any]:
    day = raw["day"]
    H, D = o.hour_s, o.day_s
    prompt, output = tokens_per_request()
    regions = day.regions
    doc: dict[str, Any] = {
        "setup": {
            "day_seconds": D, "hour_seconds": H, "trace": "/".join(TRACE),
            "live_day": o.live_day, "history_days": o.history_days,
            "history": "the previous days of the trace, posted to the controller's "
                       "telemetry API as the balancers would have reported them",
            "utc_offsets": dict(day.offsets), "peak_rps_per_region": o.peak_rps,
            "capacity_rps_per_instance": o.capacity_rps,
            "tokens_per_request": {"prompt": prompt, "output": output},
            "headroom": o.headroom, "horizon_hours": o.horizon,
            "forecaster": "seasonal-naive", "fixed_per_region": o.fixed_count(),
            "slo": f"TTFT <= {o.slo_ttft_s} s and completed", "slo_ttft_s": o.slo_ttft_s,
            "preroll_hours": o.preroll_h, "seed": o.seed},
        "arms": {}, "timeline": {"hours": list(range(24)), "regions": {}}}
    load: dict[str, list[float]] = {r: [0.0] * 24 for r in regions}
    first = next(iter(raw["arms"].values()), None)
    for rec in (first["records"] if first else []):
        if 0 <= rec.t < D:
            load[rec.region][int(rec.t // H)] += 1 / H
    # The curve's rate (what the Poisson arrivals follow) rather than the hour's few dozen
    # requests: need and rises then follow demand, not sampling noise.
    curve = {r: [float(np.mean([day.rate(r, (h + k / 8) * H) for k in range(8)]))
                 for h in range(24)] for r in regions}
    need = {r: [math.ceil(x * (1 + o.headroom) / o.capacity_rps - 1e-9) for x in curve[r]]
            for r in regions}
    for name, arm in raw["arms"].items():
        recs = [r for r in arm["records"] if 0 <= r.t < D]
        good = [r for r in recs if r.ok and r.ttft is not None and r.ttft <= o.slo_ttft_s]
        ttfts = [r.ttft for r in recs if r.ok and r.ttft is not None]
        e2es = [r.e2e for r in recs if r.ok and r.e2e is not None]
        samples = arm["samples"]
        inst_s = sum(_mean_count(samples, r, h * H, (h + 1) * H) * H
                     for r in regions for h in range(24))
        hourly = {r: [round(_mean_count(samples, r, h * H, (h + 1) * H), 3)
                      for h in range(24)] for r in regions}
        starts = {r: [_count_at(samples, r, h * H) for h in range(24)] for r in regions}
        rises = [(r, h) for r in regions for h in range(1, 24) if need[r][h] > need[r][h - 1]]
        met = sum(1 for r, h in rises if starts[r][h] >= need[r][h])
        day_samples = [c for t, c in samples if 0 <= t < D]
        events = sum(abs(b.get(r, 0) - a.get(r, 0))
                     for a, b in itertools.pairwise(day_samples) for r in regions)
        p50, p90 = percentiles(ttfts, (50, 90))
        (e50,) = percentiles(e2es, (50,))
        doc["arms"][name] = {
            "gpu_hours": round(inst_s * 24 / D, 1), "slo_attainment": round(
                len(good) / len(recs), 4) if recs else None,
            "requests": len(recs), "completed": sum(1 for r in recs if r.ok),
            "not_sent_late": arm.get("late", 0),
            "ttft_p50_s": p50, "ttft_p90_s": p90, "e2e_p50_s": e50,
            "short_hours": sum(1 for r in regions for h in range(24)
                               if hourly[r][h] < need[r][h]),
            "rises": len(rises), "rises_met": met, "scaling_steps": events,
            "regions": {r: {"slo_attainment": round(
                sum(1 for x in good if x.region == r)
                / max(1, sum(1 for x in recs if x.region == r)), 4),
                "instances": hourly[r]} for r in regions}}
    t0_unix = raw.get("t0_unix")
    for r in regions:
        row: dict[str, Any] = {"load_rps": [round(x, 3) for x in load[r]],
                               "curve_rps": [round(x, 3) for x in curve[r]], "need": need[r]}
        if t0_unix is not None:
            fc, used = _forecasts(raw.get("plans", []), t0_unix, H, r, prompt + output)
            row["forecast_rps"] = fc
            row["forecaster"] = sorted({u for u in used if u})
            pairs = [(f, a) for f, a in zip(fc, curve[r], strict=True) if f is not None and a > 0]
            row["forecast_mape"] = round(float(np.mean([abs(f - a) / a for f, a in pairs])),
                                         4) if pairs else None
        doc["timeline"]["regions"][r] = row
    if t0_unix is not None:
        doc["rounds"] = sum(1 for p in raw.get("plans", []) if p["ts"] >= t0_unix)
    return doc


def print_timeline(doc: dict[str, Any]) -> None:
    arms = list(doc["arms"])
    for r, row in doc["timeline"]["regions"].items():
        off = doc["setup"]["utc_offsets"][r]
        print(f"\n  {r} (UTC{off:+d}): hour (UTC), offered req/s, forecast, need, "
              f"instances per arm ({', '.join(arms)})")
        for h in doc["timeline"]["hours"]:
            fc = (row.get("forecast_rps") or [None] * 24)[h]
            inst = "  ".join(f"{doc['arms'][a]['regions'][r]['instances'][h]:4.1f}"
                             for a in arms)
            print(f"    {h:02d}:00  {row['load_rps'][h]:5.2f}  "
                  f"{'  -  ' if fc is None else f'{fc:5.2f}'}  {row['need'][h]}   {inst}")
    print(f"\n  {'arm':<10} {'GPU-hours':>9} {'SLO att.':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'short h':>8} {'rises met':>10} {'steps':>6}")
    for a, s in doc["arms"].items():
        att = s["slo_attainment"]
        p50, p90 = s["ttft_p50_s"], s["ttft_p90_s"]
        print(f"  {a:<10} {s['gpu_hours']:>9.1f} "
              f"{'-' if att is None else f'{att * 100:.1f}%':>9} "
              f"{'-' if p50 is None else f'{p50:.3f}':>9} "
              f"{'-' if p90 is None else f'{p90:.3f}':>9} {s['short_hours']:>8} "
              f"{s['rises_met']:>4} / {s['rises']:<3} {s['scaling_steps']:>6}")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regions = list(doc["timeline"]["regions"])
    fig, axes = plt.subplots(len(regions), 1, figsize=(9, 2.6 * len(regions)), sharex=True)
    axes = np.atleast_1d(axes)
    hours = np.arange(25)
    for ax, r in zip(axes, regions, strict=True):
        row = doc["timeline"]["regions"][r]
        # Load in instances' worth (req/s over one instance's planned capacity): one axis.
        cap = doc["setup"]["capacity_rps_per_instance"]
        offered = [x / cap for x in row["load_rps"]]
        ax.step(hours, [*offered, offered[-1]], where="post", color="black", lw=0.8,
                alpha=0.5, label="offered req/s / capacity")
        need = row["need"]
        ax.step(hours, [*need, need[-1]], where="post", color="black", lw=1.4,
                label="need (demand x 1.2 / capacity)")
        if row.get("forecast_rps"):
            fc = [np.nan if v is None else v / cap for v in row["forecast_rps"]]
            ax.step(hours, [*fc, fc[-1]], where="post", color="tab:green", ls=":", lw=1.5,
                    label="forecast req/s / capacity (made before the hour)")
        for a, s in doc["arms"].items():
            color, ls = ARM_STYLE.get(a, ("tab:red", "-"))
            inst = s["regions"][r]["instances"]
            ax.step(hours, [*inst, inst[-1]], where="post", color=color, ls=ls, lw=1.6,
                    label=f"instances: {a}")
        off = doc["setup"]["utc_offsets"][r]
        ax.set_ylabel(f"{r} (UTC{off:+d})")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7, ncol=2, loc="upper left")
    axes[-1].set_xlabel("hour of the compressed day (UTC)")
    axes[-1].set_xticks(range(0, 25, 3))
    st = doc["setup"]
    fig.suptitle(f"Autopilot on a compressed day ({st['day_seconds']:.0f} s): instances per "
                 "arm against load", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
