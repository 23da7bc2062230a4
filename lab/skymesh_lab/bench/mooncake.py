"""The Mooncake conversation trace across three regions: ``skymesh bench mooncake``.

The Mooncake FAST'25 conversation trace (open loop, real prefix ids, ``mooncake-
conversation``) replayed at its own pace, each request sent to the region its prefix chain
hashes to (so a conversation stays in one region), through the same nine systems as
``skylb-macro`` (see :mod:`skymesh_lab.bench.skylb_macro`: single US balancer baselines,
region-local, the mesh with CH / prefix tree / LMETRIC, the oracle) and measured the same
way (metrics over the window after a 10% warm-up).

Fleet: 9 Llama-3.1-8B replicas on A100-80GB, 3 per region. Not L4: the trace's prompts
average 12k tokens and a quarter exceed the L4 profile's 16k context (they would be
refused), and 12 L4s fall ever further behind its 3.4 req/s; 9 A100s keep up with it
with queueing at its peaks, where routing matters.

    skymesh bench mooncake --mode sim --json out/mooncake.json --plots out/plots
"""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.skylb_macro import (
    SYSTEMS,
    Options,
    WorkloadSpec,
    options_from_args,
    run,
)

MODES = ("sim",)
DEFAULT_DURATION_S = 900.0
SPECS: dict[str, WorkloadSpec] = {
    "mooncake": WorkloadSpec(
        "mooncake", "mooncake-conversation", {"us": 3, "eu": 3, "asia": 3}, {}, "",
        "Mooncake FAST'25 conversation trace, split by prefix chain over us/eu/asia",
        profile="llama3.1-8b-a100"),
}


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench mooncake`` entry point."""
    opts: Options = options_from_args(args)
    opts.workloads = tuple(SPECS)
    opts.systems = tuple(SYSTEMS)
    if getattr(args, "duration", None) is None:
        opts.duration_s = 120.0 if opts.extra.get("quick") else DEFAULT_DURATION_S
    return run(opts, SPECS)
