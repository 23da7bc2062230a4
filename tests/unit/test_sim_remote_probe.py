"""A simulated balancer probing a replica in another region sees it as the live one does
through the WAN: as of half a round trip after the probe left, a round trip late."""

from __future__ import annotations

from typing import Any

from skymesh.policies import build_policy
from skymesh.policies.load import PushMode
from skymesh_lab.sim.cluster import SimBalancer, SimReplica
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.network import LOCAL_ONE_WAY_S, Network
from skymesh_replica.engine.profiles import get_profile


class ClockEngine:
    """Engine state that reads the virtual clock: waiting = milliseconds since 0."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop

    @property
    def num_waiting(self) -> int:
        return round(self.loop.now * 1000)

    num_running = 0
    kv_usage = 0.0


def test_a_remote_replica_is_seen_as_of_half_a_round_trip_a_round_trip_late() -> None:
    loop, net = EventLoop(), Network()
    profile = get_profile("llama3.1-8b-l4")
    home = SimReplica("us-0", "us", profile, loop, lambda *a: None)
    far = SimReplica("asia-0", "asia", profile, loop, lambda *a: None)
    for r in (home, far):
        r.engine = ClockEngine(loop)  # type: ignore[assignment]
    lb = SimBalancer("lb-us", "us", [home, far], build_policy("least-load"), loop, net,
                     mode=PushMode.BP, is_active=lambda: False)
    seen: list[tuple[float, str, float, int]] = []
    real = lb.dispatcher.on_probe

    def record(target: str, now: float, waiting: int, *rest: Any) -> None:
        seen.append((loop.now, target, now, waiting))
        real(target, now, waiting, *rest)

    lb.dispatcher.on_probe = record  # type: ignore[method-assign]
    loop.at(1.0, lb._probe)
    loop.run()
    one_way = net.one_way("us", "asia")
    assert one_way > LOCAL_ONE_WAY_S
    (t_home, id_home, sent_home, w_home), (t_far, id_far, sent_far, w_far) = seen
    assert (id_home, t_home, sent_home, w_home) == ("us-0", 1.0, 1.0, 1000)
    assert id_far == "asia-0" and sent_far == 1.0  # in-flight accounting from the send
    assert abs(t_far - (1.0 + 2 * one_way)) < 1e-9
    assert w_far == round((1.0 + one_way) * 1000)
    assert lb.dispatcher.targets["asia-0"].load.waiting == w_far


def test_an_answer_from_a_replica_that_left_is_dropped() -> None:
    loop, net = EventLoop(), Network()
    far = SimReplica("eu-0", "eu", get_profile("llama3.1-8b-l4"), loop, lambda *a: None)
    lb = SimBalancer("lb-us", "us", [far], build_policy("least-load"), loop, net,
                     mode=PushMode.BP, is_active=lambda: False)
    calls: list[str] = []
    lb.dispatcher.on_probe = lambda target, *a: calls.append(target)  # type: ignore[method-assign]
    lb._probe()
    del lb.replicas["eu-0"]
    loop.run()
    assert calls == []
