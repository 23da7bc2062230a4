"""The RSS soak (skymesh_lab.bench.rss_soak) measures every process of the balancer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import serving, wait_for

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


def test_flat_is_a_slope_under_2_mb_per_100k_over_the_last_600k() -> None:
    from skymesh_lab.bench.rss_soak_page import flat_verdict

    def run(per_100k: float) -> list[dict[str, float]]:
        # a warm-up rise of 50 MB by 400k, then ``per_100k``
        return [{"requests": n, "rss_mb": 200 + min(n, 400_000) / 8_000
                 + max(0, n - 400_000) * per_100k / 100_000}
                for n in range(0, 1_000_001, 10_000)]

    assert "**Memory is flat over the last 600,000" in flat_verdict(run(0.5))
    assert "not flat" in flat_verdict(run(3.0))
    assert "not flat" in flat_verdict(run(0.5), span=800_000)  # the warm-up's rise counts
    assert "shorter than" in flat_verdict(run(0.0)[:30])


def _probe(requests: int, containers: dict[str, int]) -> dict[str, object]:
    return {"requests": requests, "processes": [
        {"role": "supervisor", "containers": {}, "tracemalloc": {}},
        {"role": "worker", "tracemalloc": {"filename": [
            {"where": "/x/skymesh/prefix/trie.py:0", "kib": requests / 1000}]},
         "containers": {k: {"len": n, "instances": 1, "largest": n}
                        for k, n in containers.items()}}]}


def test_the_page_names_a_growing_structure_with_no_known_bound() -> None:
    from skymesh_lab.bench.rss_soak_page import structures_section

    trie = "skymesh.prefix.trie._Segment.keys"
    doc = {"requests": 400_000, "requests_asked": 400_000, "probes": [
        _probe(20_000, {trie: 9_000, "skymesh.x.Y.grows": 200, "skymesh.x.Y.same": 500}),
        _probe(400_000, {trie: 99_000, "skymesh.x.Y.grows": 9_000,
                         "skymesh.x.Y.same": 500})]}
    page = structures_section(doc)
    assert f"| `{trie}` | 9,000 | 99,000 | the prefix trie's keys: `max_nodes`" in page
    assert "| `skymesh.x.Y.grows` | 200 | 9,000 | **no bound known" in page
    assert "skymesh.x.Y.same" not in page  # did not grow
    assert "**1 growing structure(s) with no known bound**: `skymesh.x.Y.grows`" in page
    assert "| `skymesh/prefix/trie.py` | 0.0 | 0.4 |" in page


def test_the_probe_finds_what_start_up_froze_and_counts_its_containers() -> None:
    """tune_gc freezes the policy and its trie: gc.get_objects() no longer lists them."""
    import gc

    from skymesh.prefix.trie import PrefixTrie
    from skymesh_lab.bench.rss_soak_probe import containers, reachable

    holder = {"trie": PrefixTrie(1_000)}
    for i in range(40):
        holder["trie"].insert([1_000 + i, 2_000 + i], "a")
    gc.freeze()
    try:
        assert not any(o is holder["trie"] for o in gc.get_objects())
        anchor = [holder]  # noqa: F841 (made after the freeze, as a request's objects are)
        found = containers(reachable())
    finally:
        gc.unfreeze()
    assert found["skymesh.prefix.trie.PrefixTrie._index"]["len"] >= 40
    assert found["skymesh.prefix.trie._Segment.keys"]["len"] >= 80


def test_the_soak_asks_a_balancer_process_for_a_dump_and_records_it(tmp_path: Path) -> None:
    """The probe reaches each process through the sitecustomize the soak puts on its
    PYTHONPATH, and answers SIGUSR1 with a dump of what that process holds."""
    import asyncio

    from skymesh_lab.bench.rss_soak import Prober

    prober = Prober(tmp_path / "dumps", {5}, 0)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, skymesh.prefix.keys as k\n"
         "k._prompts.update({(i, ''): ('', ()) for i in range(20)})\n"
         "print('ready', flush=True)\ntime.sleep(60)\n"],
        env=prober.env(tmp_path / "site"), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        asyncio.run(prober.take(child.pid, 5, timeout=60))
        asyncio.run(prober.take(child.pid, 9, timeout=60))  # a second dump, a new file
    finally:
        child.kill()
        child.wait()
    assert [p["requests"] for p in prober.probes] == [5, 9]
    proc = prober.probes[1]["processes"][0]
    assert proc["pid"] == child.pid and proc["role"] == "worker"
    assert proc["containers"]["skymesh.prefix.keys:_prompts"]["len"] == 20


def test_the_log_scan_counts_error_lines_and_tracebacks_and_nothing_else() -> None:
    """Issue #35: a client that leaves costs no ERROR line or traceback; the soak counts
    them in the balancer's text log (time, level, logger: message)."""
    from skymesh_lab.bench.rss_soak import log_errors

    log = [
        "2026-11-29 18:55:22,831 WARNING skymesh.lb: attempt 1 failed: HTTP 500\n",
        "2026-11-29 18:55:22,832 INFO skymesh.access: POST /v1/x 499 note=ERROR here\n",
        "2026-11-29 18:55:22,833 ERROR aiohttp.server: Error handling request from ::1\n",
        "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in <module>\n',
        "ConnectionResetError: gone\n",
        "2026-11-29 18:55:22,834 CRITICAL skymesh.lb: down\n",
        "skymesh-lb listening on http://127.0.0.1:1 (ERROR in a banner is no level)\n",
    ]
    found = log_errors(log, keep=2)
    assert found["error_lines"] == 2 and found["tracebacks"] == 1
    assert found["first"] == [
        "2026-11-29 18:55:22,833 ERROR aiohttp.server: Error handling request from ::1",
        "Traceback (most recent call last):"]
    assert log_errors(log[:2]) == {"error_lines": 0, "tracebacks": 0, "first": []}


def test_the_clients_that_left_are_the_balancers_outcomes_and_failed_writes() -> None:
    from skymesh_lab.bench.rss_soak import clients_left

    text = ('skymesh_requests_total{model="m",outcome="cancelled",worker="0"} 4.0\n'
            'skymesh_requests_total{model="m",outcome="client_disconnected",worker="0"} 7.0\n'
            'skymesh_requests_total{model="m",outcome="client_disconnected",worker="1"} 2.0\n'
            'skymesh_requests_total{model="m",outcome="ok",worker="1"} 99.0\n'
            'skymesh_client_disconnects_total{phase="mid_stream",worker="0"} 3.0\n'
            'skymesh_client_disconnects_total{phase="mid_stream",worker="1"} 1.0\n'
            'skymesh_client_disconnects_created{phase="mid_stream",worker="1"} 1.7e9\n')
    assert clients_left(text) == {"cancelled": 4, "client_disconnected": 9,
                                  "write_mid_stream": 4}


def test_a_held_stream_sends_its_first_event_and_the_rest_before_the_next_answer() -> None:
    """With --leave-hold-ms the stub holds a leave_mid_stream stream after its first event
    (the client leaves meanwhile); a request behind it on the connection waits for it."""
    import asyncio
    import json

    from skymesh_lab.bench.rss_soak import StubReplica

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.out: list[bytes] = []

        def write(self, data: bytes | bytearray | memoryview) -> None:
            self.out.append(bytes(data))

        def is_closing(self) -> bool:
            return False

    def post(body: dict[str, object]) -> bytes:
        raw = json.dumps(body).encode()
        return b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
            len(raw), raw)

    async def run() -> None:
        stub, transport = StubReplica(hold_s=3600.0), Transport()
        stub.connection_made(transport)
        leaver = {"messages": [{"content": "leave-mid-stream 3"}], "stream": True}
        stub.data_received(post(leaver) + post({"messages": [{"content": "hi"}]}))
        head, first = transport.out[0].split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and first.count(b"\n\n") == 1
        assert len(transport.out) == 1  # the rest and the next answer wait
        stub.release(StubReplica.answer(b"/v1/chat/completions",
                                        json.dumps(leaver).encode()).split(first, 1)[1])
        assert transport.out[1].endswith(b"data: [DONE]\n\n")
        assert transport.out[2].startswith(b"HTTP/1.1 200") and b"hello there" in transport.out[2]
        unheld = StubReplica()  # the default answers the same stream at once
        unheld.connection_made(t2 := Transport())
        unheld.data_received(post(leaver))
        assert len(t2.out) == 1 and t2.out[0].endswith(b"data: [DONE]\n\n")

    asyncio.run(run())


def test_the_page_says_which_server_ran_and_what_the_log_said_of_clients_that_left() -> None:
    from skymesh_lab.bench.rss_soak_page import leaving_note, server_note

    assert server_note({"http_server": "lean"}) == "HTTP server `lean` (`listen.http_server`)"
    assert "aiohttp" in server_note({})  # the runs that recorded none
    samples = [{"requests": 0}] + [
        {"requests": n, "lb_left": {"cancelled": n // 100, "client_disconnected": n // 10,
                                    "write_mid_stream": n // 1000}}
        for n in (10_000, 20_000, 30_000)]
    clean = leaving_note({"samples": samples, "log_errors": {
        "error_lines": 0, "tracebacks": 0, "first": []}})
    assert "**no ERROR line and no traceback**" in clean
    assert "moved in 2 of the 2 intervals" in clean
    assert "`client_disconnected` 3,000" in clean and "mid_stream 30" in clean
    dirty = leaving_note({"samples": samples, "leave_hold_ms": 5, "log_errors": {
        "error_lines": 2, "tracebacks": 1, "first": ["x ERROR y"]}})
    assert "**2 ERROR line(s) and 1 traceback(s)** (the first: `x ERROR y`)" in dirty
    assert "5 ms after its first event" in dirty


def test_the_held_run_is_a_section_of_the_page_with_its_command() -> None:
    from skymesh_lab.bench.rss_soak_page import LEAVE_HOLD, rss_soak

    def run(hold: float) -> dict[str, object]:
        samples = [{"requests": n, "rss_mb": 200.0, "cpu_s": n / 1000, "procs": 3,
                    "t_s": n / 500, "lb_left": {"cancelled": n // 100,
                                                "client_disconnected": n // 10}}
                   for n in range(0, 100_001, 10_000)]
        return {"requests": 100_000, "requests_asked": 100_000, "samples": samples,
                "concurrency": 32, "scenarios": ["plain"], "cpu_ms_per_1000": 500.0,
                "http_server": "lean", "leave_hold_ms": hold, "processes": 3,
                "log_errors": {"error_lines": 0, "tracebacks": 0, "first": []}}

    page = rss_soak({**run(0.0), LEAVE_HOLD: run(5.0)})
    section = page[page.index("## Clients that leave mid-stream"):]
    assert "held the rest of each `leave_mid_stream` stream 5 ms" in section
    assert "500 requests a second" in section
    assert "--requests 100000 --leave-hold-ms 5 --json" in section
    assert page.count("**no ERROR line and no traceback**") == 2  # the long run's too


def test_the_probe_is_taken_at_the_sample_it_was_asked_for() -> None:
    """The sample reads the balancer's metrics (an await): the other clients go on
    meanwhile, so the count the probe is matched against is the sample's, not the one
    after the read."""
    import asyncio
    import os

    from aiohttp import web

    from skymesh_lab.bench.rss_soak import drive

    class FakeProber:
        at = {20}

        def __init__(self) -> None:
            self.taken: list[int] = []

        async def take(self, pid: int, requests: int) -> None:
            self.taken.append(requests)

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    async def metrics(request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)  # long enough for the other clients to finish some
        return web.Response(text='skymesh_requests_total{model="m",outcome="ok"} 1.0\n')

    async def run() -> tuple[list[dict[str, object]], list[int]]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_get("/metrics", metrics)
        prober = FakeProber()
        async with serving(app) as port:
            samples = await drive(f"http://127.0.0.1:{port}", 60, 4, os.getpid(), 10, 0,
                                  prober=prober)  # type: ignore[arg-type]
        return samples, prober.taken

    samples, taken = asyncio.run(run())
    assert [s["requests"] for s in samples] == [0, 10, 20, 30, 40, 50, 60]
    assert taken == [20]
