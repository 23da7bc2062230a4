"""The README and docs/ hold together: every relative link resolves to a file (and to a
heading, when it names one), code that cites a doc section cites one that exists, and the
configuration reference lists every key of both daemons' configs with its real default."""

from __future__ import annotations

import functools
import importlib.util
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


# -- anchors: links into a page, and code that cites a doc's section --------------------
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation dropped
    (letters, digits, ``_`` and ``-`` stay), each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives ``doc``: one per heading (a repeated one gets ``-1``,
    ``-2`` ...) and any ``<a name|id="...">``."""
    text = FENCE.sub("", doc.read_text())
    out: set[str] = set()
    for heading in HEADING.findall(text):
        base = s = slug(heading)
        n = 0
        while s in out:
            n += 1
            s = f"{base}-{n}"
        out.add(s)
    return out | set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))


def test_anchors_follow_githubs_rules() -> None:
    assert slug("The real-engine lane: `make e2e`") == "the-real-engine-lane-make-e2e"
    assert slug("What it costs, and [why](x.md) (sec. 5.1)") == "what-it-costs-and-why-sec-51"
    assert slug("`skymesh-replica`") == "skymesh-replica"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_into_a_page_names_one_of_its_headings(doc: Path) -> None:
    text = CODE.sub("", FENCE.sub("", doc.read_text()))
    wrong = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        page = (doc.parent / path) if path else doc
        if page.suffix == ".md" and page.exists() and anchor not in anchors(page):
            wrong.append(target)
    assert not wrong, f"{doc.relative_to(REPO)} links to headings that do not exist: {wrong}"


# Code and comments that cite the docs: skymesh/, controller/, replica/, lab/, and the
# Makefile, deploy/ and tools/ around them; the sources, not build output (a wheel's
# build/ copy, generated stubs, caches).
_NOT_SOURCE = {"gen", "__pycache__", "build", "dist"}
CITING = [p for top in ("skymesh", "controller", "replica", "lab", "deploy", "tools")
          for p in sorted((REPO / top).rglob("*"))
          if p.is_file() and not _NOT_SOURCE & set(p.relative_to(REPO).parts)
          and not any(part.endswith(".egg-info") for part in p.parts)
          and (p.suffix in {".py", ".sh", ".yml", ".yaml", ".tf", ".toml"}
               or p.name == "Dockerfile")] + [REPO / "Makefile"]
# A page (docs/x.md, ../x.md, README.md), then maybe #anchor or `, "Section"`.
QUOTED = r"(?:\"([^\"\n]+)\"|“([^”\n]+)”|'([^'\n]+)')"
CITED_PAGE = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w./-]*\w\.md)"
                        rf"(?:#([\w-]+)|,? +(?:section +)?{QUOTED})?")
# The README without .md: `README, "Section"`, `(README, Section)`, `README section X`,
# `the README's X table`.
CITED_README = re.compile(rf"\bREADME(?:,| section)\s+(?:{QUOTED}|([A-Z][^()\"\n]*?)\))"
                          r"|\bREADME's\s+([\w-]+)\s+(?:table|section|figures)")


def cited_page(path: str, by: Path) -> Path | None:
    """The doc a citation in ``by`` means: repository-relative (docs/x.md), or relative
    to docs/ or docs/results/ (the results pages' generated links), or to ``by``."""
    for base in (REPO, REPO / "docs", REPO / "docs" / "results", by.parent):
        if (base / path).is_file():
            return (base / path).resolve()
    return None


def citations(text: str, by: Path) -> Iterator[str]:
    """What in ``text`` cites a doc that, or a section that, does not exist (comments'
    line breaks and ``#`` joined first, so a citation may wrap)."""
    text = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)
    for m in CITED_PAGE.finditer(text):
        path, anchor, *quoted = m.groups()
        section = next((q for q in quoted if q), None)
        if path.startswith("shared/") or not ("/" in path or path == "README.md" or anchor
                                              or section):
            # ../shared/ is the workspace outside the repository (data, engine notes); a
            # bare NAME.md is a file a program writes, not a citation.
            continue
        page, heading = cited_page(path, by), anchor or section
        if page is None or (heading and slug(heading) not in anchors(page)):
            yield m.group(0)
    readme = REPO / "README.md"
    for m in CITED_README.finditer(text):
        *quoted, bare, word = m.groups()
        section = next((q for q in quoted if q), bare)
        if word:
            if not any(word.lower() in h.lower() for h in HEADING.findall(readme.read_text())):
                yield m.group(0)
        elif slug(section) not in anchors(readme):
            yield m.group(0)


def test_the_citation_finder_reads_pages_anchors_sections_and_the_readme() -> None:
    by = REPO / "skymesh" / "x.py"
    good = ('# see docs/development.md#the-four-distributions and (docs/lab.md,\n'
            '# "The simulator"), README.md, (docs/notes/lab-diary.md, "Results: SkyLB\'s '
            'evaluation, reproduced"), [a](../mesh.md#forecast-aware-overflow) and '
            '(README, "Install") and (README, A first balancer).')
    assert list(citations(good, by)) == []
    assert list(citations("writes NAME.md and table.md; shared/data/MANIFEST.md", by)) == []
    bad = ('docs/nothere.md; docs/lab.md#no-such; (docs/lab.md, "No such"); '
           '(README, Results); README, "Overhead, measured"; the README\'s calibration table')
    assert len(list(citations(bad, by))) == 6


@pytest.mark.parametrize("path", CITING, ids=lambda p: str(p.relative_to(REPO)))
def test_every_doc_section_the_code_cites_exists(path: Path) -> None:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return
    stale = list(citations(text, path))
    assert not stale, f"{path.relative_to(REPO)} cites what the docs lack: {stale}"


# -- the container images: what the docs say against the Dockerfile and its role list ----
DOCKER = REPO / "deploy" / "docker"
IMAGE_DOCS = [REPO / "README.md", REPO / "deploy" / "README.md",
              *sorted(p for p in (REPO / "docs").rglob("*.md") if "notes" not in p.parts)]
OUR_IMAGE = re.compile(r"(?<![\w/-])skymesh(?:-[a-z]+)?:\d[\w.]*")
# Public base images a doc might still name from before the local Debian base.
OTHER_BASE = re.compile(r"(?<![\w/-])(?:python|debian|ubuntu|alpine|busybox)(?:/[\w.-]+)?:[\w.-]+")
DISTRIBUTION = {"skymesh": "skymesh", "controller": "skymesh-controller",
                "replica": "skymesh-replica"}  # folder under the deps dir -> its name


def image_roles() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """deploy/docker/requirements.py's ROLES: role -> (folder, extras) it installs."""
    spec = importlib.util.spec_from_file_location("image_requirements",
                                                  DOCKER / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROLES  # type: ignore[no-any-return]


def base_image() -> str:
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert m, "deploy/docker/Dockerfile has no ARG BASE_IMAGE= default"
    return m.group(1)


def test_the_docs_name_the_dockerfiles_base_and_no_other() -> None:
    base = base_image()
    for doc in (REPO / "docs" / "image.md", REPO / "deploy" / "README.md"):
        assert f"`{base}`" in doc.read_text(), f"{doc.relative_to(REPO)} does not name {base}"
    others = {str(d.relative_to(REPO)): found for d in IMAGE_DOCS
              if (found := OTHER_BASE.findall(d.read_text()))}
    assert not others, f"the Dockerfile builds on {base}; the docs name {others}"


def test_the_docs_name_one_image_per_role_as_make_image_tags_it() -> None:
    version = re.search(r'^version = "(.*)"$', (REPO / "pyproject.toml").read_text(),
                        re.M).group(1)  # type: ignore[union-attr]
    tags = {f"skymesh-{role}:{version}" for role in image_roles()}
    wrong = {str(d.relative_to(REPO)): found for d in IMAGE_DOCS
             if (found := sorted(set(OUR_IMAGE.findall(d.read_text())) - tags))}
    assert not wrong, f"`make image` tags {sorted(tags)}; the docs name {wrong}"


def test_the_image_docs_list_the_roles_and_what_each_installs() -> None:
    roles = image_roles()
    text = (REPO / "docs" / "image.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)`.*$", text, re.M)}
    assert set(rows) == set(roles), f"docs/image.md's role table: {sorted(rows)}, " \
                                    f"requirements.py's ROLES: {sorted(roles)}"
    # A role's row names what it adds to the balancer's ("+ ..."), the balancer's its own.
    for role, dists in roles.items():
        added = dists if role == "balancer" else [d for d in dists
                                                  if d not in roles["balancer"]]
        for folder, extras in added:
            for word in (DISTRIBUTION[folder], *extras):
                assert word in rows[role], f"docs/image.md, role {role}: no {word}"
    row = next(line for line in (REPO / "deploy" / "README.md").read_text().splitlines()
               if line.startswith("| `docker/Dockerfile`"))
    missing = [role for role in roles if role not in row]
    assert not missing, f"deploy/README.md's Dockerfile row does not name roles {missing}"
