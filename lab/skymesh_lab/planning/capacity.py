"""Per-instance serving capacity (PreServe's mu_p, mu_d, mu_t) and the instance count N.

PreServe (sec. 4.1, Alg. 1) profiles the most prefill, decode and total tokens per second
one instance served without violating its SLO, then sizes a service as

    N = max(P / mu_p, D / mu_d, (P + D) / mu_t)

for forecast prompt (P) and output (D) token rates. We have no GPU, so the profile is
measured on the emulated engine itself (the same code that runs inside the simulator and
``skymesh-replica``): a closed loop keeps more requests outstanding than the engine can
admit, so every step is as full as the KV cache, ``max_num_seqs`` and the token budget
allow, and we count tokens over a window after warm-up. Three streams, one per rate:

- mu_p: prompts of the representative length, one output token each (prefill bound);
- mu_d: short prompts, representative outputs (decode bound; counts output tokens only);
- mu_t: the representative mix, prompt plus output tokens.

The default mix is the Azure LLM 2023 conversation trace's mean (1,155 prompt and 211
output tokens per request: shared/data/azure_llm_2023); callers pass their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from skymesh_replica.engine.core import Engine, Sequence
from skymesh_replica.engine.profiles import Profile, get_profile

DEFAULT_PROMPT_LEN = 1155
DEFAULT_OUTPUT_LEN = 211
# A prompt short enough that decoding dominates the mu_d stream, one KV block long.
_DECODE_PROBE_PROMPT = 16


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one instance of ``profile`` sustains, in tokens per second."""

    profile: str
    model: str
    gpu: str
    num_gpus: int
    mu_p: float
    mu_d: float
    mu_t: float
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if min(self.mu_p, self.mu_d, self.mu_t) <= 0:
            raise ValueError(f"capacities must be positive, got {self}")


@dataclass(frozen=True, slots=True)
class Throughput:
    prompt_tps: float
    output_tps: float
    concurrency: float  # mean running sequences over the window

    @property
    def total_tps(self) -> float:
        return self.prompt_tps + self.output_tps


def saturated_throughput(profile: Profile, prompt_len: int, output_len: int,
                         rounds: int = 4) -> Throughput:
    """Run the engine saturated with identical requests; tokens/s after one warm-up round.

    ``rounds`` full turnovers of the running set are measured, so each sequence's prefill
    and decode both fall inside the window about ``rounds`` times.
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError("prompt_len and output_len must be at least 1")
    if prompt_len + output_len > profile.kv_capacity_tokens:
        raise ValueError(f"a {prompt_len}+{output_len}-token request does not fit "
                         f"{profile.name}'s KV cache ({profile.kv_capacity_tokens} tokens)")
    per_seq_blocks = -(-(prompt_len + output_len) // profile.block_size)
    slots = max(1, min(profile.max_num_seqs, profile.num_kv_blocks // per_seq_blocks))
    outstanding = slots + max(4, slots // 4)  # always someone waiting to be admitted
    engine = Engine(profile, enable_prefix_caching=False)
    issued = 0

    def issue() -> None:
        nonlocal issued
        engine.add(Sequence(f"p{issued}", prompt_len, output_len))
        issued += 1

    for _ in range(outstanding):
        issue()
    warm = slots
    total = warm + rounds * slots
    done = 0
    t = 0.0
    t0 = -1.0
    prompt_tok = output_tok = 0
    running_time = 0.0
    while done < total:
        batch = engine.schedule(max_steps=1_000_000)
        if batch is None:  # cannot happen while requests are outstanding
            raise RuntimeError(f"{profile.name}: engine idle with work outstanding")
        t += batch.duration
        measuring = t0 >= 0
        if measuring:
            prompt_tok += batch.prefill_tokens
            running_time += batch.duration * len(batch.entries)
        for ev in engine.complete(batch):
            if measuring:
                output_tok += ev.new_tokens
            if ev.finished:
                done += 1
                if done == warm:
                    t0 = t
                issue()
    span = t - t0
    # Prefill tokens count when computed; a decode step also computes one token per
    # sequence, which the engine books as prefill of nothing, so prompt tokens are the
    # batch prefill totals and output tokens the streamed ones.
    return Throughput(prompt_tok / span, output_tok / span, running_time / span)


@lru_cache(maxsize=64)
def profile_capacity(profile_name: str, prompt_len: int = DEFAULT_PROMPT_LEN,
                     output_len: int = DEFAULT_OUTPUT_LEN) -> Capacity:
    """mu_p, mu_d, mu_t of one instance of ``profile_name`` for the given request mix."""
    profile = get_profile(profile_name)
    prefill = saturated_throughput(profile, prompt_len, 1)
    decode = saturated_throughput(profile, _DECODE_PROBE_PROMPT, output_len)
    mixed = saturated_throughput(profile, prompt_len, output_len)
    return Capacity(
        profile=profile.name, model=profile.model, gpu=profile.gpu, num_gpus=profile.num_gpus,
        mu_p=prefill.prompt_tps, mu_d=decode.output_tps, mu_t=mixed.total_tps,
        prompt_len=prompt_len, output_len=output_len,
    )


def instances_needed(prompt_tps: float, output_tps: float, caps: Capacity,
                     utilisation: float = 1.0) -> int:
    """PreServe's N, rounded up: instances so neither phase nor the mix exceeds capacity.

    ``utilisation`` < 1 sizes for a target load per instance (headroom for bursts).
    """
    if prompt_tps < 0 or output_tps < 0:
        raise ValueError("token rates must be non-negative")
    if not 0 < utilisation <= 1:
        raise ValueError("utilisation must be in (0, 1]")
    need = max(prompt_tps / caps.mu_p, output_tps / caps.mu_d,
               (prompt_tps + output_tps) / caps.mu_t) / utilisation
    # Float noise must not add an instance: 3.0000000001 instances is 3.
    return max(0, math.ceil(need - 1e-9))
