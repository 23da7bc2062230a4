"""``GET /v1/outlook`` through the controller's API: who may read it, and what it answers
with no planner (an empty outlook: balancers poll it, so not the plans' 409)."""

from __future__ import annotations

from controller_support import AGENT, READER, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config


def test_the_outlook_needs_a_token_and_is_empty_without_a_planner() -> None:
    cfg = parse_config({"tokens": token_config()})
    with TestClient(build_app(cfg, probe=False)) as c:
        r = c.get("/v1/outlook")
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert c.get("/v1/outlook", headers=auth("not-a-token")).status_code == 401
        for token in (READER, AGENT):
            r = c.get("/v1/outlook", headers=auth(token))
            assert r.status_code == 200
            assert r.json() == {"plan": None, "ts": None, "window_s": None, "regions": []}
