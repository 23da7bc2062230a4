"""One tenant's entry (``tenants.members[]`` in ``skymesh-lb``'s config), kept in the
kernel because the controller's admin API (``/v1/tenants``) takes the same schema and
pushes it to the balancers with membership (docs/tenancy.md).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from skymesh.common.config import StrictModel


class TenantConfig(StrictModel):
    """One tenant (docs/tenancy.md). ``keys_sha256``: its client keys, named by the hex
    SHA-256 of the key (``printf %s KEY | sha256sum``), so no secret is stored here; the
    keys themselves stay in ``auth``. Limits are for the whole region (divided among its
    balancers' workers); null: no limit."""

    name: str = Field(min_length=1, max_length=64)
    keys_sha256: list[str] = Field(default_factory=list)
    default_class: str | None = None  # default: tenants.default_class
    classes: list[str] | None = None  # the classes it may use; default: all
    weight: float = Field(1.0, gt=0)
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)
    max_concurrency: int | None = Field(None, ge=1)
    tokens_per_day: float | None = Field(None, gt=0)

    @field_validator("keys_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        out = []
        for i, h in enumerate(v):
            h = h.strip().lower()
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                # Not echoed: what was given may be a key itself, pasted by mistake.
                raise ValueError(f"entry {i} is not a hex SHA-256 digest (64 hex digits): "
                                 "give the digest of the key, never the key")
            out.append(h)
        return out


__all__ = ["TenantConfig"]
