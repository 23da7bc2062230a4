"""``make bench``: every benchmark, one after the other, each printing its own figures.

Long-running and machine-dependent, so never part of ``make test``. Run one on its own with
``python -m skymesh_lab.bench.<name>`` (``foundation``, ``decision``, ``overhead``,
``critical_path``, ``heartbeat``, ``forwarding``), ``skymesh bench EXPERIMENT --mode sim``
(every experiment of ``skymesh bench``, JSON under ``out/bench/``, [planning]'s
``capacity-week`` and ``plan-ilp`` among them).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import time

STEPS: list[tuple[str, str]] = [
    ("simulator speed and sim-vs-live fidelity", "skymesh_lab.bench.foundation"),
    ("routing decision time", "skymesh_lab.bench.decision"),
    ("balancer added latency", "skymesh_lab.bench.overhead"),
    ("where the balancer's time goes", "skymesh_lab.bench.critical_path"),
    ("heartbeat size", "skymesh_lab.bench.heartbeat"),
    ("round trips per forwarded request", "skymesh_lab.bench.forwarding"),
]


def main() -> int:
    from skymesh.cli import main as cli
    from skymesh_lab.cli import BENCH_EXPERIMENTS

    failed = []
    for title, module in STEPS:
        print(f"\n######## {title} ({module}) ########", flush=True)
        t0 = time.perf_counter()
        try:
            fn = importlib.import_module(module).main
            # Benchmarks with flags take argv: give them none, so defaults apply.
            rc = fn([]) if inspect.signature(fn).parameters else fn()
        except ModuleNotFoundError as exc:
            print(f"skipped: {exc}")
            continue
        if rc:
            failed.append(module)
        print(f"({time.perf_counter() - t0:.0f} s)")
    commands = [["bench", name, "--mode", "sim", "--json", f"out/bench/{name}.json"]
                for name in sorted(BENCH_EXPERIMENTS)]
    for argv in commands:
        print(f"\n######## skymesh {' '.join(argv)} ########", flush=True)
        t0 = time.perf_counter()
        if cli(argv):
            failed.append(" ".join(argv))
        print(f"({time.perf_counter() - t0:.0f} s)")
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
