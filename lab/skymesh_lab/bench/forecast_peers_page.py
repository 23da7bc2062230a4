"""The ``forecast-peers`` results page: forecast-aware overflow against the plain rule,
from ``docs/results/data/forecast-peers.json`` (``skymesh_lab.bench.forecast_peers``)."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.results_tables import num, pct, secs, table

_ARMS = {"overflow": "overflow (SkyLB Algorithm 1)",
         "outlook-oracle": "forecast-aware, oracle forecast",
         "outlook-seasonal-naive": "forecast-aware, seasonal-naive forecast"}


def _row(name: str, m: dict[str, Any]) -> list[str]:
    return [_ARMS.get(name, name), pct(m.get("slo_attainment")), secs(m.get("ttft_p50_s")),
            secs(m.get("ttft_p90_s")), pct(m.get("forwarded_share")),
            pct(m.get("forwarded_to_falling_share")), num(m.get("throughput_rps"), ".2f")]


HEADER = ["arm", "SLO met", "TTFT p50", "TTFT p90", "forwarded", "of which to a falling "
          "region", "req/s"]


def forecast_peers(data: dict[str, Any]) -> str:
    setup = data.get("setup", {})
    mean = data.get("mean", {})
    base = mean.get("overflow", {})
    look = setup.get("outlook", {})
    day, per_day = setup.get("day_s"), setup.get("windows_per_day")
    window = day / per_day if day and per_day else None
    out = [f"{setup.get('replicas_per_region', '-')} replicas per region, "
           f"{setup.get('clients_trough', '-')} to {setup.get('clients_peak', '-')} clients "
           f"per region over a {num(setup.get('day_s'), ',.0f')} s day, figures over the "
           f"second day; SLO: TTFT <= {num(setup.get('ttft_slo_s'), '.1f')} s. Outlook: "
           f"horizon {num(look.get('horizon'), 'd')} windows of "
           f"{num(window, '.1f')} s, slack {num(look.get('slack'), '.2f')}, current weight "
           f"{num(look.get('current_weight'), '.1f')}. \"To a falling region\": the share "
           "of forwarded requests sent to a region whose client count was going down at "
           "the time (past its peak).", "",
           f"**Mean over seeds {setup.get('seeds', [])}**", "",
           table(HEADER, [_row(a, m) for a, m in mean.items()], [False] + [True] * 6), ""]
    for arm, m in mean.items():
        if arm == "overflow" or not base:
            continue
        d_slo = (m.get("slo_attainment") or 0.0) - (base.get("slo_attainment") or 0.0)
        p90, b90 = m.get("ttft_p90_s"), base.get("ttft_p90_s")
        out.append(f"- {_ARMS.get(arm, arm)} against overflow: SLO attainment "
                   f"{d_slo * 100:+.1f} points, TTFT p90 "
                   f"{num(p90, '.2f')} s against {num(b90, '.2f')} s.")
    rows = [[_ARMS.get(r["arm"], r["arm"]), str(r["seed"]), pct(r.get("slo_attainment")),
             secs(r.get("ttft_p50_s")), secs(r.get("ttft_p90_s")),
             pct(r.get("forwarded_share")), pct(r.get("forwarded_to_falling_share")),
             num(r.get("throughput_rps"), ".2f")]
            for r in data.get("runs", [])]
    out += ["", "**Every run**", "",
            table(["arm", "seed", *HEADER[1:]], rows, [False] * 2 + [True] * 6)]
    return "\n".join(out)
