"""The results page of ``skymesh_lab.bench.lb_workers``: skymesh-lb with 1 and N workers.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench import dispatch_cost_page

WORKERS_LIVE = "dispatch-cost-live-workers2"  # attached (results_pages.Source.attach)


# What a run that recorded no server ran: those runs were made before session 25, when
# aiohttp's server was the balancer's only one.
_UNRECORDED = "not recorded in the run (aiohttp's, the default before session 25)"


def server_name(server: str | None) -> str:
    """An HTTP server (``listen.http_server``) as the page names it."""
    return _UNRECORDED if server is None else f"`{server}`"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _spread(vals: list[float], fmt: str) -> str:
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def locality_table(doc: dict[str, Any]) -> str:
    runs = doc["locality"]["runs"]
    counts = doc["setup"]["workers"]
    base = doc["locality"]["median_hit_rate"].get(str(counts[0]))
    out = ["| workers | runs | prefix hit rate, median | range | vs 1 worker, points | failed |",
           "| ---: | ---: | ---: | --- | ---: | ---: |"]
    for n in counts:
        rows = [r for r in runs if r["workers"] == n]
        med = doc["locality"]["median_hit_rate"].get(str(n))
        diff = "-" if med is None or base is None else f"{100 * (med - base):+.1f}"
        out.append(f"| {n} | {len(rows)} | {_pct(med)} "
                   f"| {_spread([100 * r['hit_rate'] for r in rows if r['hit_rate']], '.1f')} "
                   f"| {diff} | {sum(r['failed'] for r in rows)} |")
    return "\n".join(out)


def share_sentence(doc: dict[str, Any]) -> str:
    """How much the workers told each other in the locality runs (``/status``'s share)."""
    rows = [r for r in doc["locality"]["runs"] if r.get("share_sent") is not None]
    if not rows:
        return ""
    sent = sum(r["share_sent"] for r in rows)
    applied = sum(r["share_applied"] for r in rows)
    reqs = sum(r["requests"] for r in rows)
    return (f" Over the {len(rows)} runs with more than one worker the workers told each "
            f"other {sent:,} trie inserts for {reqs:,} requests ({100 * sent / reqs:.0f} "
            f"per 100; each request inserts twice, at dispatch and with its reply) and "
            f"applied {applied:,}: only inserts that changed the sender's trie are "
            "sent, a repeat of a recorded decision is not.")


def cost_section(live: dict[str, Any]) -> str:
    """The default path's CPU per request with N workers against round-robin + bp, now and
    at a base revision (``skymesh_lab.bench.dispatch_cost_live --workers N``)."""
    setup, versions = live["setup"], live["versions"]
    cur, base = versions.get("current"), versions.get("base")
    servers = setup.get("http_server") or {}
    served = ("HTTP server (`listen.http_server`, each version's default): "
              + ", ".join(f"{'now' if v == 'current' else f'`{setup[v]}`'} "
                          f"{server_name(servers.get(v))}" for v in versions) + ". ")
    summary = ""
    if cur is not None and base is not None:
        d_now = cur["configs"]["default"]["median"]
        d_base = base["configs"]["default"]["median"]
        summary = (f"The default path costs {d_now:g} us of CPU per request now against "
                   f"{d_base:g} at `{setup['base']}` ({abs(d_base - d_now):.0f} us "
                   f"{'less' if d_now <= d_base else 'more'}), "
                   f"{cur['ratio_median']:g}x round-robin + bp against "
                   f"{base['ratio_median']:g}x. ")
    text = [f"## The default path's CPU with {setup['workers']} workers", "",
            dispatch_cost_page.live_table(live), "", summary +
            f"skymesh-lb with `--workers {setup['workers']}` in front of the router-overhead "
            f"benchmark's two C stub backends, wrk on {setup['connections']} connections "
            "with its shared-prefix bodies (16 shared 2 KB system prompts, a question of "
            "each request's own); the CPU of the supervisor and every worker (user + "
            "system, from /proc) per completed request, a fresh balancer per segment, "
            f"{setup['rounds']} rounds of {setup['duration_s']:g} s segments shuffled in "
            f"each round (seed {setup['seed']}). default: `{setup['configs']['default']}`; "
            f"rr: `{setup['configs']['rr']}`. {served}The same benchmark with 1 worker is "
            "on [the dispatch-cost page](dispatch-cost.md#the-whole-daemon-live). "
            + dispatch_cost_page.measured(live),
            "", f"```sh\n{live['command']}\n```"]
    return "\n".join(text)


def simulator_table(doc: dict[str, Any]) -> str:
    sim = doc.get("simulator")
    if not sim:
        return "(not measured in this run)"
    out = ["| workload | workers | trie shared | prefix hit rate, mean of seeds | per seed "
           "| vs 1 worker, points | throughput, req/s |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    for wl, arms in sim.items():
        base = None
        for arm in arms.values():
            mean = sum(arm["hit_rate"]) / len(arm["hit_rate"])
            if base is None:
                base = mean
            rps = sum(arm["throughput_rps"]) / len(arm["throughput_rps"])
            shared = "-" if arm["workers"] == 1 else ("yes" if arm["shared"] else "no")
            out.append(f"| `{wl}` | {arm['workers']} | {shared} | {100 * mean:.1f}% "
                       f"| {', '.join(f'{100 * h:.1f}' for h in arm['hit_rate'])} "
                       f"| {round(100 * (mean - base), 1) or 0.0:+.1f} | {rps:.2f} |")
    return "\n".join(out)


def throughput_table(doc: dict[str, Any]) -> str:
    runs = doc["throughput"]["runs"]
    if not runs:
        return "(not measured in this run)"
    out = ["| path | workers | req/s, median | range | balancer CPU ms per 1,000 requests "
           "| range | non-2xx |",
           "| --- | ---: | ---: | --- | ---: | --- | ---: |"]
    for key, med in doc["throughput"]["median"].items():
        path, n = key.split("/")
        rows = [r for r in runs if r["path"] == path and str(r["workers"]) == n]
        out.append(f"| {path} | {n} | {med['rps']:,.0f} "
                   f"| {_spread([r['rps'] for r in rows], ',.0f')} "
                   f"| {med['cpu_ms_per_1k']:.0f} "
                   f"| {_spread([r['cpu_ms_per_1k'] for r in rows], '.0f')} "
                   f"| {sum(r['non_2xx'] for r in rows)} |")
    return "\n".join(out)


def lb_workers(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    load = ""
    if "load_average_1m_at_start" in s:
        load = (f" The machine is shared: load average (1 min) {s['load_average_1m_at_start']:g}"
                f" at the start, {s['load_average_1m_at_end']:g} at the end.")
    return "\n".join([
        f"Measured on {s['usable_cores']} usable cores, {s['repeats']} repeats, arms "
        f"interleaved, skymesh-lb's HTTP server (`listen.http_server`) "
        f"{server_name(s.get('http_server'))} in every live run.{load}", "",
        "## Prefix locality", "",
        f"{s['replicas']} emulated replicas, {s['clients']} closed-loop clients, "
        f"{s['requests']} requests per run over {s['groups']} shared prefixes, each on a "
        "new connection. The hit rate is the replicas' own (cached prompt tokens over "
        "prompt tokens)." + share_sentence(doc), "",
        locality_table(doc), "",
        "In the simulator (`skymesh sim --region-local --workers N`): 4 replicas, 120 s per "
        "run, prefix-tree with sp-p; \"trie shared: no\" is the counterfactual where each "
        "worker learns only its own decisions. Its chat hit rate swings by several points "
        "from seed to seed (a worker that has not seen a conversation breaks the tie "
        "between idle replicas at random), and it moved by as much when ties began to "
        "break by a key fixed per request (`RouteRequest.tie`); the shared arms, which "
        "the balancer runs, stayed where they were.", "",
        simulator_table(doc), "",
        "## Throughput and CPU", "",
        f"wrk, {s['connections']} connections, {s['duration_s']:g} s per run, non-streamed "
        "completions to two stub backends. `default` is prefix-tree with sp-p, `rr-bp` "
        "round-robin with blind pushing. wrk, the stubs and the balancer share the cores: "
        "req/s is what the machine gave all of them, CPU per request the balancer's own "
        "(supervisor and workers). The prompt is shorter than a prefix chunk (64 "
        "characters), so it has no prefix keys: the trie and its share between the "
        "workers do no work here, and what the default path costs more with 2 workers "
        "than with 1 is spent elsewhere.", "",
        throughput_table(doc),
        *(["", cost_section(doc[WORKERS_LIVE])] if WORKERS_LIVE in doc else [])])


__all__ = ["WORKERS_LIVE", "cost_section", "lb_workers", "locality_table", "server_name",
           "share_sentence", "simulator_table", "throughput_table"]
