"""The results page of ``skymesh_lab.bench.dispatch_cost``: the decision core's CPU per
request, by policy and pushing mode, against the commit before the incremental state.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

from typing import Any

LIVE = "dispatch-cost-live"  # the attached live run (results_pages.Source.attach)
DEFAULT = "prefix-tree+sp-p"
BASELINE = "round-robin+bp"
STUBS = "@stubs"  # the live benchmark's shape (dispatch_cost.StubBench)
ORDER = (BASELINE, DEFAULT, "least-load+sp-p", BASELINE + STUBS, DEFAULT + STUBS,
         "prefix-tree+bp" + STUBS)


def _row(name: str, cur: dict[str, Any], base: dict[str, Any] | None,
         speedup: float | None, same: bool | None) -> str:
    c = cur["modes"][name]
    now = f"{c['us_per_request']:g} [{c['min']:g}, {c['max']:g}]"
    if base is None:
        return f"| {name} | {now} | - | - | - |"
    b = base["modes"][name]
    before = f"{b['us_per_request']:g} [{b['min']:g}, {b['max']:g}]"
    return (f"| {name} | {now} | {before} | {speedup:g}x | "
            f"{'yes' if same else 'NO'} |")


def dispatch_cost(doc: dict[str, Any]) -> str:
    setup, cur, base = doc["setup"], doc["current"], doc.get("base")
    label = base.get("label", "base") if base else "-"
    out = ["| mode (policy + pushing) | CPU us per request, now [min, max] "
           f"| at `{label}` [min, max] | faster | same decisions |",
           "| --- | ---: | ---: | ---: | :---: |"]
    for name in sorted(cur["modes"], key=lambda n: ORDER.index(n) if n in ORDER else 9):
        out.append(_row(name, cur, base, (doc.get("speedup") or {}).get(name),
                        (doc.get("same_decisions") or {}).get(name)))
    def extra(d: dict[str, Any], suffix: str = "") -> str:
        m = d["modes"]
        more = m[DEFAULT + suffix]["us_per_request"] - m[BASELINE + suffix]["us_per_request"]
        return f"{more:.0f} us"

    ratio = (f"The default ({DEFAULT}) costs **{cur['default_over_round_robin']:g}x** "
             f"{BASELINE} per request now, {extra(cur)} more")
    if base:
        ratio += (f"; {base['default_over_round_robin']:g}x, {extra(base)} more, at "
                  f"`{label}`")
    stubs = cur.get("stubs_default_over_round_robin")
    if stubs is not None:
        ratio += (f". In the live benchmark's shape ({STUBS}) it costs **{stubs:g}x** "
                  f"now, {extra(cur, STUBS)} more")
        if base and base.get("stubs_default_over_round_robin") is not None:
            ratio += (f"; {base['stubs_default_over_round_robin']:g}x, "
                      f"{extra(base, STUBS)} more, at `{label}`")
    differ = [n for n, same in (doc.get("same_decisions") or {}).items() if not same]
    notes = [
        "\n".join(out),
        ratio + " (both measured in the same run). The daemon's own per-request work "
        "(HTTP, JSON, logging, the upstream call) comes on top of these figures and is the "
        "same for every mode, so the ratio of whole-daemon CPU per request is smaller.",
    ]
    if differ:
        notes.append(
            f"Decisions differ from `{label}` for {', '.join(differ)}, on purpose: a "
            "request's ties between equally good replicas now break by a key of its own, "
            "set when it is queued (`RouteRequest.tie`: its id hashed with a salt drawn "
            "once from the policy's RNG), not by a fresh draw at each ask, so a re-asked "
            "policy answers as before and the dispatcher may skip the ask. Ties break "
            "differently, so the sequence of decisions does; the simulator pages that "
            "depend on these policies were rerun with it (quality within noise: see each "
            "page).")
    notes += [
        f"Setup: {setup['replicas']} replicas of {setup['max_num_seqs']} slots "
        f"(`max_num_seqs`, sp-p's `prefer_queue` {setup['prefer_queue']}), "
        f"{setup['clients']} closed-loop tree-of-thoughts clients, {setup['requests']:,} "
        f"requests per run, {setup['repeat']} interleaved runs (median, [min, max]), "
        f"seed {setup['seed']}. \"Same decisions\": the digest of every (request, replica) "
        "decision in order is equal in both versions.",
    ]
    st = setup.get("stubs")
    if st is not None:
        notes.append(
            f"{STUBS}: the live section's shape: {st['replicas']} replicas that publish "
            "neither `max_num_seqs` nor a KV capacity (the decision core alone, with no "
            "limit learned: sp-p gives each one request until "
            "its first byte, a few more to the one holding the prompt's prefix, "
            f"`prefer_queue`; metrics lag {st['metrics_lag_s']:g} s), {st['clients']} "
            f"clients each sending one of {st['prompts']} shared "
            f"{st['prompt_chars']:,}-character prompts with a short question of its own, "
            "answered at once; prefix-tree with blind pushing shows what sp-p's standing "
            "queue adds. Here a replica is refilled as soon as it frees, so most pumps "
            "find no replica that could take a request and ask nothing; with free slots "
            "(the rows above) a pump usually has a replica to offer, and the policy is "
            "asked about the requests whose answers changed, as before.")
    live = doc.get(LIVE)
    if live is not None:
        notes.append(live_section(live))
        cur_live = live["versions"].get("current")
        if cur_live is not None and stubs is not None:
            c = cur_live["configs"]
            gap = c["default"]["median"] - c["rr"]["median"]
            notes.append(
                f"Of the live gap now ({gap:.0f} us per request between the medians), the "
                f"decision core accounts for about {extra(cur, STUBS)} (the {STUBS} rows, "
                "prefix keys and trie included); the rest is the daemon's own work around "
                "a request, and the chat prompt's rendering on the request path. While "
                "sp-p held each stub at a request or two (before the balancer learned "
                "that they take all they are sent, issue #35), a queue stood at the "
                "balancer: each request's dispatch was awaited, with more event-loop "
                "passes per request while few were in flight to each replica. Profiled "
                "live then (py-spy, the "
                "default against `--push-mode bp` with the same policy), that rest was "
                "mostly user time spread over the request path, the pumps' share (the "
                "balancer's pump around the dispatcher's) the largest single part; the "
                "queued request's own wait (its future, its queue timeout, now one swept "
                "heap for all waiters instead of a loop timer each) was a few "
                "microseconds, and the system time (socket writes that wake a replica "
                "idling between requests) added less than the user time.")
    return "\n\n".join(notes)


def _cell(c: dict[str, Any]) -> str:
    return f"{c['median']:g} [{c['min']:g}, {c['max']:g}]"


def _limits_note(versions: dict[str, Any], connections: int) -> str:
    """What limits sp-p applied to the stubs at the segments' ends, per version."""
    out = []
    for v, name in (("current", "now"), ("base", "at the base")):
        seen = [x for seg in versions.get(v, {}).get("configs", {}).get("default", {})
                .get("limits", []) for x in seg if x is not None]
        if seen:
            out.append(f"{name} {min(seen)}-{max(seen)}" if min(seen) != max(seen)
                       else f"{name} {seen[0]}")
    if not out:
        return ""
    return ("; the limit per stub at a segment's end (`/status` `max_num_seqs`, the "
            f"default's segments): {', '.join(out)}, for {connections} connections on "
            "two stubs")


def live_section(live: dict[str, Any]) -> str:
    """The whole daemon's CPU per request, default against round-robin + bp
    (``skymesh_lab.bench.dispatch_cost_live``)."""
    setup, versions = live["setup"], live["versions"]
    rows = ["| version | default: CPU us per request, median [min, max] | round-robin + bp "
            "| default/rr per round | median |",
            "| --- | ---: | ---: | --- | ---: |"]
    for v, name in (("current", "now"), ("base", f"`{setup.get('base')}`")):
        r = versions.get(v)
        if r is None:
            continue
        per_round = ", ".join(f"{x:g}" for x in r["ratio_rounds"])
        rows.append(f"| {name} | {_cell(r['configs']['default'])} | "
                    f"{_cell(r['configs']['rr'])} | {per_round} | "
                    f"**{r['ratio_median']:g}x** |")
    flags = setup["configs"]
    return "\n\n".join([
        "## The whole daemon, live",
        "\n".join(rows),
        f"skymesh-lb (`--workers {setup['workers']}`) in front of the router-overhead "
        f"benchmark's two C stub backends, wrk on {setup['connections']} connections with "
        "its shared-prefix bodies; the balancer's process CPU (user + system, from /proc) "
        "per completed request, a fresh balancer per segment, "
        f"{setup['rounds']} rounds of {setup['duration_s']:g} s segments shuffled in each "
        f"round (seed {setup['seed']}), each after {setup.get('warmup_s', 1.0):g} s of "
        "the same load, not counted. default: "
        f"`{flags['default']}`; rr: `{flags['rr']}`. The stubs publish neither "
        "`max_num_seqs` nor a KV capacity, and their gauges read 0 while they answer at "
        "once, not streamed. sp-p learns each one's limit from what it takes "
        "(`skymesh.balancer.seqcap`: a probe showing nothing running and no queue while "
        "the limit bound, "
        "with nothing of ours left unstarted, doubles it)"
        + _limits_note(versions, setup["connections"]) + ". Beyond rr, the default hashes the "
        "prompt's keys (once per distinct keyed text), inserts into the trie at dispatch "
        "and again with the reply, and at each pump (an arrival, a first byte, a "
        "completion) where some replica can take a request re-asks the policy about the "
        "requests in the queue's window whose last answer read a load or a trie record "
        "that changed since, in queue order until one goes; a pump where no replica is "
        "available and none may take a request holding its prefix there (most of them: "
        "the replicas are refilled as soon as they free) asks nothing. A tie between two "
        "replicas holding a prompt's prefix breaks by the request's own key, set once, "
        "so it no longer forces a re-ask (the queue is searched for stranded requests "
        "only while a queued model has no healthy replica here or a breaker is open). "
        "Measured "
        f"{setup['date']} on {setup['cpus']} CPUs shared with other jobs (load average "
        f"{setup['load_average_1m_at_start']:g} at start), commit `{setup['commit']}`; "
        "per-round ratios spread widely on the loaded machine, so the median is the "
        "figure.",
        f"```sh\n{live['command']}\n```",
    ])
