"""The results page of ``skymesh_lab.faults.security_figures``: the adversarial pass's
counts (``results_tables.security``), then one row per flood or bad replica: what the
attacked process refused and held, and a healthy client's p50 in the same run with no
attack and while the attack ran.

Kept apart from the measurement so the results registry imports no daemon machinery.
"""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench import results_tables as tables
from skymesh_lab.bench.results_tables import num, table

MB = 1 << 20


def _mb(x: Any) -> str:
    return num(x, ",.1f", suffix=" MB")


def _held(before: Any, after: Any, peak: Any, unit: str = "") -> str:
    fmt = ",d" if isinstance(before, int) else ",.1f"
    return (f"{num(before, fmt, suffix=unit)} → {num(after, fmt, suffix=unit)} "
            f"(peak {num(peak, fmt, suffix=unit)})")


def _rss(rss: dict[str, Any]) -> str:
    return _held(rss.get("before"), rss.get("after"), rss.get("peak"), " MB")


def _healthy(h: dict[str, Any]) -> list[str]:
    quiet, attack = h.get("no_attack", {}), h.get("attack", {})
    failed = (quiet.get("failed") or 0) + (attack.get("failed") or 0)
    total = (quiet.get("requests") or 0) + (attack.get("requests") or 0)
    return [num(quiet.get("p50_ms"), ".1f", suffix=" ms"),
            num(attack.get("p50_ms"), ".1f", suffix=" ms"), f"{failed} / {total}"]


def _count(statuses: dict[str, int], code: str) -> str:
    return num(statuses.get(code, 0), ",d")


def mesh_row(m: dict[str, Any]) -> list[str]:
    fds = m.get("fds", {})
    return [f"peering port: {num(m.get('slots'), ',d')} plain TCP connects held open from "
            f"{num(m.get('sources'), 'd')} addresses, each re-opened "
            f"{num(m.get('reconnect_s'), '.1f')} s after it is cut "
            f"({num(m.get('connects'), ',d')} connects tried in "
            f"{num(m.get('flood_seconds'), '.0f')} s)",
            f"{num(m.get('refused'), ',d')} refused at a cap; at most "
            f"{num(m.get('held_peak'), ',d')} held at once, {num(m.get('held_after'), ',d')} "
            f"after", "fds " + _held(fds.get("before"), fds.get("after"), fds.get("peak")),
            *_healthy(m.get("healthy", {}))]


def body_rows(b: dict[str, Any]) -> list[list[str]]:
    rows = []
    size = num(b.get("body_bytes"), ",.0f", 1 / MB, " MB")
    for key, who in (("no_token", "no token"), ("agent_over_cap",
                                                  "an agent token, over `max_body_bytes`")):
        c = b.get(key, {})
        st = c.get("statuses", {})
        answered = ", ".join(f"{_count(st, code)} answered {code}" for code in sorted(st)
                             if code != "0")
        rows.append([f"controller: chunked bodies of {size} streamed with {who}, two at a "
                     f"time ({num(c.get('bodies'), ',d')} bodies)",
                     f"{answered}, {_count(st, '0')} reset before the answer was read; "
                     f"at most {_mb((c.get('max_sent_bytes') or 0) / MB)} of a body left "
                     "the client (socket buffers included)",
                     "RSS " + _rss(c.get("rss_mb", {})), *_healthy(c.get("healthy", {}))])
    return rows


def telemetry_row(t: dict[str, Any]) -> list[str]:
    st, huge = t.get("statuses", {}), t.get("huge_report", {})
    huge_st = ", ".join(f"{n} x {code}" for code, n in sorted(huge.get("statuses", {}).items()))
    return [f"controller: {num(t.get('posts'), ',d')} telemetry reports of "
            f"{num(t.get('report_bytes'), ',.0f', 1 / 1024, ' KiB')} (the largest accepted) "
            f"over {num(t.get('balancers'), 'd')} balancers of one agent, four at a time; "
            f"the issue's {num(huge.get('bytes'), ',.1f', 1 / MB, ' MB')} report",
            f"{_count(st, '204')} accepted, {num(t.get('kept_per_balancer'), ',d')} kept "
            f"per balancer ({_mb((t.get('kept_bytes_per_balancer') or 0) / MB)}); the 1 MB "
            f"report: {huge_st or '-'}",
            "RSS " + _rss(t.get("rss_mb", {})), *_healthy(t.get("healthy", {}))]


REPLICA = {"huge_body": "a non-streamed reply of {} MB",
           "huge_headers": "{} MB of response headers",
           "huge_metrics": "a /metrics of {} MB",
           "costly_metrics": "a /metrics of {} MB, costly to parse (no `# HELP`)"}


def replica_rows(bad: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, what in REPLICA.items():
        r = bad.get(mode)
        if r is None:
            continue
        st = r.get("attack_statuses", {})
        if mode.endswith("metrics"):
            down = {True: "marked unhealthy", False: "NOT marked unhealthy"}.get(
                r.get("marked_unhealthy"), "-")
            result = f"{down}; `{r.get('limit')}` limit hit {num(r.get('limit_hits'), ',d')} times"
        else:
            answered = ", ".join(f"{n:,} x {code}" for code, n in sorted(st.items()))
            result = (f"requests to it answered {answered or '-'}; `{r.get('limit')}` limit "
                      f"hit {num(r.get('limit_hits'), ',d')} times")
        rows.append(["bad replica (beside a healthy one): "
                     + what.format(num(r.get("offered_mb"), ",.0f")), result,
                     "RSS " + _rss(r.get("rss_mb", {})), *_healthy(r.get("healthy", {}))])
    return rows


def attacks(data: dict[str, Any]) -> str:
    rows = []
    if "mesh_flood" in data:
        rows.append(mesh_row(data["mesh_flood"]))
    rows += replica_rows(data.get("bad_replica", {}))
    if "controller_bodies" in data:
        rows += body_rows(data["controller_bodies"])
    if "telemetry_flood" in data:
        rows.append(telemetry_row(data["telemetry_flood"]))
    if not rows:
        return ""
    client = data.get("healthy_client", {})
    note = (f"Healthy client: {num(client.get('requests'), 'd')} requests arriving at "
            f"{num(client.get('rate_per_s'), '.0f')} a second (open loop) from a process of "
            "its own, before the attack and while it runs, in the same run: a chat completion "
            "through the attacked `skymesh-lb` (to the healthy replica), or `GET "
            "/v1/balancers` with an admin token at the attacked controller. The attack runs "
            "on the same shared cores, so part of the difference is CPU the attacker takes. "
            "Failed counts both phases.")
    return "\n".join([note, "", table(
        ["attack", "what the target did", "held before → after (peak)",
         "healthy p50, no attack", "healthy p50, attack", "healthy failed"],
        rows, [False, False, False, True, True, True])])


def security(data: dict[str, Any]) -> str:
    more = attacks(data)
    return tables.security(data) + ("\n\n" + more if more else "")
