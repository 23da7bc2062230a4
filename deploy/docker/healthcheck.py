"""The image's HEALTHCHECK: GET /health of the daemon this container runs.

The daemon is PID 1 (the entrypoint execs it) or, under an init such as ``docker run
--init``, a child of PID 1. Its port comes from its command line, as the daemon itself
decides it: ``--port``/``--host`` flags over ``listen:`` in its ``--config`` file over
the default (8080; skymesh-replica has no default). ``SKYMESH_HEALTH_PORT`` overrides
all of it. A TLS listener (``listen.tls``) is probed over HTTPS without verifying the
certificate: this checks that the process serves, not who it is.

Exit 0: healthy; 1: unhealthy or not found (the message says why). For a test or a
debugging shell, the command line may be given instead: ``healthcheck.py skymesh-lb ...``.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

DAEMONS = {"skymesh-lb", "skymesh-controller", "skymesh-replica"}  # what the entrypoint runs
DEFAULT_PORT = {"skymesh-lb": 8080, "skymesh-controller": 8080}
_ANY = {"", "0.0.0.0", "::", "[::]"}


def daemon_argv(cmdline: list[str]) -> list[str] | None:
    """The daemon's name and arguments from a process's argv (a console script runs as
    ``python /opt/skymesh/bin/skymesh-lb ARGS``), or None if it is not a daemon."""
    for i, word in enumerate(cmdline[:3]):
        if Path(word).name in DAEMONS:
            return [Path(word).name, *cmdline[i + 1:]]
    return None


def _cmdline(pid: str) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [w.decode(errors="replace") for w in raw.split(b"\0") if w]


def _children_of_init() -> list[str]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name may hold spaces and parens: the fields follow the last ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == "1":
            kids.append(stat.parent.name)
    return sorted(kids, key=int)


def find_daemon() -> list[str] | None:
    for pid in ["1", *_children_of_init()]:
        argv = daemon_argv(_cmdline(pid))
        if argv is not None:
            return argv
    return None


def target(argv: list[str], env: dict[str, str]) -> tuple[str, str, int]:
    """(scheme, host, port) to probe for the daemon started as ``argv``."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config")
    ap.add_argument("--port", type=int)
    ap.add_argument("--host")
    args, _ = ap.parse_known_args(argv[1:])
    listen: dict[str, Any] = {}
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        listen = loaded.get("listen") or {}
    port = args.port if args.port is not None else listen.get("port", DEFAULT_PORT.get(argv[0]))
    if env.get("SKYMESH_HEALTH_PORT"):
        port = int(env["SKYMESH_HEALTH_PORT"])
    if not port:
        raise ValueError(f"{argv[0]}: no port on its command line or in its config "
                         "(set SKYMESH_HEALTH_PORT)")
    host = args.host if args.host is not None else str(listen.get("host", "127.0.0.1"))
    host = "127.0.0.1" if host in _ANY else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return ("https" if listen.get("tls") else "http"), host, int(port)


def probe(url: str, timeout: float = 2.0) -> int:
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=timeout, context=insecure) as resp:
        return int(resp.status)


def main(argv: list[str]) -> int:
    daemon = argv or find_daemon()
    if daemon is None:
        print("unhealthy: no skymesh daemon at PID 1 or among its children", file=sys.stderr)
        return 1
    try:
        scheme, host, port = target(daemon, dict(os.environ))
        url = f"{scheme}://{host}:{port}/health"
        status = probe(url)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
