"""terraform/ validated offline (the AWS provider cannot be downloaded here): every file
parses with python-hcl2, every reference resolves, modules are called with the variables
they declare, and the root example holds the latency records and health checks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
import pytest

from skymesh.balancer.config import BalancerConfig

REPO = Path(__file__).resolve().parents[2]
TF = REPO / "terraform"
ROOT_EXAMPLE = TF / "examples" / "three-region"
META_ARGS = {"source", "providers", "count", "for_each", "depends_on", "version"}


def unq(label: str) -> str:
    return label.strip('"')


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            if k != "__comments__":
                yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)


@dataclass
class Module:
    path: Path
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    resources: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    data: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    providers: list[dict[str, Any]] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)


@cache
def load_module(path: Path) -> Module:
    mod = Module(path)
    files = sorted(path.glob("*.tf"))
    assert files, f"{path} holds no .tf file"
    for f in files:
        with f.open() as fh:
            doc = hcl2.load(fh)
        mod.raw.append(doc)
        for block in doc.get("variable", []):
            for name, body in block.items():
                mod.variables[unq(name)] = body
        for kind, target in (("resource", mod.resources), ("data", mod.data)):
            for block in doc.get(kind, []):
                for rtype, named in block.items():
                    for rname, body in named.items():
                        target[(unq(rtype), unq(rname))] = body
        for block in doc.get("module", []):
            for name, body in block.items():
                mod.modules[unq(name)] = body
        for block in doc.get("locals", []):
            mod.locals.update({k: v for k, v in block.items() if k != "__is_block__"})
        for block in doc.get("output", []):
            for name, body in block.items():
                mod.outputs[unq(name)] = body
        for block in doc.get("provider", []):
            for _, body in block.items():
                mod.providers.append(body)
    return mod


def module_dirs() -> list[Path]:
    return sorted({f.parent for f in TF.rglob("*.tf")})


def source_dir(mod: Module, call: dict[str, Any]) -> Path:
    return (mod.path / unq(call["source"])).resolve()


REFS = {
    "var": re.compile(r"(?<![\w.])var\.([A-Za-z_][\w-]*)"),
    "local": re.compile(r"(?<![\w.])local\.([A-Za-z_][\w-]*)"),
    "module": re.compile(r"(?<![\w.])module\.([A-Za-z_][\w-]*)"),
    "data": re.compile(r"(?<![\w.])data\.([a-z][\w]*)\.([A-Za-z_][\w-]*)"),
    "resource": re.compile(r"(?<![\w.])(aws_[a-z0-9_]+)\.([A-Za-z_][\w-]*)"),
}


def unresolved(mod: Module, node: Any) -> list[str]:
    bad = []
    for s in strings(node):
        bad += [f"var.{n}" for n in REFS["var"].findall(s) if n not in mod.variables]
        bad += [f"local.{n}" for n in REFS["local"].findall(s) if n not in mod.locals]
        bad += [f"module.{n}" for n in REFS["module"].findall(s) if n not in mod.modules]
        bad += [f"data.{t}.{n}" for t, n in REFS["data"].findall(s) if (t, n) not in mod.data]
        bad += [f"{t}.{n}" for t, n in REFS["resource"].findall(s)
                if (t, n) not in mod.resources]
    return bad


def test_the_tree_has_both_modules_and_the_example() -> None:
    assert {p.relative_to(TF).as_posix() for p in module_dirs()} == {
        "modules/region", "modules/dns", "examples/three-region"}


@pytest.mark.parametrize("path", module_dirs(), ids=lambda p: str(p.relative_to(TF)))
def test_every_reference_resolves_in_its_module(path: Path) -> None:
    mod = load_module(path)
    assert not unresolved(mod, mod.raw), f"{path}: undeclared {unresolved(mod, mod.raw)}"
    for name, out in mod.outputs.items():
        assert out.get("description"), f"output {name} has no description"
        refs = [s for s in strings(out["value"]) if any(r.search(s) for r in REFS.values())]
        assert refs, f"output {name} refers to nothing declared"
    for name, var in mod.variables.items():
        assert var.get("description"), f"variable {name} has no description"


@pytest.mark.parametrize("path", module_dirs(), ids=lambda p: str(p.relative_to(TF)))
def test_module_calls_match_the_callees_variables(path: Path) -> None:
    mod = load_module(path)
    for name, call in mod.modules.items():
        target = source_dir(mod, call)
        assert target.is_dir() and target.is_relative_to(TF), f"module {name}: {target}"
        callee = load_module(target)
        args = {k for k in call if k not in META_ARGS and k != "__is_block__"}
        unknown = args - set(callee.variables)
        assert not unknown, f"module {name}: unknown arguments {unknown}"
        required = {v for v, body in callee.variables.items() if "default" not in body}
        assert required <= args, f"module {name}: missing {required - args}"
        for s in strings(mod.raw):
            for out in re.findall(rf"module\.{name}\.([A-Za-z_]\w*)", s):
                assert out in callee.outputs, f"module.{name}.{out} is not an output"


@pytest.mark.parametrize("path", module_dirs(), ids=lambda p: str(p.relative_to(TF)))
def test_files_and_templates_it_reads_exist_and_fit(path: Path) -> None:
    mod = load_module(path)
    for s in strings(mod.raw):
        for fn, rel in re.findall(r'\b(file|templatefile)\("\$\{path\.module\}/([^"]+)"', s):
            target = (path / rel).resolve()
            assert target.is_file(), f"{fn}() reads missing {target}"
            if fn != "templatefile":
                continue
            text = target.read_text()
            loops = re.findall(r"%\{ for (\w+), (\w+) in (\w+)", text)
            loop_vars = {v for pair in loops for v in pair[:2]}
            used = set(re.findall(r"(?<!\$)\$\{(\w+)\}", text)) | {x[2] for x in loops}
            call = s[s.index(rel):]
            given = set(re.findall(r"[{,\s](\w+)\s*=\s", call.split("})")[0]))
            assert used - loop_vars <= given, f"{rel}: not passed {used - loop_vars - given}"
            assert given <= used, f"{rel}: passed but unused {given - used}"


def test_latency_records_have_health_checks_everywhere() -> None:
    seen = 0
    for path in module_dirs():
        mod = load_module(path)
        for (rtype, rname), body in mod.resources.items():
            if rtype == "aws_route53_record" and "latency_routing_policy" in body:
                seen += 1
                assert "aws_route53_health_check" in str(body.get("health_check_id")), rname
                assert body.get("set_identifier"), rname
    assert seen


def resources_reachable(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    mod = load_module(path)
    found = dict(mod.resources)
    for call in mod.modules.values():
        found.update(resources_reachable(source_dir(mod, call)))
    return found


def test_root_example_declares_latency_records_and_health_checks() -> None:
    """The [deploy] contract, through the modules the example calls."""
    reachable = resources_reachable(ROOT_EXAMPLE)
    latency = [b for (t, _), b in reachable.items()
               if t == "aws_route53_record" and "latency_routing_policy" in b]
    assert latency, "no latency-routed aws_route53_record"
    assert any(t == "aws_route53_health_check" for t, _ in reachable)
    root = load_module(ROOT_EXAMPLE)
    regions = {unq(p["region"]): unq(p["alias"]) for p in root.providers}
    assert set(regions) == {"us-east-1", "eu-west-1", "ap-northeast-1"}
    wiring = " ".join(str(c.get("providers")) for c in root.modules.values())
    for alias in regions.values():
        assert f"aws.{alias}" in wiring, f"provider aws.{alias} unused"


def model_fields(model: Any) -> set[str]:
    names: set[str] = set()
    for name, f in model.model_fields.items():
        names.add(name)
        for arg in (*getattr(f.annotation, "__args__", ()), f.annotation):
            for t in getattr(arg, "__args__", (arg,)):
                if isinstance(t, type) and hasattr(t, "model_fields"):
                    names |= model_fields(t)
    return names


def test_rendered_balancer_config_uses_only_real_keys() -> None:
    region = load_module(TF / "modules" / "region")
    text = str(region.locals["lb_config"]) + str(region.locals["replicas"])
    keys = set(re.findall(r"[{,\s](\w+)\s*=\s", text))
    assert {"region", "listen", "replicas", "mesh", "peers"} <= keys
    assert keys <= model_fields(BalancerConfig), keys - model_fields(BalancerConfig)
