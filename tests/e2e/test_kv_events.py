"""Real vLLM's KV-cache events, followed by SkyMesh's subscriber (docs/kv-events.md).

A vLLM server of its own (the shared cluster runs without events) with
``--kv-events-config``: a prompt's full blocks appear in the index from the live stream,
a subscriber that joins later gets them from the replay endpoint, and a prefix-cache reset
clears the index (vLLM publishes it with its next step's batch).

Exact scoring of vLLM replicas: the balancer's token ids (the model's tokenizer.json and
chat template, skymesh.prefix.kv_tokenize) equal vLLM's ``/tokenize`` for chat and
completion prompts, a prompt cached by traffic the balancer never saw is matched to its
full blocks, and a skymesh-lb given the model folder says so in ``/status``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import eventually, until
from vllm_cluster import MODEL_NAME, OUT_DIR, E2EEnv, e2e_env, http_get, tail

from skymesh.balancer.config import KVEventsConfig, ReplicaConfig
from skymesh.balancer.intake import parse_request
from skymesh.balancer.kv_feed import ExactScorer, KVFeeds
from skymesh.policies import RouteRequest
from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings, stop
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh.prefix.kv_tokenize import EngineTokenizer
from skymesh.util.procs import free_port

ENV = e2e_env()
pytestmark = [pytest.mark.skipif(ENV is None, reason="real-engine lane: run `make e2e`"),
              pytest.mark.timeout(1200)]
SETTINGS = SubscriberSettings(heartbeat_s=0.5, stale_after_s=5.0, replay_timeout_s=2.0)


class Server:
    def __init__(self, env: E2EEnv, log_path: Path) -> None:
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://*:{self.pub}", "replay_endpoint": f"tcp://*:{self.replay}"}
        cmd = [str(env.python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(env.model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048",
               "--max-num-seqs", "4", "--dtype", "bfloat16", "--enable-prefix-caching",
               "--kv-events-config", json.dumps(cfg)]
        penv = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
                "VLLM_CPU_OMP_THREADS_BIND": str(1 % (os.cpu_count() or 1))}
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def subscriber(self, index: ReplicaBlockIndex) -> KVEventSubscriber:
        return KVEventSubscriber(f"tcp://127.0.0.1:{self.pub}",
                                 f"tcp://127.0.0.1:{self.replay}", index, SETTINGS)

    def post(self, path: str, body: dict[str, object]) -> int:
        return self.post_json(path, body)[0]

    def post_json(self, path: str, body: dict[str, object]) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return int(r.status), json.loads(r.read() or b"null")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    assert ENV is not None
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    s = Server(ENV, OUT_DIR / "vllm-kv-events.log")
    try:
        yield s
    finally:
        s.stop()


async def wait_healthy(server: Server) -> None:
    async def healthy() -> bool:
        assert server.proc.poll() is None, tail(server.log_path)
        return (await asyncio.to_thread(http_get, server.url + "/health"))[0] == 200

    deadline = float(os.environ.get("SKYMESH_E2E_START_DEADLINE_S", "600"))
    t_end = asyncio.get_running_loop().time() + deadline
    while not await healthy():
        assert asyncio.get_running_loop().time() < t_end, tail(server.log_path)
        await asyncio.sleep(0.5)  # readiness polling cadence, bounded by the deadline


async def test_real_vllm_events_fill_clear_and_replay(server: Server) -> None:
    await wait_healthy(server)

    index = ReplicaBlockIndex()
    sub = server.subscriber(index)
    task = asyncio.get_running_loop().create_task(sub.run())
    try:
        await eventually(sub.is_live, "the replay endpoint answers", timeout=30)
        # Token ids below the tiny model's vocabulary; 300 tokens: two full blocks of 128
        # (vLLM's CPU block size) or more of 16.
        a = [100 + i for i in range(300)]
        assert await asyncio.to_thread(server.post, "/v1/completions",
                                       {"model": MODEL_NAME, "prompt": a, "max_tokens": 2}) == 200
        await eventually(lambda: index.match_tokens(a) >= 2, "A's blocks from vLLM's events",
                         timeout=30)
        blocks = index.match_tokens(a)
        assert blocks == 300 // index.block_size

        late = ReplicaBlockIndex()
        late_task = asyncio.get_running_loop().create_task(server.subscriber(late).run())
        await eventually(lambda: late.match_tokens(a) == blocks, "a late subscriber replays",
                         timeout=30)
        await stop(late_task)

        assert await asyncio.to_thread(server.post, "/reset_prefix_cache", {}) == 200
        b = [900 + i for i in range(300)]
        assert await asyncio.to_thread(server.post, "/v1/completions",
                                       {"model": MODEL_NAME, "prompt": b, "max_tokens": 2}) == 200
        await eventually(lambda: index.match_tokens(b) == blocks, "B's blocks", timeout=30)
        assert index.match_tokens(a) == 0  # AllBlocksCleared came with B's step
        assert sub.counters.malformed == 0 and sub.counters.resyncs == 0
    finally:
        await stop(task)


WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "two", "trains", "left", "the",
         "station", "at", "noon"]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "How many apples are left?"}]},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Tom has 3 pens.\nHe buys 2 more."},
                  {"role": "assistant", "content": "5"},
                  {"role": "user", "content": [{"type": "text", "text": "And then?"},
                                               {"type": "text", "text": "Explain: café, 東京"}]}]},
]
PROMPTS = ["Question: 2 + 2 =", "  leading spaces, tabs\tand émojis 🙂", "<s> typed bos"]


async def test_balancer_token_ids_equal_vllm_tokenize(server: Server) -> None:
    await wait_healthy(server)
    assert ENV is not None
    tok = EngineTokenizer(ENV.model)
    for body in CHATS:
        status, got = await asyncio.to_thread(server.post_json, "/tokenize",
                                              {"model": MODEL_NAME, **body})
        assert status == 200
        assert tok.request_ids("chat", body) == got["tokens"], body
    for prompt in PROMPTS:
        body = {"prompt": prompt}
        status, got = await asyncio.to_thread(server.post_json, "/tokenize",
                                              {"model": MODEL_NAME, **body})
        assert status == 200
        assert tok.request_ids("completion", body) == got["tokens"], prompt


async def test_prompt_cached_behind_the_balancers_back_is_matched(
        server: Server, tmp_path: Path) -> None:
    """A chat prompt sent straight to vLLM: the scorer, tokenizing with the model's own
    tokenizer and template, finds every full block of it in the replica's index, and a
    prompt sharing only its first part matches that part."""
    await wait_healthy(server)
    assert ENV is not None
    rep = ReplicaConfig.model_validate(
        {"url": server.url, "kind": "vllm", "tokenizer": str(ENV.model),
         "kv_events": {"endpoint": f"tcp://127.0.0.1:{server.pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{server.replay}"}})
    feeds = KVFeeds(KVEventsConfig(heartbeat_s=0.5))
    feeds.set_replicas([rep])
    scorer = ExactScorer(feeds)
    scorer.preload()
    try:
        await scorer.loaded()
        await eventually(lambda: feeds.state(server.url) == "live", "events live", timeout=30)
        doc = " ".join(WORDS[i % len(WORDS)] + str(i) for i in range(400))
        body = {"model": MODEL_NAME, "max_tokens": 1,
                "messages": [{"role": "system", "content": doc},
                             {"role": "user", "content": "Who left at noon?"}]}
        tok = scorer.tokenizers[str(ENV.model)]
        assert isinstance(tok, EngineTokenizer)
        ids = tok.request_ids("chat", body)
        assert await asyncio.to_thread(server.post, "/v1/chat/completions", body) == 200
        index = feeds.index(server.url)
        assert index is not None
        await eventually(lambda: index.block_size > 0 and index.match_tokens(ids) >= 2,
                         "the prompt's blocks from vLLM's events", timeout=30)
        full = len(ids) // index.block_size

        async def matched(b: dict[str, Any]) -> tuple[int, int]:
            i = parse_request("chat", json.dumps(b).encode(), {})
            route = await scorer.annotate(RouteRequest("r"), i)
            assert route.exact_prefix is not None
            return route.exact_prefix[server.url], route.exact_blocks

        async def all_blocks() -> bool:
            return await matched(body) == (full, full)

        await until(all_blocks, "every full block of the prompt matched", timeout=30)
        other = {**body, "messages": [body["messages"][0],
                                      {"role": "user", "content": "A different question."}]}
        oids = tok.request_ids("chat", other)
        common = next(i for i, (x, y) in enumerate(zip(ids, oids, strict=False)) if x != y)
        got, _ = await matched(other)
        # The blocks wholly inside the shared system document, none after it.
        assert got == min(full, common // index.block_size) >= 1
    finally:
        await feeds.stop()
