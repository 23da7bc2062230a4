"""Round-trip times between regions for the simulator.

Defaults are typical public-cloud RTTs between us-east, eu-west and ap-northeast (about
70-230 ms, as SkyLB's deployment saw; cross-region latency "can reach up to 200 ms", SkyLB
sec. 1). Region names are matched by their first letters (us*, eu*, asia*/ap*), and any
pair not listed falls back to ``default_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_RTT_MS: dict[frozenset[str], float] = {
    frozenset({"us", "eu"}): 75.0,
    frozenset({"us", "asia"}): 160.0,
    frozenset({"eu", "asia"}): 225.0,
}
# Client to its regional balancer, and balancer to a replica in the same region.
LOCAL_ONE_WAY_S = 0.0005


def _family(region: str) -> str:
    r = region.lower()
    if r.startswith(("ap", "asia")):
        return "asia"
    if r.startswith("eu"):
        return "eu"
    if r.startswith("us"):
        return "us"
    return r


class Network:
    def __init__(
        self,
        rtt_ms: Mapping[frozenset[str], float] | None = None,
        default_ms: float = 150.0,
        local_one_way_s: float = LOCAL_ONE_WAY_S,
    ) -> None:
        self.rtt_ms = dict(DEFAULT_RTT_MS if rtt_ms is None else rtt_ms)
        self.default_ms = default_ms
        self.local_one_way_s = local_one_way_s

    def one_way(self, a: str, b: str) -> float:
        if a == b:
            return self.local_one_way_s
        key = frozenset({_family(a), _family(b)})
        if len(key) == 1:
            return self.local_one_way_s
        return self.rtt_ms.get(key, self.default_ms) / 2000.0
