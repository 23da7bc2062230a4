"""A rolling upgrade through the controller's intake (issue #37): a balancer older than
the tenant demand reports sends telemetry without ``tenants`` and divides each limit by
``share``; the controller must count it at ``1/n`` so the new balancers' parts leave
room for it. In process: the controller's parts on a memory store, no network."""

from __future__ import annotations

import pytest

from skymesh_controller.config import parse_config
from skymesh_controller.models import TelemetryIn
from skymesh_controller.service import Controller
from skymesh_controller.store import MemoryStore


async def test_a_balancer_reporting_no_demand_is_counted_at_its_even_share() -> None:
    ctl = Controller(parse_config({"tenant_share_floor": 0.1}), MemoryStore())
    await ctl.store.commit(
        [("balancers", b, {"id": b, "region": "us", "url": f"http://{b}:1", "state": "up"})
         for b in ("new-a", "new-b", "old")]
        + [("tenants", "acme", {"name": "acme", "requests_per_s": 30.0, "scope": "global"})])
    busy = {"requests_per_s": 20.0, "tokens_per_min": 600.0}
    for bid, report in (("new-a", {"window_s": 5, "tenants": {"acme": busy}}),
                        ("new-b", {"window_s": 5, "tenants": {}}),  # nothing offered
                        ("old", {"window_s": 5, "models": {}})):  # no tenants: older
        await ctl.telemetry.report(bid, TelemetryIn.model_validate(report))
    got = {}
    for bid in ("new-a", "new-b", "old"):
        (acme,) = (await ctl.members.tenants_for(bid))["tenants"]
        got[bid] = acme["fraction"]
    # The old one admits 1/3 whatever it is pushed; the new ones split the other 2/3
    # (new-b at the floor, 0.1 / 3): together never over the limit.
    assert got == pytest.approx({"new-a": 2 / 3 - 0.1 / 3, "new-b": 0.1 / 3, "old": 1 / 3},
                                abs=1e-5)
