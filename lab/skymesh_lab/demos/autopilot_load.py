"""The compressed day of ``skymesh demo --autopilot``: demand curve, clients, history feed.

- :class:`Day`: per region, requests/s at a moment of the compressed day. One hourly curve
  (local time) serves every region, shifted by the region's UTC offset, so each region
  peaks at its own local afternoon. ``hour_s`` real seconds make one hour of the day.
- :func:`arrivals`: an open-loop Poisson schedule following the curve (thinning), seeded,
  so every arm of the demo replays exactly the same requests.
- :class:`Clients`: fires that schedule at the regions' balancers (streamed chat requests
  of a fixed size) and keeps one record per request: TTFT, end to end, ok.
- :class:`HistoryFeed`: the earlier compressed days the forecasters need, posted to the
  controller's telemetry API as the region's balancer would report them (the expected
  requests and tokens of each second, no clients and no replicas behind them).

The curve is the Azure LLM inference trace 2024 (conversation): exact requests per hour
over six days (``aggregated_hourly_diegohommer/azure2024_conv_hourly.csv`` in the shared
data folder, read in place).
"""

from __future__ import annotations

import asyncio
import csv
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from skymesh.balancer.intake import CHARS_PER_TOKEN
from skymesh.prefix.prompt import render_chat

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TRACE = ("aggregated_hourly_diegohommer", "azure2024_conv_hourly.csv")
# Local time = UTC + offset: us (New York), eu (Dublin, summer), asia (Tokyo).
UTC_OFFSETS = {"us": -4, "eu": 1, "asia": 9}
PROMPT_CHARS = 800  # fixed prompt size: every request costs the same tokens
OUTPUT_TOKENS = 8
REQUEST_TIMEOUT_S = 30.0
LATE_S = 2.0


def read_trace(data_dir: Path) -> np.ndarray:
    """Requests per hour, hour 0 of day 0 first (2024-05-12, a Sunday)."""
    with (data_dir.joinpath(*TRACE)).open() as f:
        rows = sorted((int(r["day"]), int(r["hour"]), float(r["conversation"]))
                      for r in csv.DictReader(f))
    return np.asarray([v for _, _, v in rows])


@dataclass(frozen=True)
class Day:
    """``hourly``: a demand curve by local hour; the live day is hours ``[24 * live_day,
    24 * live_day + 24)`` of it. Rates are scaled so the highest hour any region sees
    during the live day is ``peak_rps``."""

    hourly: np.ndarray
    live_day: int
    hour_s: float
    peak_rps: float
    offsets: Mapping[str, float]

    @property
    def day_s(self) -> float:
        return 24 * self.hour_s

    @property
    def regions(self) -> list[str]:
        return list(self.offsets)

    def _level(self, region: str, t: float) -> float:
        """Curve value (unscaled) at ``t`` seconds from the live day's 00:00 UTC."""
        x = 24 * self.live_day + t / self.hour_s + self.offsets[region]
        return float(np.interp(x, np.arange(len(self.hourly)), self.hourly))

    @cached_property
    def _scale(self) -> float:
        peak = max(self._level(r, h * self.hour_s / 4) for r in self.offsets
                   for h in range(24 * 4))
        return self.peak_rps / peak

    def rate(self, region: str, t: float) -> float:
        """Requests/s in ``region`` at ``t`` seconds from the live day's 00:00 UTC (negative:
        earlier days)."""
        return self._level(region, t) * self._scale


def arrivals(day: Day, start: float, end: float, seed: int) -> list[tuple[float, str]]:
    """``(t, region)`` of every request from ``start`` to ``end`` (seconds from the live
    day's start), time-ordered: a Poisson process at ``day.rate`` by thinning."""
    out: list[tuple[float, str]] = []
    scale = day._scale
    for i, region in enumerate(day.regions):
        rng = random.Random(seed * 1000 + i)
        top = max(day._level(region, t) for t in np.arange(start, end, day.hour_s / 4)) * scale
        t = start
        while True:
            t += rng.expovariate(top * 1.05)
            if t >= end:
                break
            if rng.random() * top * 1.05 < day.rate(region, t):
                out.append((t, region))
    out.sort()
    return out


def request_body(i: int) -> dict[str, Any]:
    # Distinct text per request (no prefix-cache shortcut), padded to a fixed size.
    words = f"Request {i}: summarise the quarterly report, section {i % 97}. "
    text = (words * (PROMPT_CHARS // len(words) + 1))[:PROMPT_CHARS]
    return {"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


def tokens_per_request() -> tuple[int, int]:
    """(prompt, output) tokens the balancer reports per request (its own prompt estimate:
    what the controller's telemetry, and so the planner, sees)."""
    prompt = max(1, len(render_chat(request_body(0)["messages"])) // CHARS_PER_TOKEN)
    return prompt, OUTPUT_TOKENS


@dataclass
class Record:
    t: float  # scheduled send, seconds from the live day's start
    region: str
    ttft: float | None = None
    e2e: float | None = None
    ok: bool = False


class Clients:
    """Sends ``schedule`` to ``urls[region]`` against the clock ``t0`` (monotonic time of
    the live day's 00:00); each request a task, so a slow replica never delays the next
    arrival (open loop)."""

    def __init__(self, urls: Mapping[str, str], schedule: Sequence[tuple[float, str]],
                 t0: float) -> None:
        self.urls, self.schedule, self.t0 = dict(urls), schedule, t0
        self.records: list[Record] = []
        self.late = 0  # requests not sent: the harness was behind their time (see run)

    async def _one(self, s: aiohttp.ClientSession, i: int, rec: Record) -> None:
        start = time.monotonic()
        try:
            async with s.post(self.urls[rec.region] + "/v1/chat/completions",
                              json=request_body(i)) as r:
                if r.status != 200:
                    await r.read()
                    return
                async for line in r.content:
                    if rec.ttft is None and line.startswith(b"data: {"):
                        rec.ttft = time.monotonic() - start
                    if b'"error"' in line:
                        return
            rec.e2e = time.monotonic() - start
            rec.ok = rec.ttft is not None
        except (aiohttp.ClientError, TimeoutError):
            return

    async def run(self, drain_s: float = REQUEST_TIMEOUT_S) -> list[Record]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as s:
            tasks = []
            for i, (t, region) in enumerate(self.schedule):
                delay = self.t0 + t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -LATE_S:
                    # Far behind (the arms started late): a burst of overdue requests
                    # would be a load the curve never had. They are counted, not sent.
                    self.late += 1
                    continue
                rec = Record(t, region)
                self.records.append(rec)
                tasks.append(asyncio.create_task(self._one(s, i, rec)))
            # Requests still running at the end of the day get their timeout, no more.
            await asyncio.wait(tasks, timeout=drain_s) if tasks else None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.records


class HistoryFeed:
    """Posts, every ``every_s``, what each region's balancer would report for the demand of
    the curve over the past ``every_s`` (expected requests, rounded with carry-over)."""

    def __init__(self, controller: str, token: str, day: Day, t0: float,
                 until: float, every_s: float = 1.0) -> None:
        self.url, self.day, self.t0, self.until = controller, day, t0, until
        self.headers = {"Authorization": f"Bearer {token}"}
        self.every_s = every_s
        self.posted = 0

    async def run(self) -> None:
        prompt, output = tokens_per_request()
        carry = dict.fromkeys(self.day.regions, 0.0)
        async with aiohttp.ClientSession(headers=self.headers) as s:
            last = time.monotonic()
            while last - self.t0 < self.until:
                await asyncio.sleep(max(0.0, last + self.every_s - time.monotonic()))
                now = time.monotonic()
                mid = (last + now) / 2 - self.t0
                for region in self.day.regions:
                    carry[region] += self.day.rate(region, mid) * (now - last)
                    n = math.floor(carry[region])
                    carry[region] -= n
                    body = {"window_s": now - last, "models": {MODEL: {
                        "requests": n, "prompt_tokens": n * prompt,
                        "output_tokens": n * output}}}
                    async with s.post(f"{self.url}/v1/balancers/lb-{region}/telemetry",
                                      json=body) as r:
                        r.raise_for_status()
                    self.posted += 1
                last = now
