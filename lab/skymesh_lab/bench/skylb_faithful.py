"""SkyLB's reproduction on the faithful setup (issue #24 item 3): the macrobenchmark and the
diurnal cost curve with SGLang's scheduler and SkyLB's own clients, beside vLLM mode.

``macro`` runs ``skylb_macro``'s sweep (four workloads, the nine systems, the throughput
ceiling unless ``--no-ceiling``) for each (scheduler, clients) pair of ``--setups``
(default: the faithful one, SGLang with SkyLB's clients; ``vllm/skylb`` shows the engine's
effect alone, and vLLM mode with our clients is ``skymesh bench skylb-macro``);
``diurnal`` runs ``diurnal``'s replica sweep once per scheduler of ``--schedulers``.
Each writes one JSON object with a block per setup; ``results_faithful`` renders the
pages. ``--jobs N`` runs the parts (macro: one workload of one setup at one seed; diurnal:
one replica count) in N processes, with the same results. ``macro --seeds 0,1,2`` repeats
the sweep at every seed: the first seed's runs are the page's per-system tables, the others
are kept (per run: throughput, latency percentiles, hit rate) for the spread of the
headline ratios over seeds.

    python -m skymesh_lab.bench.skylb_faithful macro --setups sglang/skylb,vllm/skylb \
        --seeds 0,1,2 --no-ceiling --jobs 2 --json PATH
    python -m skymesh_lab.bench.skylb_faithful diurnal --schedulers sglang --jobs 4 --json PATH

Sizes (quick, for a shared 2-core machine): 60 s of client activity per macro run (the
sweep's quick size; a SkyLB tree of four levels takes about a minute, so a client grows
about one tree in the window), 200 s per replica count of the diurnal sweep (its quick
size; the vLLM-mode page runs 600 s).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from skymesh_lab.bench import diurnal, skylb_macro
from skymesh_lab.bench.skylb_setup import (
    CLIENT_SETS,
    PAPER,
    SCHEDULERS,
    SKYLB_CHAT_MAX_TOKENS,
    SYSTEMS,
    Options,
)

MACRO_DURATION_S = skylb_macro.QUICK_DURATION_S
DIURNAL_DURATION_S = diurnal.QUICK_DURATION_S
# The faithful setup; add vllm/skylb to see the engine's effect alone (vLLM mode with our
# clients is ``skymesh bench skylb-macro``).
DEFAULT_SETUPS = ("sglang/skylb",)
# SkyLB's Figure 10 (sec. 5.3): the mesh over region-local at equal replica counts, and
# the count at which it matches region-local with 12.
PAPER_DIURNAL = {"mesh_x_vs_region_local": (1.07, 1.18), "replicas_to_match_12": 9}
# What an extra seed's run keeps: enough for the headline ratios and a look at each system,
# without tripling the committed JSON with the probe's figures.
SEED_ROW_KEYS = ("workload", "system", "throughput_rps", "ttft_mean_s", "ttft_p50_s",
                 "ttft_p90_s", "e2e_p50_s", "prefix_hit_rate", "requests", "preemptions")


def parse_setups(text: str) -> list[tuple[str, str]]:
    """``"sglang/skylb,vllm/ours"`` -> [(scheduler, clients), ...]; names are checked."""
    out: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sched, sep, clients = part.partition("/")
        if not sep or sched not in SCHEDULERS or clients not in CLIENT_SETS:
            raise ValueError(f"setup {part!r}: expected SCHEDULER/CLIENTS with SCHEDULER in "
                             f"{list(SCHEDULERS)} and CLIENTS in {list(CLIENT_SETS)}")
        out.append((sched, clients))
    if not out:
        raise ValueError("no setup given")
    return out


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: non-negative, no repeats, at least one."""
    try:
        seeds = [int(p) for p in (q.strip() for q in text.split(",")) if p]
    except ValueError:
        raise ValueError(f"seeds {text!r}: expected a comma list of integers") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {text!r}: expected distinct non-negative integers")
    return seeds


def pool_map(fn: Callable[..., dict[str, Any]], args: list[tuple[Any, ...]], jobs: int
              ) -> list[dict[str, Any]]:
    """``fn(*a)`` for each of ``args``, in order; in ``jobs`` processes when above 1 (the
    simulator is deterministic, so the results do not depend on ``jobs``)."""
    if jobs <= 1 or len(args) <= 1:
        return [fn(*a) for a in args]
    with ProcessPoolExecutor(max_workers=min(jobs, len(args))) as pool:
        return list(pool.map(fn, *zip(*args, strict=True)))


def _macro_part(sched: str, clients: str, workload: str, duration_s: float, seed: int,
                progress: bool, ceiling: bool) -> dict[str, Any]:
    opts = Options(mode="sim", duration_s=duration_s, seed=seed, workloads=(workload,),
                   systems=tuple(SYSTEMS), progress=progress, scheduler=sched,
                   clients=clients, ceiling=ceiling)
    res = skylb_macro.run_sim_sweep(opts)
    print(f"macro {sched}/{clients} {workload}: {res['wall_seconds']:.0f} s", file=sys.stderr)
    return res


def merge_parts(sched: str, clients: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's per-workload sweeps as one: every figure of a sweep is per workload
    (rows, comparisons, ceilings), so this equals sweeping all workloads at once."""
    setup = dict(parts[0]["setup"])
    for key in ("workloads", "load_scale"):
        setup[key] = {k: v for p in parts for k, v in p["setup"][key].items()}
    return {"scheduler": sched, "clients": clients,
            "runs": [r for p in parts for r in p["runs"]],
            "comparisons": {k: v for p in parts for k, v in p["comparisons"].items()},
            "ceiling": {k: v for p in parts for k, v in p["ceiling"].items()},
            "setup": setup, "wall_seconds": sum(p["wall_seconds"] for p in parts)}


def slim_block(block: dict[str, Any]) -> dict[str, Any]:
    """An extra seed's setup block: its comparisons and each run's ``SEED_ROW_KEYS``."""
    return {"scheduler": block["scheduler"], "clients": block["clients"],
            "comparisons": block["comparisons"],
            "runs": [{k: r[k] for k in SEED_ROW_KEYS if k in r} for r in block["runs"]]}


def run_macro(setups: list[tuple[str, str]], duration_s: float, seed: int,
              workloads: tuple[str, ...], progress: bool = True, jobs: int = 1,
              ceiling: bool = True, extra_seeds: tuple[int, ...] = ()) -> dict[str, Any]:
    """The sweep per setup at ``seed`` (``setups``: every run), and at each of
    ``extra_seeds`` (``by_seed``: slim blocks, see ``slim_block``)."""
    t0 = time.perf_counter()
    seeds = [seed, *extra_seeds]
    keys = [(n, s, c, w) for n in seeds for s, c in setups for w in workloads]
    parts = pool_map(_macro_part, [(s, c, w, duration_s, n, progress and jobs <= 1,
                                     ceiling) for n, s, c, w in keys], jobs)

    def blocks_at(n: int) -> list[dict[str, Any]]:
        return [merge_parts(s, c, [p for (n2, s2, c2, _), p in zip(keys, parts, strict=True)
                                   if (n2, s2, c2) == (n, s, c)]) for s, c in setups]

    out: dict[str, Any] = {
        "setups": blocks_at(seed), "paper": PAPER,
        "setup": {"duration_s": duration_s, "seed": seed, "workloads": list(workloads),
                  "profile": "llama3.1-8b-l4", "ceiling": ceiling}}
    if extra_seeds:
        out["setup"]["seeds"] = seeds
        out["by_seed"] = [{"seed": n, "setups": [slim_block(b) for b in blocks_at(n)]}
                          for n in extra_seeds]
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def _diurnal_part(sched: str, replicas: int, duration_s: float, seed: int,
                  max_tokens: int | None) -> dict[str, Any]:
    return diurnal.main(duration_s=duration_s, seed=seed, counts=range(replicas, replicas + 1),
                        scheduler=sched, max_tokens=max_tokens)


def run_diurnal(schedulers: list[str], duration_s: float, seed: int, jobs: int = 1,
                counts: range = range(6, 13),
                max_tokens: int | None = SKYLB_CHAT_MAX_TOKENS) -> dict[str, Any]:
    """``diurnal.main`` per scheduler, one replica count per job; the same figures. The
    chat clients send SkyLB's ``max_tokens`` unless ``max_tokens`` is None."""
    t0 = time.perf_counter()
    keys = [(s, n) for s in schedulers for n in counts]
    parts = pool_map(_diurnal_part, [(s, n, duration_s, seed, max_tokens) for s, n in keys],
                      jobs)
    blocks = []
    for sched in schedulers:
        mine = [p for (s, _), p in zip(keys, parts, strict=True) if s == sched]
        runs = [r for p in mine for r in p["runs"]]
        _, match = diurnal.match_summary(runs)
        blocks.append({"scheduler": sched, "runs": runs,
                       "replicas_to_match_12": match.get(
                           diurnal.DEFAULT_FORWARDING_RULE.value),
                       "replicas_to_match_12_by_rule": match, "setup": mine[0]["setup"]})
    return {"setups": blocks, "paper": PAPER_DIURNAL,
            "setup": {"duration_s": duration_s, "seed": seed, "clients": diurnal.CLIENTS,
                      "replica_counts": list(counts), "max_tokens": max_tokens},
            "wall_seconds": time.perf_counter() - t0}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.skylb_faithful",
                                 description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("macro", help="the macrobenchmark per (scheduler, clients)")
    m.add_argument("--duration", type=float, default=MACRO_DURATION_S)
    m.add_argument("--setups", default=",".join(DEFAULT_SETUPS),
                   help=f"comma list of SCHEDULER/CLIENTS with CLIENTS in "
                        f"{list(CLIENT_SETS)} (default: {','.join(DEFAULT_SETUPS)})")
    m.add_argument("--workloads", default=",".join(skylb_macro.WORKLOADS))
    m.add_argument("--no-ceiling", action="store_true",
                   help="skip the throughput ceiling (the oracle on 16x the replicas)")
    m.add_argument("--seeds", default=None, metavar="N,N,...",
                   help="run the sweep at each of these seeds (replaces --seed); the first "
                        "gives the per-system tables, all give the spread over seeds")
    d = sub.add_parser("diurnal", help="the diurnal cost curve per scheduler")
    d.add_argument("--duration", type=float, default=DIURNAL_DURATION_S)
    d.add_argument("--schedulers", default=",".join(SCHEDULERS))
    d.add_argument("--max-tokens", type=int, default=SKYLB_CHAT_MAX_TOKENS,
                   help="the chat clients' max_tokens (SkyLB's: 512; 0: none)")
    for p in (m, d):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", default=None, metavar="PATH")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--jobs", type=int, default=1,
                       help="run the sweep's parts in this many processes (same results)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from skymesh.util.jsonio import write_json

    args = build_parser().parse_args(argv)
    try:
        if args.what == "macro":
            workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
            unknown = [w for w in workloads if w not in skylb_macro.WORKLOADS]
            if unknown:
                raise ValueError(f"unknown workload(s) {unknown}")
            seeds = parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
            res = run_macro(parse_setups(args.setups), args.duration, seeds[0], workloads,
                            progress=not args.no_progress, jobs=args.jobs,
                            ceiling=not args.no_ceiling, extra_seeds=tuple(seeds[1:]))
        else:
            scheds = [s.strip() for s in args.schedulers.split(",") if s.strip()]
            bad = [s for s in scheds if s not in SCHEDULERS]
            if bad or not scheds:
                raise ValueError(f"schedulers {bad or scheds}: expected some of "
                                 f"{list(SCHEDULERS)}")
            res = run_diurnal(scheds, args.duration, args.seed, jobs=args.jobs,
                              max_tokens=args.max_tokens or None)
    except ValueError as exc:
        print(f"skylb_faithful: {exc}", file=sys.stderr)
        return 2
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
