"""End-to-end deadlines for simulated requests (GoodServe's SLO setting, sec. 4.1).

GoodServe measures "the median request execution time by running each request alone on a
mid-tier GPU", then multiplies that base latency by a relaxation factor (1x to 3x). We
compute a request's alone latency on a profile in closed form from the engine's step-time
model (chunked prefill, then decoding with a batch of one), so no run is needed; the base
is the median over the workload's requests (one deadline for all, as in GoodServe's Fig. 2
setup: short requests then have slack that just-enough routing can exploit).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from skymesh_replica.engine.profiles import Profile

# The mid-tier GPU of our L4 / A100 / H100 fleets.
DEFAULT_DEADLINE_PROFILE = "llama3.1-8b-a100"


def alone_latency(profile: Profile, prompt_len: int, output_len: int) -> float:
    """Seconds from admission to last token for one request on an otherwise idle replica."""
    t = 0.0
    done = 0
    budget = profile.max_num_batched_tokens
    prompt_len = max(1, prompt_len)
    while done < prompt_len:
        n = min(budget, prompt_len - done)
        t += profile.step_time(n, n * (done + n / 2), 0, 0)
        done += n
    # The last prefill step yields the first token; each decode step one more.
    return t + profile.decode_run_time(max(0, output_len - 1), 1, prompt_len + 1)


def median_alone_latency(profile: Profile, lengths: Iterable[tuple[int, int]]) -> float:
    values = [alone_latency(profile, p, o) for p, o in lengths]
    if not values:
        raise ValueError("no requests to take a median latency over")
    return float(statistics.median(values))
