"""README "Results" from benchmark JSON: ``python -m skymesh.bench.results out/bench/*.json``.

Reads what ``skymesh bench skylb-macro`` / ``mooncake`` wrote (``{"runs": [...],
"setup": {...}}``) and prints markdown: per file, the command that reproduces it, the
per-workload tables, the mesh against SkyLB's figures and the issue's targets, and the
PyPI routers' table when the live run had ``--peers``. Rows carry the command in the
heading of their table, so a reader can rerun any of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from skymesh.bench import skylb_macro


def command_for(res: dict[str, Any], path: Path) -> str:
    """The command line that reproduces ``res`` (from its own setup)."""
    setup = res.get("setup", {})
    mode = setup.get("mode", "sim")
    workloads = list(setup.get("workloads", {}))
    experiment = "mooncake" if workloads == ["mooncake"] else "skylb-macro"
    if mode == "live":
        cmd = (f"python -m skymesh.bench.skylb_macro --mode live --duration "
               f"{setup.get('duration_s', 0):g} --workloads {','.join(workloads)}")
        peers = list(setup.get("peers", {}))
        if peers:
            cmd += f" --peers {','.join(peers)}"
    else:
        cmd = f"skymesh bench {experiment} --mode sim --duration {setup.get('duration_s', 0):g}"
        if experiment == "skylb-macro" and workloads != list(skylb_macro.WORKLOADS):
            cmd = (f"python -m skymesh.bench.skylb_macro --mode sim --duration "
                   f"{setup.get('duration_s', 0):g} --workloads {','.join(workloads)}")
    seed = setup.get("seed", 0)
    if seed:
        cmd += f" --seed {seed}"
    scaled = load_scale_flag(setup.get("load_scale") or {})
    if scaled:
        cmd += f" --load-scale {scaled}"
    return f"{cmd} --json {path}"


def load_scale_flag(scale: dict[str, float]) -> str:
    """``--load-scale``'s value for the multipliers a run recorded ("" when none)."""
    moved = {w: x for w, x in scale.items() if x != 1.0}
    if not moved:
        return ""
    if moved == {w: x for w, x in skylb_macro.CALIBRATED_LOAD_SCALE.items() if w in scale}:
        return "calibrated"
    return ",".join(f"{w}={x:g}" for w, x in moved.items())


def targets_table(res: dict[str, Any]) -> str:
    comp = res.get("comparisons", {})
    if not comp:
        return ""
    lines = ["| workload | mesh vs best single: throughput (>= 1.3x) | P90 TTFT (<= 10%) |"
             " hit rate vs oracle (>= 95%) |", "| --- | --- | --- | --- |"]
    for w, c in comp.items():
        met: dict[str, bool] = c.get("targets_met", {})

        def mark(key: str, met: dict[str, bool] = met) -> str:
            return "met" if met.get(key) else "not met"

        thr = c.get("throughput_x_vs_best_single")
        p90 = c.get("ttft_p90_frac_of_best_single")
        hit = c.get("hit_frac_of_oracle")
        lines.append(
            f"| {w} | {thr:.2f}x vs {c.get('best_single')} ({mark('throughput_x_vs_best_single')})"
            f" | {100 * p90:.1f}% ({mark('ttft_p90_frac_of_best_single')}) | "
            + (f"{100 * hit:.1f}% ({mark('hit_frac_of_oracle')})" if hit is not None
               else "no oracle in live mode") + " |"
            if thr is not None and p90 is not None else f"| {w} | - | - | - |")
    return "\n".join(lines)


def render(paths: list[Path]) -> str:
    out: list[str] = []
    for path in paths:
        res = json.loads(path.read_text())
        setup = res.get("setup", {})
        mode = setup.get("mode", "sim")
        out += [f"## {path.name} ({'live, 2 shared cores' if mode == 'live' else 'simulator'})",
                "", "```sh", command_for(res, path), "```", ""]
        if mode == "live" and setup.get("contention"):
            out += [f"Measured under contention: {setup['contention']}.", ""]
        specs = None
        if list(setup.get("workloads", {})) == ["mooncake"]:
            from skymesh.bench.mooncake import SPECS

            specs = SPECS
        out.append(skylb_macro.format_tables(res["runs"], specs=specs))
        tt = targets_table(res)
        if tt:
            out += ["", "Targets (mesh = skymesh-prefix):", "", tt]
        ceilings = skylb_macro.format_ceilings(res.get("comparisons", {}))
        if ceilings:
            out += ["", ceilings]
        if res.get("peers_table"):
            out += ["", res["peers_table"]]
        if res.get("plots"):
            out += ["", "Plots: " + ", ".join(f"`{p}`" for p in res["plots"])]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.bench.results", description=__doc__)
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    args = ap.parse_args(argv)
    text = render(args.json)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
