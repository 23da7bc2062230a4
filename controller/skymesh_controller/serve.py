"""Running the controller under uvicorn on a socket we bind ourselves.

Binding first lets ``--port 0`` work and the ``listening on`` line carry the real port
(scripts and tests read it), and the listen backlog holds clients until startup ends.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from types import FrameType
from typing import Any

from skymesh.net.limits import ConnectionGuard, ConnLimits, fit_file_limit
from skymesh_controller.config import ControllerConfig


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on connections accepted from such a
    # socket, and with it on a response written in two parts waits for a delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(cfg: ControllerConfig) -> int:

    from skymesh_controller.api import build_app
    from skymesh_controller.dns_hook import dns_hook

    try:
        sock = _bind(cfg.listen.host, cfg.listen.port)
    except OSError as exc:
        print(f"skymesh-controller: cannot listen on {cfg.listen.host}:{cfg.listen.port}: "
              f"{exc.strerror}", file=sys.stderr)
        return 1
    app = build_app(cfg, dns=dns_hook(cfg))
    limits = fit_file_limit(cfg.limits.connections(), "skymesh-controller")
    server = make_server(app, limits)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"skymesh-controller listening on http://{shown}:{port} (store {_safe(cfg.store)})",
          file=sys.stderr, flush=True)
    # uvicorn re-raises the stop signal once it has shut down, with the handler that was
    # in place before it started: make that one a clean exit rather than death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    asyncio.run(server.serve(sockets=[sock]))
    return 0


def make_server(app: Any, limits: ConnLimits) -> Any:
    """uvicorn's server for ``app`` that answers the long polls as it starts shutting down
    (``Changes.close``): waiting them out would take ``long_poll_max_s``, and uvicorn
    cancels what is left after its graceful timeout (a traceback each in the log)."""
    import uvicorn

    changes = app.state.controller.changes

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            changes.close()
            await super().shutdown(sockets)

    return Server(uvicorn_config(app, limits))


def uvicorn_config(app: Any, limits: ConnLimits) -> Any:
    """uvicorn settings with the connection limits of skymesh.net.limits.

    uvicorn has an idle timeout between requests (``timeout_keep_alive``), a header size
    cap for h11 only, and no header or body timeout and no per-client cap: the guard adds
    those around uvicorn's own protocol. ``limit_concurrency`` stays unset: the guard caps
    connections already (with a log line and a count), and uvicorn's cap answers 503 to
    every request once the number of open connections reaches it, even on a connection
    that is already open.
    """
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    guard = ConnectionGuard(limits, "skymesh-controller")
    app.state.connection_guard = guard  # skymesh_controller.metrics serves its series
    return uvicorn.Config(guard.asgi(app), log_level="warning", access_log=False,
                          lifespan="on", timeout_graceful_shutdown=5,
                          http=guard.protocol_factory(  # type: ignore[arg-type]
                              AutoHTTPProtocol, tasks_on_data=True),
                          timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=64 * 1024)


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _safe(store: str) -> str:
    """The store URL without a password, for logs."""
    if "@" in store:
        scheme, _, rest = store.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return store
