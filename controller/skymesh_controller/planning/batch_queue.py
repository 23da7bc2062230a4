"""SageServe's queue manager for non-interactive (batch) requests (sec. 6.2-6.3).

Batch requests wait here, per model, oldest first. An endpoint signals when its effective
memory utilisation falls below 60%; the manager then hands it one request, or two when
utilisation is below 50%. A request older than 10 hours goes out with priority 0 (on par
with interactive requests), younger ones with priority 1 (served only when no priority-0
request waits at the instance). A request not served within its 24-hour deadline expires.

``fill`` is the fluid limit of ``on_signal`` for a model that moves work in tokens rather
than requests: an endpoint that signals on every request it receives and gets one small
request per signal while under 60% ends up holding batch work up to 60% of its capacity,
so ``fill`` hands out that many tokens at once, splitting the oldest request if only part
of it fits (the part handed out keeps its arrival time, so it ages and expires alike).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

DEADLINE_S = 24 * 3600.0
PROMOTE_AFTER_S = 10 * 3600.0
FEED_ONE_UNDER = 0.60
FEED_TWO_UNDER = 0.50


@dataclass(frozen=True, slots=True)
class BatchRequest:
    request_id: str
    model: str
    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Dispatch:
    request: BatchRequest
    region: str
    priority: int  # 0: as urgent as interactive traffic; 1: only when nothing else waits


@dataclass
class BatchQueue:
    deadline_s: float = DEADLINE_S
    promote_after_s: float = PROMOTE_AFTER_S
    _queues: dict[str, deque[BatchRequest]] = field(default_factory=dict)
    expired: int = 0

    def submit(self, req: BatchRequest) -> None:
        q = self._queues.setdefault(req.model, deque())
        if q and req.arrival < q[-1].arrival:
            raise ValueError("batch requests must be submitted in arrival order")
        q.append(req)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending(self) -> list[BatchRequest]:
        """Every request still waiting, all models."""
        return [r for q in self._queues.values() for r in q]

    def waiting(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def expire(self, now: float) -> list[BatchRequest]:
        """Drop (and return) the requests whose deadline passed."""
        gone: list[BatchRequest] = []
        for q in self._queues.values():
            while q and now - q[0].arrival >= self.deadline_s:
                gone.append(q.popleft())
        self.expired += len(gone)
        return gone

    def on_signal(self, model: str, region: str, utilisation: float,
                  now: float) -> list[Dispatch]:
        """An endpoint of ``model`` in ``region`` reports its utilisation."""
        self.expire(now)
        if utilisation >= FEED_ONE_UNDER:
            return []
        count = 2 if utilisation < FEED_TWO_UNDER else 1
        q = self._queues.get(model)
        out: list[Dispatch] = []
        while q and len(out) < count:
            req = q.popleft()
            prio = 0 if now - req.arrival > self.promote_after_s else 1
            out.append(Dispatch(req, region, prio))
        return out

    def fill(self, model: str, region: str, utilisation: float, capacity_tokens: float,
             now: float) -> list[Dispatch]:
        """Hand an endpoint at ``utilisation`` of ``capacity_tokens`` (its capacity over the
        signalling period) batch tokens until it would reach the 60% feed threshold."""
        self.expire(now)
        room = (FEED_ONE_UNDER - utilisation) * capacity_tokens
        q = self._queues.get(model)
        out: list[Dispatch] = []
        while q and room >= 1:
            req = q[0]
            size = req.prompt_tokens + req.output_tokens
            if size <= room:
                q.popleft()
                part = req
            else:
                share = room / size
                head_prompt = round(req.prompt_tokens * share)
                head_output = round(req.output_tokens * share)
                if head_prompt + head_output == 0:
                    break
                part = replace(req, prompt_tokens=head_prompt, output_tokens=head_output)
                q[0] = replace(req, prompt_tokens=req.prompt_tokens - head_prompt,
                               output_tokens=req.output_tokens - head_output)
            room -= part.prompt_tokens + part.output_tokens
            prio = 0 if now - part.arrival > self.promote_after_s else 1
            out.append(Dispatch(part, region, prio))
        return out
