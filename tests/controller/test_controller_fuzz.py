"""Schemathesis against the controller's own OpenAPI document, every operation.

In-process (ASGI, one event loop shared by all calls, lifespan run once), memory store,
no probing. Three runs over all operations:

- admin token, positive and negative inputs: no response may be a 5xx;
- every other credential (read, agent, an unknown token, none) on every operation: the
  answer is 401 or 403 exactly when ``NEEDS`` says so, which pins the role table.

Random names rarely hit anything that exists, so a hook steers part of the generated path
parameters and bodies to seeded regions, balancers, replicas and real policy names: the
deep paths (placement moves, policy construction, drain) get fuzzed too.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from controller_support import ADMIN, AGENT, READER, auth, token_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation

from skymesh.policies import policy_names
from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config
from skymesh_controller.store import MemoryStore

Role = str | None  # None: no token needed
RANK = {None: -1, "read": 0, "agent": 1, "admin": 2}

# What each operation needs. A new endpoint fails test_controller_fuzz_role_table_is_complete
# until it is listed here, so its role is a decision, not an accident.
NEEDS: dict[tuple[str, str], Role] = {
    ("GET", "/health"): None,
    ("GET", "/v1/regions"): "read",
    ("POST", "/v1/regions"): "admin",
    ("GET", "/v1/regions/{name}"): "read",
    ("DELETE", "/v1/regions/{name}"): "admin",
    ("GET", "/v1/balancers"): "read",
    ("POST", "/v1/balancers"): "agent",
    ("GET", "/v1/balancers/{bid}"): "read",
    ("PUT", "/v1/balancers/{bid}"): "agent",
    ("PATCH", "/v1/balancers/{bid}"): "agent",
    ("DELETE", "/v1/balancers/{bid}"): "admin",
    ("PUT", "/v1/balancers/{bid}/policy"): "admin",
    ("GET", "/v1/balancers/{bid}/membership"): "agent",
    ("POST", "/v1/balancers/{bid}/telemetry"): "agent",
    ("GET", "/v1/replicas"): "read",
    ("POST", "/v1/replicas"): "agent",
    ("GET", "/v1/replicas/{rid}"): "read",
    ("PUT", "/v1/replicas/{rid}"): "agent",
    ("PATCH", "/v1/replicas/{rid}"): "agent",
    ("DELETE", "/v1/replicas/{rid}"): "admin",
    ("POST", "/v1/replicas/{rid}/drain"): "admin",
    ("POST", "/v1/replicas/{rid}/undrain"): "admin",
    ("GET", "/v1/models"): "read",
    ("POST", "/v1/models"): "admin",
    ("DELETE", "/v1/models/{name}"): "admin",
    ("GET", "/v1/status"): "read",
    ("GET", "/v1/telemetry"): "read",
    ("GET", "/v1/telemetry/series"): "read",
    ("GET", "/v1/forecast"): "read",
    ("POST", "/v1/dns/sync"): "admin",
    # The planner's rounds: reading is read; running or approving a round is admin (or a
    # token named in planner.approvers, none here).
    ("GET", "/v1/plans"): "read",
    ("GET", "/v1/plans/{pid}"): "read",
    ("POST", "/v1/plans"): "admin",
    ("POST", "/v1/plans/{pid}/approve"): "admin",
    ("GET", "/v1/outlook"): "read",  # balancers poll it (mesh.outlook)
    # Tenants: writes need admin or the tenants role (not fuzzed here; test_tenants_api).
    ("GET", "/v1/tenants"): "read",
    ("GET", "/v1/tenants/{name}"): "read",
    ("PUT", "/v1/tenants/{name}"): "admin",
    ("DELETE", "/v1/tenants/{name}"): "admin",
}
CREDENTIALS: dict[str, tuple[str | None, Role]] = {  # label -> (token, its role)
    "read": (READER, "read"), "agent": (AGENT, "agent"),
    "unknown": ("not-a-known-token", None), "none": (None, None),
}
FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
AUTH_FUZZ = settings(FUZZ, max_examples=4)

# Long polls are capped at 10 ms: a generated `wait=300` must not stall the run.
# The documents are off by default; here they are on, behind the read token.
APP = build_app(parse_config({"tokens": token_config(), "long_poll_max_s": 0.01,
                              "api_docs": True, "url_policy": {"allow_loopback": True}}),
                store=MemoryStore(), probe=False)
# Every default check runs. positive_data_acceptance also accepts 422: a body can match the
# schema and still name a region that does not exist or a URL the url_policy refuses, and
# the admin API answers those with 422 naming the field (CONTRACTS.md), not 404 or 409.
CHECKS = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "422"]
"""
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, headers=auth(READER),
                                        config=schemathesis.Config.from_str(CHECKS))
# Authentication runs before any validation, so the role table needs only valid requests;
# negative inputs would also drop the Authorization header the test means to send.
roles_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", APP, headers=auth(READER),
    config=schemathesis.Config.from_str('[generation]\nmode = "positive"'))

SEED: dict[str, list[dict[str, Any]]] = {
    "regions": [{"name": "us-east", "latitude": 38.9, "longitude": -77.0},
                {"name": "eu-west", "latitude": 53.3, "longitude": -6.2}],
    "balancers": [{"id": "lb-us", "region": "us-east", "url": "http://127.0.0.1:9"},
                  {"id": "lb-eu", "region": "eu-west", "url": "http://127.0.0.1:9"},
                  # No replica calls it home, so DELETE can succeed.
                  {"id": "lb-spare", "region": "eu-west", "url": "http://127.0.0.1:9"}],
    "replicas": [{"id": "rep-1", "url": "http://127.0.0.1:9/1", "model": "m",
                  "region": "us-east", "gpu": "L4"},
                 {"id": "rep-2", "url": "http://127.0.0.1:9/2", "model": "m",
                  "region": "eu-west", "gpu": "L4", "balancer": "lb-eu"}],
}
KNOWN: dict[str, list[Any]] = {
    "name": ["us-east", "eu-west", "m"], "bid": ["lb-us", "lb-eu", "lb-spare"],
    "rid": ["rep-1", "rep-2"], "region": ["us-east", "eu-west"],
    "balancer": ["lb-us", "lb-eu"], "policy": policy_names(),
    "url": ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"],
    "params": [{}], "policy_params": [{}],
}

SEEN: Counter[str] = Counter()  # examples run per operation, reported at module teardown
SERVER_ERRORS: Counter[str] = Counter()
STATUS: Counter[tuple[str, int]] = Counter()  # admin run: (operation, status // 100)


NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _valid(key: str, v: Any) -> bool:
    """Steer only values that are valid already: swapping the one a negative case broke
    would make it valid while schemathesis still expects a rejection."""
    if key.endswith("params"):
        return isinstance(v, dict)
    if key == "url":
        return isinstance(v, str) and 0 < len(v) <= 2048
    return isinstance(v, str) and bool(NAME.match(v))


def _steer(value: Any) -> st.SearchStrategy[Any]:
    """Keep ``value``, or swap some known keys for names that exist (half the time each)."""
    if not isinstance(value, dict):
        return st.just(value)
    keys = [k for k in value if k in KNOWN and _valid(k, value[k])]
    if not keys:
        return st.just(value)
    swaps = st.fixed_dictionaries({}, optional={k: st.sampled_from(KNOWN[k]) for k in keys})
    return swaps.map(lambda s: {**value, **s})


@schema.hook("flatmap_path_parameters")
def _steer_path(ctx: schemathesis.HookContext, params: dict[str, Any]) -> Any:
    return _steer(params)


@schema.hook("flatmap_body")
def _steer_body(ctx: schemathesis.HookContext, body: Any) -> Any:
    return _steer(body)


def seed() -> None:
    """Create (or restore) the seeded objects; every POST here is an upsert."""
    for kind, objs in SEED.items():
        for obj in objs:
            res = schema[f"/v1/{kind}"]["POST"].Case(body=obj).call(headers=auth())
            assert res.status_code == 201, res.text


@pytest.fixture(scope="module", autouse=True)
def seeded() -> Iterator[None]:
    seed()
    yield
    by_class: Counter[str] = Counter()
    for (_, cls), n in STATUS.items():
        by_class[f"{cls}xx"] += n
    # Shown with `pytest -s`: the figures docs/notes/controller-ui.md reports.
    print(f"\nfuzz: {len(SEEN)} operations, {sum(SEEN.values())} requests, "
          f"{sum(SERVER_ERRORS.values())} 5xx {dict(SERVER_ERRORS)}; admin run by status "
          f"{dict(sorted(by_class.items()))}, operations answering 2xx: "
          f"{len({op for (op, cls) in STATUS if cls == 2})}")


def test_controller_fuzz_role_table_is_complete() -> None:
    for s in (schema, roles_schema):
        ops = {(method.upper(), path) for path, methods in s.raw_schema["paths"].items()
               for method in methods}
        assert ops == set(NEEDS)


@schema.parametrize()
@FUZZ
def test_controller_fuzz_admin_no_server_error(case: schemathesis.Case) -> None:
    # Negative cases include methods the path does not declare (TRACE, ...): any non-5xx.
    SEEN[case.operation.label] += 1
    headers = auth(ADMIN)
    header_info = case.meta.components.get(ParameterLocation.HEADER) if case.meta else None
    if header_info is not None and header_info.mode.is_negative:
        # The negative case dropped or broke a header (the token): send it as generated,
        # or our header would make the request valid again.
        headers = {}
    response = case.call(headers=headers)
    STATUS[(case.operation.label, response.status_code // 100)] += 1
    if response.status_code >= 500:
        SERVER_ERRORS[case.operation.label] += 1
    if case.method.upper() == "DELETE" and response.status_code == 204:
        seed()  # a seeded object went away: bring it back for the operations after this
    case.validate_response(response)


@roles_schema.parametrize()
@AUTH_FUZZ
def test_controller_fuzz_roles(case: schemathesis.Case) -> None:
    need = NEEDS[(case.method.upper(), case.operation.path)]
    for label, (token, role) in CREDENTIALS.items():
        SEEN[case.operation.label] += 1
        response = case.call(headers=auth(token) if token else {})
        status = response.status_code
        if need is not None and role is None:
            expected: int | None = 401
        elif RANK[role] < RANK[need]:
            expected = 403
        else:
            expected = None
        if expected is not None:
            assert status == expected, f"{label} token: {case.as_curl_command()} -> {status}"
            assert response.json()["error"]["type"] in ("unauthorized", "forbidden")
        else:
            # The role is enough; a 403 now can only be about owning the record.
            kind = response.json()["error"]["type"] if status == 403 else None
            assert status != 401 and kind in (None, "not_owner") and status < 500, (
                f"{label} token: {case.as_curl_command()} -> {status} {response.text[:300]}")
