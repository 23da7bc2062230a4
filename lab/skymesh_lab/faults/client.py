"""A client that classifies every request it sends, as a user would see it.

Outcomes (exactly one per request sent):

- ``completed``: a correct answer: a stream of exactly ``max_tokens`` content deltas
  ending in ``[DONE]`` with no error event, or a 200 JSON body with a message and
  ``usage.completion_tokens == max_tokens`` (requests use ``ignore_eos``).
- ``failed_explicit``: an error the client can see and act on: a 4xx/5xx whose body is an
  OpenAI error object, or an SSE ``error`` event in the stream.
- ``lost``: anything else: no answer before the request's deadline (hung), a stream that
  ends without ``[DONE]`` and without an error event (silent truncation), a connection
  reset with no error body, a wrong token count reported as success.
- ``refused``: the connection was refused, so no daemon saw the request; a client (or
  DNS) may safely retry it elsewhere. Not counted as sent to the balancer.

``accepted`` counts requests that got a response head (status line, or stream start).
Each client connection is closed after its request (``force_close``), so a balancer
shutting down cannot race a reused keep-alive connection: a reset then means a reset.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from skymesh_lab.faults.cluster import MODEL

COMPLETED, FAILED, LOST, REFUSED = "completed", "failed_explicit", "lost", "refused"


@dataclass
class Tally:
    accepted: int = 0
    completed: int = 0
    failed_explicit: int = 0
    lost: int = 0
    refused: int = 0
    retried: int = 0  # from the balancers' skymesh_retries_total, filled in by the scenario
    statuses: Counter[int] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # why each failure/loss
    latencies: list[float] = field(default_factory=list)  # completed requests, seconds
    missing_retry_after: int = 0  # 429s without a Retry-After header

    def add(self, outcome: str, reason: str = "") -> str:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if reason:
            self.reasons[f"{outcome}: {reason}"] += 1
        return outcome

    @property
    def sent(self) -> int:
        return self.completed + self.failed_explicit + self.lost

    def row(self) -> dict[str, Any]:
        """The contract keys first, then extra detail."""
        return {"accepted": self.accepted, "completed": self.completed,
                "retried": self.retried, "failed_explicit": self.failed_explicit,
                "lost": self.lost, "sent": self.sent, "refused": self.refused,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "reasons": dict(self.reasons)}


def chat_body(content: str, max_tokens: int, stream: bool, prompt_words: int = 0
              ) -> dict[str, Any]:
    if prompt_words:  # a long prompt: one request fills a scheduler step at the replica
        content = f"{content} " + " ".join(f"w{i % 97}" for i in range(prompt_words))
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True))


def _is_error_body(raw: bytes) -> bool:
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and bool(err.get("message"))


async def _read_stream(resp: aiohttp.ClientResponse, max_tokens: int) -> tuple[str, str]:
    tokens = 0
    done = False
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            return FAILED, f"SSE error event ({ev['error'].get('code')})"
        for ch in ev.get("choices", []):
            if ch.get("delta", {}).get("content") or ch.get("text"):
                tokens += 1
    if not done:
        return LOST, "stream ended without [DONE] or an error event"
    if tokens != max_tokens:
        return LOST, f"stream of {tokens} tokens reported as complete (wanted {max_tokens})"
    return COMPLETED, ""


async def _read_json(resp: aiohttp.ClientResponse, max_tokens: int) -> tuple[str, str]:
    doc = json.loads(await resp.read())
    got = (doc.get("usage") or {}).get("completion_tokens")
    if not doc.get("choices") or got != max_tokens:
        return LOST, f"200 with {got} completion tokens (wanted {max_tokens})"
    return COMPLETED, ""


async def send(s: aiohttp.ClientSession, base: str, body: dict[str, Any], tally: Tally,
               deadline_s: float, headers: dict[str, str] | None = None) -> str:
    """POST one chat completion; record and return its outcome."""
    t0 = time.monotonic()
    stream = bool(body.get("stream"))
    max_tokens = int(body["max_tokens"])
    answered = False
    try:
        async with asyncio.timeout(deadline_s):
            async with s.post(base + "/v1/chat/completions", json=body,
                              headers=headers) as resp:
                answered = True
                tally.accepted += 1
                tally.statuses[resp.status] += 1
                if resp.status == 429 and "Retry-After" not in resp.headers:
                    tally.missing_retry_after += 1
                if resp.status != 200:
                    raw = await resp.read()
                    if _is_error_body(raw):
                        return tally.add(FAILED, f"HTTP {resp.status}")
                    return tally.add(LOST, f"HTTP {resp.status} without an error body")
                outcome, why = await (_read_stream(resp, max_tokens) if stream
                                      else _read_json(resp, max_tokens))
    except TimeoutError:
        return tally.add(LOST, f"no answer within the {deadline_s:.0f} s deadline")
    except aiohttp.ClientConnectorError:
        if answered:  # cannot happen (connect errors come before a response); be strict
            return tally.add(LOST, "connect error after a response")
        return tally.add(REFUSED)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        where = "mid-response" if answered else "before a response"
        return tally.add(LOST, f"{type(exc).__name__} {where}")
    if outcome == COMPLETED:
        tally.latencies.append(time.monotonic() - t0)
    return tally.add(outcome, why)


async def closed_loop(s: aiohttp.ClientSession, base: str | Any, tally: Tally, *,
                      stop_at: float, deadline_s: float, max_tokens: int, stream: bool,
                      tag: str, retry_refused: bool = False, prompt_words: int = 0,
                      stop: asyncio.Event | None = None) -> None:
    """One client sending back to back until ``stop_at`` or until ``stop`` is set (a
    scenario whose phases wait on conditions ends its load when they are done, with
    ``stop_at`` as the bound). ``base`` may be a callable
    returning the current URL (DNS following a restarted daemon). With
    ``retry_refused`` a refused connection is retried until ``deadline_s`` has passed,
    as a client library would against a name whose target is restarting."""
    i = 0
    while time.monotonic() < stop_at and not (stop is not None and stop.is_set()):
        i += 1
        body = chat_body(f"{tag} request {i}: tell me something", max_tokens, stream,
                         prompt_words)
        first = time.monotonic()
        while True:
            url = base() if callable(base) else base
            out = await send(s, url, body, tally, deadline_s)
            if out != REFUSED or not retry_refused:
                break
            if time.monotonic() - first > deadline_s:
                tally.refused -= 1
                tally.add(LOST, "refused until its deadline")
                break
            await asyncio.sleep(REFUSED_BACKOFF_S)


REFUSED_BACKOFF_S = 0.05  # a client's reconnect backoff while the daemon restarts


async def probe_get(s: aiohttp.ClientSession, url: str, tally: Tally, deadline_s: float,
                    headers: dict[str, str] | None = None,
                    valid: Any = None) -> str:
    """GET ``url`` and classify it like :func:`send`: a 200 whose JSON passes ``valid``
    is completed, an error status with an error body is explicit, the rest is lost."""
    answered = False
    try:
        async with asyncio.timeout(deadline_s):
            async with s.get(url, headers=headers) as resp:
                answered = True
                tally.accepted += 1
                tally.statuses[resp.status] += 1
                raw = await resp.read()
    except TimeoutError:
        return tally.add(LOST, f"no answer within the {deadline_s:.0f} s deadline")
    except aiohttp.ClientConnectorError:
        return tally.add(REFUSED)
    except (aiohttp.ClientError, OSError) as exc:
        where = "mid-response" if answered else "before a response"
        return tally.add(LOST, f"{type(exc).__name__} {where}")
    if resp.status >= 400:
        if _is_error_body(raw):
            return tally.add(FAILED, f"HTTP {resp.status}")
        return tally.add(LOST, f"HTTP {resp.status} without an error body")
    try:
        doc = json.loads(raw)
    except ValueError:
        return tally.add(LOST, "200 with a body that is not JSON")
    if valid is not None and not valid(doc):
        return tally.add(LOST, "200 with a wrong body")
    return tally.add(COMPLETED)
