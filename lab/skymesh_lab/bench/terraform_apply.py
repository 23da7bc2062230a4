"""``terraform init/plan/apply/destroy`` of ``terraform/examples/three-region`` for real,
offline, against moto's server (an AWS API on loopback).

    python -m skymesh_lab.bench.terraform_apply --json docs/results/data/terraform-apply.json

Providers come from the local filesystem mirror (a ``tf-plugins`` folder one level below
``/``), named in a CLI config file written to a temp dir and given to terraform alone
(``TF_CLI_CONFIG_FILE``). The tree is copied to that temp dir, with an override file that
points the example's three providers at moto and fake keys; nothing is written into the
checkout. Inputs: a hosted zone created first (the dns module looks it up), one of moto's
built-in AMIs (``ami_id``: no Debian lookup), ``detailed_monitoring = false`` (moto has no
``monitor_instances``), the operator's wheels by URL and SHA-256.

:func:`deploy` applies, reads back what moto holds (:class:`Created`), destroys, and
returns both; ``tests/deploy/test_terraform_apply.py`` asserts on them (with real wheels in
moto's S3, and a replica's user data run against them while the deployment stands) and
``docs/results/terraform-apply.md`` shows the counts and times (wheels named, not built).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = "terraform/examples/three-region"
REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1")
ALIASES = ("us_east_1", "eu_west_1", "ap_northeast_1")
# The services the example's resources and data sources call.
SERVICES = ("ec2", "autoscaling", "iam", "route53", "logs", "s3", "ssm", "sts")
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
# One of moto's built-in images (its amis.json), present in every region it emulates.
MOTO_AMI = "ami-12c6146b"
ZONE, RECORD = "skymesh-moto.example.com", "api.skymesh-moto.example.com"
BUCKET = "skymesh-releases"
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Wheel:
    """A wheel the operator names: its URL and SHA-256, and, to have it fetchable from
    moto's S3 (``s3://BUCKET/KEY``), the file to upload there before the apply."""

    url: str
    sha256: str
    path: Path | None = None

    @classmethod
    def in_s3(cls, path: Path) -> Wheel:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return cls(f"s3://{BUCKET}/wheels/{path.name}", digest, path)


# Named, never fetched: enough for the figures (no instance boots under moto).
WHEELS = (Wheel("https://releases.example.com/skymesh/skymesh-0.1.0-py3-none-any.whl",
                "a" * 64),
          Wheel(f"s3://{BUCKET}/wheels/skymesh_replica-0.1.0-py3-none-any.whl", "b" * 64))


class TerraformError(RuntimeError):
    """A terraform command failed; the message holds its output."""


def provider_mirror() -> Path:
    """The filesystem mirror these machines carry, with the AWS provider in it."""
    for mirror in sorted(Path("/").glob("*/tf-plugins")):
        if (mirror / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return mirror
    raise TerraformError("no provider mirror: no /*/tf-plugins holding "
                         "registry.terraform.io/hashicorp/aws (see docs/deploy.md)")


def override_tf(endpoint: str) -> str:
    """``moto_override.tf``: Terraform merges it into the example's provider blocks."""
    endpoints = "".join(f"    {s:<11} = \"{endpoint}\"\n" for s in SERVICES)
    return "".join(
        f'provider "aws" {{\n  alias  = "{alias}"\n  region = "{region}"\n'
        '  access_key                  = "testing"\n'
        '  secret_key                  = "testing"\n'
        "  skip_credentials_validation = true\n"
        "  skip_requesting_account_id  = true\n"
        "  skip_metadata_api_check     = true\n"
        "  s3_use_path_style           = true\n"
        f"  endpoints {{\n{endpoints}  }}\n}}\n\n"
        for alias, region in zip(ALIASES, REGIONS, strict=True))


def tf_vars(replicas: int, wheels: tuple[Wheel, Wheel]) -> dict[str, Any]:
    data_plane, replica = wheels
    return {"zone_name": ZONE, "record_name": RECORD, "ami_id": MOTO_AMI,
            "detailed_monitoring": False, "emulated_replicas": replicas,
            "skymesh_wheel_url": data_plane.url, "skymesh_wheel_sha256": data_plane.sha256,
            "skymesh_replica_wheel_url": replica.url,
            "skymesh_replica_wheel_sha256": replica.sha256}


def client(endpoint: str, service: str, region: str = "us-east-1") -> Any:
    import boto3  # only the runs against moto pay for the import

    return boto3.client(service, endpoint_url=endpoint, region_name=region,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@contextmanager
def moto_server(timeout: float = 60.0) -> Iterator[str]:
    """moto's server in its own process (the apply's ~100 calls a second stay off the
    caller's interpreter), on a free loopback port: its base URL."""
    from skymesh.util.procs import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=2).read()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise TerraformError("moto's server did not start:\n"
                                             + log.read().decode(errors="replace")) from None
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def unpack_user_data(b64: str) -> str:
    """User data as EC2 holds it (base64, gzipped by the module) -> the script."""
    raw = base64.b64decode(b64)
    try:
        return gzip.decompress(raw).decode()
    except (OSError, EOFError, binascii.Error):
        return raw.decode()


@dataclass
class Created:
    """What moto held after the apply, read back through the AWS API."""

    records: list[dict[str, Any]] = field(default_factory=list)  # latency A records
    health_checks: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # region -> ASGs
    # region -> launch template name -> its user data
    templates: dict[str, dict[str, str]] = field(default_factory=dict)
    replicas: dict[str, list[str]] = field(default_factory=dict)  # region -> user data
    outputs: dict[str, Any] = field(default_factory=dict)


def read_back(endpoint: str) -> Created:
    got = Created()
    r53 = client(endpoint, "route53")
    (zone,) = [z for z in r53.list_hosted_zones()["HostedZones"] if z["Name"] == f"{ZONE}."]
    sets = r53.list_resource_record_sets(HostedZoneId=zone["Id"])["ResourceRecordSets"]
    got.records = [s for s in sets if s.get("Region")]
    got.health_checks = [h["HealthCheckConfig"] | {"Id": h["Id"]}
                         for h in r53.list_health_checks()["HealthChecks"]]
    for region in REGIONS:
        ec2, asg = client(endpoint, "ec2", region), client(endpoint, "autoscaling", region)
        got.groups[region] = asg.describe_auto_scaling_groups()["AutoScalingGroups"]
        got.templates[region] = {}
        for t in ec2.describe_launch_templates()["LaunchTemplates"]:
            (version,) = ec2.describe_launch_template_versions(
                LaunchTemplateId=t["LaunchTemplateId"], Versions=["$Latest"]
            )["LaunchTemplateVersions"]
            data = version["LaunchTemplateData"]
            got.templates[region][t["LaunchTemplateName"]] = unpack_user_data(data["UserData"])
        got.replicas[region] = []
        filters = [{"Name": "tag:skymesh:role", "Values": ["replica"]},
                   {"Name": "instance-state-name", "Values": ["pending", "running"]}]
        for res in ec2.describe_instances(Filters=filters)["Reservations"]:
            for inst in res["Instances"]:
                attr = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"],
                                                       Attribute="userData")
                got.replicas[region].append(unpack_user_data(attr["UserData"]["Value"]))
    return got


def _version(cmd: list[str], pattern: str) -> str | None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    m = re.search(pattern, out)
    return m.group(1) if m else None


def state_resources(show: dict[str, Any]) -> Counter[str]:
    """Managed resources per type in ``terraform show -json``'s state."""
    counts: Counter[str] = Counter()
    stack = [show.get("values", {}).get("root_module", {})]
    while stack:
        mod = stack.pop()
        counts.update(r["type"] for r in mod.get("resources", []) if r["mode"] == "managed")
        stack += mod.get("child_modules", [])
    return counts


@dataclass
class Deployment:
    """One init/plan/apply/destroy: the figures (:meth:`figures`) and what it created."""

    planned: int
    applied: int
    destroyed: int
    by_type: dict[str, int]
    plan_s: float  # init + plan
    apply_s: float
    destroy_s: float
    created: Created
    left_after_destroy: int  # resources in the state after destroy
    after_destroy: Created  # what moto still held then
    setup: dict[str, Any]
    while_applied: Any = None  # what deploy's while_applied hook returned

    def figures(self) -> dict[str, Any]:
        return {"setup": self.setup, "planned": self.planned, "applied": self.applied,
                "destroyed": self.destroyed, "left_after_destroy": self.left_after_destroy,
                "by_type": dict(sorted(self.by_type.items())),
                "init_plan_seconds": round(self.plan_s, 1),
                "apply_seconds": round(self.apply_s, 1),
                "destroy_seconds": round(self.destroy_s, 1),
                "latency_records": len(self.created.records),
                "health_checks": len(self.created.health_checks),
                "auto_scaling_groups": sum(len(g) for g in self.created.groups.values()),
                "launch_templates": sum(len(t) for t in self.created.templates.values()),
                "replica_instances": sum(len(r) for r in self.created.replicas.values())}


def deploy(replicas: int = 1, wheels: tuple[Wheel, Wheel] = WHEELS,
           while_applied: Callable[[str, Created], Any] | None = None,
           terraform: str | None = None) -> Deployment:
    """Apply the example against a fresh moto, read back what it made, destroy it.

    ``wheels``: the data plane's and skymesh-replica's; those with a file are uploaded to
    moto's S3 first. ``while_applied(endpoint, created)`` runs before the destroy, with
    moto still up (e.g. to run the user data's installer against its S3)."""
    exe = terraform or shutil.which("terraform")
    if exe is None:
        raise TerraformError("terraform is not on the PATH")
    mirror = provider_mirror()
    with tempfile.TemporaryDirectory(prefix="tf-moto-") as tmp_name, moto_server() as url:
        tmp = Path(tmp_name)
        # The region module reads deploy/ files by relative path: copy both, same layout.
        for part in ("terraform", "deploy"):
            shutil.copytree(REPO / part, tmp / part,
                            ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
        work = tmp / EXAMPLE
        (work / "moto_override.tf").write_text(override_tf(url))
        (work / "moto.auto.tfvars.json").write_text(json.dumps(tf_vars(replicas, wheels)))
        cli = tmp / "cli.tfrc"
        cli.write_text('provider_installation {\n  filesystem_mirror {\n'
                       f'    path    = "{mirror}"\n'
                       '    include = ["registry.terraform.io/hashicorp/*"]\n  }\n}\n')
        env = {**os.environ, **KEYS, "TF_CLI_CONFIG_FILE": str(cli), "TF_IN_AUTOMATION": "1",
               "CHECKPOINT_DISABLE": "1", "TF_DATA_DIR": str(tmp / "tfdata")}
        env.pop("TF_PLUGIN_CACHE_DIR", None)

        def tf(*args: str) -> str:
            out = subprocess.run([exe, *args, "-no-color"], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=TIMEOUT_S)
            if out.returncode != 0:
                raise TerraformError(f"terraform {args[0]} failed:\n{out.stdout}\n{out.stderr}")
            return out.stdout

        client(url, "route53").create_hosted_zone(Name=ZONE, CallerReference="skymesh-moto")
        s3 = client(url, "s3")
        s3.create_bucket(Bucket=BUCKET)
        for wheel in wheels:
            if wheel.path is not None:
                s3.upload_file(str(wheel.path), BUCKET, wheel.url.split(f"{BUCKET}/", 1)[1])
        t0 = time.monotonic()
        tf("init", "-backend=false", "-input=false")
        plan = tf("plan", "-input=false", "-out=tfplan")
        plan_s = time.monotonic() - t0
        planned = _count(r"Plan: (\d+) to add", plan)
        t0 = time.monotonic()
        applied = _count(r"Apply complete! Resources: (\d+) added", tf(
            "apply", "-input=false", "-auto-approve", "tfplan"))
        apply_s = time.monotonic() - t0
        by_type = state_resources(json.loads(tf("show", "-json")))
        created = read_back(url)
        created.outputs = {k: v["value"] for k, v in json.loads(tf("output", "-json")).items()}
        hooked = while_applied(url, created) if while_applied is not None else None
        t0 = time.monotonic()
        destroyed = _count(r"Destroy complete! Resources: (\d+) destroyed", tf(
            "destroy", "-input=false", "-auto-approve"))
        destroy_s = time.monotonic() - t0
        left = sum(state_resources(json.loads(tf("show", "-json"))).values())
        after = read_back(url)
    setup = {"example": EXAMPLE, "emulated_replicas": replicas, "regions": list(REGIONS),
             "terraform": _version([exe, "version"], r"Terraform v(\S+)"),
             "aws_provider": _provider_version(mirror),
             "moto": _version([sys.executable, "-m", "pip", "show", "moto"],
                              r"Version: (\S+)"),
             "cpus": os.cpu_count()}
    return Deployment(planned, applied, destroyed, dict(by_type), plan_s, apply_s, destroy_s,
                      created, left, after, setup, hooked)


def _count(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    if m is None:
        raise TerraformError(f"no {pattern!r} in terraform's output:\n{text[-2000:]}")
    return int(m.group(1))


def _provider_version(mirror: Path) -> str | None:
    versions = sorted(p.name for p in (mirror / "registry.terraform.io/hashicorp/aws").iterdir())
    return versions[-1] if versions else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=1,
                        help="emulated replicas per region (default 1)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    args = parser.parse_args(argv)
    result = deploy(args.replicas)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result.figures(), indent=2) + "\n")
    print(json.dumps(result.figures(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
