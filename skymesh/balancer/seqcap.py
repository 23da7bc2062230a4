"""An engine's concurrency cap, learned from its probes when nobody says it.

Selective pushing (``sp-p``) keeps a replica's requests under its admission limit
(vLLM's ``--max-num-seqs``) so that the queue forms at the balancer, where order can be
chosen, not inside the engine. vLLM does not publish that limit, but its probes show it:
``running`` stops rising while ``waiting`` > 0. :class:`CapLearner` reads that from the
(running, waiting) of successive probes:

- **learned**: waiting appeared at the same running count on ``confirmations`` (3)
  probes in a row; that count is the cap. A later, different count confirmed the same way
  replaces it (an engine restarted with a smaller limit, or one that ran out of KV cache:
  either way what it admits now), and a probe that shows more running than the cap
  drops it for a new round of learning (restarted with a larger limit).
- **until learned** sp-p is conservative: it never pushes past what it has seen the
  engine run (at least 1), plus one: the engine queue sp-p allows anyway
  (``engine_queue``, 1 on vLLM), or, with none (``engine_queue: 0``), one more in the
  limit itself, or the engine would never show more than it runs and sp-p would stay at
  one request per replica. Each probe that shows more running raises that, one step per
  probe. "Seen running" is the larger of the engine's gauge and the balancer's own
  requests there that have started (a first byte) and not ended (the prober passes it):
  an engine whose gauges lag or read 0 (seen on a loaded vLLM-CPU server,
  docs/results/vllm_burst_learned.md) still shows its concurrency by what it answers.

A cap the configuration gives (``max_num_seqs``), or one the engine publishes (the
emulated replica's ``skymesh_engine_max_num_seqs``, SGLang's ``max_running_requests``),
always wins: the balancer learns only what it is not told. Pure: the probe loop feeds it
(``skymesh.balancer.probing``); ``/status`` shows the cap and where it came from
(``max_num_seqs_source``: ``told``, ``learned`` or ``unknown`` while learning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Source = Literal["told", "learned", "unknown"]
DEFAULT_CONFIRMATIONS = 3


@dataclass(slots=True)
class CapLearner:
    confirmations: int = DEFAULT_CONFIRMATIONS
    learned: int | None = None
    seen_max: int = 0  # the most requests seen running since the last (re)start of learning
    candidate: int | None = None  # running at which waiting appeared, not yet confirmed
    streak: int = 0  # probes in a row that showed ``candidate``

    def observe(self, running: int, waiting: int) -> None:
        """One probe's running and waiting counts."""
        if self.learned is not None and running > self.learned:
            # More run than the cap allows: it is larger now. Learn it again from here.
            self.learned = None
            self.seen_max = running
            self.candidate, self.streak = None, 0
            return
        if running > self.seen_max:
            self.seen_max = running
        if waiting > 0 and running > 0:
            if running == self.candidate:
                self.streak += 1
            else:
                self.candidate, self.streak = running, 1
            if self.streak >= self.confirmations:
                self.learned = running
        else:
            self.candidate, self.streak = None, 0

    @property
    def cap(self) -> int:
        """The admission limit sp-p applies: the learned one, else what has been seen."""
        return self.learned if self.learned is not None else max(1, self.seen_max)

    @property
    def source(self) -> Source:
        return "learned" if self.learned is not None else "unknown"


def admission_limit(told: int | None, learner: CapLearner, running: int, waiting: int,
                    engine_queue: int) -> tuple[int, Source]:
    """The limit sp-p applies to a replica after a probe, and where it came from: the one
    it was told (configured, or published by the engine), else the learner's, fed with
    this probe. sp-p fills a replica to this limit plus ``engine_queue``; while learning
    that must pass what the engine has been seen to run (see the header)."""
    if told:
        return told, "told"
    learner.observe(running, waiting)
    if learner.learned is None and engine_queue < 1:
        return learner.cap + 1, learner.source
    return learner.cap, learner.source


__all__ = ["CapLearner", "Source", "admission_limit"]
