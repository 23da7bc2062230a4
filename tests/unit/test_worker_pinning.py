"""Which core each worker of a multi-worker skymesh-lb is pinned to
(skymesh.balancer.workers.worker_cpus, ``listen.pin_workers``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skymesh.balancer.config import ListenConfig
from skymesh.balancer.workers import usable_core_ids, worker_cpus


def test_auto_pins_only_with_one_core_per_worker() -> None:
    assert worker_cpus("auto", [0, 1], 2) == [0, 1]
    assert worker_cpus("auto", [5, 3], 2) == [3, 5]  # a cpuset's cores, in order
    assert worker_cpus("auto", [0, 1, 2, 3], 2) is None  # room to move: the kernel's
    assert worker_cpus("auto", [0], 2) is None


def test_true_pins_round_the_cores_and_false_never() -> None:
    assert worker_cpus(True, [0, 1, 2, 3], 2) == [0, 1]
    assert worker_cpus(True, [2, 7], 5) == [2, 7, 2, 7, 2]
    assert worker_cpus(False, [0, 1], 2) is None


def test_one_worker_or_no_known_cores_is_never_pinned() -> None:
    assert worker_cpus(True, [0, 1], 1) is None  # the single process of before
    assert worker_cpus("auto", [0], 1) is None
    assert worker_cpus(True, [], 2) is None


def test_usable_core_ids_are_this_process_affinity() -> None:
    ids = usable_core_ids()
    assert ids == sorted(ids) and len(ids) == len(set(ids)) >= 1


def test_listen_pin_workers_setting() -> None:
    assert ListenConfig().pin_workers == "auto"
    assert ListenConfig(pin_workers=True).pin_workers is True
    assert ListenConfig(pin_workers=False).pin_workers is False
    with pytest.raises(ValidationError):
        ListenConfig(pin_workers="sometimes")
