"""deploy/k8s/: the kustomize overlays rendered by the real kustomize (``kubectl
kustomize``), every object validated against a current Kubernetes schema
(kubernetes-validate) and by checkov, and the properties the deployment promises checked
on what would be applied: one controller for the whole mesh that every region's balancers
use, two or more balancers per region that survive rollouts and drains, hardened pods
that can read their Secrets, NetworkPolicies that admit exactly who needs in (across the
control and region namespaces), commands and config files the daemons accept, and no
secret material in the repository.

Three deployments, each a control overlay applied once plus region overlays: ``example``
(one cluster, one region, both in one overlay), ``mesh`` (``mesh/control`` and three
regions) and ``production`` (every knob turned; its secret files are written into a copy
of the tree).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from skymesh.balancer.config import parse_config as parse_lb_config
from skymesh.common.config import expand_env
from skymesh.mesh import certs
from skymesh_controller.auth import digest
from skymesh_controller.config import parse_config as parse_controller_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Console scripts of the distributions the images install.
SCRIPTS = {name for folder in (REPO, REPO / "controller", REPO / "replica")
           for name in tomllib.loads((folder / "pyproject.toml").read_text())["project"][
               "scripts"]}
# The image role (deploy/docker/requirements.py) each daemon's pods run.
ROLE_OF = {"skymesh-lb": "balancer", "skymesh-controller": "controller",
           "skymesh-replica": "replica"}
PARSERS = {"skymesh-lb": "skymesh.balancer.cli", "skymesh-replica": "skymesh_replica.cli",
           "skymesh-controller": "skymesh_controller.cli"}
# What the operator puts in the production overlay's secrets/ (never in git), besides the
# mesh certificates (MESH_IDS, made by mesh_files).
AGENT_TOKEN = "agt-5be1d0"
SECRET_FILES = {"api-keys": "sk-client-one\nsk-client-two\n", "admin-token": "adm-7f3e9c",
                "redis-url": "rediss://:pw-41d2@redis.example.internal:6379/0",
                "agent-token": AGENT_TOKEN,
                "agent-token-sha256": hashlib.sha256(AGENT_TOKEN.encode()).hexdigest()}
# The production overlay's balancer pods' mesh ids (region + StatefulSet pod name).
MESH_IDS = [f"eu-west-skymesh-lb-{i}" for i in range(3)]
# The overlays of each deployment: its control plane (applied once) and its regions.
DEPLOYMENTS = {
    "example": {"control": "example", "regions": ["example"]},
    "mesh": {"control": "mesh/control",
             "regions": ["mesh/us-east", "mesh/eu-west", "mesh/ap-northeast"]},
    "production": {"control": "production/control", "regions": ["production/eu-west"]},
}
OVERLAYS = sorted({d["control"] for d in DEPLOYMENTS.values()}
                  | {r for d in DEPLOYMENTS.values() for r in d["regions"]})
REGION_OVERLAYS = [r for d in DEPLOYMENTS.values() for r in d["regions"]]
CONTROL_OF = {r: d["control"] for d in DEPLOYMENTS.values() for r in d["regions"]}
# Balancer pods per region overlay.
BALANCERS = {"example": 2, "mesh/us-east": 2, "mesh/eu-west": 2, "mesh/ap-northeast": 2,
             "production/eu-west": 3}
# The token hash the old ConfigMap shipped (sha256 of "change-me-ops").
OLD_HASH = "a57dc21a5a080e90e7df96108954414da40039b3f7f9235ca63435938c0c1159"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator: no schema here
Objects = list[dict[str, Any]]


def image_roles() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """deploy/docker/requirements.py's ROLES: role -> (distribution folder, extras)."""
    spec = importlib.util.spec_from_file_location(
        "image_requirements", REPO / "deploy" / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.ROLES)


def scripts(folder: str) -> set[str]:
    """Console scripts of the distribution in ``folder`` (requirements.py's naming)."""
    home = REPO if folder == "skymesh" else REPO / folder
    return set(tomllib.loads((home / "pyproject.toml").read_text())["project"]["scripts"])


def kubectl() -> str:
    """kubectl with kustomize v5 (replacements, components), or skip saying what is missing."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not on PATH: it renders deploy/k8s (kubectl kustomize); "
                    "install kubectl >= 1.27 (kustomize v5)")
    out = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True,
                         text=True, timeout=30)
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    if not re.match(r"v[5-9]\.", version):
        pytest.skip(f"kubectl's kustomize is {version or 'unknown'}; deploy/k8s needs v5+")
    return path


def render(overlay: Path) -> Objects:
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_error(overlay: Path) -> str:
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, "the render should have failed"
    return proc.stderr


def mesh_files(out: Path) -> dict[str, str]:
    """A mesh CA and a certificate per production balancer pod, as `skymesh certs` makes
    them: {file name: PEM}."""
    certs.create_ca(out)
    for mesh_id in MESH_IDS:
        certs.issue_cert(out, mesh_id)
    names = ["ca.crt", *(f"{i}.{ext}" for i in MESH_IDS for ext in ("crt", "key"))]
    return {n: (out / n).read_text() for n in names}


# Which production overlay's secrets/ holds each of SECRET_FILES.
SECRET_HOME = {"api-keys": "eu-west", "agent-token": "eu-west", "admin-token": "control",
               "redis-url": "control", "agent-token-sha256": "control"}


def tree_copy(tmp: Path, secrets: bool) -> Path:
    root = tmp / "k8s"
    shutil.copytree(K8S, root)
    if secrets:
        prod = root / "overlays" / "production"
        for name, text in SECRET_FILES.items():
            (prod / SECRET_HOME[name] / "secrets" / name).write_text(text)
        mesh_files(prod / "eu-west" / "secrets" / "mesh")
    return root


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Objects]:
    """Every overlay, rendered: overlay path under overlays/ -> objects."""
    with_secrets = tree_copy(tmp_path_factory.mktemp("prod"), secrets=True)
    return {name: render((with_secrets if name.startswith("production/") else K8S)
                         / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def example(overlays: dict[str, Objects]) -> Objects:
    return overlays["example"]


def deployed(overlays: dict[str, Objects], region: str) -> Objects:
    """A region overlay's objects with its control plane's: what one region runs against."""
    control = CONTROL_OF[region]
    return overlays[region] + ([] if control == region else overlays[control])


def deployment(overlays: dict[str, Objects], name: str) -> Objects:
    """Every object of a deployment: its control overlay and all its region overlays."""
    d = DEPLOYMENTS[name]
    return [o for n in dict.fromkeys([d["control"], *d["regions"]]) for o in overlays[n]]


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, overlays: dict[str, Objects]) -> Objects:
    return overlays[request.param]


def one(objs: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def namespace(obj: dict[str, Any]) -> str:
    ns = obj["metadata"].get("namespace")
    assert ns, f"{obj['kind']}/{obj['metadata']['name']} has no namespace"
    return str(ns)


def workloads(objs: Objects) -> Iterator[dict[str, Any]]:
    return (o for o in objs if o["kind"] in ("Deployment", "StatefulSet"))


def values(overlay: str) -> dict[str, str]:
    doc = yaml.safe_load((K8S / "overlays" / overlay / "values.yaml").read_text())
    return {k: str(v) for k, v in doc["data"].items()}


# -- schema and policy checks ---------------------------------------------------------------


def test_every_object_is_valid_for_the_current_kubernetes_schema(rendered: Objects) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    for obj in rendered:
        # Every object names its namespace: none lands in kubectl's current one (say an
        # overlay's generated Secret away from the pods that mount it).
        if obj["kind"] != "Namespace":
            namespace(obj)
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} is invalid for "
                                 f"Kubernetes {version} at {list(exc.path)}: {exc.message}"
                                 ) from None


def checkov_binary() -> str:
    """checkov from $CHECKOV (its own venv: its dependency set is large) or the PATH."""
    path = os.environ.get("CHECKOV") or shutil.which("checkov")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("checkov not found: set CHECKOV=/path/to/venv/bin/checkov "
                    "(pip install checkov into a venv of its own)")
    return path


def test_checkov_finds_nothing_in_the_rendered_manifests(overlays: dict[str, Objects],
                                                         tmp_path: Path) -> None:
    checkov = checkov_binary()
    for name, objs in overlays.items():
        (tmp_path / f"{name.replace('/', '-')}.yaml").write_text(
            yaml.safe_dump_all(objs, sort_keys=False))
    # Skipped, and why: CKV_K8S_43 (image by digest) is the operator's release pinning
    # (`images: [{name: skymesh-balancer, digest: ...}, ...]` in an overlay); CKV_K8S_15 wants
    # imagePullPolicy Always, which breaks images loaded into the nodes (`make image`,
    # then `kind load`). CKV_K8S_35 (secrets in env) is skipped per object, by annotation.
    proc = subprocess.run(
        [checkov, "--framework", "kubernetes", "--output", "json", "--skip-download",
         "--skip-check", "CKV_K8S_43,CKV_K8S_15", "--directory", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LOG_LEVEL": "ERROR"})
    assert proc.stdout.startswith("{"), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}"
              for c in report["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert report["summary"]["passed"] > 500, report["summary"]
    assert {c["check_id"] for c in report["results"]["skipped_checks"]} <= {"CKV_K8S_35"}


# -- the balancer: HA, rollouts, probes -----------------------------------------------------


@pytest.mark.parametrize("overlay", REGION_OVERLAYS)
def test_balancers_survive_rollouts_and_drains(overlay: str, overlays: dict[str, Objects]
                                               ) -> None:
    objs, count = overlays[overlay], BALANCERS[overlay]
    # A StatefulSet: stable pod names, hence stable balancer and mesh ids (below).
    lb = one(objs, "StatefulSet", "skymesh-lb")
    labels = lb["spec"]["template"]["metadata"]["labels"]
    assert lb["spec"]["replicas"] == count
    # All pods start at once; updates replace one pod at a time (the default partition
    # 0 rolls every pod), each once its predecessor has been ready for minReadySeconds.
    assert lb["spec"]["podManagementPolicy"] == "Parallel"
    assert lb["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"partition": 0}}
    assert lb["spec"]["minReadySeconds"] > 0
    pdb = one(objs, "PodDisruptionBudget", "skymesh-lb")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = one(objs, "Service", "skymesh-lb")
    assert service["spec"]["selector"].items() <= labels.items()
    (c,) = lb["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert any(p["targetPort"] == "http" for p in service["spec"]["ports"])


def test_each_daemon_runs_its_roles_image_at_the_package_version(
        overlays: dict[str, Objects]) -> None:
    def images(objs: Objects) -> dict[str, str]:
        """command -> image of every SkyMesh container."""
        return {c["command"][0]: c["image"] for w in workloads(objs)
                for c in w["spec"]["template"]["spec"]["containers"]
                if w["metadata"]["name"] != "skymesh-redis"}

    version = PYPROJECT["version"]
    for name in ("example", "mesh"):
        assert images(deployment(overlays, name)) == {
            daemon: f"skymesh-{role}:{version}" for daemon, role in ROLE_OF.items()}, (
            "images.newTag of deploy/k8s/{control,region}/kustomization.yaml must follow "
            "pyproject.toml")
    assert images(deployment(overlays, "production")) == {
        daemon: f"registry.example.com/ml/skymesh-{role}:{version}"
        for daemon, role in ROLE_OF.items()}
    # The role's image installs the distribution whose console script the pod runs.
    for daemon, role in ROLE_OF.items():
        folders = {folder for folder, _ in image_roles()[role]}
        assert any(daemon in scripts(folder) for folder in folders), (daemon, role)


# -- pods: hardened, and able to read their Secrets -----------------------------------------


def test_pods_are_hardened_and_can_read_their_secrets(rendered: Objects) -> None:
    for w in workloads(rendered):
        name, pod = w["metadata"]["name"], w["spec"]["template"]["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        # The image's user (deploy/docker/Dockerfile); Redis runs as it too.
        assert (sc["runAsUser"], sc["runAsGroup"]) == (10001, 10001)
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] is True, name
            assert csc["allowPrivilegeEscalation"] is False, name
            assert csc["capabilities"] == {"drop": ["ALL"]}, name
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][part].keys(), name
        for vol in pod.get("volumes", []):
            if "secret" in vol:
                # Files 0440 owned by root:fsGroup: readable by the daemon's group only.
                assert vol["secret"]["defaultMode"] == 0o440
                assert sc["fsGroup"] == sc["runAsGroup"], name


def test_redis_keeps_its_data_on_a_volume_claim(overlays: dict[str, Objects]) -> None:
    redis = one(overlays["mesh/control"], "StatefulSet", "skymesh-redis")
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c["volumeMounts"]
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    assert c["args"][c["args"].index("--dir") + 1] == "/data"
    # The external-Redis overlay runs no Redis of its own.
    assert not [o for o in deployment(overlays, "production")
                if "redis" in o["metadata"]["name"]]


# -- the mesh: one control plane, every region's balancers use it ---------------------------


def controller_url(objs: Objects) -> str:
    """The address of the controller's Service, as a pod in another namespace names it."""
    svc = one(objs, "Service", "skymesh-controller")
    return f"http://{svc['metadata']['name']}.{namespace(svc)}:{svc['spec']['ports'][0]['port']}"


def balancer_configs(objs: Objects) -> list[Any]:
    """lb.yaml as each balancer pod of a region overlay loads it (its pod spec's env)."""
    sts = one(objs, "StatefulSet", "skymesh-lb")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    kind, cm, key = mounted_file(objs, pod, c, parse_flags("skymesh-lb", c["args"]).config)
    raw = yaml.safe_load(one(objs, kind, cm)["data"][key])
    return [parse_lb_config(expand_env(raw, container_env(
        objs, c, pod_name=f"skymesh-lb-{i}", pod_ip=f"10.0.0.{i + 1}",
        pod_namespace=namespace(sts)))) for i in range(sts["spec"]["replicas"])]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_a_mesh_has_one_controller_that_every_regions_balancers_use(
        name: str, overlays: dict[str, Objects]) -> None:
    d = DEPLOYMENTS[name]
    everything = deployment(overlays, name)
    # One controller Deployment for the whole mesh, in the control overlay: a leader and
    # a standby (docs/operations-control-ha.md) that a rollout or a drain never both take
    # down (surge first, a PodDisruptionBudget), spread over nodes; at most one Redis.
    (ctl,) = [o for o in everything if o["kind"] == "Deployment"]
    assert ctl["metadata"]["name"] == "skymesh-controller" and ctl["spec"]["replicas"] == 2
    assert ctl["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert ctl in overlays[d["control"]]
    pdb = one(overlays[d["control"]], "PodDisruptionBudget", "skymesh-controller")
    assert pdb["spec"]["minAvailable"] == 1
    labels = ctl["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spread = ctl["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert {t["podAffinityTerm"]["topologyKey"] for t in terms} >= {"kubernetes.io/hostname"}
    redis = [o for o in everything if o["kind"] == "StatefulSet"
             and o["metadata"]["name"] == "skymesh-redis"]
    assert len(redis) == (0 if name == "production" else 1)  # production: external Redis
    url = controller_url(overlays[d["control"]])
    regions, namespaces, ids = set(), set(), set()
    for region in d["regions"]:
        objs = overlays[region]
        if region != d["control"]:
            # A region brings no controller, no Redis, and no controller config of its own.
            assert not [o for o in objs if o["kind"] == "Deployment"
                        or re.match(r"skymesh-(controller|redis)", o["metadata"]["name"])]
        cfgs = balancer_configs(objs)
        # Every balancer of every region names the same controller: the control plane's
        # Service (a name resolvable from the region's namespace).
        assert {c.controller.url for c in cfgs} == {url}, region
        # The region the balancers run as is the overlay's value (the mesh-id prefix and
        # the monitoring label), also where an overlay replaces lb.yaml whole.
        assert {c.region for c in cfgs} == {values(region)["region"]}
        regions |= {c.region for c in cfgs}
        ids |= {c.mesh.id for c in cfgs}
        namespaces.add(namespace(one(objs, "StatefulSet", "skymesh-lb")))
    # Distinct regions, each in its own namespace, and mesh ids unique across the mesh.
    assert len(regions) == len(namespaces) == len(d["regions"])
    assert len(ids) == sum(BALANCERS[r] for r in d["regions"])
    # The controller admits the balancers of exactly these namespaces.
    policy = next(p for p in overlays[d["control"]] if p["kind"] == "NetworkPolicy"
                  and p["metadata"]["name"] == "skymesh-controller")
    (source,) = policy["spec"]["ingress"][0]["from"]
    (expr,) = source["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and set(expr["values"]) == namespaces


# -- the daemons would start: real flags, configs their own parsers accept ------------------


def parse_flags(script: str, args: list[str]) -> Any:
    assert script in SCRIPTS, f"{script} is not a console script of a distribution"
    parser = importlib.import_module(PARSERS[script]).build_parser()
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{script} rejects {args}") from exc


def container_env(objs: Objects, c: dict[str, Any], pod_name: str = "POD",
                  pod_ip: str = "10.0.0.1", pod_namespace: str = "NS") -> dict[str, str]:
    """What the kubelet would put in the environment: literal values, ConfigMap keys,
    the downward API's pod name, IP and namespace (as given), and Secret references as
    ``<secret NAME/KEY>``."""
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip,
              "metadata.namespace": pod_namespace}
    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        env |= one(objs, "ConfigMap", ref["configMapRef"]["name"])["data"]
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def secret_key(env_value: str) -> str:
    """The key of a ``<secret NAME/KEY>`` placeholder."""
    found = re.fullmatch(r"<secret [\w.-]+/([\w.-]+)>", env_value)
    assert found, f"{env_value!r} does not come from a Secret"
    return found.group(1)


def mounted_file(objs: Objects, pod: dict[str, Any], c: dict[str, Any], path: str
                 ) -> tuple[str, str, str]:
    """(kind, object name, key) of the ConfigMap or Secret key mounted at ``path``."""
    vols = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        if path.startswith(m["mountPath"] + "/"):
            key = path[len(m["mountPath"]) + 1:]
            vol = vols[m["name"]]
            if "configMap" in vol:
                cm = one(objs, "ConfigMap", vol["configMap"]["name"])
                assert key in cm["data"], f"{path}: no key {key}"
                return "ConfigMap", cm["metadata"]["name"], key
            items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
            return "Secret", vol["secret"]["secretName"], items.get(key, key)
    raise AssertionError(f"nothing is mounted at {path}")


@pytest.mark.parametrize("region", REGION_OVERLAYS)
def test_commands_and_configs_are_what_the_daemons_accept(region: str,
                                                           overlays: dict[str, Objects]
                                                           ) -> None:
    rendered = deployed(overlays, region)
    started = set()
    for w in workloads(rendered):
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["command"][0] not in PARSERS:
                continue
            env = container_env(rendered, c, pod_namespace=namespace(w))
            args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a)  # type: ignore[misc]
                    for a in c["args"]]
            flags = parse_flags(c["command"][0], args)
            started.add(c["command"][0])
            http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
            assert env["SKYMESH_HEALTH_PORT"] == str(http)
            if c["command"][0] == "skymesh-replica":
                assert (flags.host, flags.port) == ("0.0.0.0", http)
                continue
            kind, cm, key = mounted_file(rendered, pod, c, flags.config)
            assert kind == "ConfigMap"
            text = one(rendered, "ConfigMap", cm)["data"][key]
            if c["command"][0] == "skymesh-lb":
                check_lb_configs(rendered, w, c, yaml.safe_load(text), http)
            else:
                # The agent token's hash comes from the Secret, expanded when the daemon
                # loads the file: here a stand-in hash for the placeholder.
                sha_var = "SKYMESH_AGENT_TOKEN_SHA256"
                assert secret_key(env[sha_var]) == "agent-token-sha256"
                cfg = parse_controller_config(expand_env(
                    yaml.safe_load(text), {**env, sha_var: digest(AGENT_TOKEN)}))
                assert cfg.listen.port == http
                assert [(t.role, t.sha256) for t in cfg.tokens] == [
                    ("agent", digest(AGENT_TOKEN))]
                assert env["SKYMESH_ADMIN_TOKEN"].startswith("<secret ")
                assert flags.store.startswith(("redis://", "<secret "))
                if flags.store.startswith("redis://"):  # the bundled Redis, by its Service
                    redis = one(rendered, "Service", "skymesh-redis")
                    assert re.fullmatch(r"redis://:<secret [\w-]+/redis-password>@"
                                        r"skymesh-redis:6379/0", flags.store)
                    assert redis["spec"]["ports"][0]["port"] == 6379
    assert started == set(PARSERS)


def check_lb_configs(objs: Objects, sts: dict[str, Any], c: dict[str, Any],
                     raw: dict[str, Any], http: int) -> None:
    """lb.yaml as each balancer pod loads it, with its own pod name and IP: every pod is
    its own balancer and mesh member, linked to the controller, with its certificate."""
    pod, ns = sts["spec"]["template"]["spec"], namespace(sts)
    count = sts["spec"]["replicas"]
    ids = set()
    for i in range(count):
        name = f"{sts['metadata']['name']}-{i}"  # a StatefulSet's pod names
        env = container_env(objs, c, pod_name=name, pod_ip=f"10.0.0.{i + 1}", pod_namespace=ns)
        cfg = parse_lb_config(expand_env(raw, env))
        region = cfg.region
        assert region and "$" not in region
        check_lb_config(objs, pod, c, cfg, http, ns)
        # Balancer id = mesh id = region + pod name: unique within the region (pod
        # names) and across regions (the prefix), and stable across restarts.
        assert cfg.mesh is not None and cfg.controller is not None
        assert cfg.mesh.id == f"{region}-{name}" and cfg.controller.balancer_id is None
        ids.add(cfg.mesh.id)
        # The gRPC listener binds the pod's IP: the address the controller gives peers.
        assert cfg.mesh.listen_host == f"10.0.0.{i + 1}"
        mesh_port = next(p for p in c["ports"] if p["name"] == "mesh")["containerPort"]
        assert cfg.mesh.listen_port == mesh_port and not cfg.mesh.peers
        assert admits(objs, "skymesh-lb", mesh_port, src_ns="another-region")
        # Its certificate pair and the mesh CA come from the mesh Secret.
        for path in (f"{cfg.mesh.certs_dir}/ca.crt", f"{cfg.mesh.certs_dir}/{cfg.mesh.id}.crt",
                     f"{cfg.mesh.certs_dir}/{cfg.mesh.id}.key"):
            assert mounted_file(objs, pod, c, path)[0] == "Secret", path
        # The mesh's controller: its Service in the control namespace, the agent token
        # from the balancers' Secret, and this pod's own address (the headless Service's
        # per-pod name, with the namespace: the controller runs in another) for its probes.
        assert cfg.controller.url == controller_url(objs)
        assert cfg.controller.token_file
        assert mounted_file(objs, pod, c, cfg.controller.token_file)[::2] == ("Secret",
                                                                            "agent-token")
        headless = one(objs, "Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
            "labels"].items()
        assert cfg.controller.advertise_url == (
            f"http://{name}.{headless['metadata']['name']}.{ns}.svc:{http}")
        assert {p["port"] for p in headless["spec"]["ports"]} == {http, mesh_port}
    assert len(ids) == count


def check_lb_config(objs: Objects, pod: dict[str, Any], c: dict[str, Any], cfg: Any,
                    http: int, ns: str) -> None:
    assert cfg.listen.port == http and cfg.listen.host == "0.0.0.0"
    # A public balancer needs client keys: they come from a mounted Secret.
    assert cfg.auth.api_keys_file and not cfg.auth.allow_anonymous
    kind, _, key = mounted_file(objs, pod, c, cfg.auth.api_keys_file)
    assert (kind, key) == ("Secret", "api-keys")
    # Each replica URL names a pod of the replica StatefulSet through its headless Service,
    # with the namespace: the controller probes the same URLs from its own.
    sts = one(objs, "StatefulSet", "skymesh-replica")
    svc = one(objs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and namespace(svc) == ns
    pods = {f"http://skymesh-replica-{i}.{svc['metadata']['name']}.{ns}.svc:"
            f"{svc['spec']['ports'][0]['port']}" for i in range(sts["spec"]["replicas"])}
    assert {r.url for r in cfg.replicas} == pods


# -- network policies -----------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_namespace(objs: Objects, app: str) -> str:
    """The namespace of the workload whose pods are the ``app``."""
    (w,) = [w for w in workloads(objs)
            if w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == app]
    return namespace(w)


def admits(objs: Objects, pod: str, port: int, *, src_ns: str | None = None,
           peer: str | None = None) -> bool:
    """Would the NetworkPolicies let a pod of app ``peer`` (no app label if None) in the
    namespace ``src_ns`` (the ``pod`` app's own if None) connect to ``port`` of the
    ``pod`` app's pods? Only the policies of the pods' own namespace count."""
    labels, ns = {"app.kubernetes.io/name": pod}, pod_namespace(objs, pod)
    src_ns = src_ns or ns
    src_labels = {"app.kubernetes.io/name": peer} if peer else {}
    policies = [p for p in objs if p["kind"] == "NetworkPolicy" and namespace(p) == ns
                and selects(p["spec"]["podSelector"], labels)]
    assert any(p["spec"]["podSelector"] == {} for p in policies), f"no default deny in {ns}"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            if rule.get("ports") and port not in {x["port"] for x in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            if any(source_matches(src, ns, src_ns, src_labels) for src in rule["from"]):
                return True
    return False


def source_matches(src: dict[str, Any], policy_ns: str, src_ns: str,
                   src_labels: dict[str, str]) -> bool:
    """A NetworkPolicy ``from`` entry: a namespaceSelector alone (any pod there), a
    podSelector alone (pods of the policy's namespace), or both (those pods there)."""
    assert set(src) <= {"namespaceSelector", "podSelector"} and src, src
    if "namespaceSelector" in src:
        in_ns = selects(src["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
    else:
        in_ns = src_ns == policy_ns
    return in_ns and selects(src.get("podSelector", {}), src_labels)


@pytest.mark.parametrize("region", REGION_OVERLAYS)
def test_network_policies_admit_exactly_who_needs_in(region: str,
                                                     overlays: dict[str, Objects]) -> None:
    objs = deployed(overlays, region)
    lb_ns, ctl_ns = pod_namespace(objs, "skymesh-lb"), pod_namespace(objs, "skymesh-controller")
    assert lb_ns != ctl_ns  # the control plane has a namespace of its own
    prom = values(region)["prometheusNamespace"]
    # Prometheus scrapes the three daemons' /metrics, and no other namespace gets in.
    for app, port in {"skymesh-lb": 8080, "skymesh-controller": 8080,
                      "skymesh-replica": 8001}.items():
        assert admits(objs, app, port, src_ns=prom), f"Prometheus cannot scrape {app}"
    assert not admits(objs, "skymesh-replica", 8001, src_ns="default")
    assert not admits(objs, "skymesh-controller", 8080, src_ns="default")
    # The region's balancers reach the controller in its namespace; balancer-labelled
    # pods elsewhere, and other pods of the region, do not.
    assert admits(objs, "skymesh-controller", 8080, src_ns=lb_ns, peer="skymesh-lb")
    assert not admits(objs, "skymesh-controller", 8080, src_ns="default", peer="skymesh-lb")
    assert not admits(objs, "skymesh-controller", 8080, src_ns=lb_ns, peer="some-other-app")
    assert not admits(objs, "skymesh-controller", 8080, src_ns=ctl_ns, peer="skymesh-lb")
    # Replicas: the region's balancers and the controller's probes, from the control
    # namespace only (a controller-labelled pod of the region's namespace is not it).
    assert admits(objs, "skymesh-replica", 8001, peer="skymesh-lb")
    assert admits(objs, "skymesh-replica", 8001, src_ns=ctl_ns, peer="skymesh-controller")
    assert not admits(objs, "skymesh-replica", 8001, peer="skymesh-controller")
    assert not admits(objs, "skymesh-replica", 8001, peer="some-other-app")
    assert not admits(objs, "skymesh-replica", 8001, src_ns=ctl_ns, peer="skymesh-lb")
    # The balancers: their HTTP edge (clients, the controller's probes) and mesh port
    # (peers of every region, mutual TLS) from anywhere.
    for port in (8080, 7001):
        assert admits(objs, "skymesh-lb", port, src_ns=ctl_ns, peer="skymesh-controller")
        assert admits(objs, "skymesh-lb", port, src_ns="anywhere")
    # Redis, where there is one: the controller alone.
    if [w for w in workloads(objs) if w["metadata"]["name"] == "skymesh-redis"]:
        assert admits(objs, "skymesh-redis", 6379, peer="skymesh-controller")
        assert not admits(objs, "skymesh-redis", 6379, peer="skymesh-lb")
        assert not admits(objs, "skymesh-redis", 6379, src_ns=lb_ns, peer="skymesh-lb")
        assert not admits(objs, "skymesh-redis", 6379, src_ns=lb_ns, peer="skymesh-controller")
        assert not admits(objs, "skymesh-redis", 6379, src_ns=prom)


# -- secrets: none in the repository, a clear failure without them --------------------------


@pytest.mark.parametrize("name", ["example", "mesh"])
def test_the_default_render_holds_no_secret_material(name: str,
                                                     overlays: dict[str, Objects]) -> None:
    objs = deployment(overlays, name)
    assert not [o for o in objs if o["kind"] == "Secret"]
    text = yaml.safe_dump_all(objs)
    assert OLD_HASH not in text
    assert not re.search(r"\b[0-9a-f]{64}\b", text), "a token hash in the manifests"
    for w in workloads(objs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                assert "value" in e or {"secretKeyRef", "fieldRef"} & e["valueFrom"].keys()
                if e["name"] == "CONTROLLER_URL":  # an address, not a credential
                    assert "@" not in e["value"], "credentials in the controller's URL"
                elif re.search(r"TOKEN|PASSWORD|KEY|URL", e["name"]):
                    assert "value" not in e, f"{e['name']} is set in the manifest"


def test_operator_secrets_reach_the_pods_only_through_secret_objects(
        overlays: dict[str, Objects]) -> None:
    production = deployment(overlays, "production")
    secrets = {o["metadata"]["name"]: o for o in production if o["kind"] == "Secret"}
    data = {k: base64.b64decode(v).decode() for s in secrets.values()
            for k, v in s["data"].items()}
    mesh = {k: data.pop(k) for k in list(data) if k == "ca.crt" or k.startswith("eu-west-")}
    assert data == SECRET_FILES
    # Each Secret lives where its pods are: the controller's in the control namespace,
    # the balancers' in the region's.
    for overlay in DEPLOYMENTS["production"].values():
        for name in [overlay] if isinstance(overlay, str) else overlay:
            objs = overlays[name]
            (ns,) = {namespace(w) for w in workloads(objs)}
            assert {namespace(s) for s in objs if s["kind"] == "Secret"} == {ns}
    # The mesh Secret: the CA and, for every balancer pod, a certificate whose CN (what
    # peers check) is that pod's mesh id, signed by the CA.
    ca = x509.load_pem_x509_certificate(mesh["ca.crt"].encode())
    assert sorted(mesh) == sorted(["ca.crt", *(f"{i}.{e}" for i in MESH_IDS
                                               for e in ("crt", "key"))])
    assert len(MESH_IDS) == one(production, "StatefulSet", "skymesh-lb")["spec"]["replicas"]
    for mesh_id in MESH_IDS:
        cert = x509.load_pem_x509_certificate(mesh[f"{mesh_id}.crt"].encode())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == mesh_id
        cert.verify_directly_issued_by(ca)
    others = yaml.safe_dump_all([o for o in production if o["kind"] != "Secret"])
    for text in SECRET_FILES.values():
        for line in text.splitlines():
            assert line not in others
    refs = set()
    for w in workloads(production):
        pod = w["spec"]["template"]["spec"]
        refs |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        refs |= {e["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"]
                 for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == set(secrets)  # the generated (hash-suffixed) names, every one used


def test_a_missing_value_or_secret_file_stops_the_render_and_names_it(tmp_path: Path) -> None:
    root = tree_copy(tmp_path, secrets=False)
    err = render_error(root / "overlays" / "production" / "eu-west")
    assert "secrets/api-keys" in err and "no such file" in err
    err = render_error(root / "overlays" / "production" / "control")
    assert "secrets/admin-token" in err and "no such file" in err
    for overlay, key in (("example", "lbSecretName"), ("mesh/us-east", "controllerUrl"),
                         ("mesh/control", "controllerSecretName")):
        vals = root / "overlays" / overlay / "values.yaml"
        vals.write_text(re.sub(rf"\n\s*{key}:.*", "", vals.read_text()))
        err = render_error(root / "overlays" / overlay)
        assert f"data.{key}" in err and "skymesh-values" in err


# -- Prometheus Operator objects ------------------------------------------------------------


def test_prometheusrule_carries_the_alert_rules_and_servicemonitor_the_jobs(
        overlays: dict[str, Objects]) -> None:
    for name in ("example", "mesh"):  # opt-in: a component the overlay lists
        assert not [o for o in deployment(overlays, name) if o["kind"] in CRD_KINDS]
    production = deployment(overlays, "production")
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    # One set of alert rules for the mesh, with its control plane.
    (rule,) = [o for o in production if o["kind"] == "PrometheusRule"]
    assert rule in overlays["production/control"]
    assert rule["spec"]["groups"] == alerts["groups"], (
        "run python3 deploy/k8s/sync-prometheusrule.py")
    # A ServiceMonitor per namespace, each selecting the Services of its own.
    jobs = set()
    for monitor in (o for o in production if o["kind"] == "ServiceMonitor"):
        assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
        services = [s for s in production if s["kind"] == "Service"
                    and namespace(s) == namespace(monitor)
                    and selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert services, monitor["metadata"]["name"]
        for s in services:
            assert "http" in {p["name"] for p in s["spec"]["ports"]}
        mine = {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in services}
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        if mine & {"skymesh-lb", "skymesh-replica"}:
            region = next(r for r in endpoint["relabelings"] if r["targetLabel"] == "region")
            assert region["replacement"] == values("production/eu-west")["region"]
        jobs |= mine
    assert jobs == {"skymesh-lb", "skymesh-replica", "skymesh-controller"}
    # Every job alerts.yml names is scraped.
    assert set(re.findall(r'job="([\w-]+)"', json.dumps(alerts))) <= jobs
