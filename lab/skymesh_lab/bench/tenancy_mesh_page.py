"""The results page of ``skymesh_lab.bench.tenancy_mesh``: interactive SLO attainment and
batch deadlines on the diurnal three-region workload, without batch, with batch first come
first served, kept at home, and under the mesh rule; where the interactive loss is.
Medians over the seeds."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

ARMS = {"no_batch": "no batch", "fcfs": "batch, first come first served",
        "local_last": "the rule, never forwarded",
        "mesh_rule": "batch across the mesh (the rule)"}
# "Stays where it is": the rule's interactive attainment at most this far below no batch.
SLO_TOLERANCE = 0.01
SERVED_TOLERANCE = 0.05


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def _ran(rows: list[dict[str, Any]], key: str = "batch_ran") -> str:
    """Where each region's batch jobs ran, summed over the seeds."""
    cells: dict[str, dict[str, int]] = {}
    for r in rows:
        for origin, where in r.get(key, {}).items():
            row = cells.setdefault(origin, {})
            for region, n in where.items():
                row[region] = row.get(region, 0) + n
    regions = sorted({g for row in cells.values() for g in row})
    out = [[origin, *(str(cells[origin].get(g, 0)) for g in regions)]
           for origin in sorted(cells)]
    return table(["batch from \\ ran in", *regions], out, [False, *([True] * len(regions))])


def _per_region(arms: dict[str, list[dict[str, Any]]], key: str, fmt: str
                ) -> tuple[list[str], list[tuple[str, list[dict[str, Any]], list[str]]]]:
    """The client regions named under ``key`` (a dict per run), and per arm its label,
    runs and the median of each region's figure over the seeds."""
    regions: list[str] = []
    for rs in arms.values():
        for r in rs:
            regions += [g for g in r.get(key, {}) if g not in regions]
    out = []
    for arm, label in ARMS.items():
        rs = arms.get(arm) or []
        if not rs:
            continue
        cells = []
        for g in regions:
            xs = [r[key][g] for r in rs if isinstance(r.get(key, {}).get(g), int | float)]
            cells.append(num(statistics.median(xs) if xs else None, fmt))
        out.append((label, rs, cells))
    return regions, out


def _by_region(arms: dict[str, list[dict[str, Any]]]) -> str:
    """Interactive SLO attainment per client region and arm (medians over the seeds)."""
    regions, rows = _per_region(arms, "interactive_slo_by_region", ".1%")
    return table(["arm", *regions], [[label, *cells] for label, _, cells in rows],
                 [False, *([True] * len(regions))])


def verdict(arms: dict[str, list[dict[str, Any]]], where: str = "") -> str:
    """Whether interactive work stays where it is without batch (its SLO attainment
    within SLO_TOLERANCE, and as many of its requests served, to SERVED_TOLERANCE: the
    chat clients are closed-loop, so slower answers show as fewer requests) while batch
    finishes by its deadline; if not, by how much and why."""
    nb, rule = arms.get("no_batch", []), arms.get("mesh_rule", [])
    base, att = _med(nb, "interactive_slo_attainment"), _med(rule, "interactive_slo_attainment")
    served0, served = _med(nb, "interactive_ok"), _med(rule, "interactive_ok")
    by = _med(rule, "batch_by_deadline")
    if None in (base, att, served0, served, by) or not served0:
        return "Not enough runs to judge the goal."
    assert base is not None and att is not None and served is not None and by is not None
    slo_ok = att >= base - SLO_TOLERANCE
    served_ok = served >= (1 - SERVED_TOLERANCE) * served0
    batch_ok = by >= 0.99
    holds = "holds" if slo_ok and served_ok and batch_ok else "does not hold"
    gap = (base - att) * 100
    slo = (f"{gap:.1f} points down, within the {SLO_TOLERANCE * 100:.0f} point allowed"
           if slo_ok else
           f"{gap:.1f} points down: {gap - SLO_TOLERANCE * 100:.1f} more than the "
           f"{SLO_TOLERANCE * 100:.0f} point allowed")
    why = "" if served_ok and slo_ok else _why(rule, served0 - served)
    return (f"**The goal {holds}{where}.** (The goal: interactive SLO attainment within "
            f"{SLO_TOLERANCE * 100:.0f} point of no batch, chat requests served within "
            f"{SERVED_TOLERANCE:.0%} of no batch, batch by its deadline.) Under the rule "
            f"{by:.1%} of batch jobs finish by their deadline"
            f"{'' if batch_ok else ' (not all)'}; interactive SLO attainment is {att:.1%} "
            f"against {base:.1%} without batch ({slo}), and the chat clients were served "
            f"{served / served0:.1%} of the requests they were without batch "
            f"({'within' if served_ok else 'not within'} {SERVED_TOLERANCE:.0%}"
            f"{_short(served / served0)}){why}.{_lost_where(nb, rule)}"
            f"{_against_fcfs(arms, att, served)}")


def _lost_where(nb: list[dict[str, Any]], rule: list[dict[str, Any]]) -> str:
    """What the rule cost against no batch, by the region that served the chat
    requests: fewer served, more past the TTFT SLO (medians over the seeds)."""
    regions = sorted({g for r in nb + rule for g in r.get("chat_served_in", {})})
    if not regions:
        return ""
    def delta(key: str, g: str) -> float:
        return _med_of(rule, key, g) - _med_of(nb, key, g)

    parts = [f"{g} {delta('chat_served_in', g):+.0f} served, "
             f"{delta('chat_slo_missed_in', g):+.0f} past the SLO" for g in regions]
    return (" Against no batch, by the region that served the chat requests: "
            + "; ".join(parts) + ".")


def _short(ratio: float) -> str:
    gap = (1 - SERVED_TOLERANCE) - ratio
    return f": {gap * 100:.1f} points short" if gap > 0 else ""


def _why(rule: list[dict[str, Any]], lost: float) -> str:
    """The loss, as the page's figures explain it: the batch that ran during the peak,
    beside interactive work, and how much it slowed the decoding it shared a replica
    with."""
    after = _med(rule, "batch_after_peak")
    beside = _med(rule, "interactive_tpot_p50_beside_batch_s")
    alone = _med(rule, "interactive_tpot_p50_alone_s")
    due = _med(rule, "batch_in_peak_due")
    if after is None or beside is None or alone is None:
        return ""
    when = ("" if due is None else
            f" ({due:.0%} of them only once due, within `urgent_h` of their deadline: "
            "no region had room for them before)")
    return (f", {lost:.0f} fewer. Why: {1 - after:.0%} of batch jobs started during the "
            f"peak{when}, and a chat request "
            "sharing its replica with a decoding batch job took "
            f"{beside * 1000:.0f} ms per output token against {alone * 1000:.0f} ms "
            "without (a batch prefill takes whole engine steps): closed-loop clients "
            f"then send less. The other {after:.0%} waited and ran in the trough, after "
            "the chat clients stopped")


def _served_in(arms: dict[str, list[dict[str, Any]]]) -> str:
    """Where the loss is, by the region that served the chat requests: served, past the
    TTFT SLO, and beside a decoding batch job from which region (medians over seeds)."""
    regions: list[str] = []
    for rs in arms.values():
        for r in rs:
            regions += [g for g in r.get("chat_served_in", {}) if g not in regions]
    regions.sort()
    out = []
    for arm, label in ARMS.items():
        rs = arms.get(arm) or []
        if not rs:
            continue
        row = [label]
        for g in regions:
            row.append(num(_med_of(rs, "chat_served_in", g), ".0f"))
            row.append(num(_med_of(rs, "chat_slo_missed_in", g), ".0f"))
            homes = sorted({h for r in rs for h in r.get("chat_beside_batch_from", {})
                            .get(g, {})})
            beside = [f"{_med_of(rs, 'chat_beside_batch_from', g, h):.0f} ({h})"
                      for h in homes]
            row.append(", ".join(beside) if beside else "0")
        out.append(row)
    heads = [f"{g} {what}" for g in regions
             for what in ("served", "past SLO", "beside batch (its home)")]
    return table(["arm", *heads], out, [False, *([True] * len(heads))])


def _med_of(rs: list[dict[str, Any]], key: str, *path: str) -> float:
    """The median over runs of a nested count (a missing one is 0)."""
    xs = []
    for r in rs:
        v: Any = r.get(key, {})
        for k in path:
            v = v.get(k, 0) if isinstance(v, dict) else 0
        xs.append(v if isinstance(v, int | float) else 0)
    return statistics.median(xs) if xs else 0.0


def _peak_ran(rows: list[dict[str, Any]]) -> str:
    """Batch jobs that started during the peak, by home and where they ran (summed)."""
    return _ran(rows, "batch_started_in_peak")


def _loss(arms: dict[str, list[dict[str, Any]]]) -> str:
    """Where the interactive loss is: requests served per client region, and the time per
    output token of chat requests beside a decoding batch job and without one."""
    regions, rows = _per_region(arms, "interactive_ok_by_region", ".0f")
    out = []
    for label, rs, cells in rows:
        out.append([label, *cells, num(_med(rs, "interactive_beside_batch"), ".0f"),
                     num(_ms(_med(rs, "interactive_tpot_p50_beside_batch_s")), ".0f",
                         suffix=" ms"),
                     num(_ms(_med(rs, "interactive_tpot_p50_alone_s")), ".0f", suffix=" ms"),
                     num(_med(rs, "batch_after_peak"), ".0%")])
    return table(["arm", *(f"{g} served" for g in regions), "chat beside batch",
                  "TPOT p50 beside batch", "TPOT p50 without", "batch run after the peak"],
                 out, [False, *([True] * (len(regions) + 4))])


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def _against_fcfs(arms: dict[str, list[dict[str, Any]]], att: float, served: float) -> str:
    fcfs = arms.get("fcfs", [])
    f_att, f_served = _med(fcfs, "interactive_slo_attainment"), _med(fcfs, "interactive_ok")
    if f_att is None or f_served is None:
        return ""
    said = ("recovers part of the loss" if att > f_att and served > f_served
            else "gains nothing clear")
    return (f" Against batch first come first served ({f_att:.1%}, {f_served:.0f} "
            f"requests served) the rule {said} ({att:.1%}, {served:.0f}).")


def _goal(arms: dict[str, list[dict[str, Any]]], arm: str) -> tuple[str, str, bool] | None:
    """An arm's attainment (against no batch), share of chat served and whether the goal
    holds for it: medians over the seeds, as :func:`verdict` judges them."""
    nb, rs = arms.get("no_batch", []), arms.get(arm, [])
    base, att = _med(nb, "interactive_slo_attainment"), _med(rs, "interactive_slo_attainment")
    served0, served = _med(nb, "interactive_ok"), _med(rs, "interactive_ok")
    by = _med(rs, "batch_by_deadline")
    if base is None or att is None or not served0 or served is None or by is None:
        return None
    ok = (att >= base - SLO_TOLERANCE and served >= (1 - SERVED_TOLERANCE) * served0
          and by >= 0.99)
    return (f"{att:.1%} ({(att - base) * 100:+.1f})", f"{served / served0:.1%}", ok)


def _room_sweep(doc: dict[str, Any]) -> list[str]:
    """The rule at other ``room_per_replica`` values than the default, both scenarios."""
    default = doc.get("setup", {}).get("room_per_replica")
    peak, night = _arms(doc, "peak"), _arms(doc, "night")
    rooms = sorted({int(a.removeprefix("mesh_rule_room")) for a in peak
                    if a.startswith("mesh_rule_room")})
    if not rooms or default is None:
        return []
    rows = []
    for n in sorted({*rooms, default}):
        arm = "mesh_rule" if n == default else f"mesh_rule_room{n}"
        cells = [_goal(peak, arm), _goal(night, arm)]
        if None in cells:
            continue
        row = [f"{n}{' (default)' if n == default else ''}"]
        for c in cells:
            assert c is not None
            row += [c[0], c[1]]
        row.append("holds" if all(c is not None and c[2] for c in cells) else "does not hold")
        rows.append(row)
    return ["### The rule at other `room_per_replica` values", "",
            "Interactive SLO attainment (points against no batch) and chat requests served "
            "(share of no batch) at us's peak and at night, medians over the seeds; the "
            "goal in both scenarios.", "",
            table(["room_per_replica", "peak: attainment", "peak: served", "night: attainment",
                   "night: served", "goal"], rows, [False, True, True, True, True, False]), ""]


def _arms(doc: dict[str, Any], scenario: str) -> dict[str, list[dict[str, Any]]]:
    arms: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        if r.get("scenario", "peak") == scenario:
            arms.setdefault(r["arm"], []).append(r)
    return arms


def _main_table(arms: dict[str, list[dict[str, Any]]]) -> str:
    rows = []
    for arm, label in ARMS.items():
        rs = arms.get(arm)
        if not rs:
            continue
        sent = _med(rs, "batch_sent")
        rows.append([label, str(len(rs)), num(_med(rs, "interactive_slo_attainment"), ".1%"),
                     num(_med(rs, "interactive_ttft_p50_s"), ".2f", suffix=" s"),
                     num(_med(rs, "interactive_ttft_p90_s"), ".2f", suffix=" s"),
                     num(_med(rs, "interactive_us_ttft_p90_s"), ".2f", suffix=" s"),
                     num(_med(rs, "interactive_ok"), ".0f"),
                     f"{_med(rs, 'batch_ok'):.0f} / {sent:.0f}" if sent else "-",
                     num(_med(rs, "batch_by_deadline"), ".1%") if sent else "-",
                     num(_med(rs, "batch_e2e_p90_s"), ".0f", suffix=" s") if sent else "-"])
    return table(["arm", "seeds", "interactive SLO attainment", "TTFT p50", "TTFT p90",
                  "us TTFT p90", "interactive done", "batch done / sent",
                  "batch by deadline", "batch end-to-end p90"], rows,
                 [False, *([True] * 9)])


def _night(doc: dict[str, Any]) -> list[str]:
    """The same arms with eu and asia at night: where the mesh part of the rule acts."""
    arms = _arms(doc, "night")
    if not arms:
        return []
    clients = doc.get("setup", {}).get("scenarios", {}).get("night", {})
    rule = arms.get("mesh_rule", [])
    sent = sum(sum(where.values()) for r in rule for o, where in r.get("batch_ran", {}).items()
               if o == "us")
    away = sum(n for r in rule for o, where in r.get("batch_ran", {}).items() if o == "us"
               for g, n in where.items() if g != "us")
    said = (f" Under the rule {away / sent:.0%} of us's batch jobs ran in eu or asia."
            if sent else "")
    lines = ["## The same hour with eu and asia at night", "",
             "Chat clients " + " / ".join(f"{g} {n}" for g, n in clients.items())
             + ": eu and asia have few clients of their own, while us is at its peak. "
             "Their replicas are not idle for all that: they take us's interactive "
             "overflow (SkyLB's forwarding) first, as they should, and run a few "
             "requests each; that is room for batch (`batch_routing.room`: "
             "`room_per_replica` requests on each replica beyond the reserve, less what "
             "runs there)." + said, "", _main_table(arms), "", verdict(arms, " at night"), ""]
    if any(r.get("chat_served_in") for rs in arms.values() for r in rs):
        lines += ["Where the loss is, by the region that served the chat requests "
                  "(medians over the seeds):", "", _served_in(arms), ""]
    if rule:
        lines += ["Where batch ran under the rule, summed over the seeds:", "", _ran(rule), ""]
        if any(r.get("batch_started_in_peak") for r in rule):
            lines += ["Of those, the batch jobs that started during the peak:", "",
                      _peak_ran(rule), ""]
    return lines


def tenancy_mesh(doc: dict[str, Any]) -> str:
    s = doc.get("setup", {})
    arms = _arms(doc, "peak")
    clients = s.get("clients", {})
    lines = [
        "## Setup", "",
        f"Regions {', '.join(s.get('regions', []))}; ShareGPT chat clients "
        f"{' / '.join(str(clients.get(r, '?')) for r in s.get('regions', []))} (the "
        f"diurnal workload at us's peak), {s.get('replicas', '?')} replicas spread evenly, "
        f"`{s.get('policy', '?')}`, SkyLB's `{s.get('forwarding_rule', '?')}` forwarding, "
        f"{s.get('duration_s', 0):.0f} simulated seconds. The batch tenant: "
        f"{s.get('batch_per_s_per_region', '?')} jobs/s per region (Poisson; "
        f"{s.get('batch_prompt', '?')} prompt, {s.get('batch_output', '?')} output tokens), "
        f"each with a deadline of {s.get('deadline_s', 0):.0f} s (the day is compressed: "
        "the seconds stand for `tenants.batch_mesh.deadline_h`'s hours); "
        "`tenants.batch_mesh`'s defaults: `reserve` "
        f"{s.get('reserve', '?')}, `max_per_replica` {s.get('max_per_replica', '?')}, "
        f"`room_per_replica` {s.get('room_per_replica', 1)}, "
        f"`urgent_h` as {s.get('urgent_s', 0):.0f} s. The chat clients stop at the end "
        "of the run and what they sent drains: the simulated day's trough. "
        "Interactive SLO: "
        f"TTFT within {s.get('ttft_slo_s', '?')} s. Medians over seeds "
        f"{s.get('seeds', [])}.", "",
        "## Interactive SLO attainment and batch deadlines", "",
        _main_table(arms), "",
        verdict(arms, " at us's peak"), "",
    ]
    if any(r.get("interactive_ok_by_region") for rs in arms.values() for r in rs):
        lines += ["### Where the interactive loss is", "",
                  "Chat requests served by the clients' region; chat requests that shared "
                  "their replica with a decoding batch job, and the median time per "
                  "output token with and without one; the share of batch jobs whose "
                  "first token came after the chat clients stopped.", "",
                  _loss(arms), ""]
    if any(r.get("chat_served_in") for rs in arms.values() for r in rs):
        lines += ["By the region that served the chat requests: requests served, those "
                  "past the TTFT SLO, and those that shared their replica with a decoding "
                  "batch job, by that job's home region (medians over the seeds).", "",
                  _served_in(arms), ""]
    if any(r.get("interactive_slo_by_region") for rs in arms.values() for r in rs):
        lines += ["### Interactive SLO attainment by the clients' region", "",
                  _by_region(arms), ""]
    for arm in ("fcfs", "mesh_rule"):
        if arms.get(arm):
            lines += [f"### Where batch ran: {ARMS[arm]}", "",
                      "Batch jobs by the region they came from and the one that served "
                      "them, summed over the seeds.", "", _ran(arms[arm]), ""]
            if arms[arm][0].get("batch_started_in_peak") is not None:
                lines += ["Of those, the batch jobs that started during the peak:", "",
                          _peak_ran(arms[arm]), ""]
    return "\n".join(lines + _night(doc) + _room_sweep(doc))
