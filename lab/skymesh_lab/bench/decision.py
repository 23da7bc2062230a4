"""Routing decision time per policy: select + on_dispatch, 64 replicas, a full prefix trie.

What is measured
    For each registered policy, the wall time (``time.perf_counter_ns``) of one routing
    decision as the balancer makes it: ``policy.select(request, candidates, view)``
    followed by ``policy.on_dispatch(request, target, view)``. Percentiles (p50, p99, in
    microseconds) are taken over ``--requests`` decisions after a warm-up; each figure is
    the median over ``--repeat`` runs (default 3), since a shared machine is noisy.

Setup
    ``--replicas`` targets (default 64), all of them candidates (blind pushing: the widest
    choice, so scans over candidates cost the most). Each has a
    :class:`~skymesh.policies.load.ReplicaLoad` with a probe (0-2 waiting, 5-40 running)
    and our own in-flight bookkeeping, which the untimed part of each iteration keeps
    moving: the dispatch is recorded, its first byte arrives, and the oldest request
    completes once ~20 per replica are in flight.

    Requests look like chat traffic: 40 applications with a system prompt of 8-40 blocks,
    conversations that grow turn by turn (each turn's prompt extends the previous one),
    and 30-200 prefix keys per request. Policies that keep a prefix trie get it pre-filled
    to ``--nodes`` nodes (default 100,000, the default cap, so inserts evict) from the
    same generator before timing starts. Both views answer ``outstanding_of`` in one call,
    as the balancer's dispatcher does.

    The "light view" column repeats the run with bare load records instead of
    ``ReplicaLoad`` objects, separating the policy's own work from the view's.

    python -m skymesh_lab.bench.decision [--replicas 64] [--nodes 100000] [--requests 5000]
        [--repeat 3] [--policy NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from skymesh.policies import Policy, RouteRequest, build_policy, policy_names
from skymesh.policies.load import ReplicaLoad
from skymesh.prefix.trie import PrefixTrie
from skymesh.util.jsonio import write_json
from skymesh.util.stats import percentile, percentiles

TARGET_P50_US = 20.0
_MASK = (1 << 63) - 1


def _chain(parent: int, blocks: list[int]) -> list[int]:
    out = []
    h = parent
    for b in blocks:
        h = hash((h, b)) & _MASK
        out.append(h)
    return out


def requests(seed: int, *, apps: int = 40, conversations: int = 4000) -> Iterator[RouteRequest]:
    """An endless stream of chat-like requests with shared and growing prefixes."""
    rng = random.Random(seed)
    systems = [_chain(0, [rng.getrandbits(40) for _ in range(rng.randint(8, 40))])
               for _ in range(apps)]
    convs: list[list[int]] = []
    n = 0
    while True:
        if len(convs) < conversations or rng.random() < 0.05:
            keys = list(rng.choice(systems))
            keys += _chain(keys[-1], [rng.getrandbits(40) for _ in range(rng.randint(5, 40))])
            if len(convs) < conversations:
                convs.append(keys)
            else:
                convs[rng.randrange(len(convs))] = keys
        else:
            i = rng.randrange(len(convs))
            keys = convs[i]
            if len(keys) > 200 - 20:  # the conversation ends; a new one takes its slot
                keys = list(rng.choice(systems))
            keys = keys + _chain(keys[-1], [rng.getrandbits(40)
                                            for _ in range(rng.randint(3, 20))])
            convs[i] = keys
        keys = keys[:200]
        while len(keys) < 30:
            keys = keys + _chain(keys[-1], [rng.getrandbits(40)])
        n += 1
        yield RouteRequest(
            request_id=f"req-{n}",
            prompt_len=16 * len(keys) + rng.randrange(16),
            prefix_keys=tuple(keys),
            affinity_key=None,
        )


class RealView:
    """The balancer's view: ReplicaLoad per target, bookkeeping kept moving."""

    def __init__(self, targets: list[str], rng: random.Random) -> None:
        self.now = 0.0
        self.loads = {t: ReplicaLoad(t) for t in targets}
        for ld in self.loads.values():
            ld.on_probe(0.0, rng.randint(0, 2), rng.randint(5, 40), rng.random())
        self._flight: deque[tuple[RouteRequest, str]] = deque()
        self._cap = 20 * len(targets)

    def load(self, target: str) -> ReplicaLoad:
        return self.loads[target]

    def outstanding_of(self, targets: list[str]) -> list[int]:
        # As the dispatcher answers it (balancer.dispatch.Dispatcher.outstanding_of).
        loads = self.loads
        return [loads[t].outstanding for t in targets]

    def dispatched(self, req: RouteRequest, target: str, policy: Policy) -> None:
        """Book the dispatch; complete the oldest request, for the view and the policy
        alike (as the balancer does), once ~20 per replica are in flight."""
        rid = req.request_id
        ld = self.loads[target]
        ld.on_dispatch(rid, self.now)
        ld.on_first_byte(rid)
        self._flight.append((req, target))
        if len(self._flight) > self._cap:
            old, t = self._flight.popleft()
            self.loads[t].on_complete(old.request_id)
            policy.on_complete(old, t, True)


@dataclass(slots=True)
class _Plain:
    outstanding: int
    waiting: int
    running: int
    kv_usage: float


class LightView(RealView):
    """Same loads, read as plain attributes (no property, no dict scan)."""

    def __init__(self, targets: list[str], rng: random.Random) -> None:
        super().__init__(targets, rng)
        self.plain = {t: _Plain(ld.outstanding, ld.waiting, ld.running, ld.kv_usage)
                      for t, ld in self.loads.items()}

    def load(self, target: str) -> _Plain:  # type: ignore[override]
        return self.plain[target]

    def outstanding_of(self, targets: list[str]) -> list[int]:
        plain = self.plain
        return [plain[t].outstanding for t in targets]

    def dispatched(self, req: RouteRequest, target: str, policy: Policy) -> None:
        super().dispatched(req, target, policy)
        for t, ld in self.loads.items():  # the dispatch and whichever request completed
            self.plain[t].outstanding = ld.outstanding


def _prefill(policy: Policy, stream: Iterator[RouteRequest], targets: list[str],
             nodes: int, rng: random.Random) -> int:
    trie = getattr(policy, "trie", None)
    if not isinstance(trie, PrefixTrie):
        return 0
    while len(trie) < min(nodes, trie.max_nodes):
        trie.insert(next(stream).prefix_keys, rng.choice(targets))
    return len(trie)


def measure(name: str, *, replicas: int, nodes: int, n_requests: int, seed: int,
            light: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    targets = [f"http://replica-{i:02d}.internal:8000" for i in range(replicas)]
    policy = build_policy(name, rng=random.Random(seed))
    policy.on_membership(targets)
    view: RealView = LightView(targets, rng) if light else RealView(targets, rng)
    stream = requests(seed)
    filled = _prefill(policy, stream, targets, nodes, rng)
    times: list[int] = []
    warmup = max(200, n_requests // 10)
    gc.collect()
    clock = time.perf_counter_ns
    for i in range(warmup + n_requests):
        req = next(stream)
        view.now = i * 0.001
        t0 = clock()
        target = policy.select(req, targets, view)
        assert target is not None
        policy.on_dispatch(req, target, view)
        t1 = clock()
        if i >= warmup:
            times.append(t1 - t0)
        view.dispatched(req, target, policy)
    p50, p99 = percentiles(times, (50, 99))
    if p50 is None or p99 is None:
        raise ValueError(f"{name}: no decisions timed (requests <= warmup)")
    trie = getattr(policy, "trie", None)
    return {
        "policy": name,
        "p50_us": p50 / 1000,
        "p99_us": p99 / 1000,
        "trie_nodes": len(trie) if isinstance(trie, PrefixTrie) else 0,
        "prefilled": filled,
    }


def trie_memory_mib(nodes: int, replicas: int, seed: int) -> float:
    """Memory a prefix trie filled to ``nodes`` keys holds (tracemalloc, MiB), the keys
    themselves excluded: they belong to the requests that brought them."""
    rng = random.Random(seed)
    targets = [f"http://replica-{i:02d}.internal:8000" for i in range(replicas)]
    stream = requests(seed)
    batch = [next(stream) for _ in range(max(1, nodes // 8))]
    tracemalloc.start()
    try:
        trie = PrefixTrie(nodes)
        i = 0
        while len(trie) < nodes * 0.99:  # a full trie hovers just below its cap
            if i == len(batch):  # keys made here count; keep them few
                batch.extend(next(stream) for _ in range(len(batch)))
            trie.insert(batch[i].prefix_keys, rng.choice(targets))
            i += 1
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used / 2**20


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for key in ("p50_us", "p99_us"):
        out[key] = percentile([r[key] for r in runs], 50)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.decision",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per policy (median taken)")
    ap.add_argument("--policy", action="append", help="only these (repeatable)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    names = args.policy or policy_names()
    print(f"{args.replicas} candidates, prefix trie {args.nodes:,} nodes, "
          f"{args.requests:,} timed decisions (select + on_dispatch), median of "
          f"{args.repeat} runs; target p50 <= {TARGET_P50_US:g} us", flush=True)
    rows = []
    header = (f"{'policy':20s} {'p50 us':>8s} {'p99 us':>8s}   {'light p50':>9s} "
              f"{'light p99':>9s}  {'trie nodes':>10s}  target")
    print(header)
    for name in names:
        kw = dict(replicas=args.replicas, nodes=args.nodes, n_requests=args.requests,
                  seed=args.seed)
        real = _median([measure(name, light=False, **kw) for _ in range(args.repeat)])
        light = _median([measure(name, light=True, **kw) for _ in range(args.repeat)])
        ok = "ok" if real["p50_us"] <= TARGET_P50_US else "MISS"
        print(f"{name:20s} {real['p50_us']:8.1f} {real['p99_us']:8.1f}   "
              f"{light['p50_us']:9.1f} {light['p99_us']:9.1f}  {real['trie_nodes']:10,d}  {ok}",
              flush=True)
        rows.append({**real, "light_p50_us": light["p50_us"], "light_p99_us": light["p99_us"],
                     "meets_target": ok == "ok"})
    mib = trie_memory_mib(args.nodes, args.replicas, args.seed)
    print(f"prefix trie filled to {args.nodes:,} keys holds {mib:.1f} MiB (tracemalloc)")
    write_json(args.json, {"target_p50_us": TARGET_P50_US, "replicas": args.replicas,
                           "nodes": args.nodes, "trie_mib": round(mib, 2), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
