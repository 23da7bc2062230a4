"""``make bench``: every benchmark, one after the other, each printing its own figures.

Long-running and machine-dependent, so never part of ``make test``. Run one on its own with
``python -m skymesh.bench.<name>`` (``foundation``, ``decision``, ``overhead``,
``heartbeat``) or ``skymesh bench sp-microbench|diurnal-cost --mode sim``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import time

STEPS: list[tuple[str, str]] = [
    ("simulator speed and sim-vs-live fidelity", "skymesh.bench.foundation"),
    ("routing decision time", "skymesh.bench.decision"),
    ("balancer added latency", "skymesh.bench.overhead"),
    ("heartbeat size", "skymesh.bench.heartbeat"),
    ("round trips per forwarded request", "skymesh.bench.forwarding"),
]


def main() -> int:
    from skymesh.bench import diurnal, sp_microbench

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
    print("\n######## selective pushing microbenchmark (sim) ########", flush=True)
    sp_microbench.main()
    print("\n######## cost: replicas the mesh needs (sim) ########", flush=True)
    diurnal.main()
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
