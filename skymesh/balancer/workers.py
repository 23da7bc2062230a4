"""``skymesh-lb`` on every core: one port served by N worker processes.

The process the user starts is then a small supervisor, not a balancer. It binds N
listening sockets on the same ``host:port`` with ``SO_REUSEPORT`` (the kernel spreads new
connections over them by a hash of the client's address and port) and starts each worker
by re-executing ``skymesh-lb`` with the same arguments plus hidden ones (``--worker-index
I --listen-fd FD ...``), passing the socket with ``pass_fds``. Not ``os.fork``: the mesh's
gRPC and the loop's state are not fork-safe, and a fresh interpreter costs only start-up.

Each worker is a full :class:`skymesh.balancer.server.Balancer` (its own dispatcher, queue,
prober and tries): the workers push to the replicas as the balancers of one region do, so
sp-p keeps each to a ``1 / (balancers_per_region x workers)`` share of a replica's free
slots (:func:`pushing_share`). What the workers share goes over private unix sockets in a
directory of the supervisor's (``skymesh.balancer.siblings``): one ``/metrics`` and
``/status`` view, and their prefix-trie inserts (cache locality).

The supervisor forwards SIGTERM/SIGINT (each worker drains as a single balancer does) and
SIGHUP (each re-reads the file), restarts a worker that dies with a growing delay
(:class:`RestartBudget`), and gives up, stopping the rest and exiting 1, when they keep
dying. It keeps its copies of the listening sockets while running: connections the kernel
queued on a dead worker's socket wait for its replacement instead of being refused. A worker
whose supervisor dies (even by SIGKILL) sees its lifeline pipe close and drains.

Each worker on a core of its own (``listen.pin_workers``, :func:`worker_cpus`): left to
itself, the kernel often runs both workers of a 2-core machine on one core for a while
(wrk and the stubs, or any other process, make the load look balanced), and two Python
workers taking turns on one core each lose their caches to the other: per request they
cost more CPU, and together serve about a third less (docs/notes/second-worker-cost.md).
``auto`` pins them when the process may use exactly one core per worker (a container's
cpuset, the default worker count on a machine of its own); on a host shared with other
work the kernel's freedom to move a worker off a busy core is worth more. The supervisor
pins each worker as it starts it, before the worker has threads (they inherit it).

``listen.workers: 1`` (and ``auto`` with a mesh or a controller section, for now) is the
single process of before: no supervisor, nothing shared.

Parameters: ``MAX_AUTO_WORKERS`` (config) caps ``auto``; restart delays from
``RESTART_DELAY_S`` doubling to ``RESTART_DELAY_MAX_S``; ``GIVE_UP_DEATHS`` deaths within
``GIVE_UP_WINDOW_S`` end the supervisor; workers get ``STOP_GRACE_S`` to drain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.balancer.config import MAX_AUTO_WORKERS

log = logging.getLogger("skymesh-lb.workers")

RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 8.0
STABLE_AFTER_S = 30.0  # a worker up this long starts the next delay from the bottom again
GIVE_UP_DEATHS = 5
GIVE_UP_WINDOW_S = 60.0
STARTUP_TIMEOUT_S = 120.0  # every worker listening by then, or the start fails
STOP_GRACE_S = 30.0  # then stragglers are killed


# -- pure decisions ----------------------------------------------------------------------
def resolve_workers(setting: int | str, cores: int, *, mesh_or_controller: bool) -> int:
    """The worker count for ``listen.workers``: a number is taken as given; ``auto`` is
    the cores this process may use, at most ``MAX_AUTO_WORKERS``, and 1 with a mesh or a
    controller (one mesh identity; the siblings do not peer yet)."""
    if setting != "auto":
        return int(setting)
    if mesh_or_controller:
        return 1
    return max(1, min(cores, MAX_AUTO_WORKERS))


def usable_core_ids() -> list[int]:
    """The cores this process may run on, in order (empty where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return []


def usable_cores() -> int:
    """How many cores this process may run on (its affinity mask, as a container's
    cpuset; all of them where the OS does not say)."""
    return len(usable_core_ids()) or os.cpu_count() or 1


def worker_cpus(setting: bool | str, cores: Sequence[int], count: int) -> list[int] | None:
    """The core each worker is pinned to, by worker index, or ``None``: the kernel places
    them. ``auto`` pins only when ``cores`` holds exactly one core per worker; ``True``
    pins worker ``i`` to the ``i``-th core, round again when there are more workers."""
    if setting is False or count < 2 or not cores:
        return None
    if setting == "auto" and len(cores) != count:
        return None
    ordered = sorted(cores)
    return [ordered[i % len(ordered)] for i in range(count)]


def pushing_share(balancers_per_region: int, workers: int) -> int:
    """How many balancers push to one replica, for sp-p's ``1/n`` share of its free
    slots: every worker of every balancer of the region."""
    return balancers_per_region * workers


@dataclass
class RestartBudget:
    """When to restart a worker that died, or ``None``: give up (they keep dying)."""

    clock: Callable[[], float] = time.monotonic
    deaths: deque[float] = field(default_factory=deque)
    delay_s: float = RESTART_DELAY_S

    def on_death(self, uptime_s: float) -> float | None:
        now = self.clock()
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - GIVE_UP_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) >= GIVE_UP_DEATHS:
            return None
        if uptime_s >= STABLE_AFTER_S:
            self.delay_s = RESTART_DELAY_S
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, RESTART_DELAY_MAX_S)
        return delay


# -- sockets -----------------------------------------------------------------------------
def bind_shared(host: str, port: int, count: int, backlog: int = 2048) -> list[socket.socket]:
    """``count`` listening sockets on one ``host:port`` (port 0: the first one's)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    out: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(family, kind, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(backlog)
            addr = s.getsockname()  # a port 0 is now the real one, for the others
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


def listen_url(sock: socket.socket, tls: bool) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


# -- the supervisor ----------------------------------------------------------------------
@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    ready_fd: int | None = None  # read end of the readiness pipe, until the worker writes


class Supervisor:
    """Starts, watches and stops the workers (module docstring)."""

    def __init__(self, argv: Sequence[str], count: int, socks: list[socket.socket],
                 announce: str, cpus: Sequence[int] | None = None) -> None:
        self.argv = list(argv)
        self.count = count
        self.cpus = list(cpus) if cpus is not None else None  # by worker index
        self.socks = socks
        self.announce = announce  # the "listening on" line, printed once all are up
        self.dir = tempfile.mkdtemp(prefix="skymesh-lb-")
        self.workers = [_Worker(i) for i in range(count)]
        self.budget = RestartBudget()
        self._life_r, self._life_w = os.pipe()  # closes when the supervisor dies
        self._wake_r, self._wake_w = socket.socketpair()
        self._signals: deque[int] = deque()  # appended by the handler, popped here

    def run(self) -> int:
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        try:
            for w in self.workers:
                self._spawn(w)
            code = self._start()
            if code is None:
                code = self._watch()
            return code
        finally:
            self._stop_all()
            for s in self.socks:
                s.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _spawn(self, w: _Worker) -> None:
        ready_r, ready_w = os.pipe()
        sock = self.socks[w.index]
        # The interpreter's own flags too (-X importtime, -W, ...), as multiprocessing does.
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        # -P: ``-m`` would put the working directory first on sys.path, and a ``skymesh``
        # there (a checkout of another version) would become the workers' code.
        cmd = [sys.executable, *flags, "-P", "-m", "skymesh.balancer.cli", *self.argv,
               "--worker-index", str(w.index), "--worker-count", str(self.count),
               "--listen-fd", str(sock.fileno()), "--lifeline-fd", str(self._life_r),
               "--ready-fd", str(ready_w), "--worker-dir", self.dir]
        try:
            w.proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(), self._life_r, ready_w))
        finally:
            os.close(ready_w)
        if self.cpus is not None:
            # Popen returns once the interpreter is exec'd: it starts no thread before its
            # imports, so every thread the worker makes inherits the core.
            try:
                os.sched_setaffinity(w.proc.pid, {self.cpus[w.index]})
            except OSError as exc:  # gone already (its death is seen below), or refused
                log.warning("worker %d not pinned to core %d: %s", w.index,
                            self.cpus[w.index], exc)
        w.started, w.restart_at = time.monotonic(), None
        if w.ready_fd is not None:
            os.close(w.ready_fd)
        w.ready_fd = ready_r

    def _wait(self, timeout: float) -> list[int]:
        """Sleep until a signal, a readiness byte or ``timeout``; readable ready fds."""
        wake = self._wake_r.fileno()
        fds = [w.ready_fd for w in self.workers if w.ready_fd is not None]
        readable, _, _ = select.select([wake, *fds], [], [], max(0.0, timeout))
        if wake in readable:
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)
        return [fd for fd in readable if fd != wake]

    def _mark_ready(self, fds: list[int]) -> None:
        for w in self.workers:
            if w.ready_fd in fds:
                os.close(w.ready_fd)  # a byte (ready) or end of file (died): done either way
                w.ready_fd = None

    def _start(self) -> int | None:
        """Until every worker listens: ``None``, or the exit code of a failed start."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while any(w.ready_fd is not None for w in self.workers):
            self._mark_ready(self._wait(deadline - time.monotonic()))
            if self._take_stop_signal():
                return 0
            for w in self.workers:
                assert w.proc is not None
                code = w.proc.poll()
                if code is not None:
                    log.error("worker %d exited with %s while starting", w.index, code)
                    return code or 1
            if time.monotonic() > deadline:
                log.error("workers not listening after %.0f s", STARTUP_TIMEOUT_S)
                return 1
        print(self.announce, file=sys.stderr, flush=True)
        return None

    def _take_stop_signal(self) -> bool:
        stop = False
        while self._signals:  # popleft, not iterate-then-clear: none arriving between is lost
            sig = self._signals.popleft()
            if sig in (signal.SIGTERM, signal.SIGINT):
                stop = True
            elif sig == signal.SIGHUP:
                self._send(signal.SIGHUP)
        return stop

    def _watch(self) -> int:
        while True:
            pending = [w.restart_at for w in self.workers if w.restart_at is not None]
            timeout = min(pending) - time.monotonic() if pending else 3600.0
            self._mark_ready(self._wait(timeout))
            if self._take_stop_signal():
                return 0
            now = time.monotonic()
            for w in self.workers:
                if w.restart_at is not None:
                    if now >= w.restart_at:
                        log.warning("restarting worker %d", w.index)
                        self._spawn(w)
                    continue
                assert w.proc is not None
                code = w.proc.poll()
                if code is None:
                    continue
                delay = self.budget.on_death(now - w.started)
                if delay is None:
                    log.error("worker %d exited with %s; workers died %d times in %.0f s, "
                              "giving up", w.index, code, GIVE_UP_DEATHS, GIVE_UP_WINDOW_S)
                    return 1
                log.warning("worker %d (pid %d) exited with %s; restarting in %.1f s",
                            w.index, w.proc.pid, code, delay)
                w.restart_at = now + delay

    def _send(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    def _stop_all(self) -> None:
        """Drain: the workers stop accepting and finish what they hold."""
        for s in self.socks:  # new connections are refused now, not queued for no one
            s.close()
        self._send(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in %.0f s; killing it", w.index,
                          STOP_GRACE_S)
                w.proc.kill()
                w.proc.wait()
        os.close(self._life_w)


def supervise(argv: Sequence[str], count: int, host: str, port: int, tls: bool,
              detail: str, pin: bool | str = False) -> int:
    """Bind the port, run the workers until a stop signal; the process's exit code.
    ``pin``: ``listen.pin_workers`` (:func:`worker_cpus`)."""
    try:
        socks = bind_shared(host, port, count)
    except OSError as exc:
        print(f"skymesh-lb: {exc}", file=sys.stderr)
        return 1
    announce = f"skymesh-lb listening on {listen_url(socks[0], tls)} ({detail}, {count} workers)"
    cpus = worker_cpus(pin, usable_core_ids(), count)
    if cpus is not None:
        log.info("workers pinned to cores %s", ", ".join(map(str, cpus)))
    return Supervisor(argv, count, socks, announce, cpus).run()


__all__ = ["RestartBudget", "Supervisor", "bind_shared", "pushing_share", "resolve_workers",
           "supervise", "usable_core_ids", "usable_cores", "worker_cpus"]
