"""Forecast-aware overflow in the simulator: the live balancer's :class:`PeerOutlook` on
every simulated balancer, fed by a forecast source every ``interval_s`` of virtual time.

The decision code is the product's (``skymesh.mesh.outlook`` through the dispatcher's
overflow step); only the feed differs: where the live balancer reads ``GET /v1/outlook``
from the controller, the simulator asks an :class:`OutlookFeed` (an oracle, or a
forecaster over the workload's own past; see ``skymesh_lab.bench.forecast_peers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from skymesh.mesh.outlook import OutlookParams, PeerOutlook, RegionOutlook
from skymesh_lab.sim.runner import Simulation


class OutlookFeed(Protocol):
    @property
    def interval_s(self) -> float:
        """Virtual seconds between publications."""
        ...

    def outlooks(self, now: float) -> Sequence[RegionOutlook]:
        """The outlook every balancer receives at virtual time ``now``."""
        ...


def attach(sim: Simulation, feed: OutlookFeed, params: OutlookParams | None = None
           ) -> dict[str, PeerOutlook]:
    """Give every balancer of ``sim`` a :class:`PeerOutlook` and schedule the feed; returns
    them by region. Call before ``sim.run()``."""
    if not feed.interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {feed.interval_s}")
    outlooks: dict[str, PeerOutlook] = {}
    for region, bal in sim.balancers.items():
        o = PeerOutlook(params, clock=lambda: sim.loop.now)
        o.set_regions({name: p.region for name, p in bal.peers.items()})
        bal.dispatcher.outlook = o
        outlooks[region] = o

    def publish() -> None:
        fresh = list(feed.outlooks(sim.loop.now))
        for o in outlooks.values():
            o.update(fresh)
        if sim._active():
            sim.loop.after(feed.interval_s, publish)

    sim.loop.at(0.0, publish)
    return outlooks
