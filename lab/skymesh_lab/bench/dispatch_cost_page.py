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
TOLD = "@told"  # that shape where sp-p's limit does not bind
ORDER = (BASELINE, DEFAULT, "least-load+sp-p", BASELINE + STUBS, DEFAULT + STUBS,
         "prefix-tree+bp" + STUBS, DEFAULT + TOLD)
TOLD_LIVE = "default-told"  # the live arm of the same (dispatch_cost_live)
LOADED = 0.5  # a 1-minute load average per CPU from which the page calls the machine loaded


def _row(name: str, cur: dict[str, Any], base: dict[str, Any] | None,
         speedup: float | None, same: bool | None) -> str:
    c = cur["modes"][name]
    now = f"{c['us_per_request']:g} [{c['min']:g}, {c['max']:g}]"
    b = base["modes"].get(name) if base is not None else None
    if b is None:  # no base, or a mode the base's run did not have
        return f"| {name} | {now} | - | - | - |"
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
    def extra(d: dict[str, Any], suffix: str = "", vs: str = "") -> str:
        m = d["modes"]
        more = (m[DEFAULT + suffix]["us_per_request"]
                - m[BASELINE + (vs or suffix)]["us_per_request"])
        return f"{more:.0f} us"

    ratio = (f"The default ({DEFAULT}) costs **{cur['default_over_round_robin']:g}x** "
             f"{BASELINE} per request now, {extra(cur)} more")
    if base:
        ratio += (f"; {base['default_over_round_robin']:g}x, {extra(base)} more, at "
                  f"`{label}`")

    def clause(key: str, lead: str, suffix: str, vs: str = "") -> str:
        """``lead`` it costs (``key``'s ratio) now and at the base, ``suffix``'s row
        against ``vs``'s (the same suffix's baseline when empty)."""
        r = cur.get(key)
        if r is None:
            return ""
        than = f"{BASELINE}{vs} " if vs else ""
        text = f". {lead} it costs **{r:g}x** {than}now, {extra(cur, suffix, vs)} more"
        if base and base.get(key) is not None:
            text += f"; {base[key]:g}x, {extra(base, suffix, vs)} more, at `{label}`"
        return text

    stubs = cur.get("stubs_default_over_round_robin")
    told = cur.get("told_default_over_round_robin")
    ratio += clause("stubs_default_over_round_robin",
                    f"In the live benchmark's shape ({STUBS})", STUBS)
    ratio += clause("told_default_over_round_robin",
                    f"Where sp-p's limit does not bind ({TOLD})", TOLD, STUBS)
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
            f"clients each sending one of {st['prompts']} shared system prompts of about "
            f"{st['prompt_chars']:,} characters (the live benchmark's wrk bodies) with a "
            "short question of its own, rendered as the daemon renders a chat (where the "
            "question reaches into a full chunk the keyed text is new and hashed), "
            "answered at once; prefix-tree with blind pushing shows what sp-p's standing "
            "queue adds. Here a replica is refilled as soon as it frees, so most pumps "
            "find no replica that could take a request and ask nothing; with free slots "
            "(the rows above) a pump usually has a replica to offer, and the policy is "
            "asked about the requests whose answers changed, as before.")
    td = setup.get("told")
    if td is not None:
        notes.append(
            f"{TOLD}: that shape where sp-p's limit does not bind, the live section's "
            f"`{TOLD_LIVE}`: each replica told a cap of {td['max_num_seqs']} and a queue "
            f"of {td['prefer_queue']} for the prompt's prefix (`prefer_queue`: without a "
            "published KV capacity sp-p holds a replica at one request until its first "
            "byte whatever its cap, and only the replica holding the prompt's prefix may "
            "take more), timed after the first "
            f"{td['warmup']:,} completions (until the trie holds the shared prompts, every "
            "client waits in a queue). Each request then goes at its arrival to the "
            "replica holding its prefix, with no queue at the balancer: what is left is "
            "the default's own cost per request.")
    live = doc.get(LIVE)
    if live is not None:
        notes.append(live_section(live))
        cur_live = live["versions"].get("current")
        if cur_live is not None and stubs is not None:
            notes.append(_remaining(cur_live["configs"], extra(cur, STUBS),
                                    extra(cur, TOLD, STUBS) if told is not None else None))
    return "\n\n".join(notes)


def _yaml_line(text: str) -> str:
    """A YAML file of sections of scalars on one line: ``pushing: {max_num_seqs: 256}``."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if line.startswith(" ") and sections:
            sections[-1][1].append(f"{key}: {value.strip()}")
        else:
            sections.append((key, []))
    return ", ".join(f"{k}: {{{', '.join(v)}}}" for k, v in sections)


def _remaining(configs: dict[str, Any], stubs_core: str, told_core: str | None) -> str:
    """Where the live gap lies: the decision core's share (the in-process rows) and the
    rest, with the default where sp-p's limit does not bind when the run has it."""
    gap = configs["default"]["median"] - configs["rr"]["median"]
    text = (f"Where the remaining cost lies. Of the live gap now ({gap:.0f} us per request "
            f"between the medians of the default and rr), the decision core accounts for "
            f"about {stubs_core} (the {STUBS} rows, prefix keys and trie included)")
    if told_core is None or TOLD_LIVE not in configs:
        return text + "."
    not_binding = configs[TOLD_LIVE]["median"] - configs["rr"]["median"]
    queue = configs["default"]["median"] - configs[TOLD_LIVE]["median"]
    return text + (
        f"; the default where sp-p's limit never binds ({TOLD_LIVE}) costs "
        f"{not_binding:.0f} us over rr (the decision core's {TOLD} row: about "
        f"{told_core}); the default costs {abs(queue):.0f} us "
        + ("more than that: what sp-p's limit still costs once " if queue >= 0 else
           "less than that, within the spread between rounds: here nothing shows of what "
           "sp-p's limit may still cost once ")
        + "learnt (a request that waits at the balancer costs its dispatch "
        "awaited, a pump at each first byte and completion that re-checks the window, more "
        "event-loop passes while few requests are in flight to each replica; within the "
        "spread between rounds when small). Without a queue, what the default does "
        "beyond rr per request "
        "is a flat list of small parts, profiled in process and live (py-spy): one "
        "prefix-trie match over the serving replicas and a least-loaded choice among the "
        "replicas holding the prefix (`preferred`), two trie inserts (the prompt's keys "
        "at dispatch, the prompt and reply's at completion), each replica's sp-p "
        "availability and takers recomputed after each of its load changes (a dispatch, "
        "a first byte, a completion), the request's tie key, the prompt's keys (hashed "
        "once per new keyed text, and then only the chunks after those a recent prompt "
        "shares) and the reply's; outside the core, the reply's text read out of its "
        "JSON for those keys (the rest of the live gap is within the spread between "
        "rounds). None of them is a rescan of the queue or of the "
        "replicas; each is a few microseconds of Python. Step by step, with what a second "
        "worker adds: [the default path's cost](../notes/default-path-cost.md).")


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


def measured(live: dict[str, Any]) -> str:
    """When and where, and how the per-round ratios spread: said of the machine as its
    recorded load average was, not as a fixed adjective."""
    setup = live["setup"]
    load, cpus = setup["load_average_1m_at_start"], setup["cpus"]
    state = "a loaded machine" if load >= LOADED * cpus else "the machine quiet"
    rounds = live["versions"]["current"]["ratio_rounds"]
    spread = (f"the per-round ratios range from {min(rounds):g} to {max(rounds):g} now"
              if min(rounds) != max(rounds) else f"the per-round ratio is {rounds[0]:g}")
    return (f"Measured {setup['date']} on {cpus} CPUs shared with other jobs ({state} at "
            f"start: load average {load:g}), commit `{setup['commit']}`; {spread}, so the "
            "median is the figure.")


def _cell(c: dict[str, Any]) -> str:
    return f"{c['median']:g} [{c['min']:g}, {c['max']:g}]"


def live_table(live: dict[str, Any]) -> str:
    """Per version of a live run: default and rr CPU per request, the per-round ratios, and
    the default where sp-p's limit does not bind (``default-told``) when the run has it."""
    setup, versions = live["setup"], live["versions"]
    told = TOLD_LIVE in setup["configs"]
    head = ("| version | default: CPU us per request, median [min, max] | round-robin + bp "
            "| default/rr per round | median |")
    if told:
        head += " default, sp-p not binding | its /rr per round | median |"
    rows = [head, "| --- | ---: | ---: | --- | ---: |" + (" ---: | --- | ---: |" if told
                                                          else "")]
    for v, name in (("current", "now"), ("base", f"`{setup.get('base')}`")):
        r = versions.get(v)
        if r is None:
            continue
        per_round = ", ".join(f"{x:g}" for x in r["ratio_rounds"])
        row = (f"| {name} | {_cell(r['configs']['default'])} | "
               f"{_cell(r['configs']['rr'])} | {per_round} | "
               f"**{r['ratio_median']:g}x** |")
        if told:
            t = r["ratios"][TOLD_LIVE]
            row += (f" {_cell(r['configs'][TOLD_LIVE])} | "
                    f"{', '.join(f'{x:g}' for x in t['rounds'])} | **{t['median']:g}x** |")
        rows.append(row)
    return "\n".join(rows)


def live_section(live: dict[str, Any]) -> str:
    """The whole daemon's CPU per request, default against round-robin + bp
    (``skymesh_lab.bench.dispatch_cost_live``), and the default where sp-p's limit does
    not bind (``default-told``) when the run has it."""
    setup = live["setup"]
    flags = setup["configs"]
    told = TOLD_LIVE in flags
    return "\n\n".join([
        "## The whole daemon, live",
        live_table(live),
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
        "the limit bound, with nothing of ours left unstarted, doubles it; before, sp-p "
        "held each stub at a request or two and a queue stood at the balancer)"
        + _limits_note(live["versions"], setup["connections"])
        + ". Beyond rr, the default hashes the prompt's keys (once per distinct keyed text, "
        "and then only the chunks after those a recent prompt shares), inserts into the trie "
        "at dispatch and again with the reply, and at each pump (an arrival, a first byte, a "
        "completion) where some replica can take a request re-asks the policy about the "
        "requests in the queue's window whose last answer read a load or a trie record that "
        "changed since, in queue order until one goes; a pump where no replica is available "
        "and none may take a request holding its prefix there (most of them: the replicas "
        "are refilled as soon as they free) asks nothing. A tie between two replicas holding "
        "a prompt's prefix breaks by the request's own key, set once, so it no longer forces "
        "a re-ask (the queue is searched for stranded requests only while a queued model has "
        "no healthy replica here or a breaker is open). "
        + (f"{TOLD_LIVE}: the default with `--config` holding "
           f"`{_yaml_line(setup.get('told_yaml', ''))}`: a told cap alone leaves the queue "
           "standing (sp-p still holds a replica without a published KV capacity at one "
           "request until its first byte), so the replica holding the prompt's prefix may "
           "also take any number, and each request goes at its arrival. " if told else "")
        + measured(live),
        f"```sh\n{live['command']}\n```",
    ])
