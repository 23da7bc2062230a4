"""``skymesh faults run [--short] [--only NAME ...] --json PATH``: the fault table.

Runs each fault scenario against real local processes (replicas, balancers, controller,
Redis, the three-region mesh) and prints, per scenario, the requests accepted, completed
correctly, retried by a balancer, failed with an explicit error, and lost (target 0).
``--short`` is the CI form (``make faults``). Exits 1 if any request was lost or any
scenario's invariant failed.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh_lab.faults.scenarios import SCENARIOS


def register(subparsers: Any) -> None:
    fp = subparsers.add_parser("faults", help="fault-injection scenarios (hardening)")
    fsub = fp.add_subparsers(dest="faults_cmd", required=True)
    rp = fsub.add_parser("run", help="run the fault scenarios and print the table",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("--short", action="store_true", help="the short (CI) form")
    rp.add_argument("--only", action="append", choices=sorted(SCENARIOS), metavar="NAME",
                    help="run only this scenario (repeatable); names: "
                         + ", ".join(SCENARIOS))
    rp.add_argument("--json", metavar="PATH", help="write the report here")
    rp.set_defaults(fn=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from skymesh_lab.faults.runner import run, table

    names = args.only or list(SCENARIOS)
    print(f"== fault scenarios ({'short' if args.short else 'full'} form) ==", flush=True)
    report = asyncio.run(run(names, args.short))
    print(table(report))
    write_json(args.json, report)
    return 0 if report["ok"] else 1
