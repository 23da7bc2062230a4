"""What both planes' configuration shares: a strict pydantic base, YAML loading with
``${NAME}`` expansion, error messages that name the offending key's dotted path, the
connection-limit section, and the start of a daemon CLI's config.

``skymesh-lb`` (skymesh.balancer.config) and ``skymesh-controller`` build their config
models on these, so both fail the same way on a bad file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skymesh.net.limits import DEFAULT_LIMITS as _CONN
from skymesh.net.limits import ConnLimits


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


M = TypeVar("M", bound=BaseModel)


class ConnectionLimitsConfig(StrictModel):
    """Connection limits (skymesh.net.limits): caps on open connections per process and
    per client address, and the header, body and idle timeouts. The controller's
    ``limits`` section too."""

    max_connections: int = Field(_CONN.max_connections, ge=1)
    max_connections_per_client: int = Field(_CONN.max_connections_per_client, ge=1)
    header_timeout_s: float = Field(_CONN.header_timeout_s, gt=0)
    body_timeout_s: float = Field(_CONN.body_timeout_s, gt=0)
    idle_timeout_s: float = Field(_CONN.idle_timeout_s, gt=0)
    # The top of max_connections kept from addresses that already hold many, and the
    # share of what is free there one address may take (skymesh.net.limits.admission).
    reserved_fraction: float = Field(_CONN.reserved_fraction, ge=0, lt=1)
    reserve_share: float = Field(_CONN.reserve_share, gt=0, le=1)

    def connections(self) -> ConnLimits:
        return ConnLimits(self.max_connections, self.max_connections_per_client,
                          self.header_timeout_s, self.body_timeout_s, self.idle_timeout_s,
                          self.reserved_fraction, self.reserve_share)


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_model(model: type[M], data: Any) -> M:
    """Validate a mapping into ``model``; errors name every offending key's dotted path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the configuration must be a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None


_ENV_REF = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(data: Any, environ: Mapping[str, str], where: str = "") -> Any:
    """``${NAME}`` in every string value replaced by the environment variable NAME, and
    ``$${NAME}`` by a literal ``${NAME}``: what differs between the pods or hosts that
    share one file (``mesh.id: us-east-${POD_NAME}``, the pod name from Kubernetes'
    downward API). An unset variable is an error naming the key."""
    if isinstance(data, dict):
        return {k: expand_env(v, environ, f"{where}.{k}" if where else str(k))
                for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, environ, f"{where}.{i}") for i, v in enumerate(data)]
    if not isinstance(data, str):
        return data

    def value(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(0)[1:]
        if m.group(2) not in environ:
            raise ConfigError(f"{where or '(top level)'}: ${{{m.group(2)}}} is not set in "
                              "the environment")
        return environ[m.group(2)]

    return _ENV_REF.sub(value, data)


def load_yaml(path: str | Path, environ: Mapping[str, str] | None = None) -> Any:
    """A config file's YAML with ``${NAME}`` references expanded (:func:`expand_env`) from
    ``environ``, by default the process environment as it is now."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return expand_env(data, os.environ if environ is None else environ)


def cli_base(config: BaseModel | None, port: int | None, host: str | None) -> dict[str, Any]:
    """A daemon's config as a mapping (from its file, or empty) with the quick-start
    ``--port``/``--host`` flags applied: the common start of both daemons' CLIs."""
    base: dict[str, Any] = config.model_dump(mode="json") if config is not None else {}
    if port is not None:
        base.setdefault("listen", {})["port"] = port
    if host is not None:
        base.setdefault("listen", {})["host"] = host
    return base
