"""The policy registry: every built-in policy, by its stable name.

Importing this module imports the built-in policy modules, whose classes add themselves
to :data:`~skymesh.policies.base.POLICY_CLASSES` as they are declared; nothing else keeps
a list of them. Unknown names and bad parameters fail here, naming the culprit, so config
and code cannot drift.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping
from typing import Any

# Imported for their registration (each module declares its classes with ``name=``).
from skymesh.policies import (  # noqa: F401
    basic,
    consistent_hash,
    goodserve,
    lmetric,
    power_of_two,
    prefix_tree,
    preserve,
    sglang_cache_aware,
    vllm_load,
)
from skymesh.policies.base import POLICY_CLASSES, Policy, PolicyConfigError


def policy_names() -> list[str]:
    return sorted(POLICY_CLASSES)


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICY_CLASSES[name]
    except KeyError:
        raise PolicyConfigError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICY_CLASSES))}"
        ) from None


def build_policy(
    name: str, params: Mapping[str, Any] | None = None, *, rng: random.Random | None = None
) -> Policy:
    """Construct a registered policy, validating its parameters against its signature."""
    cls = policy_class(name)
    params = dict(params or {})
    sig = inspect.signature(cls.__init__)
    accepted = {
        p.name
        for p in sig.parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "rng"
    }
    for key in params:
        if key not in accepted:
            allowed = ", ".join(sorted(accepted)) or "none"
            raise PolicyConfigError(
                f"policy {name!r} has no parameter {key!r} (parameters: {allowed})"
            )
    try:
        return cls(rng=rng, **params)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"policy {name!r}: {exc}") from exc
