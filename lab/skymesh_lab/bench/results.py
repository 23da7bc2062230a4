"""Results from benchmark JSON.

Two uses:

- ``python -m skymesh_lab.bench.results docs/results/data docs/results [--check] [--run NAMES]``
  writes the results pages from the committed JSON (``skymesh_lab.bench.results_pages``);
- ``python -m skymesh_lab.bench.results out/bench/*.json`` prints the SkyLB evaluation's
  markdown from what ``skymesh bench skylb-macro`` / ``mooncake`` wrote (``{"runs": [...],
  "setup": {...}}``): per file, the command that reproduces it, the per-workload tables,
  the mesh against SkyLB's figures and the issue's targets, and the PyPI routers' table
  when the live run had ``--peers``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from skymesh_lab.bench import results_pages, skylb_macro
from skymesh_lab.bench.results_tables import targets_table


def command_for(res: dict[str, Any], path: Path) -> str:
    """The command line that reproduces ``res`` (from its own setup)."""
    setup = res.get("setup", {})
    mode = setup.get("mode", "sim")
    workloads = list(setup.get("workloads", {}))
    experiment = "mooncake" if workloads == ["mooncake"] else "skylb-macro"
    if mode == "live":
        cmd = (f"python -m skymesh_lab.bench.skylb_macro --mode live --duration "
               f"{setup.get('duration_s', 0):g} --workloads {','.join(workloads)}")
        peers = list(setup.get("peers", {}))
        if peers:
            cmd += f" --peers {','.join(peers)}"
    else:
        cmd = f"skymesh bench {experiment} --mode sim --duration {setup.get('duration_s', 0):g}"
        if experiment == "skylb-macro" and workloads != list(skylb_macro.WORKLOADS):
            cmd = (f"python -m skymesh_lab.bench.skylb_macro --mode sim --duration "
                   f"{setup.get('duration_s', 0):g} --workloads {','.join(workloads)}")
    seed = setup.get("seed", 0)
    if seed:
        cmd += f" --seed {seed}"
    for flag, default in (("scheduler", "vllm"), ("clients", "ours")):
        if setup.get(flag, default) != default:
            cmd += f" --{flag} {setup[flag]}"
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
            from skymesh_lab.bench.mooncake import SPECS

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
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.results", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path,
                    help="benchmark JSON files, or DATA_DIR OUT_DIR for the results pages")
    ap.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    ap.add_argument("--check", action="store_true",
                    help="pages: exit 1 if a page differs from what the JSON gives")
    ap.add_argument("--run", default="", metavar="NAMES",
                    help="pages: rerun these benchmarks first (comma-separated, or all)")
    args = ap.parse_args(argv)
    if len(args.json) == 2 and args.json[0].is_dir():
        return results_pages.main(args.json[0], args.json[1], check=args.check, run=args.run)
    text = render(args.json)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
