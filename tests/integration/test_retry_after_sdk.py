"""A client that honours Retry-After is served (issue #33, item 9).

A cold burst of 300 chat requests, each through the OpenAI SDK's own retry logic
(``max_retries=2``: it sleeps what ``retry-after-ms`` / ``Retry-After`` says), at a
``skymesh-lb`` with a 16-deep queue in front of one emulated replica (8 sequences, about
7 requests a second). Before the fix every first 429 said 40-60 s (nothing measured yet),
nothing ran between the first seconds and the 40th, the whole burst came back inside 20 s
and what the queue could not take then failed: 100 of the 300 on this set-up. Now each
turned-away client is booked a time when the queue will have room for it (all 300 served,
in about 45 s).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import openai
import pytest

from skymesh_lab.faults.cluster import MODEL, healthy_replicas, start_lb, start_replicas, wait_for

pytestmark = pytest.mark.timeout(300)

BURST = 300


async def test_a_cold_burst_through_the_sdk_s_retries_is_served(tmp_path: Path) -> None:
    replicas = await start_replicas(tmp_path, 1, time_scale=0.25,
                                    extra=["--max-num-seqs", "8"])
    lb = await start_lb(tmp_path, replicas, overrides={
        "queue": {"max_length": 16, "timeout_s": 60}, "pushing": {"max_outstanding": 8}})
    try:
        async with aiohttp.ClientSession() as s:
            await wait_for(lambda: _all_up(s, lb.url, 1), "the replica healthy", 20)
        client = openai.AsyncOpenAI(base_url=lb.url + "/v1", api_key="unused",
                                    max_retries=2, timeout=120)

        async def one(i: int) -> str:
            try:
                # Lengths vary, as they do: the replicas' completions do not come in step.
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=16 + (i * 37) % 97)
            except openai.APIError as exc:
                return type(exc).__name__
            return "ok"

        outcomes = Counter(await asyncio.gather(*(one(i) for i in range(BURST))))
        await client.close()
        assert outcomes["ok"] >= 0.95 * BURST, outcomes
        # What did not complete was turned away, never an error of the balancer's.
        assert set(outcomes) <= {"ok", "RateLimitError"}, outcomes
    finally:
        lb.stop()
        for r in replicas:
            r.stop()


async def _all_up(s: aiohttp.ClientSession, url: str, n: int) -> bool:
    return await healthy_replicas(s, url) == n
