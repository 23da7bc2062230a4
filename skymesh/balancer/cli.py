"""``skymesh-lb``: the regional balancer daemon.

    skymesh-lb --config FILE
    skymesh-lb --port P --replicas URL,URL,... [--policy NAME] [--region NAME]
    [--workers N]

With ``--config``, the quick-start flags override the file's values when given.
``--workers N`` (``listen.workers``, default ``auto``: one per core, up to 8) serves the
port from N processes (skymesh.balancer.workers); with 1 it is one process, as before.
SIGHUP re-reads the file and applies the replicas, policy and pushing sections live
(skymesh.balancer.reload); a bad file is rejected and the running config kept.
"""

from __future__ import annotations

import argparse
import logging
import os
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
    ap.add_argument("--workers", type=_workers_arg, metavar="N",
                    help="processes serving the port (listen.workers): a number or 'auto', "
                         "one per usable core up to 8 (1 with a mesh or a controller)")
    # A worker of a supervisor (skymesh.balancer.workers): not for users.
    for flag in ("--worker-index", "--worker-count", "--listen-fd", "--lifeline-fd",
                 "--ready-fd"):
        ap.add_argument(flag, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-dir", help=argparse.SUPPRESS)
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"])
    add_obs_flags(ap)
    add_version_flag(ap)
    return ap


def _workers_arg(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 'auto', not {v!r}") from None


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
    if args.workers is not None:
        base.setdefault("listen", {})["workers"] = args.workers
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
    from skymesh.balancer.config import ConfigError
    from skymesh.balancer.workers import resolve_workers, supervise, usable_cores
    from skymesh.obs.logs import setup_logging

    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"skymesh-lb: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, cfg.logging.format, cfg.logging.access_log)
    if args.worker_index is None:
        workers = resolve_workers(cfg.listen.workers, usable_cores(),
                                  mesh_or_controller=cfg.mesh is not None
                                  or cfg.controller is not None)
        if workers > 1:
            logging.getLogger("skymesh-lb.workers").setLevel(logging.INFO)
            return supervise(sys.argv[1:] if argv is None else argv, workers,
                             cfg.listen.host, cfg.listen.port, cfg.listen.tls is not None,
                             startup_detail(cfg, args.config), pin=cfg.listen.pin_workers)
    return serve(args, cfg)


def serve(args: argparse.Namespace, cfg: Any) -> int:
    """One balancer process: the whole of it, or one worker of a supervisor's."""
    import asyncio
    import signal
    import socket

    from skymesh.balancer.config import ConfigError
    from skymesh.balancer.server import balancer_of, build_app
    from skymesh.net.serving import METRICS_REGISTRY, run, serve_app
    from skymesh.util.extras import require

    worker = args.worker_index is not None
    logging.getLogger("skymesh-lb.access").setLevel(
        logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    # A reload's outcome is shown at the default level: an operator sent the signal.
    log.setLevel(logging.ERROR if args.log_level == "error" else logging.INFO)
    require("tracing" if cfg.tracing.enabled else None, "skymesh-lb")
    try:
        # reads the API keys and the TLS files
        app = build_app(cfg, workers=args.worker_count if worker else 1,
                        worker=args.worker_index if worker else 0)
    except ConfigError as exc:
        print(f"skymesh-lb: config error: {exc}", file=sys.stderr)
        return 2
    lb = balancer_of(app)
    app[METRICS_REGISTRY] = lb.metrics.registry  # serving adds the connection metrics
    siblings = join_siblings(args, app) if worker else None
    sock = socket.socket(fileno=args.listen_fd) if worker else None

    async def on_bound(url: str) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, reload_on_hup, args, lb)
        await lb.bound(url)
        if siblings is not None:
            await siblings.start()
            # The supervisor gone (even killed), its end of the lifeline closes: drain.
            def orphaned() -> None:
                loop.remove_reader(args.lifeline_fd)
                os.kill(os.getpid(), signal.SIGTERM)

            loop.add_reader(args.lifeline_fd, orphaned)
            os.write(args.ready_fd, b"1")
            os.close(args.ready_fd)

    # Until the loop's handler is in place, a SIGHUP must not kill the daemon.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        run(serve_app(app, cfg.listen.host, cfg.listen.port, "skymesh-lb",
                      startup_detail(cfg, args.config), on_bound=on_bound, tuned_gc=True,
                      ssl_context=lb.edge.ssl_context, limits=cfg.limits.connections(),
                      sock=sock, announce=not worker, http_server=cfg.listen.http_server))
    except OSError as exc:
        print(f"skymesh-lb: {exc}", file=sys.stderr)
        return 1
    return 0


def join_siblings(args: argparse.Namespace, app: Any) -> Any:
    """A worker's end of what the workers share (skymesh.balancer.siblings)."""
    from skymesh.balancer.server import balancer_of
    from skymesh.balancer.siblings import Siblings
    from skymesh.prefix.trie import PrefixTrie

    lb = balancer_of(app)

    def trie_of() -> PrefixTrie | None:
        trie = getattr(lb.dispatcher.policy, "trie", None)
        return trie if isinstance(trie, PrefixTrie) else None

    siblings = Siblings(args.worker_dir, args.worker_index, args.worker_count,
                        lb.status.local_metrics, lb.status.worker_summary, trie_of,
                        lambda t: t in lb.dispatcher.targets, lb.metrics.registry)
    lb.status.siblings = siblings

    async def on_cleanup(app: Any) -> None:
        await siblings.stop()

    app.on_cleanup.append(on_cleanup)
    return siblings


if __name__ == "__main__":
    sys.exit(main())
