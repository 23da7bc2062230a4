"""Added latency of two skymesh-lb code trees, side by side in one run.

A change to the balancer's request path moves its added latency by a tenth of a
millisecond, less than two runs of ``skymesh_lab.bench.overhead`` differ by on this shared
2-core machine. So both trees run at once, behind the same emulated replicas, in the same
shuffled 2-second rounds (round robin, blind pushing: the proxy's own cost), and only the
difference between them is read.

    git worktree add /tmp/base HEAD~1    # the tree to compare against
    python -m skymesh_lab.bench.overhead_ab --tree base=/tmp/base --tree new=. --rate 20

Each tree's ``skymesh`` package is imported from its directory (``PYTHONPATH``); run the
mesh code generator in a worktree first (``python -m skymesh.mesh.codegen``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
from pathlib import Path

import aiohttp

from skymesh.util.procs import start_daemon
from skymesh.util.stats import fmt, percentile, percentiles
from skymesh_lab.bench.overhead import (
    DEFAULT_PROFILE,
    DEFAULT_TIME_SCALE,
    _body,
    _wait_ok,
    _warm,
    open_loop_segment,
    start_replicas,
)
from skymesh_replica.engine.profiles import get_profile


async def run(trees: dict[str, Path], rate: float, seconds: float, seed: int
              ) -> dict[str, list[float]]:
    """TTFT samples (seconds) per path: ``direct`` and one per tree."""
    body = _body(get_profile(DEFAULT_PROFILE).model)
    with contextlib.ExitStack() as exits:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            replicas = await start_replicas(exits, s, 2, DEFAULT_PROFILE, DEFAULT_TIME_SCALE)
            urls = [d.url for d in replicas]
            paths: dict[str, list[str]] = {"direct": urls}
            for name, tree in trees.items():
                # PYTHONSAFEPATH: a worker started as ``python -m`` (trees before the
                # workers' -P) would put the current directory ahead of the tree.
                env = dict(os.environ, PYTHONPATH=str(tree.resolve()), PYTHONSAFEPATH="1")
                d = start_daemon("skymesh-lb", ["--port", "0", "--replicas", ",".join(urls),
                                                "--policy", "round-robin", "--push-mode", "bp"],
                                 env=env)
                exits.callback(d.stop)
                await _wait_ok(s, d, "GET", "/ready")
                paths[name] = [d.url]
            for path_urls in paths.values():
                await _warm(s, path_urls, body)
            rng = random.Random(seed)
            ttft: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(max(1, int(seconds / 2))):
                order = list(paths)
                rng.shuffle(order)
                for p in order:
                    for x in await open_loop_segment(s, paths[p], body, rate, 2.0, rng):
                        if x.ok and x.first is not None:
                            ttft[p].append(x.first - x.sent)
            return ttft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.overhead_ab",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                    help="a skymesh checkout to run skymesh-lb from (repeatable)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=40.0, help="per path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    trees = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "skymesh" / "__init__.py").exists():
            ap.error(f"--tree wants NAME=DIR with DIR a skymesh checkout, got {spec!r}")
        trees[name] = Path(path)
    ttft = asyncio.run(run(trees, args.rate, args.seconds, args.seed))
    base = percentile(ttft["direct"], 50)
    print(f"{args.rate:g} req/s, {args.seconds:g} s per path, TTFT in ms "
          f"(added = median minus direct's median)")
    for name, xs in ttft.items():
        p50, p90 = percentiles(xs, (50, 90))
        add = None if p50 is None or base is None else p50 - base
        print(f"{name:12s} n={len(xs):5d}  p50 {fmt(p50, '6.3f', 1e3)}  "
              f"added {fmt(add, '+6.3f', 1e3)}  p90 {fmt(p90, '6.2f', 1e3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
