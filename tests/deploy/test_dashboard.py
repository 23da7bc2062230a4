"""The Grafana dashboards and the alert rules against what the daemons really export.

A real skymesh-replica, skymesh-lb and skymesh-controller run (tests/deploy/
scrape_support.py); their /metrics is parsed with prometheus_client's parser. Every query
of every dashboard in deploy/grafana/ and every expression of deploy/prometheus/alerts.yml
must use only exported names, take rate() of counters (and histogram buckets) only and of
nothing else, and group or filter only by labels the series or the scrape job
(deploy/prometheus/prometheus.yml) really set. ``promtool check metrics`` lints the
balancer's and the controller's exposition.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from scrape_support import running_stack

from skymesh.balancer.metrics import BalancerMetrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
JOB_OF = {"lb": "skymesh-lb", "replica": "skymesh-replica", "controller": "skymesh-controller"}
METRIC = re.compile(r"(?<![\w:])((?:skymesh_|skymesh:|vllm:|sglang:)[A-Za-z0-9_:]*|up(?=\{))")
RATE = re.compile(r"\b(?:rate|irate|increase)\(\s*$")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\{([^}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class Exported:
    kind: dict[str, str] = field(default_factory=dict)  # sample name -> family type
    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names
    job: dict[str, str] = field(default_factory=dict)  # sample name -> scrape job
    text: dict[str, str] = field(default_factory=dict)

    def rateable(self, name: str) -> bool:
        kind = self.kind[name]
        return ((kind == "counter" and name.endswith("_total"))
                or (kind in ("histogram", "summary")
                    and name.endswith(("_bucket", "_count", "_sum"))))


def target_labels() -> dict[str, set[str]]:
    """Per scrape job: the labels Prometheus attaches to every series it scrapes there
    (job, instance, and static labels every target group of the job sets)."""
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    out = {}
    for job in prom["scrape_configs"]:
        groups = [set(sc.get("labels", {})) for sc in job.get("static_configs", [])]
        out[job["job_name"]] = {"job", "instance"} | (set.intersection(*groups) if groups
                                                      else set())
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    with running_stack(tmp_path_factory.mktemp("stack")) as scrape:
        ex = Exported(text=scrape.text)
        for daemon, text in scrape.text.items():
            for fam in text_string_to_metric_families(text):
                # The family alone (no child yet) still names its samples.
                names = {s.name for s in fam.samples} or {
                    fam.name + "_total" if fam.type == "counter" else fam.name}
                for name in names:
                    ex.kind[name] = fam.type
                    ex.job[name] = JOB_OF[daemon]
                    ex.labels.setdefault(name, set())
                for s in fam.samples:
                    ex.labels[s.name] |= set(s.labels)
        # A labelled series nothing has touched yet (no retry happened, say) has no child
        # to show its label names: take those the balancer declares.
        bm = BalancerMetrics()
        for metric in [*vars(bm).values(), *vars(bm.enable_tenants()).values()]:
            declared = set(getattr(metric, "_labelnames", ()))
            for name in getattr(metric, "_name", None), f"{getattr(metric, '_name', '')}_total":
                if name in ex.labels and not ex.labels[name]:
                    ex.labels[name] = declared
        yield ex


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(where, expr, legendFormat) for every query of every dashboard."""
    out = []
    for path in sorted((DEPLOY / "grafana").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                out.append((f"{path.name}: {panel['title']}", t["expr"], t.get("legendFormat", "")))
    return out


def alert_exprs() -> list[tuple[str, str, str]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [(f"alerts.yml: {r['alert']}", r["expr"], "")
            for g in doc["groups"] for r in g["rules"]]


def problems(ex: Exported, expr: str, legend: str) -> list[str]:
    jobs = target_labels()
    bad: list[str] = []
    names = set()
    for m in METRIC.finditer(expr):
        name = m.group(1)
        if name == "up":
            continue
        names.add(name)
        if name not in ex.kind:
            bad.append(f"{name} is not exported")
            continue
        in_rate = bool(RATE.search(expr[:m.start()]))
        if ex.rateable(name) and not in_rate:
            bad.append(f"{name} is a {ex.kind[name]}: use it through rate()")
        if in_rate and not ex.rateable(name):
            bad.append(f"rate() of {name}, a {ex.kind[name]}")
    for job in re.findall(r'up\{job="([^"]+)"\}', expr):
        if job not in jobs:
            bad.append(f"up{{job={job!r}}}: no such scrape job in prometheus.yml")
    allowed = {"job", "instance", "le"}
    for name in names & set(ex.kind):
        allowed |= ex.labels[name] | jobs.get(ex.job[name], set())
    used = {x.strip() for g in GROUPING.findall(expr) for x in g.split(",") if x.strip()}
    for _, matchers in SELECTOR.findall(expr):
        used |= set(MATCHER.findall(matchers))
    used |= set(LEGEND.findall(legend))
    bad += [f"label {lbl!r} is set by neither the series nor the scrape job"
            for lbl in sorted(used - allowed)]
    return bad


def test_the_expressions_cover_every_dashboard_and_alert() -> None:
    dash = dashboard_exprs()
    assert len(dash) >= 26 and len(alert_exprs()) >= 7
    assert {p.name for p in (DEPLOY / "grafana").glob("*.json")} >= {
        "skymesh-dashboard.json", "skymesh-controller-dashboard.json"}


@pytest.mark.parametrize("where, expr, legend", [
    pytest.param(*q, id=f"{q[0]} [{i}]") for i, q in enumerate(dashboard_exprs() + alert_exprs())])
def test_queries_use_exported_names_counters_through_rate_and_real_labels(
        exported: Exported, where: str, expr: str, legend: str) -> None:
    assert not problems(exported, expr, legend), f"{where}: {problems(exported, expr, legend)}"


def test_every_tenant_series_has_a_panel() -> None:
    """Issue #37: each per-tenant series (docs/tenancy.md) is on the dashboard, split by
    tenant where it carries the label."""
    main = [(w, e, lg) for w, e, lg in dashboard_exprs() if w.startswith("skymesh-dashboard")]
    series = [(m._name + ("_total" if m._type == "counter" else ""), m._labelnames)
              for m in vars(BalancerMetrics().enable_tenants()).values()]
    # Read from the fair queue at scrape time (metrics.TenantQueueDepth).
    series.append(("skymesh_tenant_queue_waiting", ("tenant", "priority")))
    for name, labels in series:
        used = re.compile(rf"\b{name}(?:_bucket|_count|_sum)?\b")
        uses = [(e, lg) for _, e, lg in main if used.search(e)]
        assert uses, f"no panel queries {name}"
        for label in labels:
            assert all(label in e and f"{{{{{label}}}}}" in lg for e, lg in uses), (name, label)


def test_the_checker_catches_what_it_is_for(exported: Exported) -> None:
    """The rules above reject the mistakes the dashboard once made."""
    assert problems(exported, "rate(skymesh_queue_length[5m])", "")  # rate of a gauge
    assert problems(exported, "sum(skymesh_forwarded_out_total)", "")  # a raw counter
    assert problems(exported, "sum by (zone) (skymesh_queue_length)", "")  # no such label
    assert problems(exported, "vllm:gpu_cache_usage_perc", "")  # not exported any more
    assert problems(exported, 'up{job="skymesh-nothing"} == 0', "")
    assert not problems(exported, "sum by (region, model) (skymesh_queue_length)", "{{model}}")


def test_counters_are_typed_as_counters(exported: Exported) -> None:
    for name in ("skymesh_forwarded_out_total", "skymesh_forwarded_in_total",
                 "skymesh_peer_heartbeat_bytes_total", "skymesh_requests_total",
                 "skymesh_controller_probes_total", "skymesh_controller_http_requests_total"):
        assert exported.kind.get(name) == "counter", (name, exported.kind.get(name))
    # No gauge pretends to be a counter.
    fake = [n for n, k in exported.kind.items() if n.endswith("_total") and k != "counter"]
    assert not fake, fake


@pytest.mark.parametrize("daemon", ["lb", "controller"])
def test_promtool_finds_the_exposition_clean(exported: Exported, daemon: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "metrics"], input=exported.text[daemon],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{daemon}: {out.stdout}{out.stderr}"
