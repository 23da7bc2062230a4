"""Fixtures for the deploy tests: a Route53 client and a fresh zone on moto (tests/conftest.py)."""

from __future__ import annotations

import uuid
from typing import Any

import boto3
import pytest


@pytest.fixture
def route53(moto_url: str) -> Any:
    return boto3.client("route53", endpoint_url=moto_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture
def zone(route53: Any) -> tuple[str, str]:
    """A fresh hosted zone per test (health checks are per account, so each test's record
    name differs too): ``(zone name, zone id)``."""
    name = f"t{uuid.uuid4().hex[:10]}.example.com."
    resp = route53.create_hosted_zone(Name=name, CallerReference=uuid.uuid4().hex)
    return name, resp["HostedZone"]["Id"].rsplit("/", 1)[-1]
