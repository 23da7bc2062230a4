"""The router-overhead benchmark's C stub backend: it compiles and answers what the
routers and skymesh-lb's prober ask (no benchmark run here)."""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from skymesh.common.probe import parse_metrics
from skymesh.util.procs import Daemon
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="gcc is needed to build the stub backend")
EVENTS = 5


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[Daemon]:
    d = ro.start_stub(ro.build_stub(tmp_path), EVENTS, tmp_path, 0)
    try:
        yield d
    finally:
        d.stop()


def _conn(d: Daemon) -> http.client.HTTPConnection:
    host, port = d.url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=5)


def test_stub_answers_probes_and_chat_on_one_keep_alive_connection(stub: Daemon) -> None:
    c = _conn(stub)
    c.request("GET", "/health")
    r = c.getresponse()
    assert (r.status, r.read()) == (200, b"OK")
    c.request("GET", "/metrics")
    probe = parse_metrics(c.getresponse().read().decode())
    assert (probe.running, probe.waiting) == (0, 0)
    c.request("GET", "/v1/models")
    assert b'"id":"stub"' in c.getresponse().read()
    c.request("GET", "/get_server_info")
    assert b'"model_path"' in c.getresponse().read()
    c.request("POST", "/v1/chat/completions", body=b'{"model":"stub","messages":[]}',
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and b'"chat.completion"' in r.read()
    c.request("GET", "/nothing-here")
    r = c.getresponse()
    assert r.status == 404
    r.read()
    c.close()


def test_stub_streams_k_events_and_reads_chunked_bodies(stub: Daemon) -> None:
    c = _conn(stub)
    # A chunked request body (a router forwarding a stream of its own), "stream": true.
    c.request("POST", "/v1/chat/completions",
              body=iter([b'{"model":"stub",', b'"stream": true}']),
              headers={"Content-Type": "application/json",
                       "Transfer-Encoding": "chunked"}, encode_chunked=True)
    r = c.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == EVENTS + 1 and events[-1] == "data: [DONE]"
    assert all('"content":"tok"' in e for e in events[:-1])
    c.close()


def _ask(c: http.client.HTTPConnection, system: str) -> None:
    body = json.dumps({"model": "stub", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "q"}]},
        separators=(",", ":")).encode()
    c.request("POST", "/v1/chat/completions", body=body,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.read()


def test_stub_counts_prefix_hits_in_a_bounded_lru(stub: Daemon) -> None:
    c = _conn(stub)
    _ask(c, "prefix A")
    _ask(c, "prefix A")  # a hit
    for i in range(ro.STUB_PREFIX_CACHE):  # as many others: A is the least recent, evicted
        _ask(c, f"other {i}")
    _ask(c, "prefix A")  # a miss again
    _ask(c, f"other {ro.STUB_PREFIX_CACHE - 1}")  # still cached: a hit
    c.request("GET", "/metrics")
    samples = st.prefix_samples(c.getresponse().read().decode())
    c.close()
    n = ro.STUB_PREFIX_CACHE + 4
    assert samples == {"stub_prefix_lookups_total": n, "stub_prefix_hits_total": 2}
    assert st.prefix_hit_rate({}, samples) == pytest.approx(2 / n)
