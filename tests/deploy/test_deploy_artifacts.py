"""deploy/: units, image, manifests, configs and dashboards checked against the code they run."""

from __future__ import annotations

import argparse
import configparser
import importlib
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from support import until

from skymesh.balancer.config import load_config as load_lb_config
from skymesh.util.procs import Daemon, start_daemon
from skymesh_controller.config import parse_config as parse_controller_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# Console scripts of the distributions an operator installs (lab excluded).
SCRIPTS: dict[str, str] = {
    name: target for folder in (REPO, REPO / "controller", REPO / "replica")
    for name, target in tomllib.loads((folder / "pyproject.toml").read_text())["project"][
        "scripts"].items()}
PARSERS = {"skymesh-lb": "skymesh.balancer.cli", "skymesh-replica": "skymesh_replica.cli",
           "skymesh-controller": "skymesh_controller.cli"}
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "Restart": "on-failure",
             "User": "skymesh", "PrivateTmp": "yes", "ProtectHome": "yes"}


def parse_flags(script: str, args: list[str]) -> argparse.Namespace:
    """Parse ``args`` with the daemon's own argparse parser (fails on an unknown flag)."""
    assert script in SCRIPTS, f"{script} is not a console script of a distribution"
    parser = importlib.import_module(PARSERS[script]).build_parser()
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{script} rejects {args}") from exc


def read_unit(path: Path) -> configparser.ConfigParser:
    # Repeated keys (Environment=, SystemCallFilter=) accumulate in systemd: allow them.
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(path.read_text())
    return unit


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def exec_words(unit: configparser.ConfigParser, env: dict[str, str]) -> list[str]:
    """ExecStart split as systemd does, ``$VAR`` expanded to its words."""
    words: list[str] = []
    for word in shlex.split(unit["Service"]["ExecStart"]):
        if word.startswith("$"):
            words += env[word[1:].strip("{}")].split()
        else:
            words.append(word)
    return words


# -- systemd units ---------------------------------------------------------------------------

@pytest.mark.parametrize("daemon", ["lb", "replica", "controller"])
def test_units_run_real_scripts_with_real_flags_hardened(daemon: str) -> None:
    unit = read_unit(DEPLOY / "systemd" / f"skymesh-{daemon}.service")
    svc = unit["Service"]
    for key, value in HARDENING.items():
        assert svc.get(key) == value, f"skymesh-{daemon}.service: {key}"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    env: dict[str, str] = {}
    spec = svc.get("EnvironmentFile")
    if spec:
        path = DEPLOY / "config" / Path(spec.lstrip("-")).name
        # "-" marks an optional file (the controller's AWS credentials); others must ship.
        assert path.exists() or spec.startswith("-"), spec
        if path.exists():
            env.update(env_file(path))
    words = exec_words(unit, env)
    assert words[0] == f"/opt/skymesh/venv/bin/skymesh-{daemon}"
    args = parse_flags(f"skymesh-{daemon}", words[1:])
    if daemon != "replica":
        # The config it names is one of ours, and valid.
        assert args.config.startswith("/etc/skymesh/")
        assert (DEPLOY / "config" / Path(args.config).name).exists()


def test_example_configs_validate_against_the_daemons_models() -> None:
    lb = load_lb_config(DEPLOY / "config" / "lb.yaml")
    assert lb.mesh is not None and lb.mesh.listen_port == 7001 and lb.listen.host == "0.0.0.0"
    assert lb.auth.api_keys_file == "/etc/skymesh/api-keys"  # install-skymesh.sh puts it
    ctl = parse_controller_config(yaml.safe_load((DEPLOY / "config" / "controller.yaml")
                                                 .read_text()))
    assert ctl.dns is not None and ctl.dns.record == "api.example.com"
    assert {t.role for t in ctl.tokens} == {"admin", "read"}


# -- image and Kubernetes ----------------------------------------------------------------------

def test_dockerfile_is_multi_stage_locked_and_non_root() -> None:
    """The image (built for real in tests/e2e/test_image.py): dependencies from the lock in
    a layer before the source, the wheel built in a builder stage, only the venv copied
    into a runtime stage that runs as uid 10001."""
    lines = [line.strip() for line in (DEPLOY / "docker" / "Dockerfile").read_text()
             .splitlines() if line.strip() and not line.lstrip().startswith("#")]
    stages = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(stages) == 2 and lines[stages[0]].endswith(" AS builder")
    builder, runtime = lines[stages[0]:stages[1]], lines[stages[1]:]
    for line in lines:
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert src == "." or (REPO / src).exists(), f"Dockerfile copies missing {src}"
    copies = [i for i, line in enumerate(builder) if line.startswith("COPY ")]
    lock_install = next(i for i, line in enumerate(builder) if "-c /deps/lock.txt" in line)
    source = next(i for i in copies if builder[i].split()[1] == ".")
    assert lock_install < source, "dependencies must be installed before the source is copied"
    assert any("--from=builder /opt/skymesh" in line for line in runtime)
    assert not any(line.startswith("COPY . ") for line in runtime)
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(line.startswith("HEALTHCHECK ") for line in runtime)


# The Kubernetes manifests: tests/deploy/test_k8s_manifests.py (rendered by kustomize).


def test_prometheus_scrapes_metrics_endpoints() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert {"skymesh-lb", "skymesh-replica"} <= set(jobs)
    for name in ("skymesh-lb", "skymesh-replica"):
        assert jobs[name]["metrics_path"] == "/metrics"
        assert all(":" in t for sc in jobs[name]["static_configs"] for t in sc["targets"])


# -- the dashboard against what the daemons really export ----------------------------------

METRIC = re.compile(r"(?<![\w:])((?:skymesh_|skymesh:|vllm:|sglang:)[A-Za-z0-9_:]*)")


def exported_names(text: str) -> set[str]:
    """Series names a Prometheus server would store from this exposition."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def lb_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    tmp = tmp_path_factory.mktemp("metrics")
    replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                           log_path=tmp / "replica.log")
    try:
        # With a tenants section, for the per-tenant series the dashboard draws.
        (tmp / "lb.yaml").write_text(yaml.safe_dump({
            "listen": {"port": 0}, "replicas": [{"url": replica.url}], "tenants": {}}))
        lb = start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                          log_path=tmp / "lb.log")
        try:
            yield lb, replica
        finally:
            lb.stop()
    finally:
        replica.stop()


async def test_dashboard_queries_only_metrics_the_daemons_export(
        lb_and_replica: tuple[Daemon, Daemon]) -> None:
    lb, replica = lb_and_replica
    async with aiohttp.ClientSession() as session:
        async def ready() -> bool:
            async with session.get(lb.url + "/ready") as r:
                return r.status == 200
        await until(ready, "the balancer sees its replica")
        # One request, so every labelled series has a child.
        body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(lb.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        texts = []
        for d in (lb, replica):
            async with session.get(d.url + "/metrics") as r:
                texts.append(await r.text())
    exported = exported_names("\n".join(texts))
    dash = json.loads((DEPLOY / "grafana" / "skymesh-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        names = set(METRIC.findall(expr))
        assert names, f"no SkyMesh/vLLM metric in {expr!r}"
        used |= names
    missing = used - exported
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"
    assert {"skymesh_requests_total", "vllm:num_requests_waiting"} <= used
