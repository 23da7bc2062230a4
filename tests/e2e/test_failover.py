"""A vLLM server killed while it holds requests: the balancer retries them on the other.

Runs last (``e2e_disruptive``): the shared cluster has one server fewer afterwards.
Requests are non-streamed, so no byte has reached the client when the server dies and
every one of them must come back complete, served by the survivor.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import wait_for
from vllm_cluster import MODEL_NAME, Cluster, http_get

N_REQUESTS = 8
LONG = 600  # tokens: seconds of decoding, so the kill lands mid-generation


def gauge(base: str, name: str) -> float:
    """Sum of a metric's samples on a server (0 when the server does not answer)."""
    status, body = http_get(base + "/metrics")
    if status != 200:
        return 0.0
    return sum(s.value for fam in text_string_to_metric_families(body.decode())
               for s in fam.samples if s.name == name)


def complete(base: str, max_tokens: int = LONG) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": "Betty is saving money for a new wallet.",
            "max_tokens": max_tokens, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return {"status": r.status, **json.loads(r.read())}


@pytest.mark.e2e_disruptive
def test_requests_on_a_killed_server_are_retried_on_the_other(cluster: Cluster) -> None:
    victim = cluster.servers[1]
    retries_before = gauge(cluster.lb.url, "skymesh_retries_total")
    with ThreadPoolExecutor(N_REQUESTS) as pool:
        futures = [pool.submit(complete, cluster.lb.url) for _ in range(N_REQUESTS)]
        wait_for(lambda: gauge(victim.url, "vllm:num_requests_running") > 0,
                 "the victim to run some of the requests", timeout=120)
        victim.kill()
        results = [f.result() for f in futures]
    assert all(r["status"] == 200 for r in results)
    assert all(r["usage"]["completion_tokens"] == LONG for r in results)
    assert gauge(cluster.lb.url, "skymesh_retries_total") > retries_before
    # The balancer notices the dead server and keeps serving with the survivor.
    wait_for(lambda: json.loads(http_get(cluster.lb.url + "/ready")[1] or b"{}")
             .get("healthy_replicas") == 1, "skymesh-lb to mark the killed server", 60)
    assert complete(cluster.lb.url, max_tokens=8)["status"] == 200
