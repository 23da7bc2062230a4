"""A fast stand-in for an OpenAI-compatible engine: answers every completion at once.

Lab code: for measuring a balancer's own cost (``skymesh_lab.bench.lb_workers``), where an
emulated engine's scheduling would be the bottleneck. It answers ``POST
/v1/completions`` and ``/v1/chat/completions`` with one fixed non-streamed body, and
``/metrics`` with vLLM's gauges at zero, so skymesh-lb's prober sees an idle vLLM.

    python -m skymesh_lab.bench.stub_backend --port P
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

MODEL = "stub"
_BODY = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}).encode()
_METRICS = (f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n').encode()
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()


async def _complete(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=_BODY, content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=_METRICS, content_type="text/plain")


async def _models(request: web.Request) -> web.Response:
    return web.Response(body=_MODELS, content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    app = web.Application()
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
