"""``skymesh``: the command-line entry point.

The data plane's own subcommands are ``certs``, ``ctl`` and ``dns``. Every other one comes
from an installed distribution through the ``skymesh.commands`` entry-point group: each
entry point names a ``register(subparsers)`` that adds its subcommand (the control plane
adds ``plan`` and ``forecast``, the lab ``sim``, ``bench``, ``demo``, ``faults`` and
``predict``). A distribution that is not installed adds nothing, so ``--help`` lists
exactly what can run.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import Any

from skymesh.version import add_version_flag

PLUGIN_GROUP = "skymesh.commands"
# The data plane's own subcommands: modules with ``register(subparsers)``.
BUILTIN_MODULES: tuple[str, ...] = ("skymesh.ops.ctl", "skymesh.ops.dns_cli")


def cmd_certs(args: argparse.Namespace) -> int:
    from skymesh.mesh import certs

    return certs.run(args)


def _add_certs(sub: Any) -> None:
    cp = sub.add_parser("certs", help="create the peering CA and per-balancer mTLS certificates")
    cp.add_argument("--out", required=True, metavar="DIR", help="where to write (and find the CA)")
    cp.add_argument("--ca", action="store_true", help="create the mesh CA (ca.crt, ca.key)")
    cp.add_argument("--name", action="append", default=[], metavar="BALANCER_ID",
                    help="issue a certificate for this balancer id (repeatable)")
    cp.add_argument("--ip", action="append", default=None, metavar="ADDR",
                    help="IP SAN for every --name (repeatable; default 127.0.0.1)")
    cp.add_argument("--dns", action="append", default=[], metavar="HOST",
                    help="extra DNS SAN for every --name (repeatable)")
    cp.add_argument("--days", type=int, default=None,
                    help="validity in days (default 3650 for the CA, 825 for balancers)")
    cp.add_argument("--force", action="store_true", help="replace an existing CA")
    cp.set_defaults(fn=cmd_certs)


def _add_plugins(sub: Any) -> None:
    """Each installed ``skymesh.commands`` entry point adds its subcommand; one that fails
    to load is reported in a line and left out, so the others still run."""
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plug-in must not take the CLI down
            print(f"skymesh: the {ep.name!r} command from {ep.value} is unavailable: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    ap = argparse.ArgumentParser(
        prog="skymesh", description="SkyMesh: cross-region load balancing for LLM replicas. "
        "Commands from the controller and the lab appear when those are installed.")
    add_version_flag(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_certs(sub)
    for name in BUILTIN_MODULES:
        importlib.import_module(name).register(sub)
    _add_plugins(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from skymesh.util.extras import hint_for, require

    args = build_parser().parse_args(argv)
    # A subcommand that needs one of its distribution's extras says so on its parser.
    require(getattr(args, "extra", None), f"skymesh {args.cmd}")
    try:
        return int(args.fn(args))
    except ModuleNotFoundError as exc:  # a lazy import of an extra not installed
        hint = hint_for(exc)
        if hint is None:
            raise
        print(f"skymesh {args.cmd}: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
