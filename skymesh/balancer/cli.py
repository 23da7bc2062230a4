"""``skymesh-lb``: the regional balancer daemon.

    skymesh-lb --config FILE
    skymesh-lb --port P --replicas URL,URL,... [--policy NAME] [--region NAME]

With ``--config``, the quick-start flags override the file's values when given.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from skymesh.balancer.config import ConfigError, cli_base, load_config, parse_config
from skymesh.balancer.server import balancer_of, build_app
from skymesh.serving import run, serve_app


def build_parser() -> argparse.ArgumentParser:
    from skymesh.policies import policy_names

    ap = argparse.ArgumentParser(prog="skymesh-lb", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="FILE", help="YAML configuration file")
    ap.add_argument("--port", type=int, help="TCP port (0: any free port)")
    ap.add_argument("--host", help="bind address (default 127.0.0.1)")
    ap.add_argument("--replicas", help="comma-separated replica base URLs")
    ap.add_argument("--policy", choices=policy_names())
    ap.add_argument("--push-mode", choices=["sp-p", "sp-o", "bp"])
    ap.add_argument("--region")
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"])
    return ap


def config_from_args(args: argparse.Namespace) -> Any:
    if not args.config and not args.replicas:
        raise ConfigError("give --config FILE, or --port and --replicas URL,URL,...")
    base = cli_base(load_config(args.config) if args.config else None, args.port, args.host)
    if args.region:
        base["region"] = args.region
    if args.policy:
        base["policy"] = {"name": args.policy, "params": {}}
    if args.push_mode:
        base.setdefault("pushing", {})["mode"] = args.push_mode
    if args.replicas:
        urls = [u.strip() for u in args.replicas.split(",") if u.strip()]
        base["replicas"] = [{"url": u} for u in urls]
    return parse_config(base)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("skymesh-lb.access").setLevel(
        logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    try:
        cfg = config_from_args(args)
        app = build_app(cfg)  # reads the API keys and the TLS files
    except ConfigError as exc:
        print(f"skymesh-lb: config error: {exc}", file=sys.stderr)
        return 2
    detail = (f"region {cfg.region}, policy {cfg.policy.name}, {cfg.pushing.mode.value}, "
              f"{len(cfg.replicas)} replicas")
    try:
        run(serve_app(app, cfg.listen.host, cfg.listen.port, "skymesh-lb", detail,
                      on_bound=balancer_of(app).bound, tuned_gc=True,
                      ssl_context=balancer_of(app).edge.ssl_context))
    except OSError as exc:
        print(f"skymesh-lb: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
