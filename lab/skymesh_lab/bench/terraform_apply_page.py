"""The results page of ``skymesh_lab.bench.terraform_apply``: what the three-region example
planned, applied and destroyed against moto, by resource type, and how long it took.

Kept apart from the run so the results registry (``results_pages``) imports no terraform
or moto machinery to render a page.
"""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.results_tables import num, secs, table

# What moto held after the apply, read back through the AWS API (JSON key -> label).
READ_BACK = (("latency_records", "Route53 latency records"),
             ("health_checks", "Route53 health checks"),
             ("auto_scaling_groups", "Auto Scaling groups (balancers)"),
             ("launch_templates", "launch templates"),
             ("replica_instances", "emulated replica instances"))


def terraform_apply(data: dict[str, Any]) -> str:
    setup = data.get("setup", {})
    regions = setup.get("regions", [])
    out = [f"Terraform {setup.get('terraform', '?')}, AWS provider "
           f"{setup.get('aws_provider', '?')} from the local mirror, moto "
           f"{setup.get('moto', '?')}; {len(regions)} regions ({', '.join(regions)}), "
           f"`emulated_replicas = {setup.get('emulated_replicas', '?')}`, "
           "`detailed_monitoring = false`, `ami_id` = one of moto's built-in images.", ""]
    rows = [["planned (`init` + `plan`)", num(data.get("planned"), "d"),
             secs(data.get("init_plan_seconds"), 1)],
            ["applied", num(data.get("applied"), "d"), secs(data.get("apply_seconds"), 1)],
            ["destroyed", num(data.get("destroyed"), "d"),
             secs(data.get("destroy_seconds"), 1)],
            ["left in the state after destroy", num(data.get("left_after_destroy"), "d"), "-"]]
    out += [table(["step", "resources", "wall time"], rows, [False, True, True]), ""]
    out += ["Read back from moto after the apply:", ""]
    out += [table(["what", "count"], [[label, num(data.get(key), "d")]
                                      for key, label in READ_BACK], [False, True]), ""]
    by_type = data.get("by_type", {})
    out += ["Resources in the state after the apply, by type:", ""]
    out += [table(["type", "count"], [[f"`{t}`", num(n, "d")] for t, n in by_type.items()]
                  + [["total", num(sum(by_type.values()), "d")]], [False, True])]
    return "\n".join(out)
