"""The pure parts of ``skymesh_lab.bench.terraform_apply`` and its results page: resource
counts from ``terraform show -json``, the provider override, user data as EC2 holds it."""

from __future__ import annotations

import base64
import gzip

from skymesh_lab.bench.terraform_apply import (
    ALIASES,
    SERVICES,
    override_tf,
    state_resources,
    unpack_user_data,
)
from skymesh_lab.bench.terraform_apply_page import terraform_apply


def test_resources_are_counted_through_every_child_module_and_data_is_not() -> None:
    show = {"values": {"root_module": {
        "resources": [{"mode": "managed", "type": "aws_route53_record"}],
        "child_modules": [
            {"resources": [{"mode": "data", "type": "aws_ami"},
                           {"mode": "managed", "type": "aws_vpc"}],
             "child_modules": [{"resources": [{"mode": "managed", "type": "aws_vpc"}]}]}]}}}
    assert state_resources(show) == {"aws_route53_record": 1, "aws_vpc": 2}
    assert not state_resources({"format_version": "1.0"})  # the state after destroy


def test_the_override_points_every_provider_alias_at_the_emulator() -> None:
    text = override_tf("http://127.0.0.1:4566")
    assert text.count('provider "aws"') == len(ALIASES)
    for alias in ALIASES:
        assert f'alias  = "{alias}"' in text
    assert text.count('"http://127.0.0.1:4566"') == len(ALIASES) * len(SERVICES)
    assert "skip_requesting_account_id  = true" in text


def test_user_data_unpacks_gzipped_or_plain() -> None:
    script = "#!/bin/bash\necho hi\n"
    assert unpack_user_data(base64.b64encode(gzip.compress(script.encode())).decode()) == script
    assert unpack_user_data(base64.b64encode(script.encode()).decode()) == script


def test_the_page_totals_the_types_and_prints_missing_figures_as_a_dash() -> None:
    text = terraform_apply({"setup": {"regions": ["us-east-1"]}, "planned": 3, "applied": 3,
                            "apply_seconds": 4.5,
                            "by_type": {"aws_vpc": 1, "aws_eip": 2}})
    assert "| applied | 3 | 4.5 s |" in text
    assert "| destroyed | - | - |" in text
    assert "| total | 3 |" in text
    assert "| Route53 latency records | - |" in text
