"""rr_profile's reading of a py-spy raw profile: only Python on the loop thread counts,
the socket writes (where a thread waiting for a core is sampled) and the loop's C code do
not (they are shown apart), a coroutine's sample counts without ``Runner.run`` under it
(the lean server's), and a sample goes to the stage of its innermost matching frame."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from skymesh_lab.bench import rr_profile
from skymesh_lab.bench.rr_profile import LEFT_LOOP, LEFT_WRITES, by_line, split, table

LOOP = "<module> (skymesh-lb:8);run (uvloop/__init__.py:92);Runner.run (asyncio/runners.py:118)"
HANDLER = (f"{LOOP};RequestHandler._handle_request (aiohttp/web_protocol.py:577);"
           "Application._handle (aiohttp/web_app.py:563);"
           "Handlers.handle_generate (nowhere/handlers.py:107)")
MAIN = "thread (11715): MainThread"
RAW = [
    # the body parse, under the handler: its stage, not the handler's or aiohttp's
    f"{HANDLER};parse_request (nowhere/balancer/intake.py:46);"
    "loads_body (nowhere/net/jsonbody.py:105) 8",
    # a frame of the handler itself
    f"{HANDLER.replace('nowhere/', 'skymesh/balancer/')} 4",
    # the socket write to the replica: waiting for a core, not counted (by name: no source)
    f"{HANDLER};Forwarder.serve (nowhere/forwarding.py:175);"
    "Upstream._request (nowhere/upstream.py:549) 50",
    # aiohttp writing the reply, and the loop's own C code: not counted
    f"{LOOP};StreamWriter._writelines (nowhere/http_writer.py:116) 30",
    f"{LOOP} 12",
    # aiohttp's parser, on the loop
    f"{LOOP};RequestHandler.data_received (aiohttp/web_protocol.py:446) 6",
    # another thread (the probe parsing pool): not the request path's
    "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83) 40",
    "",
]
US = 1e6 / 400 / 1000  # one sample per request, in microseconds


def test_only_python_on_the_loop_thread_counts_by_innermost_stage() -> None:
    got = split(RAW, requests=1000, rate=400)
    assert got == {
        "body parse and checks (parse_request, jsonbody, prompt)": 8 * US,
        "handlers.py's own lines": 4 * US,
        "aiohttp server and response": 6 * US,
        LEFT_WRITES: 80 * US,
        LEFT_LOOP: 12 * US,
    }


# The lean server under py-spy --threads: a resumed coroutine's stack starts at the
# outermost coroutine (no Runner.run below it), every sample names its thread.
LEAN = [
    f"{MAIN};LeanProtocol._serve (skymesh/net/lean.py:385);"
    "LeanProtocol._respond (skymesh/net/lean.py:402);"
    "request_handler.<locals>.front (skymesh/net/front.py:97);"
    "Handlers.handle_generate (skymesh/balancer/handlers.py:153);"
    "Forwarder.serve (skymesh/balancer/forwarding.py:255) 10",
    f"{MAIN};LeanProtocol._respond (skymesh/net/lean.py:434);"
    "LeanProtocol._respond (nowhere/net/lean.py:412) 6",
    f"{MAIN};LeanProtocol._feed (skymesh/net/lean.py:276) 3",
    f"{MAIN};request_handler.<locals>.front (skymesh/net/front.py:90) 2",
    f"{MAIN};LeanProtocol._send_plain (nowhere/lean.py:478) 7",  # by name: a write
    f"{MAIN} 5",  # no Python frame: the loop's C code
    f"{MAIN};<module> (skymesh-lb:8);Runner.run (asyncio/runners.py:118) 4",
    "thread (11764): uvloop_1;_worker (concurrent/futures/thread.py:81) 9",
]


def test_lean_server_samples_count_without_runner_run_and_other_threads_do_not() -> None:
    got = split(LEAN, requests=1000, rate=400)
    assert got == pytest.approx({
        "forwarding.py's own lines": 10 * US,
        "lean server (net/lean.py, net/lean_request.py)": 9 * US,
        "server's request handler (net/front.py)": 2 * US,
        LEFT_WRITES: 7 * US,
        LEFT_LOOP: 9 * US,
    })


def test_a_write_is_found_in_the_profiled_source_whatever_its_function(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "srv.py").write_text(
        "def send(t, b):\n    head = b'x'\n    t.transport.write(head + b)\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    rr_profile.is_write.cache_clear()
    rr_profile._file_lines.cache_clear()
    try:
        raw = [f"{MAIN};Proto.send (pkg/srv.py:3) 4", f"{MAIN};Proto.send (pkg/srv.py:2) 1"]
        assert split(raw, requests=1000, rate=400) == {LEFT_WRITES: 4 * US, "other": 1 * US}
        # and a function named as a write elsewhere is not one on a line that is not
        named = [f"{MAIN};Upstream._request (pkg/srv.py:2) 2"]
        assert split(named, requests=1000, rate=400) == {"other": 2 * US}
    finally:
        rr_profile.is_write.cache_clear()
        rr_profile._file_lines.cache_clear()


def test_by_line_gives_self_time_per_frame_and_its_functions_inclusive_time() -> None:
    rows = by_line(LEAN, requests=1000, rate=400, top=2)
    assert rows[0] == ("Forwarder.serve (skymesh/balancer/forwarding.py:255)", 10 * US,
                       10 * US)
    assert rows[1] == ("LeanProtocol._respond (nowhere/net/lean.py:412)", 6 * US, 16 * US)
    # _respond is under the handler's sample and its own: 16 samples inclusive


def test_the_table_puts_the_two_profiles_side_by_side_with_totals() -> None:
    a = split(RAW, requests=1000, rate=400)
    out = table(a, {"aiohttp server and response": 10.0}).splitlines()
    assert out[2] == "| body parse and checks (parse_request, jsonbody, prompt) | 20.0 | 0.0 |"
    assert "| aiohttp server and response | 15.0 | 10.0 |" in out
    # the total is Python on the loop; what was left out follows it, per request too
    assert out[-3] == "| total | 45.0 | 10.0 |"
    assert out[-2] == f"| ({LEFT_WRITES}) | 200.0 | 0.0 |"
    assert out[-1] == f"| ({LEFT_LOOP}) | 30.0 | 0.0 |"
