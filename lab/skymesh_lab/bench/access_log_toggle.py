"""The access log switched on and off inside one live skymesh-lb, for paired turns.

``access_log_cost --toggle`` measures each build's "on" and "off" in the same balancer
process rather than in two: a process carries an offset of its own in CPU per request
(its memory layout, its hash seed: several microseconds, as much as the log's whole
cost), which a pair of processes adds to their difference and which fresh processes
every round only turn into spread. Here the offset is common to both turns and cancels.

A ``sitecustomize.py`` on the daemon's ``PYTHONPATH`` calls :func:`apply` before
anything else (the product has no switch for this): it wraps
``skymesh.net.serving.request_handler`` so that the server's request handler is made
twice, with the access log and without (what a daemon started with ``--no-access-log``
runs), and on ``SIGUSR1`` (on) or ``SIGUSR2`` (off), handled on the loop between
requests, it puts one or the other on the server, takes the log's prepare hook out of
the app's ``on_response_prepare`` or puts it back, and sets the balancer's notes
working or returning at once (``skymesh.obs.access._installed``), flushing the open
batch when it switches off. New connections take the server's handler when they are
made, and each turn of the benchmark is a new wrk run (new connections). The daemon
then writes the state to the file named by ``SKYMESH_LAB_TOGGLE_ACK``; the benchmark
waits for it (:func:`switch`) before it reads the CPU counters.

"Off" here differs from a daemon without the log only in what stays idle: the writer
thread (blocked on its queue), the dropped-lines collector, the code loaded.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ACK_ENV = "SKYMESH_LAB_TOGGLE_ACK"
ON, OFF = signal.SIGUSR1, signal.SIGUSR2


def apply() -> None:
    """Patch this process's skymesh-lb (see the module): the log starts on."""
    import asyncio

    from aiosignal import Signal

    from skymesh.net import serving
    from skymesh.obs import access

    made = serving.request_handler
    ack = Path(os.environ[ACK_ENV])

    def request_handler(app: Any, handle: Any, routes: Any, log: Any) -> Any:
        with_log = made(app, handle, routes, log)
        if log is None:  # nothing to switch (the log is off, or in the app's chain)
            return with_log
        without = made(app, handle, routes, None)
        # start_app's own local: the server this handler is made for (lab only).
        server = sys._getframe(1).f_locals["server"]
        hooks_on = app.on_response_prepare
        hooks_off = Signal(app)
        # The log's prepare hook (a module function before session 29, then its
        # middleware object's method): the off turn runs without it.
        watch = getattr(access, "_watch_body", None) or log.watch_body
        hooks_off.extend(h for h in hooks_on if h != watch)
        hooks_off.freeze()
        writer = log.writer

        def set_state(on: bool) -> None:
            server.request_handler = with_log if on else without
            app._on_response_prepare = hooks_on if on else hooks_off
            access._installed = on
            if not on and writer is not None:
                writer.flush()  # the open batch is the "on" turn's
            ack.write_text("on" if on else "off")

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(ON, set_state, True)
        loop.add_signal_handler(OFF, set_state, False)
        ack.write_text("on")
        return with_log

    serving.request_handler = request_handler


def switch(pid: int, ack: Path, on: bool, timeout_s: float = 10.0) -> None:
    """Put the daemon ``pid`` in state ``on`` and wait until it says so."""
    want = "on" if on else "off"
    if _read(ack) == want:
        return
    os.kill(pid, ON if on else OFF)
    deadline = time.monotonic() + timeout_s
    while _read(ack) != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"skymesh-lb {pid} did not switch its access log {want}")
        time.sleep(0.005)


def _read(ack: Path) -> str:
    try:
        return ack.read_text()
    except FileNotFoundError:
        return ""


def sitecustomize(into: Path) -> Path:
    """A folder for ``PYTHONPATH`` whose ``sitecustomize.py`` applies the toggle."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "sitecustomize.py").write_text(
        "from skymesh_lab.bench.access_log_toggle import apply\napply()\n")
    return into
