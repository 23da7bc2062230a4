"""The burst benchmark's CPU and memory accounting, on this test's own process and a real
listening socket (Linux /proc; no vLLM needed)."""

from __future__ import annotations

import os
import socket
import sys

import procstat
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_listening_port_leads_to_its_process_and_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert procstat.listener_pid(port) == os.getpid()
        assert procstat.server_groups([f"http://127.0.0.1:{port}"]) == {"s0": os.getpgid(0)}
    assert procstat.listener_pid(port) is None  # closed: nobody listens


def test_usage_sums_a_process_and_is_none_for_no_process() -> None:
    u = procstat.usage(pids={os.getpid()})
    assert u is not None and u.processes == 1 and u.threads >= 1 and u.rss_mb > 1
    assert procstat.usage(pids=set(), pgid=-7) is None


def test_meter_charges_cpu_spent_between_begin_and_end_to_its_owner() -> None:
    meter = procstat.Meter({}, os.getpid())
    meter.begin()
    start = sum(os.times()[:2])
    while sum(os.times()[:2]) - start < 0.2:  # burn CPU until the kernel has counted it
        sum(i * i for i in range(10_000))
    spent = meter.end()["cpu_s"]
    assert spent["bench"] >= 0.2
    assert spent["lb"] >= 0.15  # the same process, read from /proc in clock ticks
    assert "others" in spent and "machine" not in spent
    assert procstat.runnable() is not None and procstat.runnable() >= 1
