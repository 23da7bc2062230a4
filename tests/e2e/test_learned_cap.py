"""sp-p learns vLLM's ``--max-num-seqs`` from its probes (issue #34 [defaults] item 1), on
the real servers: a fresh ``skymesh-lb`` on the balancer's defaults, NOT told
``max_num_seqs``, takes the benchmark's 48-stream burst (``tools/e2e/burst_bench.py``,
no warm-up, so the limit is learned during this very burst). vLLM's own waiting queue
must stay at a mean of at most 1 per server (the issue's bar, met when told), and the
balancer's ``/status`` must end with both servers' limit ``learned`` as 4, what they run.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import burst_bench
from vllm_cluster import MAX_NUM_SEQS, OUT_DIR, Cluster, http_get, start_lb, wait_lb_ready

# The bar: vLLM's mean waiting count per server during the burst.
WAITING_MEAN_MAX = 1.0
BURST = argparse.Namespace(requests=48, min_tokens=256, max_tokens=512, seed=0,
                           sample_s=0.2, timeout_s=1800.0)


def caps(lb: str, urls: list[str]) -> dict[str, tuple[object, object]]:
    status, body = http_get(lb + "/status")
    assert status == 200, body[:200]
    replicas = json.loads(body)["replicas"]
    return {u: (replicas[u]["max_num_seqs"], replicas[u]["max_num_seqs_source"])
            for u in urls}


def test_the_burst_queues_at_the_balancer_with_the_limit_learned(cluster: Cluster) -> None:
    urls = cluster.replica_urls
    # Only the queue timeout is set (bp's requests wait in vLLM, where nothing times them
    # out; the benchmark gives every mode 600 s): pushing is the balancer's defaults.
    lb = start_lb(urls, OUT_DIR / "learned-cap-lb.log", push_mode="sp-p",
                  config={"queue": {"timeout_s": 600.0}})
    try:
        wait_lb_ready(lb, len(urls))
        burst_bench.wait_idle(urls)
        burst_bench.wait_lb_idle(lb.url, urls)
        assert all(src == "unknown" for _, src in caps(lb.url, urls).values())
        result = asyncio.run(burst_bench.burst(urls, lb.url, BURST,
                                               burst_bench.prompts(BURST.requests)))
        final = caps(lb.url, urls)
    finally:
        lb.stop()
    (OUT_DIR / "learned-cap.json").write_text(json.dumps(result, indent=2) + "\n")
    assert result["completed"] == BURST.requests, result["errors"]
    waiting = {s["url"]: (s["waiting_mean"], s["waiting_max"])
               for s in result["servers"].values()}
    assert all(s["metrics_samples"] > 0 for s in result["servers"].values()), waiting
    assert all(mean <= WAITING_MEAN_MAX for mean, _ in waiting.values()), waiting
    assert final == {u: (MAX_NUM_SEQS, "learned") for u in urls}, (final, waiting)
    # The queue formed at the balancer, not inside vLLM.
    assert result["lb_queue_max"] > 0
