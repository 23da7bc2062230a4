"""The planner inside the controller, through its admin API: rounds recorded in the store
(memory and a real redis-server), dry-run / approve / auto, who may approve, a partial
failure retried on the cooldowns, the strategy between rounds, and the planner's series
on /metrics read with prometheus_client's parser. The clock is fake; the actuator is a
fake at the edge that records the counts it is given."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from controller_support import AGENT, READER, auth, token_config
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from skymesh_controller.api import build_app
from skymesh_controller.auth import digest
from skymesh_controller.autopilot.planner import Planner
from skymesh_controller.planning.actuate import ApplyReport, Change
from skymesh_controller.planning.ilp import Key

W = 60
T0 = 1_800_000_000.0  # the fake clock's start (a multiple of W and of an hour)
APPROVER = "approver-token-for-tests"


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class FakeActuator:
    """Runs nothing: holds counts per key, and fails the keys in ``failing``."""

    kind = "fake"

    def __init__(self) -> None:
        self.counts: dict[Key, int] = {}
        self.calls: list[dict[Key, int]] = []
        self.failing: set[Key] = set()

    def current(self, keys: Any, registered: Any) -> dict[Key, int]:
        return {k: self.counts.get(k, 0) for k in keys}

    def apply_counts(self, counts: dict[Key, int], registered: Any) -> ApplyReport:
        self.calls.append(dict(counts))
        rep = ApplyReport()
        for k, n in counts.items():
            if k in self.failing:
                rep.errors[k] = "no capacity in the zone"
            else:
                rep.changed.append(Change(*k, before=self.counts.get(k, 0), after=n))
                self.counts[k] = n
        return rep

    def close(self) -> None:
        pass


@contextmanager
def controller(store: str = "memory", **planner: Any) -> Iterator[tuple[TestClient, Planner,
                                                                          FakeActuator,
                                                                          FakeClock]]:
    tokens = [*token_config(), {"name": "capacity-ops", "sha256": digest(APPROVER),
                                "role": "read"}]
    section = {"capacity": {"llama": {"L4": 100.0}}, "epsilon": 1.0,
               "schedule": {"window_s": W, "horizon": 2, "first_round_s": 1e9,
                            "tick_s": 3600},
               "forecaster": {"headroom": 0.0}, "approvers": ["capacity-ops"],
               "cooldowns": {"retry_s": 30, "hold_s": 600}, **planner}
    from skymesh_controller.config import parse_config

    cfg = parse_config({"store": store, "tokens": tokens, "planner": section,
                        "url_policy": {"allow_loopback": True}})
    app = build_app(cfg, probe=False)
    p: Planner = app.state.planner
    fake, clock = FakeActuator(), FakeClock()
    p.backend, p.clock = fake, clock  # before start-up: the planner keeps what it is given
    with TestClient(app) as c:
        for region in ("us", "eu"):
            r = c.post("/v1/regions", headers=auth(),
                       json={"name": region, "latitude": 1.0, "longitude": 2.0})
            assert r.status_code == 201, r.text
        yield c, p, fake, clock


def report(c: TestClient, p: Planner, region: str, tps: float, ts: float) -> None:
    """A balancer's telemetry for the window ending at ``ts``, straight into the store
    (the API stamps reports with the wall clock; the planner runs on the fake one)."""
    sample = {"ts": ts, "region": region, "window_s": W, "balancer": f"lb-{region}",
              "queue_length": 0, "in_flight": 0,
              "models": {"llama": {"requests": 1, "prompt_tokens": int(tps * W),
                                   "output_tokens": 0}}}
    c.portal.call(p.ctl.store.append, f"balancer:lb-{region}", sample, 1000)


def history(c: TestClient, p: Planner, clock: FakeClock, load: dict[str, float],
            windows: int = 5) -> None:
    for _ in range(windows):
        for region, tps in load.items():
            report(c, p, region, tps, clock.now + 1)
        clock.now += W


def scrape(c: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_plans_answer_409_when_the_planner_is_off() -> None:
    from skymesh_controller.config import parse_config

    cfg = parse_config({"tokens": token_config()})
    with TestClient(build_app(cfg, probe=False)) as c:
        r = c.get("/v1/plans", headers=auth(READER))
        assert r.status_code == 409 and r.json()["error"]["type"] == "planner_off"
        assert c.post("/v1/plans", headers=auth()).status_code == 409


def test_dry_run_shows_what_would_change_and_applies_nothing(store_spec: str) -> None:
    with controller(store_spec, mode="dry-run") as (c, p, fake, clock):
        history(c, p, clock, {"us": 420, "eu": 90})
        r = c.post("/v1/plans", headers=auth(), json={"dry_run": False})
        assert r.status_code == 201, r.text
        rec = r.json()
        assert rec["status"] == "planned" and rec["mode"] == "dry-run"
        assert {(x["region"], x["before"], x["after"]) for x in rec["changes"]} == {
            ("us", 0, 5), ("eu", 0, 1)}
        assert [f["tokens_per_s"] for f in rec["forecast"]] == [[90.0, 90.0], [420.0, 420.0]]
        assert rec["inputs"]["series"][1]["tokens_per_s"] == [420.0] * 5
        assert fake.calls == []
        # Recorded in the store: listed, fetched by id, and not approvable.
        assert [x["id"] for x in c.get("/v1/plans", headers=auth(READER)).json()] == [rec["id"]]
        assert c.get(f"/v1/plans/{rec['id']}", headers=auth(READER)).json() == rec
        r = c.post(f"/v1/plans/{rec['id']}/approve", headers=auth())
        assert r.status_code == 409 and "is planned" in r.json()["error"]["message"]


def test_approve_mode_waits_for_an_approver_then_applies(store_spec: str) -> None:
    with controller(store_spec, mode="approve") as (c, p, fake, clock):
        history(c, p, clock, {"us": 420, "eu": 90})
        first = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
        assert first["status"] == "pending" and fake.calls == []
        history(c, p, clock, {"us": 420, "eu": 90}, windows=1)
        rec = c.post("/v1/plans", headers=auth(APPROVER), json={"dry_run": False}).json()
        assert rec["status"] == "pending" and rec["trigger"] == "api:capacity-ops"
        old = c.get(f"/v1/plans/{first['id']}", headers=auth(READER)).json()
        assert old["status"] == "superseded"  # only the newest round can be approved
        assert c.post(f"/v1/plans/{first['id']}/approve", headers=auth()).status_code == 409
        # A read token may look, not approve; an agent token neither; no token: 401.
        for token, status in ((READER, 403), (AGENT, 403)):
            r = c.post(f"/v1/plans/{rec['id']}/approve", headers=auth(token))
            assert r.status_code == status and r.json()["error"]["type"] == "forbidden"
        assert c.post(f"/v1/plans/{rec['id']}/approve").status_code == 401
        r = c.post(f"/v1/plans/{rec['id']}/approve", headers=auth(APPROVER))
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["status"] == "applied" and done["approved_by"] == "capacity-ops"
        assert fake.calls == [{("llama", "eu", "L4"): 1, ("llama", "us", "L4"): 5}]
        assert [a["attempt"] for a in done["actions"]] == [1]
        pending = c.get("/v1/plans", headers=auth(READER), params={"status": "pending"})
        assert pending.json() == []
        m = scrape(c)
        assert m[("skymesh_controller_planner_planned_instances",
                  (("model", "llama"), ("region", "us")))] == 5
        assert m[("skymesh_controller_planner_actual_instances",
                  (("model", "llama"), ("region", "us")))] == 5
        assert m[("skymesh_controller_planner_rounds_total", (("status", "pending"),))] == 2


def test_auto_mode_retries_a_partial_failure_on_the_cooldown_and_never_flaps() -> None:
    with controller(mode="auto") as (c, p, fake, clock):
        us, eu = ("llama", "us", "L4"), ("llama", "eu", "L4")
        fake.failing = {us}
        history(c, p, clock, {"us": 420, "eu": 190})
        rec = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
        assert rec["status"] == "partial"
        assert rec["actions"][0]["errors"] == [
            {"model": "llama", "region": "us", "gpu": "L4", "error": "no capacity in the zone"}]
        assert rec["actions"][0]["retry_at"] == clock.now + 30
        assert fake.counts == {eu: 2}
        m = scrape(c)
        assert m[("skymesh_controller_planner_actuation_errors_total",
                  (("model", "llama"), ("region", "us")))] == 1
        # Before the cooldown nothing is retried; after it, only the failed key is.
        clock.now += 29
        c.portal.call(p.tick)
        assert len(fake.calls) == 1
        fake.failing = set()
        clock.now += 1
        c.portal.call(p.tick)
        assert fake.calls[-1] == {us: 5}
        rec = c.get(f"/v1/plans/{rec['id']}", headers=auth(READER)).json()
        assert rec["status"] == "applied" and [a["attempt"] for a in rec["actions"]] == [1, 2]
        # Demand drops at once: the next round would scale in, but eu grew moments ago.
        history(c, p, clock, {"us": 420, "eu": 40}, windows=3)
        again = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
        assert again["status"] == "no-change"
        assert [(h["region"], h["after"]) for h in again["held"]] == [("eu", 1)]
        assert "hold" in again["held"][0]["reason"]
        assert fake.counts == {eu: 2, us: 5}


def test_a_scheduled_round_runs_on_the_clock_and_a_short_history_is_skipped() -> None:
    with controller(mode="auto") as (c, p, fake, clock):
        p.next_round_at = T0 + 2 * W
        history(c, p, clock, {"us": 300}, windows=1)
        c.portal.call(p.tick)
        assert c.get("/v1/plans", headers=auth(READER)).json() == []
        history(c, p, clock, {"us": 300}, windows=1)
        c.portal.call(p.tick)
        [rec] = c.get("/v1/plans", headers=auth(READER)).json()
        assert rec["trigger"] == "schedule" and rec["status"] == "skipped"
        assert "needs 3" in rec["reason"] and fake.calls == []
        assert p.next_round_at == clock.now + p.cfg.schedule.interval_s


def test_the_strategy_steps_between_rounds_with_the_simulated_weeks_code() -> None:
    with controller(mode="auto", strategy="reactive",
                    bounds={"llama": {"*": {"min": 1, "max": 3}}}) as (c, p, fake, clock):
        from skymesh_controller.planning.strategies import Reactive

        # The strategy object is the simulated week's own class, not a copy.
        assert p.stepper is not None and type(p.stepper.strategy) is Reactive
        key = ("llama", "us", "L4")
        fake.counts[key] = 1
        for _ in range(4):  # 95 tokens/s on one 100 tokens/s instance: over 70%
            report(c, p, "us", 95 * (fake.counts[key]), clock.now)
            c.portal.call(p.tick)
            clock.now += 20  # past the strategy's 15 s cooldown
        assert [call[key] for call in fake.calls] == [2, 3]  # then the bound holds it
        m = scrape(c)
        assert m[("skymesh_controller_planner_strategy_actions_total",
                  (("direction", "out"), ("model", "llama"), ("region", "us")))] == 2


def test_bad_requests_get_the_admin_api_error_shape() -> None:
    with controller() as (c, _, _, _):
        r = c.get("/v1/plans", headers=auth(READER), params={"status": "done"})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "status"
        r = c.get("/v1/plans", headers=auth(READER), params={"limt": 3})
        assert r.status_code == 422 and "limt" in r.json()["error"]["message"]
        r = c.get("/v1/plans/plan-nope", headers=auth(READER))
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
        r = c.post("/v1/plans", headers=auth(), json={"dry_run": "maybe"})
        assert r.status_code == 422 and "dry_run" in r.json()["error"]["message"]
        assert c.get("/v1/plans").status_code == 401
        r = c.post("/v1/plans", headers=auth(AGENT))
        assert r.status_code == 403 and "planner.approvers" in r.json()["error"]["message"]


class FakeDaemon:
    """A replica process that is not one: a URL, alive until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.up = url, True

    def alive(self) -> bool:
        return self.up

    def stop(self) -> int:
        self.up = False
        return 0


def test_the_local_actuator_registers_in_process_and_counts_other_replicas() -> None:
    import asyncio

    from skymesh.util.procs import free_port
    from skymesh_controller.autopilot.actuators import LocalBackend

    started: list[FakeDaemon] = []

    def starter(name: str, args: list[str], log_path: Any = None) -> FakeDaemon:
        started.append(FakeDaemon(f"http://127.0.0.1:{free_port()}"))
        return started[-1]

    with controller(mode="auto") as (c, p, _, clock):
        loop = c.portal.call(asyncio.get_running_loop)
        p.backend = LocalBackend(p.cfg.actuator, p.ctl, loop, starter=starter)
        # One replica registered by hand: the plan's total counts it.
        manual = f"http://127.0.0.1:{free_port()}"
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": manual, "model": "llama", "region": "us", "gpu": "L4"})
        assert r.status_code == 201, r.text
        history(c, p, clock, {"us": 290})
        rec = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
        assert rec["status"] == "applied", rec
        assert rec["changes"] == [{"model": "llama", "region": "us", "gpu": "L4",
                                   "before": 1, "after": 3}]
        assert len(started) == 2  # 3 in all, one of them not ours
        reps = c.get("/v1/replicas", headers=auth(READER)).json()
        assert sorted(x["url"] for x in reps if x["kind"] == "skymesh") == sorted(
            d.url for d in started)
        # Shutdown deregisters and stops ours, and leaves the other one alone.
        c.portal.call(p.stop)
        assert not any(d.alive() for d in started)
        left = c.get("/v1/replicas", headers=auth(READER)).json()
        assert [x["url"] for x in left] == [manual]


def test_a_restarted_controller_keeps_its_rounds_and_its_cooldowns(redis_server: Any) -> None:
    with controller(redis_server.url, mode="auto") as (c, p, fake, clock):
        history(c, p, clock, {"us": 420, "eu": 190})
        first = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
        assert first["status"] == "applied"
        made_at = clock.now
    # A new controller on the same store, minutes later, sees much less demand.
    with controller(redis_server.url, mode="auto") as (c, p, fake, clock):
        clock.now = made_at + 120
        fake.counts = {("llama", "us", "L4"): 5, ("llama", "eu", "L4"): 2}
        assert [r["id"] for r in c.get("/v1/plans", headers=auth(READER)).json()] == [
            first["id"]]
        history(c, p, clock, {"us": 100, "eu": 40}, windows=3)
        rec = c.post("/v1/plans", headers=auth(), json={"dry_run": True}).json()
        assert rec["changes"] == []
        assert {h["region"] for h in rec["held"]} == {"us", "eu"}
        assert all("hold" in h["reason"] for h in rec["held"])
