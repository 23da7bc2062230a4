"""Route by route: the same request sent to a vLLM server directly and through skymesh-lb.

Each case records status, content type and body shape of both answers into
``out/e2e/compat.json`` (``tools/e2e/compat_table.py`` renders it as Markdown), then
asserts what a transparent balancer owes: the same status and the same body shape.
Routes the balancer answers itself (``/health``, ``/metrics``) only need the same status.
The pass-through of routes the balancer does not own, OpenAI-shaped errors, the
``X-Request-Id`` echo and the merged ``/v1/models`` fields are asserted like the rest.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm_cluster import MODEL_NAME, OUT_DIR, Cluster

CHAT = {"model": MODEL_NAME, "max_tokens": 4,
        "messages": [{"role": "user", "content": "How many clips?"}]}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    body: dict[str, Any] | None = None
    owned: bool = False  # answered by the balancer itself: only the status must match
    lb_status: int | None = None  # where the balancer deliberately answers otherwise
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def call(base: str, route: Route) -> Answer:
    data = None if route.body is None else json.dumps(route.body).encode()
    req = urllib.request.Request(base + route.path, data=data, method=route.method,
                                 headers={"Content-Type": "application/json", **route.headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return Answer(r.status, r.headers.get("Content-Type", ""), r.read(),
                          dict(r.headers.items()))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("Content-Type", ""), exc.read(),
                      dict(exc.headers.items()))


def shape(a: Answer) -> Any:
    """The body's shape, not its values: JSON object keys with their value types (one
    level down for the first element of a list), or the bare media type."""
    if "json" not in a.content_type:
        return a.content_type.split(";")[0] or "empty"
    try:
        return _shape(a.json(), depth=2)
    except ValueError:
        return "invalid json"


def _shape(v: Any, depth: int) -> Any:
    if isinstance(v, dict):
        return {k: _shape(x, depth - 1) if depth > 0 else type(x).__name__
                for k, x in sorted(v.items())}
    if isinstance(v, list):
        return [_shape(v[0], depth - 1)] if v and depth > 0 else "list"
    return type(v).__name__


class CompatTable:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}

    def record(self, name: str, route: Route, direct: Answer, lb: Answer) -> None:
        self.rows[name] = {
            "method": route.method, "path": route.path, "owned_by_balancer": route.owned,
            "direct": {"status": direct.status, "content_type": direct.content_type,
                       "shape": shape(direct)},
            "skymesh_lb": {"status": lb.status, "content_type": lb.content_type,
                           "shape": shape(lb)},
            "same_status": direct.status == lb.status,
            "lb_status_by_design": route.lb_status,
            "same_shape": shape(direct) == shape(lb),
        }


@pytest.fixture(scope="module")
def table(cluster: Cluster) -> Iterator[CompatTable]:
    t = CompatTable()
    yield t
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    doc = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "engine": _version(cluster), "routes": t.rows}
    (OUT_DIR / "compat.json").write_text(json.dumps(doc, indent=2) + "\n")


def _version(cluster: Cluster) -> str:
    a = call(cluster.replica_urls[0], Route("GET", "/version"))
    try:
        return f"vllm {a.json()['version']}"
    except (ValueError, KeyError, TypeError):
        return "vllm (version unknown)"


ROUTES = [
    pytest.param(Route("POST", "/v1/chat/completions", CHAT), id="chat"),
    pytest.param(Route("POST", "/v1/completions",
                       {"model": MODEL_NAME, "prompt": "Weng earns", "max_tokens": 4}),
                 id="completions"),
    pytest.param(Route("GET", "/v1/models"), id="models"),
    # vLLM 0.32 has no GET /v1/models/{id} (404); OpenAI's API does, so the balancer
    # answers it from the replicas' model objects.
    pytest.param(Route("GET", f"/v1/models/{MODEL_NAME}", owned=True, lb_status=200),
                 id="model"),
    pytest.param(Route("POST", "/v1/responses",
                       {"model": MODEL_NAME, "input": "How many clips?",
                        "max_output_tokens": 4}), id="responses"),
    pytest.param(Route("POST", "/v1/embeddings", {"model": MODEL_NAME, "input": "clips"}),
                 id="embeddings"),
    pytest.param(Route("POST", "/tokenize", {"model": MODEL_NAME, "prompt": "clips"}),
                 id="tokenize"),
    pytest.param(Route("POST", "/detokenize", {"model": MODEL_NAME, "tokens": [10, 11, 12]}),
                 id="detokenize"),
    pytest.param(Route("POST", "/v1/chat/completions/render", CHAT), id="chat-render"),
    pytest.param(Route("GET", "/version"), id="version"),
    pytest.param(Route("GET", "/health", owned=True), id="health"),
    pytest.param(Route("GET", "/metrics", owned=True), id="metrics"),
    # Under /v1 an unknown path is the engine's to answer (vLLM's own 404 body).
    pytest.param(Route("GET", "/v1/no-such-route"), id="unknown-v1-route"),
    pytest.param(Route("GET", "/no-such-route", owned=True), id="unknown-route"),
    pytest.param(Route("GET", "/v1/chat/completions", owned=True, lb_status=405),
                 id="chat-wrong-method"),
    # No replica serves the model: the balancer's own 404. vLLM's error body has an int
    # ``code`` (404) where OpenAI's has a string (``model_not_found``): status only.
    pytest.param(Route("POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"},
                       owned=True), id="unknown-model"),
]


@pytest.mark.parametrize("route", ROUTES)
def test_route_matches_direct(route: Route, cluster: Cluster, table: CompatTable,
                              request: pytest.FixtureRequest) -> None:
    direct = call(cluster.replica_urls[0], route)
    lb = call(cluster.lb.url, route)
    table.record(request.node.callspec.id, route, direct, lb)
    want = direct.status if route.lb_status is None else route.lb_status
    assert lb.status == want, (lb.status, lb.body[:300])
    if not route.owned:
        assert shape(lb) == shape(direct), lb.body[:300]


def test_errors_the_balancer_answers_are_openai_shaped(cluster: Cluster) -> None:
    """An unknown model is the balancer's own answer (no replica serves it)."""
    a = call(cluster.lb.url, Route("POST", "/v1/chat/completions",
                                   {**CHAT, "model": "no-such-model"}))
    assert a.status == 404
    err = a.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/no-such-route", 404),  # not an engine route: not forwarded
    ("GET", "/v1/chat/completions", 405),  # the balancer's own path, wrong method
], ids=["404", "405"])
def test_the_balancers_own_404_and_405_are_openai_shaped(cluster: Cluster, method: str,
                                                         path: str, status: int) -> None:
    a = call(cluster.lb.url, Route(method, path))
    assert a.status == status
    assert "json" in a.content_type
    err = a.json()["error"]
    assert err["message"] and err["code"]


def test_models_keep_the_engines_fields(cluster: Cluster) -> None:
    direct = call(cluster.replica_urls[0], Route("GET", "/v1/models")).json()["data"][0]
    ours = [m for m in call(cluster.lb.url, Route("GET", "/v1/models")).json()["data"]
            if m["id"] == MODEL_NAME]
    assert ours, "skymesh-lb does not list the served model"
    missing = {k for k in direct if k not in ours[0]}
    assert not missing, f"dropped: {sorted(missing)}"
    assert ours[0]["max_model_len"] == direct["max_model_len"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_request_id_is_echoed(cluster: Cluster, stream: bool) -> None:
    route = Route("POST", "/v1/chat/completions", {**CHAT, "stream": stream},
                  headers={"X-Request-Id": "e2e-req-42"})
    a = call(cluster.lb.url, route)
    assert a.status == 200
    assert {k.lower(): v for k, v in a.headers.items()}.get("x-request-id") == "e2e-req-42"
