"""Copy the alert groups of deploy/prometheus/alerts.yml into the PrometheusRule of
components/monitoring-control, so both Prometheus set-ups alert on the same rules.

    python3 deploy/k8s/sync-prometheusrule.py          # rewrite prometheusrule.yaml
    python3 deploy/k8s/sync-prometheusrule.py --check  # exit 1 if it is out of date

Kustomize cannot embed another file's YAML into a field, hence this copy;
tests/deploy/test_k8s_manifests.py fails when the two differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
TARGET = HERE / "components" / "monitoring-control" / "prometheusrule.yaml"
HEADER = ("# Generated from deploy/prometheus/alerts.yml by deploy/k8s/sync-prometheusrule.py:"
          "\n# edit alerts.yml, then run the script.\n")


def render() -> str:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "skymesh", "labels": {"app.kubernetes.io/name": "skymesh"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
