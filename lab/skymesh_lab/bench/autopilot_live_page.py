"""The results page of ``skymesh demo --autopilot``: the three arms, the plot, the setup.

Kept apart from the demo so the results registry (``results_pages``) imports no daemon
machinery to render a page. The plot is written by the demo itself (``--plot``) next to
the page; the page only links it.
"""

from __future__ import annotations

from typing import Any

PLOT = "autopilot-live.png"
ORDER = ("autopilot", "reactive", "fixed")
# Fewer rounds than this in the day's 24 hours: the planner was held (replica starts on a
# starved machine) for more than a quarter of the day, and its arm measured the machine.
MIN_ROUNDS = 18


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def starved(doc: dict[str, Any]) -> list[str]:
    """Signs, in the run's own data, that the machine rather than the policies was measured:
    other jobs loading it before the demo started (a load average over twice the cores;
    the demo's own forty-odd processes load it later, alike for every arm), requests the
    clients sent late or not at all, a planner that missed a quarter of the day's rounds."""
    m, arms = doc.get("machine", {}), doc["arms"]
    out = []
    load = m.get("load_average_1m_at_start", 0)
    if m and load > 2 * m["cpus"]:
        out.append(f"load average {load} on {m['cpus']} cores before the demo started")
    late = sum(a.get("not_sent_late", 0) for a in arms.values())
    if late:
        out.append(f"{late} requests the clients fell too far behind to send (of "
                   f"{late + sum(a['requests'] for a in arms.values())})")
    if "autopilot" in arms and doc.get("rounds") is not None and doc["rounds"] < MIN_ROUNDS:
        out.append(f"{doc['rounds']} planner rounds in the day's 24 hours (replica starts "
                   "hold a round until they finish)")
    return out


def comparison(arms: dict[str, Any]) -> list[str]:
    """The autopilot against each other arm, in words: GPU-hours saved, SLO points."""
    if "autopilot" not in arms:
        return []
    a = arms["autopilot"]
    parts = []
    for name in [n for n in ORDER if n in arms and n != "autopilot"]:
        b = arms[name]
        saved = 1 - a["gpu_hours"] / b["gpu_hours"] if b["gpu_hours"] else 0.0
        slo = (a["slo_attainment"] - b["slo_attainment"]) * 100
        fewer = f"{abs(saved) * 100:.1f}% {'fewer' if saved >= 0 else 'more'}"
        parts.append(f"{fewer} GPU-hours than {name} with "
                     f"{slo:+.1f} points of SLO attainment, {a['rises_met']} of {a['rises']}"
                     f" rises met ahead against {b['rises_met']}, {a['short_hours']} short "
                     f"hours against {b['short_hours']}")
    return ["The autopilot: " + "; ".join(parts) + "."] if parts else []


def autopilot_live(doc: dict[str, Any]) -> str:
    st, arms = doc["setup"], doc["arms"]
    regions = list(doc["timeline"]["regions"])
    out = []
    signs = starved(doc)
    if signs:
        out += ["**This run measured a starved machine, not the policies**: "
                + "; ".join(signs) + ". Rerun it on a quieter machine before reading the "
                "arms against each other.", ""]
    out += [f"![instances per arm against load and forecast, per region]({PLOT})", "",
           f"One compressed day of {st['day_seconds']:.0f} s ({st['hour_seconds']:.0f} s an "
           f"hour), regions {', '.join(f'{r} (UTC{o:+d})' for r, o in st['utc_offsets'].items())}"
           f", the trace's day {st['live_day']} of `{st['trace']}` at up to "
           f"{st['peak_rps_per_region']:g} req/s per region; one instance planned at "
           f"{st['capacity_rps_per_instance']:g} req/s, headroom {st['headroom']:g}; SLO: "
           f"{st['slo']}. Fixed: {st['fixed_per_region']} instances per region all day. "
           f"Autopilot history: {st['history_days']} days, {st['history']}.", "",
           "| arm | GPU-hours (24 h) | SLO attainment | TTFT p50 s | TTFT p90 s | requests "
           "| short hours | rises met | scaling steps |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name in [a for a in ORDER if a in arms]:
        a = arms[name]
        out.append(f"| {name} | {a['gpu_hours']:.1f} | {_pct(a['slo_attainment'])} "
                   f"| {_s(a['ttft_p50_s'])} | {_s(a['ttft_p90_s'])} | {a['requests']} "
                   f"| {a['short_hours']} | {a['rises_met']} / {a['rises']} "
                   f"| {a['scaling_steps']} |")
    out += ["", *comparison(arms)]
    out += ["", "Per region: SLO attainment per arm, and the autopilot's forecast error "
            "(mean APE of the forecast made before each hour against the hour's demand, "
            "the curve's rate).", "",
            "| region | " + " | ".join(n for n in ORDER if n in arms) + " | forecast MAPE |",
            "|---|" + "---|" * (sum(1 for n in ORDER if n in arms) + 1)]
    for r in regions:
        row = doc["timeline"]["regions"][r]
        cells = " | ".join(_pct(arms[n]["regions"][r]["slo_attainment"])
                           for n in ORDER if n in arms)
        out.append(f"| {r} | {cells} | {_pct(row.get('forecast_mape'))} |")
    m = doc.get("machine", {})
    if m:
        out += ["", f"Measured on {m['cpus']} shared cores, load average (1 min) "
                f"{m['load_average_1m_at_start']} before the demo started and "
                f"{m['load_average_1m_at_end']} at its end (its own controllers, balancers "
                "and replicas: their contention adds latency to every arm alike); "
                f"{doc.get('rounds', '-')} planner rounds in the day's 24 hours; "
                f"{m['wall_seconds']:.0f} s in all."]
    out += ["", "Definitions: *GPU-hours*, registered replicas integrated over the day and "
            "scaled to 24 h; *short hours*, (region, hour) pairs whose mean instances stayed "
            "under what the hour's demand needed at the planned capacity; *rises met*, "
            "hours needing more instances than the hour before that began with them "
            "already running ([autopilot](../autopilot.md#shown-live))."]
    return "\n".join(out)
