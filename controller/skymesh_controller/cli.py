"""``skymesh-controller``: the controller daemon.

    skymesh-controller --config FILE
    skymesh-controller --port P [--store memory|redis://HOST:PORT/DB]

The admin token comes from the config (hashed) or ``SKYMESH_ADMIN_TOKEN``. A quick start
(``--port`` without ``--config``) is a local run: it allows loopback replica and balancer
URLs (``url_policy.allow_loopback``), which a config file denies unless it says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from skymesh.common.config import cli_base
from skymesh.obs.cli import add_obs_flags, apply_obs_flags
from skymesh.obs.logs import setup_logging
from skymesh.version import add_version_flag
from skymesh_controller.config import ConfigError, load_config, parse_config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="skymesh-controller", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="FILE", help="YAML configuration file")
    ap.add_argument("--port", type=int, help="TCP port (0: any free port)")
    ap.add_argument("--host", help="bind address (default 127.0.0.1)")
    ap.add_argument("--store", help="memory (default) or redis://HOST:PORT/DB")
    ap.add_argument("--probe-interval", type=float, metavar="SECONDS")
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"])
    add_obs_flags(ap)
    add_version_flag(ap)
    return ap


def config_from_args(args: argparse.Namespace) -> Any:
    if not args.config and args.port is None:
        raise ConfigError("give --config FILE, or --port P")
    base = cli_base(load_config(args.config) if args.config else None, args.port, args.host)
    if not args.config:  # a quick start is a local mesh: its replicas are on loopback
        base.setdefault("url_policy", {})["allow_loopback"] = True
    if args.store:
        base["store"] = args.store
    if args.probe_interval is not None:
        base.setdefault("probe", {})["interval_s"] = args.probe_interval
    apply_obs_flags(args, base)
    return parse_config(base)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"skymesh-controller: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, cfg.logging.format, cfg.logging.access_log)
    if not cfg.tokens and not os.environ.get("SKYMESH_ADMIN_TOKEN"):
        print("skymesh-controller: no admin token: set SKYMESH_ADMIN_TOKEN or list tokens "
              "in the config (every endpoint but /health needs one)", file=sys.stderr)
        return 2
    from skymesh.util.extras import require

    require("tracing" if cfg.tracing.enabled else None, "skymesh-controller")
    from skymesh_controller.serve import serve

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
