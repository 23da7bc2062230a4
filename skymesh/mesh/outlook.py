"""Forecast-aware overflow: which peer regions a balancer should prefer when it forwards.

SkyLB's overflow rule sends a request that finds no local replica to any peer that is
alive, has an available replica and a short queue (``policies.peers``); the peer policy
picks among them from what each looks like *now*. Under diurnal load two such peers can
look alike while one is coming off its peak and the other is climbing into it. The
controller's planner forecasts every region's load for the next windows (issue #25
item 4); :class:`PeerOutlook` turns those forecasts into a preference: it narrows the
overflow candidates to the regions whose load over the next windows is lowest, and the
peer policy then chooses among those as before (prefix affinity, least load...).

Score of a peer region for a model (lower is better), all loads relative to the region's
capacity (1.0 = every replica busy)::

    score = (current_weight * busy_now + sum(forecast[i] for the next horizon windows))
            / (current_weight + number of those windows)

``busy_now`` is the share of the peer's replicas its last heartbeat reported unavailable;
``forecast[i]`` is the published forecast of the window that contains ``now`` and the
ones after it. A peer with no usable outlook (none published, another model, or every
window in the past) scores ``busy_now`` alone. The candidates kept are those within
``slack`` of the best score, in the order given. When no candidate has a usable outlook
the candidates come back unchanged: the decision is then exactly SkyLB's overflow rule.

Pure: no I/O; the clock is injected (unix seconds by default, since the controller's
window starts are unix times; the simulator passes its virtual clock).

Parameters (``mesh.outlook`` in the balancer YAML): ``horizon`` = 3 windows,
``slack`` = 0.1 (of capacity), ``current_weight`` = 1.0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_HORIZON = 3
DEFAULT_SLACK = 0.1
DEFAULT_CURRENT_WEIGHT = 1.0


class HeartbeatLoad(Protocol):
    """What a peer's heartbeat says about one model (``policies.peers.ModelLoad``)."""

    @property
    def available(self) -> int: ...

    @property
    def total(self) -> int: ...


@dataclass(frozen=True, slots=True)
class OutlookParams:
    horizon: int = DEFAULT_HORIZON
    slack: float = DEFAULT_SLACK
    current_weight: float = DEFAULT_CURRENT_WEIGHT

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.slack < 0 or self.current_weight < 0:
            raise ValueError(f"slack and current_weight must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class RegionOutlook:
    """One region's forecast load for one model: ``load[i]`` covers the window starting
    at ``start + i * window_s`` (unix seconds), relative to the region's capacity."""

    region: str
    model: str
    start: float
    window_s: float
    load: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if any(not (math.isfinite(x) and x >= 0) for x in self.load):
            raise ValueError(f"load must be finite and >= 0, got {self.load}")

    def ahead(self, now: float, horizon: int) -> tuple[float, ...]:
        """The windows from the one containing ``now``, at most ``horizon`` of them."""
        first = max(0, math.floor((now - self.start) / self.window_s))
        return self.load[first:first + horizon]

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> RegionOutlook:
        return cls(str(o["region"]), str(o["model"]), float(o["start"]),
                   float(o["window_s"]), tuple(float(x) for x in o["load"]))

    def to_json(self) -> dict[str, Any]:
        return {"region": self.region, "model": self.model, "start": self.start,
                "window_s": self.window_s, "load": list(self.load)}


def busy_share(load: HeartbeatLoad | None) -> float:
    """Share of a peer's replicas its heartbeat reported unavailable (0 if unknown)."""
    if load is None or load.total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - load.available / load.total))


class PeerOutlook:
    """The published outlooks and the peers' regions; ranks overflow candidates."""

    def __init__(self, params: OutlookParams | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.params = params or OutlookParams()
        self.clock = clock
        self.regions: dict[str, str] = {}  # peer id -> region
        self._outlooks: dict[tuple[str, str], RegionOutlook] = {}
        self.updates = 0

    def set_regions(self, regions: Mapping[str, str]) -> None:
        self.regions = dict(regions)

    def update(self, outlooks: Iterable[RegionOutlook]) -> None:
        """Replace every outlook whole (the newest publication is the forecast)."""
        self._outlooks = {(o.region, o.model): o for o in outlooks}
        self.updates += 1

    def outlooks(self) -> list[RegionOutlook]:
        return [self._outlooks[k] for k in sorted(self._outlooks)]

    def score(self, peer: str, model: str, load: HeartbeatLoad | None, now: float
              ) -> tuple[float, bool]:
        """``(score, forecast used)`` of ``peer`` for ``model`` (see the module docstring)."""
        p = self.params
        busy = busy_share(load)
        o = self._outlooks.get((self.regions.get(peer, ""), model))
        ahead = o.ahead(now, p.horizon) if o is not None else ()
        if not ahead:
            return busy, False
        return (p.current_weight * busy + sum(ahead)) / (p.current_weight + len(ahead)), True

    def rank(self, peers: Sequence[str], model: str,
             loads: Mapping[str, HeartbeatLoad | None]) -> list[str]:
        """The candidates to offer the peer policy: those within ``slack`` of the best
        score, in the given order; all of them when none has a usable outlook."""
        if len(peers) < 2 or not self._outlooks:
            return list(peers)
        now = self.clock()
        scored = [(pid, *self.score(pid, model, loads.get(pid), now)) for pid in peers]
        if not any(used for _, _, used in scored):
            return list(peers)
        best = min(s for _, s, _ in scored)
        return [pid for pid, s, _ in scored if s <= best + self.params.slack]

    def status(self) -> dict[str, Any]:
        """For ``/status``: the parameters and, per region and model, the windows ahead."""
        p, now = self.params, self.clock()
        return {"horizon": p.horizon, "slack": p.slack, "current_weight": p.current_weight,
                "updates": self.updates, "peer_regions": dict(sorted(self.regions.items())),
                "regions": [{**o.to_json(), "ahead": list(o.ahead(now, p.horizon))}
                            for o in self.outlooks()]}
