"""Every metric name the docs and the deploy rules mention is one a running daemon exports.

A real skymesh-replica, a skymesh-lb with a mesh section (so the peering series exist), a
skymesh-lb with two workers (the workers' series) and a skymesh-controller with a planner
section (so the planner's series exist) run on loopback; their ``/metrics`` is parsed
with prometheus_client's parser. A family with no child yet still has its ``# HELP``/``#
TYPE`` lines, so no traffic is needed.

Scanned: README.md and docs/**/*.md (names in inline code and code blocks), except
docs/notes/, which are dated working notes that record names as they stood then; and
deploy/prometheus/*.yml, deploy/grafana/*.json and deploy/k8s/**/*.yaml (the
PrometheusRule): their PromQL. A counter is named by its sample, ``x_total``; a histogram
by its family ``x`` or a sample (``x_bucket`` ...).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from controller_support import planner_controller
from prometheus_client.parser import text_string_to_metric_families
from support import http_call, make_pki

from skymesh.util.procs import Daemon, free_port, start_daemon

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "README.md",
           *sorted(p for p in (REPO / "docs").rglob("*.md") if "notes" not in p.parts),
           *sorted((REPO / "deploy" / "prometheus").glob("*.yml")),
           *sorted((REPO / "deploy" / "grafana").glob("*.json")),
           *sorted((REPO / "deploy" / "k8s").rglob("*.yaml"))]
# A name ends where a word does; a path (docs/skymesh_x), a module (skymesh_lab.bench), a
# wheel file (skymesh_replica-0.1.0), a glob (skymesh_controller_*) or an assignment
# (-var skymesh_wheel_url=...) is not a metric.
NAME = re.compile(r"(?<![\w./-])skymesh_[a-z0-9_]*[a-z0-9](?![\w*/=:]|[.-][\w.])")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
# Names in backticks that are not metrics, and why.
NOT_METRICS = {
    "skymesh_controller": "the control plane's import package",
    "skymesh_replica": "the emulated replica's import package",
    "skymesh_lab": "the lab's import package",
}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("", "_bucket", "_sum", "_count",
                                                             "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": (
                "", "_bucket", "_gsum", "_gcount")}


def sample_names(exposition: str) -> set[str]:
    """The names a query may use: each family's samples, and those its type implies when
    it has no child yet (a counter ``x`` is ``x_total``, never ``x``)."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(exposition):
        out |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
        out |= {s.name for s in fam.samples}
    return out


def terraform_variables() -> set[str]:
    found = set()
    for tf in (REPO / "terraform").rglob("*.tf"):
        found |= set(re.findall(r'^variable "(\w+)"', tf.read_text(), re.M))
    return found


def mentioned(path: Path) -> Iterator[str]:
    """Metric-like names in ``path``: in a Markdown file, those in code (inline or fenced);
    elsewhere (rules, dashboards: PromQL throughout), all."""
    text = path.read_text()
    if path.suffix == ".md":
        text = "\n".join(m.group(0) for pat in (FENCE, CODE) for m in pat.finditer(text))
    yield from NAME.findall(text)


def test_the_name_finder_skips_paths_modules_wheels_globs_and_assignments() -> None:
    text = ("`skymesh_requests_total{outcome}` rate(skymesh_queue_wait_seconds_bucket[5m]) "
            "controller/skymesh_controller/x.py skymesh_lab.bench dist/skymesh_replica-0.1 "
            "`skymesh_controller_*` -var skymesh_wheel_url=s3:// `skymesh_peer_state`.")
    assert NAME.findall(text) == ["skymesh_requests_total", "skymesh_queue_wait_seconds_bucket",
                                  "skymesh_peer_state"]


def test_sample_names_follow_the_family_type_even_without_children() -> None:
    text = ("# HELP a_total A counter with labels and no child yet\n# TYPE a_total counter\n"
            "# HELP h A histogram\n# TYPE h histogram\n"
            'h_bucket{le="+Inf"} 1.0\nh_sum 0.5\nh_count 1.0\n'
            "# HELP g A gauge\n# TYPE g gauge\ng 3.0\n")
    names = sample_names(text)
    assert {"a_total", "h", "h_bucket", "h_sum", "h_count", "g"} <= names
    assert "a" not in names  # a doc must name the counter's sample


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    tmp = tmp_path_factory.mktemp("stack")
    pki = make_pki(tmp / "pki", rogue_id="lb-x")
    started: list[Daemon] = []
    try:
        replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                               log_path=tmp / "replica.log")
        started.append(replica)
        cfg = tmp / "lb.yaml"
        cfg.write_text(yaml.safe_dump({
            "region": "us", "listen": {"port": 0}, "replicas": [{"url": replica.url}],
            "mesh": {"id": "lb-a", "certs_dir": str(pki), "listen_port": free_port(),
                     "peers": [{"id": "lb-b", "address": f"127.0.0.1:{free_port()}"}]},
            "tenants": {}}))  # the tenant series (docs/tenancy.md)
        started.append(start_daemon("skymesh-lb", ["--config", str(cfg)],
                                    log_path=tmp / "lb.log"))
        # Two workers (no mesh: one identity), for the series only they export.
        started.append(start_daemon("skymesh-lb", ["--port", "0", "--replicas", replica.url,
                                                   "--workers", "2"],
                                    log_path=tmp / "lb-workers.log"))
        planner = {"mode": "dry-run", "capacity": {"llama": {"L4": 100.0}}}
        with planner_controller(tmp, planner) as ctl:
            names: set[str] = set()
            for d in (*started, ctl):
                status, body = http_call(d.url + "/metrics")
                assert status == 200, (d.name, body[:200])
                names |= sample_names(body.decode())
            yield names
    finally:
        for d in reversed(started):
            d.stop()


def test_every_metric_the_docs_name_is_exported(exported: set[str]) -> None:
    not_metrics = set(NOT_METRICS) | terraform_variables()
    assert all(importlib.util.find_spec(p) for p in NOT_METRICS)  # still packages
    wrong: dict[str, set[str]] = {}
    for path in SCANNED:
        for name in set(mentioned(path)) - exported - not_metrics:
            hint = f"{name} (a counter: {name}_total)" if f"{name}_total" in exported else name
            wrong.setdefault(hint, set()).add(str(path.relative_to(REPO)))
    assert not wrong, f"named but not exported by any daemon: {wrong}"
    # The scan sees the docs at all (a broken finder would pass everything).
    assert "skymesh_requests_total" in set(mentioned(REPO / "docs" / "operations.md"))
