"""The README and docs/ hold together: every relative link resolves to a file, and the
configuration reference lists every key of both daemons' configs with its real default."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from skymesh.balancer.config import BalancerConfig
from skymesh_controller.config import ControllerConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# [text](target) and ![alt](target), not inside inline code; the target up to a space or ).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def relative_links(text: str) -> Iterator[str]:
    text = CODE.sub("", FENCE.sub("", text))
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        yield target.split("#", 1)[0]


def test_the_link_finder_sees_links_and_skips_code() -> None:
    text = ("[a](docs/a.md) ![img](img/x.png) [web](https://x.org) [anchor](#top) "
            "[b](b.md#part) `[not](code.md)`\n```\n[no](fenced.md)\n```\n")
    assert list(relative_links(text)) == ["docs/a.md", "img/x.png", "b.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(REPO)} links to missing files: {broken}"


def leaf_keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, default) for every leaf; list entries are ``key[].field``."""
    for name, field in model.model_fields.items():
        key, ann = prefix + name, field.annotation
        nested = [a for t in (ann, *typing.get_args(ann)) for a in (t, *typing.get_args(t))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            is_list = typing.get_origin(ann) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(ann))
            yield from leaf_keys(nested[0], key + ("[]." if is_list else "."))
        else:
            yield key, field.get_default(call_default_factory=True)


def shown(default: Any) -> str:
    """A default as the reference writes it (YAML spelling)."""
    if default is PydanticUndefined:
        return "required"
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, Enum):
        return str(default.value)
    if default in ({}, []):
        return "{}" if default == {} else "[]"
    return str(default)


def reference_rows(section: str) -> dict[str, str]:
    text = (REPO / "docs" / "configuration.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


@pytest.mark.parametrize(("section", "model"), [("skymesh-lb", BalancerConfig),
                                                 ("skymesh-controller", ControllerConfig)])
def test_the_configuration_reference_lists_every_key_with_its_default(
        section: str, model: type[BaseModel]) -> None:
    rows = reference_rows(section)
    keys = dict(leaf_keys(model))
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"docs/configuration.md ({section}) has no row for {missing}"
    wrong = {k: (rows[k], shown(d)) for k, d in keys.items() if rows[k] != shown(d)}
    assert not wrong, f"docs/configuration.md ({section}): (written, actual) defaults {wrong}"
    stale = sorted(set(rows) - set(keys))
    assert not stale, f"docs/configuration.md ({section}) lists keys the code lacks: {stale}"


# -- examples/lb.yaml: every key, and valid ------------------------------------------------
COMMENTED_YAML = re.compile(r"^( *)# ( *(?:[a-z_][a-z0-9_]*:.*|- .*))$")


def example_config(text: str) -> Any:
    """The example with its commented-out optional sections (``# mesh:`` ...) switched on:
    a commented line that is YAML (a key, or a list item) is read as if uncommented."""
    import yaml

    lines = [m.group(1) + m.group(2) if (m := COMMENTED_YAML.match(line)) else line
             for line in text.splitlines()]
    return yaml.safe_load("\n".join(lines))


def present_keys(data: Any, prefix: str = "") -> Iterator[str]:
    """Dotted keys of a loaded YAML document, as :func:`leaf_keys` spells them."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + str(k)
            yield from present_keys(v, f"{prefix}{k}.")
    elif isinstance(data, list):
        for item in data:
            yield from present_keys(item, prefix.rstrip(".") + "[].")


def test_the_example_reader_switches_commented_sections_on() -> None:
    text = ("a: 1\n# b:\n#   c: 2   # why\n#   d: [x]\n# A sentence: not YAML here.\n"
            "e:\n  # f: 3\n")
    assert example_config(text) == {"a": 1, "b": {"c": 2, "d": ["x"]}, "e": {"f": 3}}
    assert set(present_keys({"r": [{"u": 1}], "p": {"q": 2}})) == {"r", "r[].u", "p", "p.q"}


def test_the_example_config_has_every_key_and_is_valid() -> None:
    from skymesh.balancer.config import parse_config

    data = example_config((REPO / "examples" / "lb.yaml").read_text())
    parse_config(data)  # with its optional sections on, it still validates
    present = set(present_keys(data))
    missing = sorted(k for k, _ in leaf_keys(BalancerConfig) if k not in present)
    assert not missing, f"examples/lb.yaml lacks {missing}"
