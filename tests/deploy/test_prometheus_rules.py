"""deploy/prometheus/: the alert rules pass ``promtool check rules`` and their unit tests
(``promtool test rules alerts_test.yml``), the scrape configuration passes ``promtool check
config``, every alert has a firing and a quiet case, and the 5xx outcome pattern matches
exactly the balancer's server errors. (The names and labels the rules use are checked
against a live scrape in test_dashboard.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from skymesh.balancer import errors

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; "
                    "`make system-deps` does it)")
    return subprocess.run([exe, *args], cwd=PROM, capture_output=True, text=True, timeout=120)


def alerts() -> dict[str, dict[str, object]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def test_promtool_checks_the_rules() -> None:
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_checks_the_scrape_config_and_the_rules_it_loads() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fires, quiet = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert set(alerts()) == fires, set(alerts()) ^ fires
    assert set(alerts()) == quiet, set(alerts()) ^ quiet
    required = {"SkyMeshBalancerDown", "SkyMeshNoHealthyReplicas", "SkyMeshQueueSaturated",
                "SkyMeshPeerDown", "SkyMeshHigh5xxRatio", "SkyMeshProbeFailures",
                "SkyMeshControllerDown"}
    assert required <= set(alerts())
    for name, rule in alerts().items():
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), name  # type: ignore[union-attr]
        assert rule.get("for"), f"{name} fires on one bad evaluation"


def subclasses(cls: type) -> list[type]:
    return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]


def test_the_5xx_outcomes_are_exactly_the_balancers_server_errors() -> None:
    expr = str(alerts()["SkyMeshHigh5xxRatio"]["expr"])
    m = re.search(r'outcome=~"([^"]+)"', expr)
    assert m is not None
    pattern = re.compile(m.group(1))  # PromQL regexes are anchored at both ends

    def counted(outcome: str) -> bool:
        return pattern.fullmatch(outcome) is not None

    classes = subclasses(errors.SkyMeshError)
    assert {"NoCapacity", "UpstreamFailed", "BadRequest"} <= {c.__name__ for c in classes}
    for cls in classes:  # outcome = the class name (skymesh/balancer/server.py)
        assert counted(cls.__name__) == (cls.status >= 500), (cls.__name__, cls.status)
    for outcome, is_5xx in (("error", True), ("upstream_503", True), ("upstream_broken", True),
                            ("upstream_404", False), ("ok", False), ("cancelled", False)):
        assert counted(outcome) == is_5xx, outcome


def test_kubernetes_scrape_sets_region_on_balancers_and_replicas_only() -> None:
    doc = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    (job,) = doc["scrape_configs"]
    assert doc["rule_files"] == ["alerts.yml"]
    by_target = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert by_target["job"]["source_labels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    region = re.compile(by_target["region"]["regex"])
    assert region.fullmatch("skymesh-lb") and region.fullmatch("skymesh-replica")
    assert not region.fullmatch("skymesh-controller")
