"""Fixtures for the deploy tests: a Route53 client and a fresh zone on moto (tests/conftest.py),
and one wheel of this checkout for the installer tests."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from wheel_support import build_product_wheels, build_wheel


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


@pytest.fixture(scope="session")
def skymesh_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout (with its generated peering stubs), built once."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def product_wheels(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The data plane's, the replica's and the controller's wheels, built once."""
    return build_product_wheels(tmp_path_factory.mktemp("product-wheels"))
