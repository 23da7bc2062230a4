"""The RSS soak (skymesh_lab.bench.rss_soak) measures every process of the balancer."""

from __future__ import annotations

import subprocess
import sys

from support import wait_for

from skymesh_lab.bench.rss_soak import balancer_outcomes, process_tree, read_one, read_proc
from skymesh_lab.bench.rss_soak_page import outcomes_note

# A stand-in for skymesh-lb with workers: a parent that starts two children and waits.
_PARENT = ("import subprocess, sys, time\n"
           "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
           " for _ in range(2)]\n"
           "time.sleep(60)\n")


def test_rss_and_cpu_are_those_of_the_supervisor_and_every_worker() -> None:
    """With ``listen.workers: auto`` the balancer is a supervisor and N workers: the
    soak read the supervisor alone (a few MB, no requests) and missed what grows."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT])
    try:
        wait_for(lambda: len(process_tree(parent.pid)) == 3, "the two children")
        rss, cpu, procs = read_proc(parent.pid)
        assert procs == 3
        each = [read_one(p)[0] for p in process_tree(parent.pid)]
        assert rss >= max(each) + min(each)  # summed, not the supervisor's alone
        assert rss > read_one(parent.pid)[0]
        assert cpu >= 0
    finally:
        for pid in process_tree(parent.pid)[1:]:
            subprocess.run(["kill", str(pid)], check=False)
        parent.kill()
        parent.wait()


def test_the_balancers_outcomes_are_summed_over_models_and_workers() -> None:
    text = ('# HELP skymesh_requests_total Requests by final outcome\n'
            'skymesh_requests_total{model="m",outcome="ok",worker="0"} 10.0\n'
            'skymesh_requests_total{model="m",outcome="ok",worker="1"} 5.0\n'
            'skymesh_requests_total{model="?",outcome="BadRequest",worker="0"} 2.0\n'
            'skymesh_requests_created{model="m",outcome="ok",worker="0"} 1.7e9\n')
    assert balancer_outcomes(text) == {"BadRequest": 2, "ok": 15}


def test_the_page_names_the_errors_and_where_each_outcome_comes_from() -> None:
    note = outcomes_note({"ok": 50, "client_disconnected": 3, "error": 2})
    assert note.index("`ok` 50") < note.index("`client_disconnected` 3")
    assert "mid-stream" in note and "**2 `error`**" in note
    assert "no `error`" in outcomes_note({"ok": 50})
