"""deploy/k8s/components/redis-sentinel: the bundled Redis as three pods, each a
redis-server and a sentinel, and the controllers on a ``redis+sentinel://`` URL.

Rendered by the real kustomize in an overlay (the example one, with the component added
in a copy of the tree), every object validated against the current Kubernetes schema, the
wiring checked (the URL names the StatefulSet's pods and the sentinels' service, the
NetworkPolicy admits the sentinel port and the Redis pods' replication), and the start
script's choices run with stand-in ``redis-cli``/``redis-server``/``hostname`` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from skymesh_controller.store import parse_sentinel_url

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
COMPONENT = K8S / "components" / "redis-sentinel"
Objects = list[dict[str, Any]]


def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not on PATH: it renders deploy/k8s (kubectl kustomize)")
    out = subprocess.run([exe, "version", "--client", "-o", "json"], capture_output=True,
                         text=True, check=False)
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    if not version.startswith("v5"):
        pytest.skip(f"kubectl's kustomize is {version or 'unknown'}; deploy/k8s needs v5+")
    return exe


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Objects:
    root = tmp_path_factory.mktemp("sentinel") / "k8s"
    shutil.copytree(K8S, root)
    overlay = root / "overlays" / "example" / "kustomization.yaml"
    doc = yaml.safe_load(overlay.read_text())
    doc["components"].append("../../components/redis-sentinel")
    overlay.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([kubectl(), "kustomize", str(overlay.parent)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


def one(objs: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def test_every_object_is_valid_and_in_the_control_namespace(rendered: Objects) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    for obj in rendered:
        if obj["kind"] in {"ServiceMonitor", "PrometheusRule"}:
            continue
        kv.validate(obj, version, strict=True)
        if obj["metadata"]["name"].startswith("skymesh-redis"):
            assert obj["metadata"].get("namespace") == "skymesh-control", obj["kind"]


def test_three_redis_pods_with_sentinels_and_the_controllers_find_them(
        rendered: Objects) -> None:
    sts = one(rendered, "StatefulSet", "skymesh-redis")
    pod = sts["spec"]["template"]
    assert sts["spec"]["replicas"] == 3
    redis, sentinel = container(pod, "redis"), container(pod, "sentinel")
    # Both run the script the ConfigMap carries (its hashed name resolved).
    cm_name = next(v["configMap"]["name"] for v in pod["spec"]["volumes"]
                   if v["name"] == "start")
    cm = one(rendered, "ConfigMap", cm_name)
    assert cm["data"]["start.sh"] == (COMPONENT / "start.sh").read_text()
    for c, role in ((redis, "redis"), (sentinel, "sentinel")):
        assert c["command"] == ["sh", "/etc/skymesh/redis/start.sh"]
        env = {e["name"]: e for e in c["env"]}
        assert env["ROLE"]["value"] == role
    # The same Secret as the controller's password.
    ctl = container(one(rendered, "Deployment", "skymesh-controller")["spec"]["template"],
                    "controller")
    secret = {e["name"]: e for e in ctl["env"]}["REDIS_PASSWORD"]["valueFrom"]
    for c in (redis, sentinel):
        assert {e["name"]: e for e in c["env"]}["REDIS_PASSWORD"]["valueFrom"] == secret
    # The controller's store names each pod's sentinel, through the headless Service.
    svc = one(rendered, "Service", "skymesh-redis")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {6379, 26379}
    url = ctl["args"][ctl["args"].index("--store") + 1]
    hosts, service, db, password = parse_sentinel_url(url)
    assert hosts == [(f"skymesh-redis-{i}.{svc['metadata']['name']}", 26379)
                     for i in range(3)]
    assert service == "skymesh" and db == 0 and password == "$(REDIS_PASSWORD)"
    assert "sentinel monitor skymesh " in cm["data"]["start.sh"]
    # Two of three stay through a drain: a primary, a replica and a sentinel quorum.
    assert one(rendered, "PodDisruptionBudget", "skymesh-redis")["spec"]["minAvailable"] == 2


def test_the_network_policy_admits_the_sentinels_and_replication(rendered: Objects) -> None:
    pol = one(rendered, "NetworkPolicy", "skymesh-redis")
    admitted: dict[str, set[int]] = {}
    for rule in pol["spec"]["ingress"]:
        for src in rule["from"]:
            name = src["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            admitted.setdefault(name, set()).update(p["port"] for p in rule["ports"])
    assert admitted == {"skymesh-controller": {6379, 26379},
                        "skymesh-redis": {6379, 26379}}


def test_checkov_finds_nothing_in_the_rendered_component(rendered: Objects,
                                                          tmp_path: Path) -> None:
    """As test_k8s_manifests checks the overlays (same skips, same reasons)."""
    path = os.environ.get("CHECKOV") or shutil.which("checkov")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("checkov not found: set CHECKOV=/path/to/venv/bin/checkov")
    (tmp_path / "sentinel.yaml").write_text(yaml.safe_dump_all(rendered, sort_keys=False))
    proc = subprocess.run(
        [path, "--framework", "kubernetes", "--output", "json", "--skip-download",
         "--skip-check", "CKV_K8S_43,CKV_K8S_15", "--directory", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LOG_LEVEL": "ERROR"})
    assert proc.stdout.startswith("{"), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}"
              for c in report["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert {c["check_id"] for c in report["results"]["skipped_checks"]} <= {"CKV_K8S_35"}


STUBS = {
    # redis-cli: the sentinel answer the test sets (empty: no sentinel is up yet).
    "redis-cli": '#!/bin/sh\nprintf "%s" "$SENTINEL_ANSWER"\n',
    "redis-server": '#!/bin/sh\necho "redis-server $*"\n',
    "hostname": '#!/bin/sh\necho "$POD"\n',
}


def start(tmp: Path, pod: str, role: str, answer: str = "") -> str:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "POD": pod, "ROLE": role,
           "SENTINEL_ANSWER": answer, "REDIS_PASSWORD": "pw", "RUN_DIR": str(tmp)}
    out = subprocess.run(["sh", str(COMPONENT / "start.sh")], env=env, capture_output=True,
                         text=True, check=False, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_start_script_picks_the_primary(tmp_path: Path) -> None:
    # First start, no sentinel answers: pod 0 is the primary, the others its replicas.
    first = start(tmp_path, "skymesh-redis-0", "redis")
    assert "--replicaof" not in first and "--appendfsync always" in first
    assert "--min-replicas-to-write 1" in first and "--masterauth pw" in first
    assert ("--replicaof skymesh-redis-0.skymesh-redis 6379"
            in start(tmp_path, "skymesh-redis-2", "redis"))
    # After a failover pod 0 restarts as a replica of the primary the sentinels name.
    assert ("--replicaof skymesh-redis-1.skymesh-redis 6379"
            in start(tmp_path, "skymesh-redis-0", "redis", "skymesh-redis-1.skymesh-redis"))
    # And the promoted pod, restarting, is the primary again.
    again = start(tmp_path, "skymesh-redis-1", "redis", "skymesh-redis-1.skymesh-redis")
    assert "--replicaof" not in again
    # A sentinel monitors the primary (by name) with the password.
    out = start(tmp_path, "skymesh-redis-2", "sentinel", "skymesh-redis-1.skymesh-redis")
    assert out.strip() == f"redis-server {tmp_path}/sentinel.conf --sentinel"
    conf = (tmp_path / "sentinel.conf").read_text()
    assert "sentinel monitor skymesh skymesh-redis-1.skymesh-redis 6379 2" in conf
    assert "sentinel auth-pass skymesh pw" in conf
    assert conf.index("resolve-hostnames yes") < conf.index("sentinel monitor")
