"""``/v1/plans``: the planner's rounds, one round on demand, and approval.

    GET  /v1/plans                 newest first (read token); ?limit=N, ?status=pending
    GET  /v1/plans/{id}            one round: inputs, forecast, plan, changes, actions
    POST /v1/plans                 run a round now; {"dry_run": true} (the default) only
                                   shows what would change
    POST /v1/plans/{id}/approve    apply a pending plan (approve mode)
    GET  /v1/outlook               per region, the forecast load of the next windows
                                   (read token; outlook.py); empty with no planner

A round that applies (``dry_run: false``) and approval act on the world: only the leader
controller does (docs/operations-control-ha.md); a standby answers 409 ``not_leader``
naming it. Dry-run rounds and reads work on every controller.

Running a round or approving needs an admin token, or a token named in
``planner.approvers`` whatever its role: an operator can hold a read token that may also
approve capacity plans, and nothing else (least privilege). With no ``planner:`` section
every one of these answers 409 ``planner_off``.
"""


import contextlib
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict

from skymesh_controller.auth import Principal, TokenBook, allowed
from skymesh_controller.config import ControllerConfig
from skymesh_controller.errors import ApiError
from skymesh_controller.models import ERRORS
from skymesh_controller.store import Obj

STATUSES = ("skipped", "no-change", "planned", "pending", "superseded", "applied", "partial",
            "failed")


class RoundIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dry_run: bool = True


def mount_planner(app: FastAPI, cfg: ControllerConfig, ctl: Any) -> None:
    """Add the routes, and start and stop the planner with the app (when configured)."""
    planner = None
    if cfg.planner is not None:
        from skymesh_controller.autopilot.planner import Planner

        planner = Planner(cfg.planner, ctl)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
            async with inner(a) as state:  # the controller first, then the planner
                await planner.start()
                try:
                    yield state
                finally:
                    await planner.stop()

        app.router.lifespan_context = lifespan
    app.state.planner = planner
    tokens = TokenBook(list(cfg.tokens), os.environ.get("SKYMESH_ADMIN_TOKEN"))
    approvers = set(cfg.planner.approvers) if cfg.planner is not None else set()
    bearer = HTTPBearer(auto_error=False)

    def who(request: Request, creds: HTTPAuthorizationCredentials | None, role: str
            ) -> Principal:
        p = tokens.lookup(creds.credentials) if creds is not None else None
        if p is None:
            raise ApiError(401, "unauthorized", "a valid bearer token is required")
        request.state.principal = p.name  # the access log's (skymesh.obs.asgi)
        if role == "read" and allowed(p.role, "read"):
            return p
        if allowed(p.role, "admin") or p.name in approvers:
            return p
        raise ApiError(403, "forbidden", f"token {p.name!r} ({p.role}) may not do this: it "
                                         "needs the admin role or planner.approvers")

    async def reader(request: Request,
                     c: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                     ) -> Principal:
        return who(request, c, "read")

    async def approver(request: Request,
                       c: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                       ) -> Principal:
        return who(request, c, "approve")

    def on() -> Any:
        if planner is None:
            raise ApiError(409, "planner_off", "the planner is off (add a planner section "
                                               "to the controller config)")
        return planner

    @contextlib.asynccontextmanager
    async def leading() -> AsyncIterator[None]:
        lead = ctl.leadership
        if not lead.leader:
            info = await lead.info()
            where = info.get("leader_url") or info.get("leader") or "none yet"
            raise ApiError(409, "not_leader", f"this controller ({lead.id}) stands by: "
                                              f"the leader ({where}) applies plans")
        with lead.fenced():
            yield

    @app.get("/v1/plans", tags=["plans"], responses=ERRORS, dependencies=[Depends(reader)])
    async def list_plans(limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                         status: Annotated[str | None, Query()] = None) -> list[Obj]:
        if status is not None and status not in STATUSES:
            raise ApiError(422, "invalid_request", f"status: one of {', '.join(STATUSES)}",
                           [{"field": "status", "message": "unknown status"}])
        recs = await on().records()
        return [r for r in recs if status in (None, r["status"])][:limit]

    @app.get("/v1/plans/{pid}", tags=["plans"], responses=ERRORS, dependencies=[Depends(reader)])
    async def get_plan(pid: str) -> Obj:
        rec = await on().record(pid)
        if rec is None:
            raise ApiError(404, "not_found", f"no plan named {pid!r}")
        return rec

    @app.post("/v1/plans", tags=["plans"], status_code=201, responses=ERRORS)
    async def run_plan(p: Annotated[Principal, Depends(approver)],
                       body: Annotated[RoundIn | None, Body()] = None) -> Obj:
        dry = body.dry_run if body is not None else True
        planner = on()
        if dry:
            return await planner.run_round(dry_run=True, trigger=f"api:{p.name}")
        async with leading():
            return await planner.run_round(dry_run=False, trigger=f"api:{p.name}")

    @app.get("/v1/outlook", tags=["plans"], responses=ERRORS, dependencies=[Depends(reader)])
    async def get_outlook() -> Obj:
        from skymesh_controller.autopilot.outlook import outlook

        if planner is None:  # balancers poll this: no planner is an empty outlook, not 409
            return outlook((), {})
        return outlook(await planner.records(), planner.cfg.capacity)

    @app.post("/v1/plans/{pid}/approve", tags=["plans"], responses=ERRORS)
    async def approve(pid: str, p: Annotated[Principal, Depends(approver)]) -> Obj:
        planner = on()
        async with leading():
            return await planner.approve(pid, p.name)
