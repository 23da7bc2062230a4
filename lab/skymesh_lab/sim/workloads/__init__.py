"""The simulator's workloads, by name.

======================== ======================================================= ========
name                     what                                                    loop
======================== ======================================================= ========
mooncake-conversation    Mooncake FAST'25 conversation trace, real prefix ids    open
mooncake-synthetic       Mooncake FAST'25 synthetic trace, real prefix ids       open
azure2023-code           Azure LLM 2023 (Splitwise) code trace, unique prompts   open
azure2023-conv           Azure LLM 2023 (Splitwise) conversation trace           open
sharegpt-chat            SkyLB multi-turn ShareGPT chat clients                  closed
tot-gsm8k                SkyLB tree of thoughts over GSM8K questions             closed
tot-skylb                SkyLB's own ToT client: virtual root, identical siblings closed
mixed-tree-skylb         tot-skylb, first region 4-branch x 2, others 2-branch   closed
poisson                  Poisson arrivals, ShareGPT or fixed lengths             open
======================== ======================================================= ========

Each module's docstring lists its parameters and defaults. Build one with
:func:`build_workload`; the data comes from :func:`skymesh_lab.sim.workloads.data.data_dir`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

from skymesh_lab.sim.workload import Workload
from skymesh_lab.sim.workloads.azure import AzureWorkload
from skymesh_lab.sim.workloads.data import data_dir
from skymesh_lab.sim.workloads.mooncake import MooncakeWorkload
from skymesh_lab.sim.workloads.poisson import PoissonWorkload
from skymesh_lab.sim.workloads.sharegpt import ShareGPTChatWorkload
from skymesh_lab.sim.workloads.tot import TreeOfThoughtsWorkload
from skymesh_lab.sim.workloads.tot_skylb import MixedTreeSkyLBWorkload, SkyLBTreeWorkload

_FACTORIES: dict[str, Callable[..., Workload]] = {
    "mooncake-conversation": partial(MooncakeWorkload, "conversation"),
    "mooncake-synthetic": partial(MooncakeWorkload, "synthetic"),
    "azure2023-code": partial(AzureWorkload, "code"),
    "azure2023-conv": partial(AzureWorkload, "conv"),
    "sharegpt-chat": ShareGPTChatWorkload,
    "tot-gsm8k": TreeOfThoughtsWorkload,
    "tot-skylb": SkyLBTreeWorkload,
    "mixed-tree-skylb": MixedTreeSkyLBWorkload,
    "poisson": PoissonWorkload,
}

WORKLOAD_NAMES: tuple[str, ...] = tuple(_FACTORIES)

_COMMON = ("regions", "seed", "duration_s")


def workload_params(name: str) -> dict[str, object]:
    """The extra parameters ``name`` accepts, with their defaults."""
    factory = _factory(name)
    return {
        p.name: p.default
        for p in inspect.signature(factory).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _COMMON
    }


def build_workload(
    name: str,
    *,
    regions: list[str],
    seed: int,
    duration_s: float | None,
    **params: object,
) -> Workload:
    """Build the workload called ``name`` (see the table above) with its ``params``."""
    factory = _factory(name)
    unknown = sorted(set(params) - set(workload_params(name)))
    if unknown:
        raise ValueError(
            f"workload {name!r} has no parameter(s) {unknown}; "
            f"it takes {sorted(workload_params(name))}"
        )
    return factory(regions=regions, seed=seed, duration_s=duration_s, **params)


def _factory(name: str) -> Callable[..., Workload]:
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; valid names: {', '.join(WORKLOAD_NAMES)}"
        ) from None


__all__ = [
    "WORKLOAD_NAMES",
    "AzureWorkload",
    "MixedTreeSkyLBWorkload",
    "MooncakeWorkload",
    "PoissonWorkload",
    "ShareGPTChatWorkload",
    "SkyLBTreeWorkload",
    "TreeOfThoughtsWorkload",
    "build_workload",
    "data_dir",
    "workload_params",
]
