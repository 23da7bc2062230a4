"""The added-latency benchmark's statistics and CPU placement (skymesh_lab.bench.overhead):
the round-paired bootstrap that says whether skymesh-lb is behind sglang-router, and
pinning every thread of a process tree."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from skymesh_lab.bench.overhead import (
    LB_BP,
    SGLR,
    Sample,
    against_sglang,
    pin_pid,
    round_bootstrap,
)


def rounds(rng: np.random.Generator, n: int, shift: float = 0.0,
           drift: float = 0.0) -> list[np.ndarray]:
    # Round i is slower by i * drift on every path: the machine's state over a run.
    return [rng.lognormal(-7, 0.3, 40) + shift + i * drift for i in range(n)]


def test_a_shift_between_paths_is_found_and_bracketed() -> None:
    rng = np.random.default_rng(1)
    d, lo, hi = round_bootstrap(rounds(rng, 20, shift=2e-4), rounds(rng, 20), 50)
    assert lo > 0 and lo <= d <= hi
    assert abs(d - 2e-4) < 1e-4


def test_the_same_path_twice_is_not_called_different_even_with_drift() -> None:
    rng = np.random.default_rng(2)
    a, b = rounds(rng, 20, drift=5e-5), rounds(rng, 20, drift=5e-5)
    d, lo, hi = round_bootstrap(a, b, 50)
    assert lo <= 0 <= hi and lo <= d <= hi


def test_rounds_must_pair() -> None:
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="rounds"):
        round_bootstrap(rounds(rng, 3), rounds(rng, 4), 50)


def test_failed_requests_are_left_out_of_the_comparison() -> None:
    def sample(ttft: float, ok: bool = True) -> Sample:
        return Sample(due=0.0, sent=1.0, first=1.0 + ttft, done=1.0 + 2 * ttft,
                      error="" if ok else "HTTP 502")

    lb = [[sample(0.002), sample(9.0, ok=False)] for _ in range(5)]
    sg = [[sample(0.001)] for _ in range(5)]
    vs = against_sglang({LB_BP: lb, SGLR: sg}, seed=0)
    d, lo, hi = vs[LB_BP]["ttft_p50_s"]
    assert d == pytest.approx(0.001) and lo == pytest.approx(0.001) == hi
    assert vs[LB_BP]["e2e_p50_s"][0] == pytest.approx(0.002)
    assert against_sglang({LB_BP: lb}, seed=0) == {}  # no sglang-router column: nothing


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinning_moves_every_thread_of_a_process_and_its_children() -> None:
    cpu = max(os.sched_getaffinity(0))
    # A parent with a second thread and a child process, all waiting on stdin.
    code = ("import subprocess, sys, threading\n"
            "threading.Thread(target=sys.stdin.readline, daemon=True).start()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
            " stdin=subprocess.PIPE)\n"
            "print(child.pid, flush=True)\n"
            "sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        pin_pid(proc.pid, {cpu})
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) >= 2
        assert all(os.sched_getaffinity(t) == {cpu} for t in tids)
        assert os.sched_getaffinity(child) == {cpu}
    finally:
        proc.kill()  # the child reads the parent's pipe: it ends at EOF
        proc.wait()
