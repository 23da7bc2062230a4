"""``skymesh-lb``: the regional balancer daemon.

    skymesh-lb --config FILE
    skymesh-lb --port P --replicas URL,URL,... [--policy NAME] [--region NAME]

With ``--config``, the quick-start flags override the file's values when given.
SIGHUP re-reads the file and applies the replicas, policy and pushing sections live
(skymesh.balancer.reload); a bad file is rejected and the running config kept.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from skymesh.obs.cli import add_obs_flags, apply_obs_flags
from skymesh.version import add_version_flag, package_version

if TYPE_CHECKING:
    from skymesh.balancer.server import Balancer

# The balancer's own modules (aiohttp, pydantic, numpy, ...) are imported after the
# arguments are parsed: --help and --version stay fast and do not need them.

log = logging.getLogger("skymesh-lb.reload")
_SHOWN_REPLICAS = 8  # the start-up line names this many replica URLs, then counts the rest


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
    ap.add_argument("--max-num-seqs", type=int, metavar="N",
                    help="each replica's admission limit (vLLM's --max-num-seqs): under sp-p "
                         "no replica gets more; vLLM does not publish it, so give it here")
    ap.add_argument("--region")
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"])
    add_obs_flags(ap)
    add_version_flag(ap)
    return ap


def config_from_args(args: argparse.Namespace) -> Any:
    from skymesh.balancer.config import load_config, parse_config
    from skymesh.common.config import ConfigError, cli_base

    if not args.config and not args.replicas:
        raise ConfigError("give --config FILE, or --port and --replicas URL,URL,...")
    base = cli_base(load_config(args.config) if args.config else None, args.port, args.host)
    if args.region:
        base["region"] = args.region
    if args.policy:
        base["policy"] = {"name": args.policy, "params": {}}
    if args.push_mode:
        base.setdefault("pushing", {})["mode"] = args.push_mode
    if args.max_num_seqs is not None:
        base.setdefault("pushing", {})["max_num_seqs"] = args.max_num_seqs
    if args.replicas:
        urls = [u.strip() for u in args.replicas.split(",") if u.strip()]
        base["replicas"] = [{"url": u} for u in urls]
    apply_obs_flags(args, base)
    return parse_config(base)


def reload_on_hup(args: argparse.Namespace, lb: Balancer) -> None:
    """SIGHUP: re-read the config file (the quick-start flags still override it) and apply
    what can change live; a file that does not parse or validate is rejected whole and
    the running config kept."""
    from skymesh.balancer.config import ConfigError
    from skymesh.balancer.reload import apply_config

    if not args.config:
        log.warning("SIGHUP: started without --config, nothing to reload")
        return
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        log.error("SIGHUP: %s rejected, keeping the running config: %s", args.config, exc)
        return
    result = apply_config(lb, cfg)
    log.info("SIGHUP: reloaded %s: %s", args.config, result.summary())
    if result.needs_restart:
        log.warning("SIGHUP: %s changed but needs restart to take effect",
                    ", ".join(result.needs_restart))


def startup_detail(cfg: Any, config_path: str | None) -> str:
    """The start-up line's detail: version, config file, region, policy and replicas (the
    listen address is the line itself)."""
    urls = [r.url for r in cfg.replicas]
    shown = ", ".join(urls[:_SHOWN_REPLICAS])
    if len(urls) > _SHOWN_REPLICAS:
        shown += f", +{len(urls) - _SHOWN_REPLICAS} more"
    return (f"skymesh {package_version()}, config {config_path or '(flags only)'}, "
            f"region {cfg.region}, policy {cfg.policy.name}, {cfg.pushing.mode.value}, "
            f"{len(urls)} replicas [{shown}]")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import asyncio
    import signal

    from skymesh.balancer.config import ConfigError
    from skymesh.balancer.server import balancer_of, build_app
    from skymesh.net.serving import METRICS_REGISTRY, run, serve_app
    from skymesh.obs.logs import setup_logging
    from skymesh.util.extras import require

    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"skymesh-lb: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, cfg.logging.format, cfg.logging.access_log)
    logging.getLogger("skymesh-lb.access").setLevel(
        logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    # A reload's outcome is shown at the default level: an operator sent the signal.
    log.setLevel(logging.ERROR if args.log_level == "error" else logging.INFO)
    require("tracing" if cfg.tracing.enabled else None, "skymesh-lb")
    try:
        app = build_app(cfg)  # reads the API keys and the TLS files
    except ConfigError as exc:
        print(f"skymesh-lb: config error: {exc}", file=sys.stderr)
        return 2
    lb = balancer_of(app)
    app[METRICS_REGISTRY] = lb.metrics.registry  # serving adds the connection metrics

    async def on_bound(url: str) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_hup, args, lb)
        await lb.bound(url)

    # Until the loop's handler is in place, a SIGHUP must not kill the daemon.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        run(serve_app(app, cfg.listen.host, cfg.listen.port, "skymesh-lb",
                      startup_detail(cfg, args.config), on_bound=on_bound, tuned_gc=True,
                      ssl_context=lb.edge.ssl_context, limits=cfg.limits.connections()))
    except OSError as exc:
        print(f"skymesh-lb: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
