"""Several balancer pods of one region, as deploy/k8s runs them, for real on loopback.

The balancer and controller config files are taken from the rendered example overlay
(``kubectl kustomize``) and run by real ``skymesh-lb`` and ``skymesh-controller``
processes with the environment the pod spec gives them: ``POD_NAME`` and ``POD_IP`` from
the downward API, ``REGION`` from the overlay's values, the agent token's hash from a
Secret. Only what cannot exist here is
swapped: cluster names for loopback URLs, mounted Secret paths for temporary files, and
one mesh port per process (the pods each have their own IP; here all share 127.0.0.1).

Two pods of ``us-east`` (``skymesh-lb-0``, ``skymesh-lb-1``) and one of ``eu-west`` must
each register under their own balancer id (= mesh id, ``REGION-POD_NAME``), share the
region's replica through the controller, answer chat completions, and peer with each
other over mTLS with the peer lists the controller hands out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import http_call
from support import wait_for as wait
from test_k8s_manifests import K8S, one, render

from skymesh.balancer.config import parse_config
from skymesh.common.config import ConfigError, expand_env, load_yaml
from skymesh.mesh import certs
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_controller.auth import digest

ADMIN, AGENT, CLIENT_KEY = "adm-k8s-test", "agt-k8s-test", "sk-k8s-test"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PODS = [("us-east", "skymesh-lb-0"), ("us-east", "skymesh-lb-1"), ("eu-west", "skymesh-lb-0")]


def call(url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """``http_call`` with a 200's body decoded from JSON."""
    status, raw = http_call(url, body, token)
    return status, json.loads(raw or b"null") if status == 200 else raw




def config_files() -> tuple[dict[str, Any], dict[str, Any]]:
    """(lb.yaml, controller.yaml) of the rendered example overlay, unexpanded."""
    objs = render(K8S / "overlays" / "example")
    lb_cm = one(objs, "ConfigMap", next(o["metadata"]["name"] for o in objs
                                        if o["kind"] == "ConfigMap"
                                        and o["metadata"]["name"].startswith("skymesh-lb")))
    ctl_cm = one(objs, "ConfigMap", next(o["metadata"]["name"] for o in objs
                                         if o["kind"] == "ConfigMap" and o["metadata"]["name"]
                                         .startswith("skymesh-controller")))
    return yaml.safe_load(lb_cm["data"]["lb.yaml"]), yaml.safe_load(
        ctl_cm["data"]["controller.yaml"])


def test_an_unset_variable_is_refused_naming_the_key(tmp_path: Path) -> None:
    lb, _ = config_files()
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(lb, sort_keys=False))
    env = {"REGION": "us-east", "CONTROLLER_URL": "http://skymesh-controller.skymesh-control:8080",
           "POD_NAMESPACE": "skymesh", "POD_IP": "10.0.0.1"}
    with pytest.raises(ConfigError, match=r"^mesh\.id: \$\{POD_NAME\} is not set"):
        parse_config(load_yaml(path, env))
    cfg = parse_config(load_yaml(path, {**env, "POD_IP": "10.0.0.7",
                                        "POD_NAME": "skymesh-lb-3"}))
    assert cfg.mesh is not None and cfg.controller is not None
    assert (cfg.mesh.id, cfg.mesh.listen_host) == ("us-east-skymesh-lb-3", "10.0.0.7")
    assert cfg.controller.advertise_url == "http://skymesh-lb-3.skymesh-lb-mesh.skymesh.svc:8080"
    assert cfg.controller.url == env["CONTROLLER_URL"]
    # $$ escapes; only strings are touched.
    assert expand_env({"a": ["$${POD_NAME}", 1]}, {}) == {"a": ["${POD_NAME}", 1]}


@pytest.fixture
def region_pods(tmp_path: Path) -> Iterator[dict[str, Any]]:
    lb_raw, ctl_raw = config_files()
    # Every daemon starts at once (start-up is mostly imports): ports chosen beforehand.
    replica_url = f"http://127.0.0.1:{free_port()}"
    ctl_port = free_port()
    ctl_url = f"http://127.0.0.1:{ctl_port}"
    ctl_cfg = {**ctl_raw, "listen": {"host": "127.0.0.1", "port": ctl_port},
               "probe": {"interval_s": 0.2, "timeout_s": 1.0, "failure_threshold": 2,
                         "success_threshold": 1},
               "url_policy": {"allow_loopback": True}}
    (tmp_path / "controller.yaml").write_text(yaml.safe_dump(ctl_cfg))
    # name -> (console script, args, environment)
    runs: dict[str, tuple[str, list[str], dict[str, str] | None]] = {
        "replica": ("skymesh-replica", ["--port", replica_url.rsplit(":", 1)[1],
                                        "--time-scale", "0.05"], None),
        # What the pod spec's env gives it: the admin token, the agent token's hash, and
        # its pod's name and address.
        "controller": ("skymesh-controller",
                       ["--config", str(tmp_path / "controller.yaml"), "--store", "memory"],
                       {**_base_env(), "SKYMESH_ADMIN_TOKEN": ADMIN,
                        "SKYMESH_AGENT_TOKEN_SHA256": digest(AGENT),
                        # the downward API's, for its name in the leader lease
                        "POD_NAME": "skymesh-controller-0", "POD_IP": "127.0.0.1"}),
    }
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "api-keys").write_text(CLIENT_KEY + "\n")
    (secrets / "agent-token").write_text(AGENT + "\n")
    pki = tmp_path / "mesh"
    certs.create_ca(pki)
    for region, pod in PODS:
        mesh_id = f"{region}-{pod}"
        certs.issue_cert(pki, mesh_id)
        cfg = json.loads(json.dumps(lb_raw))  # a deep copy
        # The eu-west region's own file: the same but for its replicas (the region and
        # the mesh id's prefix come from REGION).
        cfg["replicas"] = ([{"url": replica_url, "kind": "skymesh"}]
                           if region == "us-east" else [])
        cfg["listen"] = {"host": "127.0.0.1", "port": 0}
        cfg["auth"]["api_keys_file"] = str(secrets / "api-keys")
        cfg["mesh"].update(certs_dir=str(pki), listen_port=free_port(),
                           heartbeat_interval_s=0.1)
        link = cfg["controller"]
        link.update(url=ctl_url, token_file=str(secrets / "agent-token"), retry_s=0.2,
                    poll_wait_s=2.0, url_policy={"allow_loopback": True})
        link.pop("advertise_url")  # the pod's DNS name; here the address it binds
        path = tmp_path / f"{mesh_id}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        runs[mesh_id] = ("skymesh-lb", ["--config", str(path)],
                         {**_base_env(), "REGION": region, "POD_NAME": pod,
                          "POD_IP": "127.0.0.1"})
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(start_daemon, script, args, env=env,
                                     log_path=tmp_path / f"{name}.log", timeout=120)
                   for name, (script, args, env) in runs.items()}
    started: dict[str, Daemon] = {}
    try:
        errors = []
        for name, fut in futures.items():
            try:
                started[name] = fut.result()
            except RuntimeError as exc:
                errors.append(f"{name}: {exc}")
        assert not errors, "\n".join(errors)
        ctl = started["controller"]
        for name, lat, lon in (("us-east", 38.9, -77.0), ("eu-west", 53.3, -6.3)):
            status, body = call(ctl.url + "/v1/regions",
                                {"name": name, "latitude": lat, "longitude": lon}, ADMIN)
            assert status == 201, body
        yield {"controller": ctl, "replica": started["replica"],
               "lbs": {f"{r}-{p}": started[f"{r}-{p}"] for r, p in PODS}}
    finally:
        with ThreadPoolExecutor(len(runs)) as pool:
            list(pool.map(Daemon.stop, started.values()))


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SKYMESH_")}


def test_each_pod_is_its_own_balancer_shares_the_replicas_and_peers(
        region_pods: dict[str, Any]) -> None:
    ctl, lbs = region_pods["controller"], region_pods["lbs"]
    replica = region_pods["replica"]
    ids = set(lbs)
    assert ids == {"us-east-skymesh-lb-0", "us-east-skymesh-lb-1", "eu-west-skymesh-lb-0"}

    def registered() -> bool:
        status, body = call(ctl.url + "/v1/balancers", token=ADMIN)
        return status == 200 and {b["id"] for b in body if b.get("state") == "up"} == ids

    wait(registered, "the controller probes all three balancers up, each under its own id",
         timeout=60)

    def status(mesh_id: str) -> dict[str, Any]:
        code, body = call(lbs[mesh_id].url + "/status", token=CLIENT_KEY)
        assert code == 200, body
        return body

    for mesh_id in ids:
        s = status(mesh_id)
        assert s["mesh"]["id"] == mesh_id and s["controller"]["balancer_id"] == mesh_id

    def shared() -> bool:
        return all(status(m)["replicas"].get(replica.url, {}).get("healthy")
                   for m in ids if m.startswith("us-east-"))

    wait(shared, "both us-east balancers serve the region's replica (controller membership)",
         timeout=60)

    def peered() -> bool:
        for me in ids:
            views = {p["id"]: p["liveness"] for p in status(me)["mesh"]["peers"]}
            if views != dict.fromkeys(ids - {me}, "alive"):
                return False
        return True

    wait(peered, "every balancer hears every other over mTLS, peers from the controller",
         timeout=60)

    chat = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    for mesh_id in ("us-east-skymesh-lb-0", "us-east-skymesh-lb-1"):
        code, body = call(lbs[mesh_id].url + "/v1/chat/completions", chat, CLIENT_KEY)
        assert code == 200, body
        assert body["choices"][0]["message"]["content"]
