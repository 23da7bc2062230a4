"""rr_profile's reading of a py-spy raw profile: only Python on the loop thread counts,
the socket writes (where a thread waiting for a core is sampled) do not, and a sample
goes to the stage of its innermost matching frame."""

from __future__ import annotations

from skymesh_lab.bench.rr_profile import split, table

LOOP = "<module> (skymesh-lb:8);run (uvloop/__init__.py:92);Runner.run (asyncio/runners.py:118)"
HANDLER = (f"{LOOP};RequestHandler._handle_request (aiohttp/web_protocol.py:577);"
           "Application._handle (aiohttp/web_app.py:563);"
           "Handlers.handle_generate (skymesh/balancer/handlers.py:107)")
RAW = [
    # the body parse, under the handler: its stage, not the handler's or aiohttp's
    f"{HANDLER};parse_request (skymesh/balancer/intake.py:46);"
    "loads_body (skymesh/net/jsonbody.py:105) 8",
    # a frame of the handler itself
    f"{HANDLER} 4",
    # the socket write to the replica: waiting for a core, not counted
    f"{HANDLER};Forwarder.serve (skymesh/balancer/forwarding.py:175);"
    "Upstream._request (skymesh/balancer/upstream.py:549) 50",
    # aiohttp writing the reply, and the loop's own C code: not counted
    f"{LOOP};StreamWriter._writelines (aiohttp/http_writer.py:116) 30",
    f"{LOOP} 12",
    # aiohttp's parser, on the loop
    f"{LOOP};RequestHandler.data_received (aiohttp/web_protocol.py:446) 6",
    # another thread (the probe parsing pool): not the request path's
    "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83) 40",
    "",
]


def test_only_python_on_the_loop_thread_counts_by_innermost_stage() -> None:
    got = split(RAW, requests=1000, rate=400)
    us = 1e6 / 400 / 1000  # one sample per request in microseconds
    assert got == {
        "body parse and checks (parse_request, jsonbody, prompt)": 8 * us,
        "handlers.py's own lines": 4 * us,
        "aiohttp server and response": 6 * us,
    }


def test_the_table_puts_the_two_profiles_side_by_side_with_totals() -> None:
    a = split(RAW, requests=1000, rate=400)
    out = table(a, {"aiohttp server and response": 10.0}).splitlines()
    assert out[2] == "| body parse and checks (parse_request, jsonbody, prompt) | 20.0 | 0.0 |"
    assert "| aiohttp server and response | 15.0 | 10.0 |" in out
    assert out[-1] == "| total | 45.0 | 10.0 |"
