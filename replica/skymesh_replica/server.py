"""The replica's HTTP surface: what vLLM's and SGLang's OpenAI servers expose, on aiohttp.

OpenAI endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) with JSON
and SSE streaming; the load and cache signals routers scrape (vLLM's and SGLang's
``/metrics``, SGLang's ``/get_load``); and the small endpoints routers probe at start-up
(``/health``, ``/get_model_info``, ``/get_server_info``, ``/version``, ``/tokenize``, and
vLLM's ``/v1/completions/render`` and ``/v1/chat/completions/render``, which vllm-router's
prefix-aware policies call to tokenise a request without running it).

Every request error is an OpenAI error body ``{"error": {message, type, param, code}}``.
A client that goes away mid-request (streaming or not) has its request aborted inside the
engine, so its KV blocks and batch slot are freed at once, as in vLLM. Handler
cancellation on disconnect must be on (``handler_cancellation=True``, see :func:`serve`)
for the non-streaming case.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from skymesh.net.jsonbody import JsonBodyError, loads_body
from skymesh.net.serving import METRICS_REGISTRY
from skymesh.prefix.prompt import (
    PromptError,
    Tokenizer,
    completion_prompt,
    get_tokenizer,
    render_chat,
)
from skymesh_replica.driver import ContextLengthError, RealtimeDriver, RequestHandle
from skymesh_replica.engine.core import Engine
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, Profile, get_profile
from skymesh_replica.kv_events import EventRecorder, KVEventPublisher, KVEventsConfig
from skymesh_replica.metrics import CONTENT_TYPE, ReplicaMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _version() -> str:
    # From the installed metadata: an editable install made before skymesh/__init__.py
    # existed imports skymesh as a namespace package, without __version__.
    try:
        return importlib.metadata.version("skymesh")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


VERSION = _version()


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    profile: str = DEFAULT_PROFILE
    model: str | None = None  # served model name; the profile's model by default
    seed: int = 0
    time_scale: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # vLLM's --api-key: the /v1 routes want "Authorization: Bearer KEY"; the others
    # (health, metrics, load, tokenize) stay open, as in vLLM.
    api_key: str | None = None
    # vLLM's --max-num-seqs, over the profile's; and the load gauges' lag over the
    # profile's metrics_lag_s (skymesh_replica.metrics).
    max_num_seqs: int | None = None
    metrics_lag_s: float | None = None
    # The engine's scheduler: "vllm" (v1) or "sglang" (v0.4.x, skymesh_replica.engine.sglang).
    # In sglang mode /metrics has SGLang's families only, its queue gauge a log-point
    # snapshot, and the extra lag defaults to 0.
    scheduler: str = "vllm"
    # vLLM's --kv-events-config: publish KV-cache events (skymesh_replica.kv_events).
    kv_events: KVEventsConfig | None = None

    @property
    def served_model(self) -> str:
        return self.model or get_profile(self.profile).model


# A machine-readable code for every error, so clients can branch without parsing text.
_DEFAULT_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                  413: "payload_too_large", 503: "unavailable"}


class ApiError(Exception):
    """An error to return as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # shadows the builtin: it is OpenAI's field name
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _DEFAULT_CODES.get(status, "internal_error" if status >= 500
                                               else "invalid_request")
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return web.json_response(body, status=self.status)


@dataclass(slots=True)
class Replica:
    """Everything a handler needs, stored on the app."""

    config: ReplicaConfig
    profile: Profile
    model: str
    tokenizer: Tokenizer
    engine: Engine
    driver: RealtimeDriver
    metrics: ReplicaMetrics
    started: int
    kv_events: KVEventPublisher | None = None


REPLICA = web.AppKey("replica", Replica)


# -- request parsing -----------------------------------------------------------------
async def _read_json(request: web.Request, limit: int) -> dict[str, Any]:
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(length, limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    try:
        body = loads_body(raw)
    except JsonBodyError as exc:  # NaN, huge integers, deep nesting, bad UTF-8 included
        raise ApiError(400, str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    return body


def _too_large(length: int | None, limit: int) -> ApiError:
    size = f"{length} bytes" if length is not None else "the request body"
    return ApiError(413, f"Request body too large: {size} exceeds the limit of {limit} bytes",
                    code="request_too_large")


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer", param=name)
    if v < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {v}", param=name)
    return v


def _bool_field(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean", param=name)
    return v


@dataclass(frozen=True, slots=True)
class GenParams:
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    seed: int | None


# vLLM's (and OpenAI's legacy) default for /v1/completions; chat has none (fill context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _gen_params(body: dict[str, Any], *, chat: bool) -> GenParams:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "n>1 not supported", param="n")
    max_tokens = _int_field(body, "max_tokens", 1)
    if chat:
        mct = _int_field(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else max_tokens
    elif "max_tokens" not in body:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be at most max_tokens "
                       f"({max_tokens})", param="min_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "seed must be an integer", param="seed")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    return GenParams(max_tokens, min_tokens, _bool_field(body, "ignore_eos"),
                     _bool_field(body, "stream"), include_usage, seed)


def _check_model(replica: Replica, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError(400, "model is required", param="model")
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model != replica.model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")


def _usage(h: RequestHandle) -> dict[str, Any]:
    return {
        "prompt_tokens": h.prompt_tokens,
        "completion_tokens": h.num_delivered,
        "total_tokens": h.prompt_tokens + h.num_delivered,
        "prompt_tokens_details": {"cached_tokens": h.cached_tokens},
    }


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- generation ----------------------------------------------------------------------
def _submit(
    replica: Replica, rid: str, prompt_ids: list[int], p: GenParams, prompt_field: str
) -> RequestHandle:
    try:
        return replica.driver.submit(
            prompt_ids, request_id=rid, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
            ignore_eos=p.ignore_eos, seed=p.seed,
        )
    except ContextLengthError as exc:
        raise ApiError(400, str(exc), param=prompt_field, code="context_length_exceeded") from None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


ChunkBuilder = Callable[[str, str | None], dict[str, Any]]


async def _generate(
    request: web.Request,
    replica: Replica,
    handle: RequestHandle,
    p: GenParams,
    *,
    first: dict[str, Any] | None,
    chunk: ChunkBuilder,
    final: Callable[[str, str], dict[str, Any]],
    usage_chunk: dict[str, Any],
) -> web.StreamResponse:
    """Run one request to its end, streaming or not; abort it if the client leaves."""
    decode = replica.tokenizer.decode
    try:
        if not p.stream:
            parts = [decode(ids) async for ids in handle]
            if handle.finish_reason == "abort":
                raise ApiError(503, "Request aborted: the replica is shutting down",
                               code="aborted")
            return web.json_response(final("".join(parts), handle.finish_reason or "stop"),
                                     headers={"X-Request-Id": handle.request_id})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": handle.request_id})
        await resp.prepare(request)
        try:
            async for ids in handle:
                if first is not None:
                    # Like vLLM: the role chunk goes out with the first token (after
                    # prefill), so a router may read the first body byte as "admitted".
                    await resp.write(_sse(first))
                    first = None
                last = handle.exhausted and handle.finish_reason != "abort"
                await resp.write(_sse(chunk(decode(ids), handle.finish_reason if last else None)))
            if handle.finish_reason == "abort":
                return resp  # server shutting down: end without [DONE]
            if p.include_usage:
                await resp.write(_sse({**usage_chunk, "usage": _usage(handle)}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.debug("client left request %s mid-stream", handle.request_id)
        return resp
    finally:
        # Client gone (write failed or the handler was cancelled): free the engine slot.
        if not handle.done:
            replica.driver.abort(handle.request_id)


async def _chat_input(request: web.Request) -> tuple[Replica, dict[str, Any], str]:
    """A chat request's body, checked, and its messages rendered to the prompt text."""
    replica = request.app[REPLICA]
    body = await _read_json(request, replica.config.max_body_bytes)
    _check_model(replica, body)
    if "messages" not in body:
        raise ApiError(400, "messages is required", param="messages")
    try:
        return replica, body, render_chat(body["messages"])
    except PromptError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    replica, body, text = await _chat_input(request)
    p = _gen_params(body, chat=True)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    handle = _submit(replica, rid, replica.tokenizer.encode(text), p, "messages")
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": replica.model}

    def chunk(delta: str, finish: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": {"content": delta},
                                     "logprobs": None, "finish_reason": finish}]}

    def final(content: str, finish: str) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": replica.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "logprobs": None, "finish_reason": finish}],
                "usage": _usage(handle)}

    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]}
    return await _generate(request, replica, handle, p, first=first, chunk=chunk, final=final,
                           usage_chunk={**head, "choices": []})


async def completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    body = await _read_json(request, replica.config.max_body_bytes)
    _check_model(replica, body)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", param="echo")
    try:
        prompt = completion_prompt(body["prompt"], replica.tokenizer.vocab_size)
    except PromptError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    p = _gen_params(body, chat=False)
    rid = f"cmpl-{uuid.uuid4().hex}"
    handle = _submit(replica, rid, prompt.ids(replica.tokenizer), p, "prompt")
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": replica.model}

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish}]}

    def final(text: str, finish: str) -> dict[str, Any]:
        return {**chunk(text, finish), "usage": _usage(handle)}

    return await _generate(request, replica, handle, p, first=None, chunk=chunk, final=final,
                           usage_chunk={**head, "choices": []})


# -- information endpoints -----------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    card = {"id": r.model, "object": "model", "created": r.started, "owned_by": "skymesh",
            "root": r.model, "parent": None, "max_model_len": r.profile.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[REPLICA].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def get_load(request: web.Request) -> web.Response:
    # SGLang's shape: one entry per data-parallel rank (rid/http_worker_ipc are null
    # unless a specific request is named).
    e = request.app[REPLICA].engine
    used = e.num_used_tokens
    load = {"rid": None, "http_worker_ipc": None, "dp_rank": 0,
            "num_reqs": e.num_running + e.num_waiting, "num_waiting_reqs": e.num_waiting,
            "num_tokens": used}
    return web.json_response([load])


async def tokenize(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    body = await _read_json(request, r.config.max_body_bytes)
    if body.get("model") is not None:
        _check_model(r, body)
    try:
        if "messages" in body:
            add_gen = body.get("add_generation_prompt", True)
            ids = r.tokenizer.encode(render_chat(body["messages"],
                                                 add_generation_prompt=bool(add_gen)))
        elif "prompt" in body:
            ids = completion_prompt(body["prompt"], r.tokenizer.vocab_size).ids(r.tokenizer)
        else:
            raise ApiError(400, "prompt or messages is required", param="prompt")
    except PromptError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    return web.json_response({"count": len(ids), "max_model_len": r.profile.max_model_len,
                              "tokens": ids, "token_strs": None})


# What vLLM's /render endpoints echo back as sampling parameters (the request's own keys).
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                  "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "seed",
                  "ignore_eos", "min_tokens", "logprobs", "n")


def _render_request(r: Replica, body: dict[str, Any], rid: str, ids: list[int],
                    p: GenParams) -> dict[str, Any]:
    """vLLM's GenerateRequest: the token-in request the router would send on."""
    params = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    params["max_tokens"] = p.max_tokens
    return {"request_id": rid, "token_ids": ids, "sampling_params": params,
            "model": r.model, "stream": p.stream, "stream_options": body.get("stream_options"),
            "token_offsets": None}


async def render_completions(request: web.Request) -> web.Response:
    """vLLM's ``/v1/completions/render``: the prompt(s) tokenised, nothing generated.

    A list of GenerateRequest objects, one per prompt (a batch of strings is allowed here,
    as in vLLM, although generation takes one prompt).
    """
    r = request.app[REPLICA]
    body = await _read_json(request, r.config.max_body_bytes)
    _check_model(r, body)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    raw = body["prompt"]
    prompts = raw if isinstance(raw, list) and raw and all(
        isinstance(x, str | list) for x in raw) else [raw]
    p = _gen_params(body, chat=False)
    try:
        ids = [completion_prompt(x, r.tokenizer.vocab_size).ids(r.tokenizer) for x in prompts]
    except PromptError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    return web.json_response([_render_request(r, body, f"cmpl-{uuid.uuid4().hex}", x, p)
                              for x in ids])


async def render_chat_completions(request: web.Request) -> web.Response:
    """vLLM's ``/v1/chat/completions/render``: one GenerateRequest for the conversation."""
    r, body, text = await _chat_input(request)
    out = _render_request(r, body, f"chatcmpl-{uuid.uuid4().hex}", r.tokenizer.encode(text),
                          _gen_params(body, chat=True))
    return web.json_response({**out, "assistant_tokens_mask": None})


async def detokenize(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    body = await _read_json(request, r.config.max_body_bytes)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < r.tokenizer.vocab_size
        for t in tokens
    ):
        raise ApiError(400, "tokens must be a list of token ids", param="tokens")
    return web.json_response({"prompt": r.tokenizer.decode(tokens)})


def _model_info(r: Replica) -> dict[str, Any]:
    return {"model_path": r.model, "tokenizer_path": r.tokenizer.name, "is_generation": True,
            "served_model_name": r.model, "max_model_len": r.profile.max_model_len,
            "preferred_sampling_params": None, "weight_version": "default"}


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_model_info(request.app[REPLICA]))


async def server_info(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    p = r.profile
    info = {
        **_model_info(r),
        "version": VERSION,
        "engine": "skymesh-replica",
        "profile": p.name, "gpu": p.gpu, "tp_size": p.num_gpus, "dp_size": 1,
        "page_size": p.block_size, "max_total_num_tokens": p.kv_capacity_tokens,
        "max_running_requests": p.max_num_seqs, "chunked_prefill_size": p.max_num_batched_tokens,
        "max_num_batched_tokens": p.max_num_batched_tokens, "max_num_seqs": p.max_num_seqs,
        "context_length": p.max_model_len, "disable_radix_cache": False,
        "seed": r.config.seed, "time_scale": r.config.time_scale,
        "internal_states": [{"num_running_reqs": r.engine.num_running,
                             "num_waiting_reqs": r.engine.num_waiting,
                             "token_usage": r.engine.kv_usage}],
    }
    return web.json_response(info)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def flush_cache(request: web.Request) -> web.Response:
    # SGLang's /flush_cache and vLLM's /reset_prefix_cache: forget cached prefixes (blocks
    # held by running requests stay valid; only the hash index is dropped).
    r = request.app[REPLICA]
    r.engine.reset_prefix_cache()
    if r.kv_events is not None:
        r.kv_events.flush()
    return web.Response(text="OK")


# -- app -----------------------------------------------------------------------------
@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        key = request.app[REPLICA].config.api_key
        if key is not None and request.path.startswith("/v1") and \
                not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                        f"Bearer {key}".encode()):
            raise ApiError(401, "Unauthorized", code="invalid_api_key")
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason or "error").response()
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return ApiError(500, "Internal server error").response()


def build_replica(config: ReplicaConfig) -> Replica:
    profile = get_profile(config.profile)
    if config.max_num_seqs is not None:
        profile = dataclasses.replace(profile, max_num_seqs=config.max_num_seqs)
    if config.metrics_lag_s is not None:
        profile = dataclasses.replace(profile, metrics_lag_s=config.metrics_lag_s)
    elif config.scheduler == "sglang":
        # SGLang's gauges are already stale by construction (published at log points).
        profile = dataclasses.replace(profile, metrics_lag_s=0.0)
    tokenizer = get_tokenizer()
    engine = Engine(profile, scheduler=config.scheduler)
    driver = RealtimeDriver(engine, tokenizer=tokenizer, seed=config.seed,
                            time_scale=config.time_scale)
    model = config.served_model
    publisher = None
    if config.kv_events is not None and config.kv_events.enabled:
        recorder = EventRecorder()
        engine.kv.recorder = recorder
        publisher = KVEventPublisher(config.kv_events, recorder)
        # Called after each schedule and completion: one batch per step that changed the
        # cache (evictions at scheduling, stores at completion).
        driver.state_listeners.append(publisher.flush)
    return Replica(config, profile, model, tokenizer, engine, driver,
                   ReplicaMetrics(driver, model, profile.metrics_lag_s), int(time.time()),
                   publisher)


def create_app(config: ReplicaConfig) -> web.Application:
    """The replica as an aiohttp app; the engine task runs between startup and shutdown."""
    replica = build_replica(config)
    # aiohttp's own limit backs up the Content-Length check for chunked uploads.
    app = web.Application(middlewares=[_errors], client_max_size=config.max_body_bytes)
    app[REPLICA] = replica
    app[METRICS_REGISTRY] = replica.metrics.registry  # serving adds the connection metrics

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        replica.driver.start()
        if replica.kv_events is not None:
            replica.kv_events.start()
        yield
        if replica.kv_events is not None:
            await replica.kv_events.close()

    async def on_shutdown(app: web.Application) -> None:
        # Before aiohttp waits for in-flight handlers: end their streams so they return.
        await replica.driver.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/ping"):
        r.add_get(path, health)
    r.add_get("/metrics", metrics)
    r.add_get("/get_load", get_load)
    r.add_post("/tokenize", tokenize)
    r.add_post("/v1/completions/render", render_completions)
    r.add_post("/v1/chat/completions/render", render_chat_completions)
    r.add_post("/detokenize", detokenize)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/version", version)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/reset_prefix_cache", flush_cache)
    return app
