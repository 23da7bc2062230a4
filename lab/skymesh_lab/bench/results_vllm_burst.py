"""The results page of ``tools/e2e/burst_bench.py``: the burst on real vLLM, per push mode,
over rounds run in a balanced order (``tools/e2e/burst_stats.py`` says why and how).

Reads only the JSON it is given. A figure over rounds prints as "mean (min-max)"; the
paired ratios are per round, so they compare two modes that met the same machine minutes
apart.
"""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.results_tables import num, pct, secs, table


def _spread(s: dict[str, Any] | None, fmt: str, unit: str = "") -> str:
    if not s or s.get("mean") is None:
        return "-"
    mean = f"{num(s['mean'], fmt)}{unit}"
    if s.get("n", 0) < 2 or s.get("min") == s.get("max"):
        return mean
    return f"{mean} ({num(s['min'], fmt)}-{num(s['max'], fmt)})"


def _modes_table(data: dict[str, Any]) -> str:
    rows = []
    for mode, agg in data.get("modes", {}).items():
        for name, srv in agg.get("servers", {}).items():
            rows.append([mode, name, _spread(srv.get("waiting_mean"), ".2f"),
                         num((srv.get("waiting_max") or {}).get("max"), "g"),
                         _spread(srv.get("running_when_backlogged_mean"), ".2f"),
                         _spread(agg.get("lb_queue_mean"), ".1f"),
                         _spread(agg.get("ttft_p50_s"), ".1f", " s"),
                         _spread(agg.get("ttft_p90_s"), ".1f", " s"),
                         _spread(agg.get("completion_s"), ".1f", " s"),
                         num(_total(data, mode, "failed"), "d")])
    return table(["push mode", "server", "vLLM waiting, mean", "max", "running while work "
                  "waits", "balancer queue, mean", "TTFT p50", "TTFT p90", "all done",
                  "failed"], rows, [False, False] + [True] * 8)


def _total(data: dict[str, Any], mode: str, key: str) -> int | None:
    vals = [r["runs"][mode].get(key) for r in data.get("rounds", []) if mode in r["runs"]]
    return sum(v for v in vals if v is not None) if vals else None


def _ratio(x: Any) -> str:
    return num(x, ".2f")


def _paired_table(data: dict[str, Any]) -> str:
    rows = []
    for pair, figs in data.get("paired", {}).items():
        for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"),
                           ("completion_s", "all done")):
            f = figs.get(key, {})
            ci = f.get("ci95") or [None, None]
            rows.append([pair, label, " / ".join(_ratio(x) for x in f.get("per_round", [])),
                         _ratio(f.get("geomean")), f"{_ratio(ci[0])}-{_ratio(ci[1])}"])
    return table(["ratio", "figure", "per round", "geometric mean", "95% interval"], rows,
                 [False, False, True, True, True])


def _position_table(data: dict[str, Any]) -> str:
    pos = data.get("by_position", {})
    keys = (("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"), ("completion_s",
                                                                      "all done"))
    width = max((len(v) for v in pos.values()), default=0)
    rows = [[str(i + 1), *(_ratio((pos.get(k) or [None] * width)[i]) for k, _ in keys)]
            for i in range(width)]
    return table(["position in its round", *(label for _, label in keys)], rows,
                 [True] * (1 + len(keys)))


def _rounds_table(data: dict[str, Any]) -> str:
    rows = []
    for rnd in data.get("rounds", []):
        for i, mode in enumerate(rnd.get("order", [])):
            r = rnd["runs"][mode]
            cpu = r.get("cpu_s", {})
            servers = [v for k, v in sorted(cpu.items()) if k.startswith("s")]
            rss = r.get("rss_mb", {})
            rows.append([str(rnd.get("round")), str(i + 1), mode, secs(r.get("ttft_p50_s"), 1),
                         secs(r.get("completion_s"), 1), num(r.get("loadavg_mean"), ".1f"),
                         num(r.get("runnable_mean"), ".1f"),
                         " / ".join(num(v, ".0f") for v in servers) or "-",
                         num(_cores(r, servers), ".2f"),
                         num(cpu.get("lb"), ".1f"), num(cpu.get("bench"), ".1f"),
                         num(cpu.get("others"), ".0f"),
                         " / ".join(num(v, ".0f") for _, v in sorted(rss.items())) or "-",
                         _hits(r.get("prefix_cache")), num(r.get("unhealthy_flips"), "d")])
    return table(["round", "position", "mode", "TTFT p50", "all done", "load average",
                  "runnable tasks", "CPU s, servers", "servers' cores", "CPU s, balancer",
                  "CPU s, benchmark", "CPU s, others", "server RSS MB", "prefix-cache hits",
                  "replica flips"], rows, [True, True, False] + [True] * 12)


def _cores(run: dict[str, Any], servers: list[float]) -> float | None:
    wall = run.get("completion_s")
    return sum(servers) / wall if servers and wall else None


def _hits(pc: dict[str, Any] | None) -> str:
    if not pc or pc.get("query_tokens") is None:
        return "-"
    return f"{num(pc.get('hit_tokens'), ',.0f')} of {num(pc['query_tokens'], ',.0f')}"


def _limit(cap: Any, source: Any) -> str:
    return "-" if cap is None and source is None else f"{num(cap, 'd')} {source or '?'}"


def _caps(data: dict[str, Any]) -> list[str]:
    """Per run and server, the balancer's admission limit from ``/status`` (told, learned
    or unknown) beside vLLM's own waiting, when the run recorded it (``sp-p-told`` and
    ``sp-p-learned``): where the queue formed, told the limit or learning it."""
    rows = []
    for rnd in data.get("rounds", []):
        for mode in rnd.get("order", []):
            for name, srv in sorted(rnd["runs"][mode].get("servers", {}).items()):
                if "lb_max_num_seqs_source" not in srv:
                    continue
                rows.append([str(rnd.get("round")), mode, name,
                             num(srv.get("waiting_mean"), ".2f"),
                             num(srv.get("waiting_max"), "g"),
                             _limit(srv.get("lb_max_num_seqs_at_start"),
                                    srv.get("lb_max_num_seqs_source_at_start")),
                             _limit(srv.get("lb_max_num_seqs"),
                                    srv.get("lb_max_num_seqs_source")),
                             secs(srv.get("learned_after_s"), 1)])
    if not rows:
        return []
    return ["", "The balancer's admission limit per server (`/status`: `max_num_seqs` and "
            "`max_num_seqs_source`) as each measured burst began (after its warm-up) and "
            "at its end, with vLLM's own waiting in that burst; \"learned after\": the "
            "first sample in the burst that showed it learned (under `bp` the limit is "
            "not used):", "",
            table(["round", "mode", "server", "vLLM waiting, mean", "max",
                   "limit at start", "limit at end", "learned after"], rows,
                  [True, False, False, True, True, False, False, True])]


def _control(ctl: dict[str, Any] | None) -> list[str]:
    """The control run, when attached: one mode repeated in a fixed order on the same
    servers, no warm-up. A burst that costs more or runs slower the later it comes would
    show here, with nothing else changing."""
    if not ctl:
        return []
    st = ctl.get("setup", {})
    modes = sorted({m for r in ctl.get("rounds", []) for m in r.get("runs", {})})
    return ["", f"Control ({st.get('generated_at')}, load average "
            f"{num((st.get('loadavg_at_start') or [None])[0], '.1f')} before it): "
            f"`{', '.join(modes)}` {len(ctl.get('rounds', []))} times in a row on the same "
            f"servers, order {st.get('order')}, "
            + (f"warm-up {st.get('warmup_max_tokens')} tokens" if st.get("warmup_max_tokens")
               else "no warm-up") + ":", "", _rounds_table(ctl)]


def _contention(c: dict[str, Any] | None) -> list[str]:
    if not c or c.get("completion_vs_servers_cores_r") is None:
        return []
    return ["", f"Over all {c.get('runs')} runs, Pearson's r of a burst's completion time "
            f"with the cores the servers got: {num(c['completion_vs_servers_cores_r'], '.2f')}"
            f"; with the cores everything else took: "
            f"{num(c.get('completion_vs_others_cores_r'), '.2f')}."]


def _hit_rates(data: dict[str, Any]) -> list[str]:
    """vLLM's prefix-cache hit rate per mode, where the run recorded it."""
    rates = [(m, s["prefix_hit_rate"]) for m, s in data.get("modes", {}).items()
             if isinstance(s.get("prefix_hit_rate"), dict)]
    if not rates:
        return []
    return ["vLLM's prefix-cache hit rate (hit over queried prompt tokens), mean over "
            "rounds (min-max): " + "; ".join(
                f"{m} {pct(r.get('mean'))} ({pct(r.get('min'))}-{pct(r.get('max'))})"
                for m, r in rates) + ".", ""]


def _prefix_groups(st: dict[str, Any]) -> str:
    """What a shared-prefix burst (``--prefix-groups``) adds to the setup."""
    groups = st.get("prefix_groups")
    if not groups:
        return ""
    return (f" The streams fall into {groups} groups sharing a prefix of "
            f"{st.get('prefix_chars')} characters (GSM8K questions; a suffix of at most "
            f"{st.get('suffix_chars')}), like a tree of thought's children: each group's "
            f"parent (the prefix alone, {st.get('parent_max_tokens')} tokens) goes through "
            "the balancer first, once it shows both servers idle, and every run (the "
            "warm-up too) opens its prompts with its own nonce, since the servers' KV "
            "cache outlives a run. `sp-p` runs the balancer's defaults (the queue for the "
            "prefix's replica on: `prefer_queue` 3 for `kind: vllm`, `hold_queue_max` 48); "
            "`sp-p-strict` is SkyLB's rule (`prefer_queue: 0`, `hold_queue_max: null`). "
            "vLLM-CPU caches whole 128-token blocks only, so the hit rate's ceiling is "
            "about two thirds of the prompt tokens.")


def _told_learned(data: dict[str, Any]) -> str:
    modes = {m for r in data.get("rounds", []) for m in r.get("order", [])}
    if not modes & {"sp-p-told", "sp-p-learned"}:
        return ""
    return (" `sp-p-told` and `sp-p-learned` run the balancer's defaults for a `kind: vllm` "
            "replica (`engine_queue` 1), told `max_num_seqs` 4 (`pushing.max_num_seqs`) or "
            "not: then sp-p learns it from the probes (`skymesh.balancer.seqcap`), afresh "
            "in every run, since each run has a balancer of its own.")


def vllm_burst(data: dict[str, Any]) -> str:
    st = data.get("setup", {})
    n_rounds = len(data.get("rounds", []))
    warm = st.get("warmup_max_tokens")
    before = (st.get("loadavg_at_start") or [None])[0]
    head = (f"{st.get('servers')} servers of {st.get('engine')} ({st.get('model')}, "
            f"max_num_seqs {st.get('max_num_seqs')}), policy `{st.get('policy')}`, "
            f"{st.get('requests')} streams fired at once, "
            f"{'..'.join(str(x) for x in st.get('max_tokens', []))} tokens each; "
            f"{n_rounds} rounds, order {st.get('order')}, each measured burst after a "
            + (f"warm-up burst of the same prompts ({warm} tokens each) through the same "
               "balancer." if warm else "fresh balancer, no warm-up.")
            + _prefix_groups(st)
            + f" Load average before the run: {num(before, '.1f')}"
            f" on {st.get('cores', '?')} cores"
            + "".join(f"; rounds from {p.get('from_round')} on resumed at {p.get('at')} "
                      f"(load average {num((p.get('loadavg_at_start') or [None])[0], '.1f')})"
                      for p in st.get("resumed", []))
            + (". The servers were up before the run (`--servers`), the same two for every "
               "round" if st.get("servers_started_here") is False else "")
            + ". `sp-p+K` is `sp-p` letting K requests wait inside each server "
              "(`pushing.engine_queue` K, a vLLM replica's default being 1; these rounds "
              "set it as `max_num_seqs` 4 + K, the same rule)."
            + _told_learned(data))
    return "\n".join([
        head, "", "Per mode, mean over rounds (min-max):", "", _modes_table(data), "",
        *_hit_rates(data),
        "Paired: one mode's figure over the other's in the same round (below 1: the first "
        "is better; an interval that holds 1.00: these rounds cannot tell the two apart):",
        "", _paired_table(data), *_caps(data), "",
        "The order effect: each run's figure over its mode's mean, by its position in the "
        "round (1.00 everywhere: no order effect):", "", _position_table(data), "",
        "Every run, with what its burst cost in CPU seconds (each server's API server and "
        "engine core; \"others\": the rest of the machine, other people's work included), "
        "the cores the servers kept busy on average, and the servers' memory after it:", "",
        _rounds_table(data), *_contention(data.get("contention")),
        *_control(data.get("control")),
        "", "\"Running while work waits\" is a server's running count over the samples in "
        "which a request waited for a slot (at the balancer or inside that server): "
        f"{st.get('max_num_seqs')} when freed slots are refilled at once. A replica flip is "
        "a replica taken out of rotation because its `/metrics` answered later than the "
        "probe's 1 s timeout."])
