"""terraform/ validated offline: every file parses with python-hcl2, every reference
resolves, modules are called with the variables they declare, the root example holds the
latency records and health checks; and Terraform itself runs ``init -backend=false`` +
``validate`` on every module and example against the local provider mirror (no network),
and ``fmt -check``. What the region module deploys is checked too: the operator's wheel,
a watchdog that gets a dead balancer replaced, replicas with a way out."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import boto3
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


# -- terraform itself, offline, against the local provider mirror ---------------------------

def _provider_mirror() -> Path | None:
    """The filesystem mirror these machines carry (``/<dir>/tf-plugins``) with the AWS
    provider in it."""
    for mirror in sorted(Path("/").glob("*/tf-plugins")):
        if (mirror / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return mirror
    return None


@pytest.fixture(scope="module")
def tf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run terraform on a copy of the tree (init writes a lock file and .terraform/),
    offline: providers from the mirror only, CLI config and data dirs in a temp dir."""
    exe = shutil.which("terraform")
    mirror = _provider_mirror()
    if exe is None:
        pytest.skip("terraform is not on the PATH (Terraform >= 1.5 is needed)")
    if mirror is None:
        pytest.skip("no provider mirror: no /*/tf-plugins holding "
                    "registry.terraform.io/hashicorp/aws")
    tmp = tmp_path_factory.mktemp("tf")
    # The region module reads deploy/ files by relative path: copy both, same layout.
    for part in ("terraform", "deploy"):
        shutil.copytree(REPO / part, tmp / "repo" / part,
                        ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    cli = tmp / "cli.tfrc"
    cli.write_text('provider_installation {\n  filesystem_mirror {\n'
                   f'    path    = "{mirror}"\n'
                   '    include = ["registry.terraform.io/hashicorp/*"]\n  }\n}\n')

    def run(rel: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "TF_CLI_CONFIG_FILE": str(cli), "TF_IN_AUTOMATION": "1",
               "CHECKPOINT_DISABLE": "1",
               "TF_DATA_DIR": str(tmp / "data" / rel.replace("/", "_"))}
        env.pop("TF_PLUGIN_CACHE_DIR", None)
        return subprocess.run([exe, *args, "-no-color"], cwd=tmp / "repo" / "terraform" / rel,
                              env=env, capture_output=True, text=True, timeout=300)
    return run


@pytest.fixture(scope="module")
def validated(tf: Callable[..., subprocess.CompletedProcess[str]]) -> dict[str, str]:
    """``init`` + ``validate`` of every module and example, the directories side by side
    (each validate spends most of its time loading the AWS provider's schema): a failure
    report per directory, empty when it validates."""

    def one(rel: str) -> str:
        init = tf(rel, "init", "-backend=false", "-input=false")
        if init.returncode != 0:
            return f"terraform init in {rel}:\n{init.stdout}\n{init.stderr}"
        check = tf(rel, "validate")
        if check.returncode != 0 or "The configuration is valid" not in check.stdout:
            return f"terraform validate in {rel}:\n{check.stdout}\n{check.stderr}"
        return ""

    rels = [p.relative_to(TF).as_posix() for p in module_dirs()]
    with ThreadPoolExecutor(len(rels)) as pool:
        return dict(zip(rels, pool.map(one, rels), strict=True))


@pytest.mark.parametrize("path", module_dirs(), ids=lambda p: str(p.relative_to(TF)))
def test_terraform_init_and_validate_offline(validated: dict[str, str], path: Path) -> None:
    failure = validated[path.relative_to(TF).as_posix()]
    assert not failure, failure


def test_terraform_fmt_is_clean() -> None:
    exe = shutil.which("terraform")
    if exe is None:
        pytest.skip("terraform is not on the PATH")
    # fmt reads no provider; -check writes nothing.
    out = subprocess.run([exe, "fmt", "-check", "-recursive", "-no-color", str(TF)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"terraform fmt would change: {out.stdout}{out.stderr}"


# -- what the region module deploys ----------------------------------------------------------

def region_resource(rtype: str, name: str) -> dict[str, Any]:
    return load_module(TF / "modules" / "region").resources[(rtype, name)]


def test_software_comes_from_the_operators_wheel_not_a_pypi_name() -> None:
    region = load_module(TF / "modules" / "region")
    text = "\n".join(p.read_text() for p in TF.rglob("*.tf*"))
    assert "pip_spec" not in text and "skymesh==" not in text
    wheel = region.variables["skymesh_wheel_url"]
    assert "default" not in wheel, "the wheel must be the operator's choice"
    condition = str(wheel["validation"][0]["condition"])
    pattern = re.search(r'regex\("(.+?)",', condition)
    assert pattern is not None
    regex = re.compile(pattern.group(1).replace("\\\\", "\\"))
    assert regex.search("s3://releases/skymesh/skymesh-0.2.0-py3-none-any.whl")
    assert regex.search("https://example.com/r/skymesh-0.2.0-py3-none-any.whl")
    assert not regex.search("skymesh==0.1.0")
    assert not regex.search("http://example.com/skymesh-0.2.0-py3-none-any.whl")
    template = (TF / "modules" / "region" / "user_data.sh.tftpl").read_text()
    assert "SKYMESH_WHEEL_URL='${wheel_url}'" in template
    assert "SKYMESH_PIP_SPEC" not in template


def test_a_dead_balancer_is_replaced_and_a_refresh_keeps_it_serving() -> None:
    asg = region_resource("aws_autoscaling_group", "lb")
    prefs = asg["instance_refresh"][0]["preferences"][0]
    assert prefs["min_healthy_percentage"] >= 50
    assert asg["max_size"] >= 2 and asg["desired_capacity"] == 1
    assert "health_check_grace_period" in asg
    # No load balancer to take health from: the instance's watchdog reports to the group.
    template = (TF / "modules" / "region" / "user_data.sh.tftpl").read_text()
    assert "set_instance_health" in template and 'HealthStatus="Unhealthy"' in template
    assert "${watchdog_url}" in template and "/health" in str(
        region_resource("aws_launch_template", "lb")["user_data"])
    policy = str(region_resource("aws_iam_role_policy", "lb")["policy"])
    assert "autoscaling:SetInstanceHealth" in policy


def test_replicas_reach_apt_and_the_index_through_a_nat_gateway() -> None:
    route = region_resource("aws_route_table", "private")["route"][0]
    assert "aws_nat_gateway.this" in str(route["nat_gateway_id"])
    assert "aws_subnet.public" in str(region_resource("aws_nat_gateway", "this")["subnet_id"])
    replica = region_resource("aws_instance", "replica")
    assert "replica_subnet_id" in str(replica["subnet_id"])
    assert "aws_route_table_association.private" in str(replica["depends_on"])
    endpoint = region_resource("aws_vpc_endpoint", "s3")
    assert unq(endpoint["vpc_endpoint_type"]) == "Gateway"


def test_no_account_or_ami_owner_is_hard_coded() -> None:
    region = load_module(TF / "modules" / "region")
    ami = region.data[("aws_ami", "debian")]
    assert ami["owners"] == ["${var.ami_owner}"]
    code = "\n".join(p.read_text() for p in TF.rglob("*.tf") if p.name != "variables.tf")
    assert not re.findall(r"\b\d{12}\b", code), "a 12-digit account id outside a variable"


# -- the balancer's watchdog, rendered by terraform and run against moto ---------------------

class _Fake(http.server.BaseHTTPRequestHandler):
    """A balancer's /health (status set by the test) and the instance metadata service."""

    health = 200
    instance = ""

    def _answer(self, status: int, body: str) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self) -> None:
        self._answer(200, "token")

    def do_GET(self) -> None:
        meta = {"/latest/meta-data/instance-id": _Fake.instance,
                "/latest/meta-data/placement/region": "us-east-1"}
        if self.path == "/health":
            self._answer(_Fake.health, "")
        elif self.path in meta and self.headers.get("X-aws-ec2-metadata-token") == "token":
            self._answer(200, meta[self.path])
        else:
            self._answer(404, "")

    def log_message(self, *args: Any) -> None:
        pass


def render_user_data(tmp: Path, **overrides: str) -> str:
    """templatefile() of the region module's user data, by terraform itself (a root
    module with no provider: nothing to download)."""
    exe = shutil.which("terraform")
    if exe is None:
        pytest.skip("terraform is not on the PATH")
    args = {"roles": "lb", "wheel_url": "https://example.com/skymesh-0.1.0-py3-none-any.whl",
            "wheel_sha256": "", "pip_args": "", "watchdog_url": "", "asg_name": "",
            "install_script": "echo install", "eip_allocation": "", "certs_prefix": "",
            "mesh_id": "", "api_keys_param": "", "tls_prefix": "", **overrides}
    tpl = TF / "modules" / "region" / "user_data.sh.tftpl"
    (tmp / "main.tf").write_text(
        f'output "user_data" {{\n  value = templatefile("{tpl}", {{\n'
        + "".join(f"    {k} = {json.dumps(v)}\n" for k, v in args.items())
        + '    units = { "skymesh-lb.service" = "[Unit]" }\n'
        + '    configs = { "lb.yaml" = "region: us-east" }\n  })\n}\n')
    env = {**os.environ, "TF_DATA_DIR": str(tmp / ".tf"), "CHECKPOINT_DISABLE": "1",
           "TF_IN_AUTOMATION": "1"}
    for cmd in (["init", "-input=false"], ["apply", "-auto-approve", "-input=false"]):
        out = subprocess.run([exe, *cmd, "-no-color"], cwd=tmp, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([exe, "output", "-raw", "user_data"], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def test_rendered_user_data_is_valid_bash_for_both_roles(tmp_path: Path) -> None:
    for role, watchdog in (("lb", "http://127.0.0.1:8080/health"), ("replica", "")):
        work = tmp_path / role
        work.mkdir()
        text = render_user_data(work, roles=role, watchdog_url=watchdog, asg_name="lb-x-0")
        check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert ("skymesh-lb-watchdog.timer" in text) == (role == "lb")
        assert "SKYMESH_WHEEL_URL='https://example.com/skymesh-0.1.0-py3-none-any.whl'" in text


def test_the_watchdog_marks_a_balancer_that_fails_health_unhealthy(
        tmp_path: Path, moto_url: str) -> None:
    aws = {"endpoint_url": moto_url, "region_name": "us-east-1",
           "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    ec2, asg = boto3.client("ec2", **aws), boto3.client("autoscaling", **aws)
    name = f"lb-us-east-{uuid.uuid4().hex[:6]}"
    # One of moto's built-in AMIs (listing them all is slow).
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "c7i.large"})
    asg.create_auto_scaling_group(AutoScalingGroupName=name, MinSize=1, MaxSize=2,
                                  DesiredCapacity=1, AvailabilityZones=["us-east-1a"],
                                  LaunchTemplate={"LaunchTemplateName": name})

    def health() -> str:
        group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])
        (instance,) = group["AutoScalingGroups"][0]["Instances"]
        _Fake.instance = instance["InstanceId"]
        return str(instance["HealthStatus"])

    assert health() == "Healthy"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        text = render_user_data(tmp_path, watchdog_url=f"{base}/health", asg_name=name)
        script = text.split("cat > /usr/local/sbin/skymesh-lb-watchdog <<'SKYMESH_EOF'\n")[1]
        watchdog = tmp_path / "watchdog"
        watchdog.write_text(script.split("\nSKYMESH_EOF\n")[0] + "\n")
        bin_dir = tmp_path / "bin"  # python3 = this venv's (boto3), as python3-boto3 on EC2
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(sys.executable)
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_ENDPOINT_URL": moto_url,
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "SKYMESH_WATCHDOG_STATE": str(tmp_path / "fails"),
               "SKYMESH_WATCHDOG_IMDS": base}

        def tick() -> subprocess.CompletedProcess[str]:
            out = subprocess.run(["bash", str(watchdog)], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out

        _Fake.health = 200
        tick()
        _Fake.health = 500
        tick()
        tick()
        assert health() == "Healthy"  # two failures are not enough
        _Fake.health = 200
        tick()  # a success resets the count
        _Fake.health = 500
        tick()
        tick()
        assert health() == "Healthy"
        out = tick()  # the third failure in a row
        assert f"Unhealthy in {name}" in out.stdout
        assert health() == "Unhealthy"
    finally:
        server.shutdown()
        server.server_close()


# -- what an AWS API emulator needs (tests/deploy/test_terraform_apply.py applies it) -------

def test_a_named_ami_skips_the_debian_lookup() -> None:
    region = load_module(TF / "modules" / "region")
    assert region.data[("aws_ami", "debian")]["count"] == "${var.ami_id == null ? 1 : 0}"
    assert "var.ami_id" in str(region.locals["ami_id"])
    example = load_module(ROOT_EXAMPLE)
    assert "default" in example.variables["ami_id"]
    for name, call in example.modules.items():
        if name != "dns":
            assert call["ami_id"] == "${var.ami_id}", name


def test_detailed_monitoring_is_a_variable_of_the_example() -> None:
    (monitoring,) = region_resource("aws_launch_template", "lb")["monitoring"]
    assert monitoring["enabled"] == "${var.detailed_monitoring}"
    assert region_resource("aws_instance", "replica")["monitoring"] == (
        "${var.detailed_monitoring}")
    example = load_module(ROOT_EXAMPLE)
    assert example.variables["detailed_monitoring"]["default"] is True
    for name, call in example.modules.items():
        if name != "dns":
            assert call["detailed_monitoring"] == "${var.detailed_monitoring}", name


def test_emulated_replicas_install_the_replica_wheel_beside_the_data_planes() -> None:
    region = load_module(TF / "modules" / "region")
    assert "var.skymesh_replica_wheel_url" in str(region.locals["replica_wheels"])
    user_data = str(region_resource("aws_instance", "replica")["user_data_base64"])
    assert 'join(" ", local.replica_wheels)' in user_data
    assert "local.replica_sha256" in user_data
    condition = str(region.variables["skymesh_replica_wheel_url"]["validation"][0]["condition"])
    pattern = re.search(r'regex\("(.+?)",', condition)
    assert pattern is not None
    regex = re.compile(pattern.group(1).replace("\\\\", "\\"))
    assert regex.search("s3://releases/w/skymesh_replica-0.1.0-py3-none-any.whl")
    assert not regex.search("s3://releases/w/skymesh-0.1.0-py3-none-any.whl")
    example = load_module(ROOT_EXAMPLE)
    assert {"skymesh_replica_wheel_url", "skymesh_replica_wheel_sha256"} <= set(
        example.variables)


def test_the_wheels_hash_is_required_never_optional() -> None:
    """An instance installs only the wheel the operator pinned (issue #34): the data
    plane's SHA-256 has no default in the module or the example, and is 64 hex digits."""
    for path in (ROOT_EXAMPLE, REPO / "terraform" / "modules" / "region"):
        sha = load_module(path).variables["skymesh_wheel_sha256"]
        assert "default" not in sha, f"{path}: skymesh_wheel_sha256 must be required"
    module = load_module(REPO / "terraform" / "modules" / "region")
    condition = str(module.variables["skymesh_wheel_sha256"]["validation"][0]["condition"])
    assert "null" not in condition and "[0-9a-f]{64}" in condition
