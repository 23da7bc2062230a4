"""The burst benchmark's push modes: each name's balancer config, and what it resolves to.

- ``bp``: blind pushing;
- ``sp-o``: ``pushing.max_outstanding`` 4, the servers' ``max_num_seqs``;
- ``sp-p``: ``engine_queue`` 0, and ``max_num_seqs`` 4 when told (``--sp-p-max-num-seqs``;
  without it the balancer learns it, as in ``sp-p-learned``);
  the queue for the replica holding a request's prefix (``prefer_queue``,
  ``hold_queue_max``) is the balancer's default, by replica kind (vllm here);
- ``sp-p+K``: ``sp-p`` with ``engine_queue`` K (and ``max_num_seqs`` 4);
- ``sp-p-strict``: ``sp-p`` with ``prefer_queue`` 0 and ``hold_queue_max`` null: SkyLB's
  strict rule, whatever the balancer's defaults become;
- ``sp-p-told``: ``sp-p`` told ``max_num_seqs`` 4, the balancer's defaults otherwise
  (``engine_queue`` 1 on a vllm replica), whatever ``--sp-p-max-num-seqs`` says;
- ``sp-p-learned``: ``sp-p`` on the balancer's defaults alone: not told ``max_num_seqs``,
  so it learns it from the probes (``skymesh.balancer.seqcap``).

``effective_pushing`` resolves a mode's file with the balancer's own config code, so a
run records what it ran, not only what its file said.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_cluster import MAX_NUM_SEQS

# "sp-p-strict": SkyLB's sp-p, where a request never goes to the replica holding its
# prefix while sp-p finds it busy (pushing.prefer_queue 0, hold_queue_max null); "sp-p"
# runs the balancer's defaults for them (by replica kind, vllm here).
STRICT = "sp-p-strict"
# The same sp-p on the balancer's defaults, told the servers' max_num_seqs or not: the
# learned cap against the configured one, whatever --sp-p-max-num-seqs says.
TOLD, LEARNED = "sp-p-told", "sp-p-learned"
MODES = ("sp-p", "bp", "sp-o", STRICT, TOLD, LEARNED)
# A mode name "sp-p+K": sp-p with pushing.engine_queue K, so up to K requests per server
# wait inside vLLM, next to the slot they take (K = 1: a vllm replica's default).
HEADROOM_PREFIX = "sp-p+"


def lb_config(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    # vLLM does not publish its --max-num-seqs: sp-o's cap and sp-p's admission limit
    # come from a config file, as a user would write them.
    # sp-p's queue inside the engine is explicit (a vllm replica's default is 1): "sp-p"
    # has none, "sp-p+K" lets K wait (the same rule as telling sp-p max_num_seqs + K,
    # which the committed rounds did). The queue for the replica holding the prefix
    # (prefer_queue, hold_queue_max) is the balancer's default except in "sp-p-strict".
    sp_p = mode in ("sp-p", STRICT, TOLD, LEARNED) or mode.startswith(HEADROOM_PREFIX)
    pushing: dict[str, Any] = {"mode": "sp-p" if sp_p else mode}
    if mode == "sp-o":
        pushing["max_outstanding"] = MAX_NUM_SEQS
    elif mode in ("sp-p", STRICT):
        pushing["engine_queue"] = 0
        if args.sp_p_max_num_seqs:
            pushing["max_num_seqs"] = MAX_NUM_SEQS
        if mode == STRICT:
            pushing["prefer_queue"] = 0
            pushing["hold_queue_max"] = None
    elif mode == TOLD:
        pushing["max_num_seqs"] = MAX_NUM_SEQS
    elif mode.startswith(HEADROOM_PREFIX):
        pushing["max_num_seqs"] = MAX_NUM_SEQS
        pushing["engine_queue"] = int(mode[len(HEADROOM_PREFIX):])
    # The queue timeout is the same in every mode; bp's requests wait inside vLLM, where
    # nothing times them out, so a burst longer than the balancer's default 60 s would
    # fail requests under sp-p and sp-o only.
    return {"pushing": pushing, "queue": {"timeout_s": args.queue_timeout_s}}


def effective_pushing(config: dict[str, Any]) -> dict[str, Any]:
    """The pushing figures a balancer runs with ``config`` (as ``start_lb`` writes it, so
    every replica is of kind vllm), resolved by the balancer's own config code: what a
    mode ran, not only what its file said."""
    from skymesh.balancer.config import parse_config

    cfg = parse_config({**config, "replicas": [{"url": "http://127.0.0.1:9"}]})
    p, replica = cfg.pushing, cfg.replicas[0]
    sp_p = p.mode.value == "sp-p"  # the figures only sp-p reads are None in other modes
    return {"mode": p.mode.value, "max_num_seqs": p.max_num_seqs if sp_p else None,
            # Not told, sp-p learns it from the probes (skymesh.balancer.seqcap).
            "max_num_seqs_source": ("told" if p.max_num_seqs else "learned") if sp_p else None,
            "engine_queue": replica.engine_queue(p) if sp_p else None,
            "prefer_queue": replica.prefer_queue(p) if sp_p else None,
            "hold_queue_max": p.hold_queue_max, "hold_s": p.hold_s,
            "max_outstanding": p.max_outstanding if p.mode.value == "sp-o" else None}


def parse_modes(raw: str) -> list[str]:
    modes = [m.strip() for m in raw.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES and not (
        m.startswith(HEADROOM_PREFIX) and m[len(HEADROOM_PREFIX):].isdigit())]
    if bad or len(set(modes)) != len(modes):
        raise ValueError(f"bad or repeated push mode(s): {', '.join(bad) or raw}")
    return modes


def paired_modes(modes: list[str]) -> list[tuple[str, str]]:
    """The (mode, reference) pairs whose per-round ratios a run reports: every mode to
    ``bp``, every sp-p on the balancer's defaults to ``sp-p-strict``, and the learned cap
    to the told one."""
    modes = sorted(modes)
    pairs = [(m, "bp") for m in modes if m != "bp" and "bp" in modes]
    pairs += [(m, STRICT) for m in modes if STRICT in modes
              and (m == "sp-p" or m.startswith(HEADROOM_PREFIX))]
    if TOLD in modes and LEARNED in modes:
        pairs.append((LEARNED, TOLD))
    return pairs
