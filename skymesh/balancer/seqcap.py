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
- **an engine that shows no queue took what it was sent.** A non-streamed reply's first
  byte and its end come together, so against an engine whose gauges read 0 (the
  router-overhead stubs; any engine without them) or lag, ``started`` stays near 0 and
  the rule above held every replica at a request or two while a queue stood at the
  balancer for good, although the engine never queued anything (issue #35: the default
  path cost 1.7x round-robin's CPU per request on the stubs). So a probe counts what the
  engine took: when it shows nothing running (neither its gauge nor a stream of ours
  that had started as the probe left or has when it answers: an engine that shows what
  it runs is measured by that, for what it took may include requests it queued briefly)
  and no waiting, sp-p's limit binds (requests wait at the balancer while sp-p holds
  this replica back), no request of ours pushed there before the probe is still
  unstarted (one could sit in the engine's queue, whatever its lagging gauges say) and
  the probe answered within a probe interval (a later one is too old to tell what
  happened meanwhile), the engine took all sp-p let it have: "seen running" rises to
  ``RAMP`` (2) times the most of ours in flight there at once since the last probe
  (``ReplicaLoad.peak_in_flight``; times the balancers pushing there, each kept to its
  share). The limit thus doubles per probe while the engine takes everything: live on
  the stubs (32 connections each) it passed 30 within the bench's 1 s warm-up, where one
  step per probe had reached 18-20 after 5 s and cost 1.18x the CPU per request
  (dispatch_cost_live, same run). Once a probe finds a request unstarted or a queue
  after such a rise (``doubted``), it rises one step per probe, so an engine with a cap
  and no gauges is filled past it by one doubling at most. A waiting count its gauges
  show confirms the cap as before (vLLM-CPU, whose gauges lag:
  docs/results/vllm_burst_learned.md). While that evidence holds (``takes_all``), sp-p
  also lets requests it cannot see start yet (non-streamed replies) fill a replica that
  publishes no KV capacity up to the limit (``skymesh.policies.load``), where it would
  otherwise push one at a time.

A cap the configuration gives (``max_num_seqs``), or one the engine publishes (the
emulated replica's ``skymesh_engine_max_num_seqs``, SGLang's ``max_running_requests``),
always wins: the balancer learns only what it is not told. Pure: the probe loop feeds it
(``skymesh.balancer.probing``); ``/status`` shows the cap and where it came from
(``max_num_seqs_source``: ``told``, ``learned`` or ``unknown`` while learning), the
gauge ``skymesh_replica_admission_limit`` the limit sp-p applies, and an INFO line
(:func:`cap_news`) each learned cap confirmed or dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Source = Literal["told", "learned", "unknown"]
DEFAULT_CONFIRMATIONS = 3
# While learning, "seen running" after a probe showing that the engine took all sp-p let
# it have: this many times that (the header; chosen on the stubs and on vLLM-CPU).
RAMP = 2.0


@dataclass(slots=True)
class CapLearner:
    confirmations: int = DEFAULT_CONFIRMATIONS
    ramp: float = RAMP  # "seen running" after a probe that shows the engine took it all
    learned: int | None = None
    seen_max: int = 0  # the most requests seen running since the last (re)start of learning
    candidate: int | None = None  # running at which waiting appeared, not yet confirmed
    streak: int = 0  # probes in a row that showed ``candidate``
    took_all: bool = False  # a probe since the (re)start of learning showed it took it all
    # ... and the last probe did not contradict it: no waiting, nothing of ours unstarted.
    takes_all: bool = False
    doubted: bool = False  # ... and a later one did: the limit rises a step at a time

    def observe(self, running: int, waiting: int, took: int = 0,
                unstarted: bool = False) -> None:
        """One probe's running and waiting counts; ``took``: how many of ours the engine
        took at once since the last probe with none left unstarted (0: not known);
        ``unstarted``: one of ours pushed before this probe has not started."""
        self._observe(running, waiting, took)
        self.takes_all = (self.took_all and self.learned is None and waiting == 0
                          and not unstarted)
        if self.took_all and not self.takes_all:
            self.doubted = True

    def _observe(self, running: int, waiting: int, took: int) -> None:
        if self.learned is not None and running > self.learned:
            # More run than the cap allows: it is larger now. Learn it again from here.
            self.learned = None
            self.seen_max = running
            self.candidate, self.streak = None, 0
            self.took_all = self.doubted = False
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
            # Only while nothing shows running: an engine that shows it runs ours (its
            # gauge, or streams that have started) is measured by that, not by what it
            # took, which may include requests it queued briefly.
            if waiting == 0 and running == 0 and took > 0 and self.learned is None:
                self.seen_max = max(self.seen_max,
                                    took if self.doubted else math.ceil(took * self.ramp))
                self.took_all = True

    @property
    def cap(self) -> int:
        """The admission limit sp-p applies: the learned one, else what has been seen."""
        return self.learned if self.learned is not None else max(1, self.seen_max)

    @property
    def source(self) -> Source:
        return "learned" if self.learned is not None else "unknown"

    def limit(self, engine_queue: int) -> int:
        """The ``max_num_seqs`` sp-p applies (see the header: one more while learning with
        no engine queue)."""
        return self.cap + 1 if self.learned is None and engine_queue < 1 else self.cap


def admission_limit(told: int | None, learner: CapLearner, running: int, waiting: int,
                    engine_queue: int, in_flight: int = 0, held: bool = False,
                    unstarted: bool = False, balancers: int = 1, late: bool = False
                    ) -> tuple[int, Source]:
    """The limit sp-p applies to a replica after a probe, and where it came from: the one
    it was told (configured, or published by the engine), else the learner's, fed with
    this probe. sp-p fills a replica to this limit plus ``engine_queue``; while learning
    that must pass what the engine has been seen to run (see the header).
    ``in_flight``: the most of ours in flight there at once since the last probe;
    ``held``: requests wait at the balancer while sp-p holds this replica back (its
    limit binds: a probe at the tail of a burst, with no queue left, is no evidence);
    ``unstarted``: one of ours pushed there before this probe has not started.
    Together they say whether the engine took all sp-p let it have (the header).
    ``balancers``: how many push to the replica (sp-p's n x margin keeps each to its
    share); the engine is taken to have taken as much from each of them. ``late``: the
    probe answered over a probe interval after it left, too late to tell what the engine
    did with what was pushed meanwhile."""
    if told:
        return told, "told"
    took = in_flight * balancers if held and not unstarted and not late else 0
    learner.observe(running, waiting, took, unstarted)
    return learner.limit(engine_queue), learner.source


def cap_news(before: int | None, learner: CapLearner) -> str | None:
    """The log line for what one probe did to the learned cap (``before``: the learned
    cap before it), None when nothing changed: a line per change, not per probe."""
    after = learner.learned
    if after == before:
        return None
    if after is None:
        return (f"learned admission limit {before} dropped: the engine ran more; "
                "learning it again")
    return (f"admission limit learned: {after} (the engine ran {after} with requests "
            f"waiting on {learner.confirmations} probes in a row)")


__all__ = ["RAMP", "CapLearner", "Source", "admission_limit", "cap_news"]
