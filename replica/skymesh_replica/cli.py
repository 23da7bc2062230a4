"""``skymesh-replica``: serve one emulated vLLM/SGLang replica over HTTP.

    skymesh-replica --port 8001 --profile llama3.1-8b-l4
    skymesh-replica --list-profiles

Quiet by default (warnings only); ``--log-level info`` logs one line per finished request.
Once listening it prints ``skymesh-replica listening on http://HOST:PORT`` to stderr, with
the real port when ``--port 0`` asked for any free one. SIGINT/SIGTERM stop it cleanly:
open requests are aborted, then the listener closes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp.http_exceptions import BadHttpMessage

from skymesh.net.serving import run, serve_app
from skymesh.version import add_version_flag
from skymesh_replica.engine.core import SCHEDULERS
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, PROFILES
from skymesh_replica.kv_events import KVEventsConfig
from skymesh_replica.server import DEFAULT_MAX_BODY_BYTES, ReplicaConfig, create_app

log = logging.getLogger("skymesh_replica")


class _QuietBadRequests(logging.Filter):
    """Demote aiohttp's traceback for unparsable requests to one debug line.

    sglang-router opens each worker with an HTTP/2 preface first (probing for gRPC) and
    falls back to HTTP/1.1; aiohttp answers 400 but logs a full ERROR traceback per probe.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            log.debug("rejected a request that is not HTTP/1.x: %s", str(exc).splitlines()[0])
            return False
        return True


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text}") from None
    if not 0 <= v <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60, got {text}")
    return v


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_from_endpoint(endpoint: str) -> KVEventsConfig:
    """``tcp://HOST:PORT`` -> events there, replay on PORT + 1."""
    host, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or int(port) < 1:
        raise ValueError(f"--kv-events-endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                          replay_endpoint=f"{host}:{int(port) + 1}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="skymesh-replica",
        description="An emulated LLM replica speaking the vLLM/SGLang OpenAI-compatible API.",
    )
    ap.add_argument("--port", type=int, help="TCP port (0: any free port)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                    metavar="NAME", help="engine profile (default: %(default)s)")
    ap.add_argument("--model", help="served model name (default: the profile's model)")
    ap.add_argument("--seed", type=int, default=0, help="seed for output lengths and text")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help="largest accepted request body (default: %(default)s)")
    ap.add_argument("--time-scale", type=_positive_float, default=1.0,
                    help="multiply step durations by this (< 1 runs faster than real time)")
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"])
    ap.add_argument("--api-key", default=os.environ.get("SKYMESH_REPLICA_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on the /v1 routes, as vLLM's "
                         "--api-key (default: $SKYMESH_REPLICA_API_KEY)")
    ap.add_argument("--max-num-seqs", type=_positive_int, metavar="N",
                    help="most requests running at once, as vLLM's flag (default: the "
                         "profile's); published as skymesh_engine_max_num_seqs")
    ap.add_argument("--metrics-lag-s", type=_non_negative_float, metavar="SECONDS",
                    help="how far the /metrics load gauges trail the engine (default: the "
                         "profile's, 0.9 s as vLLM-CPU's)")
    ap.add_argument("--scheduler", default="vllm", choices=SCHEDULERS,
                    help="engine scheduler: vllm (v1) or sglang (v0.4.x; /metrics then has "
                         "SGLang's families, the queue gauge updated at its log points)")
    ap.add_argument("--kv-events-config", type=_kv_events_config, metavar="JSON",
                    help="publish KV-cache events as vLLM does, e.g. "
                         "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                         "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                         "\"tcp://*:5558\"}' (default: off; docs/kv-events.md)")
    ap.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                    help="shorthand: publish KV-cache events on this endpoint, the replay "
                         "endpoint on the next port")
    ap.add_argument("--list-profiles", action="store_true", help="print profile names and exit")
    add_version_flag(ap)
    return ap


async def serve(config: ReplicaConfig, host: str, port: int) -> None:
    """Run until SIGINT or SIGTERM."""
    await serve_app(create_app(config), host, port, "skymesh-replica",
                    f"model {config.served_model}, profile {config.profile}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_profiles:
        for name in sorted(PROFILES):
            print(name)
        return 0
    if args.port is None:
        build_parser().error("--port is required")
    if args.scheduler == "sglang" and args.max_num_seqs is not None:
        # SGLang sizes max_running_requests from its KV pool (skymesh_replica.engine.sglang).
        build_parser().error("--max-num-seqs is vLLM's limit; not used with --scheduler sglang")
    budget = PROFILES[args.profile].max_num_batched_tokens
    if args.max_num_seqs is not None and args.max_num_seqs >= budget:
        build_parser().error(f"--max-num-seqs must be below the profile's "
                             f"max_num_batched_tokens ({budget})")
    kv_events = args.kv_events_config
    if args.kv_events_endpoint is not None:
        if kv_events is not None:
            build_parser().error("give --kv-events-config or --kv-events-endpoint, not both")
        try:
            kv_events = kv_events_from_endpoint(args.kv_events_endpoint)
        except ValueError as exc:
            build_parser().error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())
    # Access lines only at debug: at info the driver already logs one line per request.
    logging.getLogger("skymesh-replica.access").setLevel(
        logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    config = ReplicaConfig(profile=args.profile, model=args.model, seed=args.seed,
                           time_scale=args.time_scale, max_body_bytes=args.max_body_bytes,
                           api_key=args.api_key or None, max_num_seqs=args.max_num_seqs,
                           metrics_lag_s=args.metrics_lag_s, scheduler=args.scheduler,
                           kv_events=kv_events)
    try:
        run(serve(config, args.host, args.port))
    except OSError as exc:
        print(f"skymesh-replica: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
