"""sp-p's queue inside the engine (``pushing.engine_queue``): a replica is filled to
``max_num_seqs + engine_queue``, one request of ours waiting there so a freed slot is taken
at the engine's next step; the default follows the replica kind."""

from __future__ import annotations

import pytest

from skymesh.balancer.config import ConfigError, parse_config
from skymesh.policies.load import PushMode, ReplicaLoad, is_available


def _filled(engine_queue: int, seqs: int = 4) -> int:
    """How many pushes sp-p lets onto an idle replica before the next probe."""
    load = ReplicaLoad("r", max_num_seqs=seqs, engine_queue=engine_queue, metrics_lag_s=1.0)
    load.on_probe(0.0, waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=10**6)
    n = 0
    while is_available(load, PushMode.SP_P) and n < 100:
        load.on_dispatch(f"q{n}", 0.5)
        load.on_first_byte(f"q{n}")
        n += 1
    return n


@pytest.mark.parametrize("queue", [0, 1, 3])
def test_sp_p_fills_a_replica_to_its_limit_plus_the_engine_queue(queue: int) -> None:
    assert _filled(queue) == 4 + queue


def test_a_probe_that_shows_the_queue_full_holds_further_pushes() -> None:
    load = ReplicaLoad("r", max_num_seqs=4, engine_queue=1)
    load.on_probe(0.0, waiting=1, running=4, kv_usage=0.5, kv_capacity_tokens=10**6)
    assert not is_available(load, PushMode.SP_P)
    load.on_probe(1.0, waiting=0, running=4, kv_usage=0.5, kv_capacity_tokens=10**6)
    assert is_available(load, PushMode.SP_P)  # the fifth, which will wait inside


def test_the_default_follows_the_replica_kind_and_the_config_overrides_it() -> None:
    urls = [{"url": "http://127.0.0.1:1"}, {"url": "http://127.0.0.1:2", "kind": "sglang"},
            {"url": "http://127.0.0.1:3", "kind": "skymesh"}]
    cfg = parse_config({"replicas": urls})
    assert [r.engine_queue(cfg.pushing) for r in cfg.replicas] == [1, 0, 0]
    cfg = parse_config({"replicas": urls, "pushing": {"engine_queue": 2}})
    assert [r.engine_queue(cfg.pushing) for r in cfg.replicas] == [2, 2, 2]
    with pytest.raises(ConfigError, match=r"pushing\.engine_queue"):
        parse_config({"pushing": {"engine_queue": -1}})
