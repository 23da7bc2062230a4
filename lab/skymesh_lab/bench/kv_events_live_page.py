"""The results page of ``skymesh_lab.bench.kv_events_live``: prefix routing on the trie vs
on real vLLM's KV-cache events, through 1, 2 and 4 balancers, and in the simulator over
three regions with 1 to 8 balancers per region (events delayed as published).

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import statistics
from typing import Any


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:,.0f}"


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


# Arms in table order. "events-only": an earlier run's events arm, when a prompt cached
# nowhere went by load instead of to the trie's pick (its rows name their commit).
LABELS = {"trie": "trie", "events-only": "events, none cached: by load", "exact": "events"}


def table(doc: dict[str, Any]) -> str:
    runs = doc["runs"] + doc.get("earlier_runs", [])
    out = ["| balancers | routing | prefix cache hit rate | TTFT mean, ms | TTFT p50, ms "
           "| TTFT p90, ms | failed | runs |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in doc["setup"]["balancers"]:
        for mode, label in LABELS.items():
            rows = [r for r in runs if r["balancers"] == n and r["mode"] == mode]
            if not rows:
                continue
            out.append(f"| {n} | {label} "
                       f"| {_pct(_med(rows, 'hit_rate'))} | {_ms(_med(rows, 'ttft_mean_s'))} "
                       f"| {_ms(_med(rows, 'ttft_p50_s'))} | {_ms(_med(rows, 'ttft_p90_s'))} "
                       f"| {sum(r['failed'] for r in rows)} | {len(rows)} |")
    return "\n".join(out)


def simulator_table(doc: dict[str, Any]) -> str:
    sim = doc.get("simulator")
    if not sim:
        return "(not measured in this run)"
    out = ["| workload | balancers | routing | prefix hit rate, mean of seeds | per seed "
           "| TTFT mean, ms | throughput, req/s |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    for wl, rows in sim.items():
        for r in rows:
            hit = statistics.fmean(r["hit_rate"])
            out.append(f"| `{wl}` | {r['balancers']} "
                       f"| {'events' if r['mode'] == 'exact' else 'trie'} | {100 * hit:.1f}% "
                       f"| {', '.join(f'{100 * h:.1f}' for h in r['hit_rate'])} "
                       f"| {_ms(statistics.fmean(r['ttft_mean_s']))} "
                       f"| {statistics.fmean(r['throughput_rps']):.2f} |")
    return "\n".join(out)


# The simulator's arms (kv_events_live.SIM_ARMS) in table order.
SIM_LABELS = {"trie": "trie", "exact": "events", "exact-no-delay": "events, no delay",
              "exact-slow": "events, {slow:g} s behind"}
SIM_COMMAND = (".venv/bin/python -m skymesh_lab.bench.kv_events_live --only sim "
               "--json docs/results/data/kv-events.json")
# Issue #36's bar: exact state keeps this share of one balancer's hit rate.
GOAL_SHARE = 0.95


def _mean(vals: list[float]) -> float:
    return statistics.fmean(vals)


def _hit(rows: list[dict[str, Any]], n: int, mode: str, key: str = "hit_rate"
         ) -> float | None:
    for r in rows:
        if r["balancers"] == n and r["mode"] == mode:
            return _mean(r[key])
    return None


def regions_table(sim: dict[str, Any]) -> str:
    """The three-region comparison: one row per workload, balancer count and arm."""
    slow = sim["setup"].get("slow_delay_s", 0.0)
    out = ["| workload | balancers per region | routing | prefix hit rate, mean of seeds "
           "| per seed | of 1 balancer's (trie) | TTFT mean, ms | TTFT p90, ms "
           "| throughput, req/s | forwarded, mean |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for wl, rows in sim["results"].items():
        base = _hit(rows, 1, "trie")
        for r in rows:
            hit = _mean(r["hit_rate"])
            label = SIM_LABELS.get(r["mode"], r["mode"]).format(slow=slow)
            share = "-" if not base else f"{100 * hit / base:.1f}%"
            out.append(f"| `{wl}` | {r['balancers']} | {label} | {100 * hit:.1f}% "
                       f"| {', '.join(f'{100 * h:.1f}' for h in r['hit_rate'])} | {share} "
                       f"| {_ms(_mean(r['ttft_mean_s']))} | {_ms(_mean(r['ttft_p90_s']))} "
                       f"| {_mean(r['throughput_rps']):.2f} | {_mean(r['forwarded']):.0f} |")
    return "\n".join(out)


def regions_verdict(sim: dict[str, Any]) -> str:
    """Issue #36's bar, per workload, at the largest balancer count: is it met?"""
    n = max(sim["setup"]["balancers_per_region"])
    lines = []
    for wl, rows in sim["results"].items():
        base, trie, exact = _hit(rows, 1, "trie"), _hit(rows, n, "trie"), _hit(rows, n, "exact")
        if not base or trie is None or exact is None:
            continue
        met = exact >= GOAL_SHARE * base
        line = (f"- `{wl}`: at {n} balancers per region events keep "
                f"{100 * exact / base:.1f}% of one balancer's hit rate ({100 * exact:.1f}% "
                f"against {100 * base:.1f}%), the trie {100 * trie / base:.1f}% "
                f"({100 * trie:.1f}%): the bar ({100 * GOAL_SHARE:.0f}%) is "
                f"{'met' if met else 'NOT met'}. TTFT mean on events "
                f"{_ms(_hit(rows, n, 'exact', 'ttft_mean_s'))} ms against "
                f"{_ms(_hit(rows, 1, 'trie', 'ttft_mean_s'))} ms at one balancer; requests "
                f"forwarded {_hit(rows, n, 'exact', 'forwarded') or 0:.0f} against "
                f"{_hit(rows, 1, 'trie', 'forwarded') or 0:.0f}.")
        costs = [(label, hit) for mode, label in (("exact-no-delay", "no delay"),
                                                 ("exact-slow", "{slow:g} s behind"))
                 if (hit := _hit(rows, n, mode)) is not None]
        if costs:
            slow = sim["setup"].get("slow_delay_s", 0.0)
            line += (" What the delay costs there: " + ", ".join(
                f"{label.format(slow=slow)} {100 * hit:.1f}%" for label, hit in costs)
                + f", against {100 * exact:.1f}% with the default delay.")
        lines.append(line)
    return "\n".join(lines)


def simulator_regions_section(doc: dict[str, Any]) -> str:
    """The page's simulator section: three regions, 1 to 8 balancers per region."""
    sim = doc["simulator_regions"]
    s = sim["setup"]
    regions = ", ".join(s["regions"])
    counts = ", ".join(str(n) for n in s["balancers_per_region"])
    seeds = ", ".join(str(x) for x in s["seeds"])
    params = s.get("workload_params", {})
    skew = params.get("sharegpt-chat", {}).get("clients_per_region")
    skew_txt = (", ".join(f"{k} {v}" for k, v in skew.items()) if isinstance(skew, dict)
                else "its default")
    return "\n".join([
        "## In the simulator: three regions, up to "
        f"{max(s['balancers_per_region'])} balancers per region", "",
        f"`skymesh_lab.sim`, {len(s['regions'])} regions ({regions}) of "
        f"{s['replicas_per_region']} emulated replicas each (the default profile), "
        f"forwarding across regions on (the default mesh), `{s['policy']}` with sp-p; "
        f"{counts} balancers per region that share nothing (`balancers_per_region`): each "
        "its own trie, each pushing with its share of the free slots, each a mesh peer of "
        "every balancer in the other regions; a client's request goes to one of its "
        f"region's balancers at random. {s['duration_s']:g} s per run, seeds {seeds}.", "",
        "Workloads: `tot-gsm8k`, tree-of-thoughts clients over GSM8K, 10 in every region "
        "(each region loaded as the live arm's replicas and as one region was before), "
        f"and `sharegpt-chat`, SkyLB's multi-turn chat clients at the diurnal experiment's "
        f"peak skew ({skew_txt}), so the busy region forwards and forwarded prefixes "
        "count too. Both carry the prompts' real prefix structure (trees, conversations "
        "that grow turn by turn), which is what the comparison is about; the open-loop "
        "traces without shared prompts (`azure2023-*`) would show no prefix effect.", "",
        "`trie`: each balancer scores prefixes on its own trie of its own decisions. "
        "`events`: `exact_prefix_state`: each replica records the blocks its cache stores "
        "and evicts, publishes them once per engine step, and the balancers apply each "
        "batch one engine step (that step's mean) plus the in-region one-way hop later "
        "(`skymesh_lab.sim.kv_view`); routing reads that delayed view, not the cache. "
        "`events, no delay`: published each step, applied at once. "
        f"`events, {s.get('slow_delay_s', 0.0):g} s behind`: a feed that far behind, at "
        "the largest balancer count. \"of 1 balancer's\": the arm's hit rate over one "
        "balancer per region on its trie, same workload.", "",
        regions_table(sim), "",
        f"Issue #36's bar: events keep >= {100 * GOAL_SHARE:.0f}% of the single balancer's "
        "hit rate where the trie falls.", "",
        regions_verdict(sim), "",
        "Where the hit rate holds and TTFT still grows with the balancer count, prefixes "
        "are not the cause (the hit rates match): the pushing is. Each balancer keeps to "
        "its share of the free slots, and the busy region forwards fewer requests (the "
        "last column); these runs do not tell the two apart.", "",
        "The simulator part alone (the live part kept from the file):", "",
        "```sh", SIM_COMMAND, "```"])


def page(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    cache = s.get("cache", {})
    load = ""
    if "load_average_1m_at_start" in s:
        load = (f" The machine is shared with other sessions: load average "
                f"(1 min) {s['load_average_1m_at_start']:g} at the start, "
                f"{s['load_average_1m_at_end']:g} at the end, so TTFT is noisy; the hit "
                "rate depends on routing only.")
    cache_txt = ""
    if cache:
        cache_txt = (f" Each server's KV cache: {cache.get('num_gpu_blocks', '?')} blocks of "
                     f"{cache.get('block_size', '?')} tokens "
                     f"({s['kv_cache_memory_bytes']:,} bytes).")
    return "\n".join([
        f"Engine: {s['engine']}, {s['replicas']} servers with KV events on.{cache_txt} "
        f"{s['docs']} documents of about {s['doc_chars']:,} characters (GSM8K questions), "
        f"{s['requests_per_arm']} streamed chat requests per run (the document as system "
        f"message, a GSM8K test question, `max_tokens` {s['max_tokens']}), "
        f"{s['clients']} closed-loop clients spread round-robin over the balancers, "
        f"`{s['policy']}`, {s['workers_per_balancer']} worker per balancer, "
        f"{s['repeats']} repeat(s), arms interleaved.{load}", "",
        "The hit rate is vLLM's own: added `vllm:prefix_cache_hits_total` over added "
        "`vllm:prefix_cache_queries_total` (prompt tokens), both servers. TTFT is the "
        "client's, to the first streamed event. Medians over repeats.", "",
        table(doc), "",
        "`trie`: each balancer scores prefixes on its own trie of its own decisions (it "
        "knows nothing of the other balancers' routing, nor of evictions). `events`: the "
        "replicas' `kv_events` and the model folder as `tokenizer`, every balancer scoring "
        "on the same exact block index ([KV-cache events](../kv-events.md)); a prompt no "
        "replica holds a block of is left to the balancer's trie, which knows where it sent "
        "the requests still in prefill (unpublished)."
        + (f" `events, none cached: by load`: the same arm at commit "
           f"`{doc['earlier_runs'][0]['commit']}`, when such a prompt went to the least "
           "loaded replica instead." if doc.get("earlier_runs") else ""), "",
        simulator_part(doc)])


def simulator_part(doc: dict[str, Any]) -> str:
    """The three-region section when measured; else an older file's one-region table."""
    if "simulator_regions" in doc:
        return simulator_regions_section(doc)
    return "\n".join([
        "## In the simulator", "",
        "`skymesh_lab.sim` with `exact_prefix_state` (each balancer reads its replicas' "
        "cache state at a request's arrival, as following the events gives, without their "
        "delay): one region of 4 emulated replicas (the default profile), 1, 2 and 4 "
        "balancers sharing nothing (each its own trie, each pushing with its share of the "
        "free slots), prefix-tree with sp-p, 120 s per run, seeds 0-2.", "",
        simulator_table(doc)])


__all__ = ["GOAL_SHARE", "LABELS", "SIM_LABELS", "page", "regions_table", "regions_verdict",
           "simulator_part", "simulator_regions_section", "simulator_table", "table"]
