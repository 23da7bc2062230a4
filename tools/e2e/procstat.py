"""CPU time, memory and threads of the processes a benchmark runs, read from Linux /proc.

The burst benchmark charges each burst's CPU to its parts (each vLLM server: API server and
engine core, one process group; the balancer; the benchmark's own client) so a run whose
parts took more CPU for the same tokens shows it, instead of only a slower wall clock.
A vLLM server is found by the port it listens on, so servers started elsewhere
(``--servers``) are measured too. Linux only; elsewhere every figure is None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class Usage:
    cpu_s: float  # user + system, all threads
    rss_mb: float
    threads: int
    processes: int


def _stat(pid: str) -> list[str] | None:
    try:
        raw = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def usage(pids: set[int] | None = None, pgid: int | None = None) -> Usage | None:
    """Summed over ``pids`` and every process of group ``pgid``; None when none exist."""
    cpu = rss = 0.0
    threads = procs = 0
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        f = _stat(entry.name)
        # After the name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) ...
        # num_threads(17) ... rss(21), in pages.
        if f is None or not ((pids and int(entry.name) in pids)
                             or (pgid is not None and int(f[2]) == pgid)):
            continue
        cpu += (int(f[11]) + int(f[12])) / _TICK
        threads += int(f[17])
        rss += int(f[21]) * _PAGE / 2**20
        procs += 1
    return Usage(round(cpu, 2), round(rss, 1), threads, procs) if procs else None


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (IPv4 or IPv6), if this user can see it."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(cols[9])
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:
            continue
    return None


def runnable() -> int | None:
    """Tasks runnable right now, machine-wide (``/proc/loadavg``'s fourth field)."""
    try:
        return int((PROC / "loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``, all cores)."""
    try:
        cols = (PROC / "stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(c) for c in cols[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


@dataclass
class Meter:
    """What one burst cost each part, in CPU seconds: each vLLM server (its process group:
    API server and engine core), the balancer, this benchmark (client and sampler) and
    everything else on the machine (other people's work on a shared machine)."""

    groups: dict[str, int]  # server name -> process group
    lb_pid: int
    start: dict[str, float] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        out = {}
        for name, pgid in self.groups.items():
            if (u := usage(pgid=pgid)) is not None:
                out[name] = u.cpu_s
        if (u := usage(pids={self.lb_pid})) is not None:
            out["lb"] = u.cpu_s
        t = os.times()
        out["bench"] = t.user + t.system
        if (busy := machine_busy_s()) is not None:
            out["machine"] = busy
        return out

    def begin(self) -> None:
        self.start = self.read()

    def end(self) -> dict[str, Any]:
        now = self.read()
        spent = {k: round(now[k] - self.start[k], 2) for k in now if k in self.start}
        if "machine" in spent:
            ours = sum(v for k, v in spent.items() if k != "machine")
            spent["others"] = round(spent.pop("machine") - ours, 2)
        mem = {n: usage(pgid=g) for n, g in self.groups.items()}
        return {"cpu_s": spent,
                "rss_mb": {n: u.rss_mb for n, u in mem.items() if u is not None},
                "threads": {n: u.threads for n, u in mem.items() if u is not None}}


def server_groups(urls: list[str]) -> dict[str, int]:
    """Each server's process group, found by its listening port (if visible here)."""
    out = {}
    for i, url in enumerate(urls):
        pid = listener_pid(int(url.rsplit(":", 1)[1]))
        if pid is not None:
            out[f"s{i}"] = os.getpgid(pid)
    return out
