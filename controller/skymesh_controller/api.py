"""The admin API (FastAPI): resources under ``/v1/``, ``/health`` open, the rest by token.

Errors use one shape, ``{"error": {"type", "message"}}``; validation errors (422) also list
each offending field under ``error.fields`` and name it in the message. Balancers and
replicas carry an ``owner`` (the token's name): an ``agent`` token changes only what it
owns (POST of another's id is 409, PUT/PATCH of it 403), an ``admin`` token anything.
``/openapi.json``, ``/docs`` and ``/redoc`` are off unless ``api_docs: true``, and then
need a read token like the rest.
"""


import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from skymesh.net.urlpolicy import Resolver, system_resolver
from skymesh.obs.asgi import AccessLogMiddleware
from skymesh.obs.tracing import from_config as tracing_from_config
from skymesh_controller.auth import Principal, TokenBook, allowed
from skymesh_controller.autopilot.routes import mount_planner
from skymesh_controller.config import ControllerConfig, Role
from skymesh_controller.dashboard import mount_dashboard
from skymesh_controller.dns_sync import DnsHook
from skymesh_controller.errors import ApiError
from skymesh_controller.forecasting import walk_forward
from skymesh_controller.intake import BodyGate
from skymesh_controller.metrics import install_metrics
from skymesh_controller.models import (
    ERRORS,
    BalancerIn,
    BalancerPatch,
    BalancerUpdate,
    DnsSyncIn,
    ModelIn,
    PolicyIn,
    RegionIn,
    ReplicaIn,
    ReplicaPatch,
    ReplicaUpdate,
    TelemetryIn,
)
from skymesh_controller.records import given_policy, may_modify, not_owner
from skymesh_controller.series import telemetry_series as telemetry_series_of
from skymesh_controller.series import to_csv as series_csv
from skymesh_controller.service import Controller
from skymesh_controller.status import mesh_status
from skymesh_controller.store import Obj, Store, StoreError, open_store
from skymesh_controller.tenants import TenantIn

MAX_FORECAST_SERIES = 24

def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None,
           **extra: Any) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse({"error": {"type": kind, "message": message, **extra}},
                        status_code=status, headers=headers)


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match != Match.NONE and route_methods:
            methods |= set(route_methods)
    return sorted(methods)


async def _no_unknown_query(request: Request) -> None:
    """A query parameter the operation does not declare is a 422, not silently ignored
    (a typo such as ``?regoin=us`` would otherwise return everything)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not request.query_params:
        return
    known: set[str] = set()
    todo = [dependant]
    while todo:  # the operation's own parameters and those of its dependencies
        d = todo.pop()
        known |= {p.alias for p in d.query_params}
        todo += d.dependencies
    unknown = sorted(k for k in request.query_params if k not in known)
    if unknown:
        raise ApiError(422, "invalid_request", f"{unknown[0]}: unknown query parameter",
                       [{"field": k, "message": "unknown query parameter"} for k in unknown])


def build_app(cfg: ControllerConfig, store: Store | None = None, dns: DnsHook | None = None,
              probe: bool = True, resolver: Resolver = system_resolver) -> FastAPI:
    tokens = TokenBook(list(cfg.tokens), os.environ.get("SKYMESH_ADMIN_TOKEN"))
    if store is None:
        store = open_store(cfg.store, wait_replicas=cfg.ha.wait_replicas,
                           wait_timeout_ms=cfg.ha.wait_timeout_ms,
                           writer_lock_s=cfg.ha.writer_lock_s)
    ctl = Controller(cfg, store, dns,
                     resolver=resolver)
    # Each route calls the part it needs (service.py lists them).
    records, balancers, replicas = ctl.records, ctl.balancers, ctl.replicas
    members, reports, changes = ctl.members, ctl.telemetry, ctl.changes
    dns_syncer = ctl.dns

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctl.start(probe=probe)
        try:
            yield
        finally:
            await ctl.stop()

    app = FastAPI(title="SkyMesh controller", version="1.0", lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None,
                  dependencies=[Depends(_no_unknown_query)],
                  description="Admin API of the SkyMesh mesh: regions, balancers, replicas, "
                              "models, policies, telemetry and status.")
    app.state.controller = ctl
    bearer = HTTPBearer(auto_error=False)
    forecast_cache: dict[tuple[Any, ...], tuple[list[Obj], str]] = {}

    def need(role: Role) -> Any:
        async def check(
            request: Request,
            creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        ) -> Principal:
            who = tokens.lookup(creds.credentials) if creds is not None else None
            if who is None:
                raise ApiError(401, "unauthorized", "a valid bearer token is required")
            request.state.principal = who.name  # the access log's (skymesh.obs.asgi)
            if not allowed(who.role, role):
                raise ApiError(403, "forbidden", f"token {who.name!r} ({who.role}) may not "
                                                 f"do this: it needs the {role} role")
            return who
        return Depends(check)

    read, agent, admin = need("read"), need("agent"), need("admin")
    tenant_admin = need("tenants")  # tenants only (auth.py): least privilege

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.fields is not None:
            return _error(exc.status, exc.kind, exc.message, fields=exc.fields)
        return _error(exc.status, exc.kind, exc.message)

    @app.exception_handler(StoreError)
    async def store_error(request: Request, exc: StoreError) -> JSONResponse:
        return _error(503, "store_unavailable", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # The router names only the first matching route's methods; a path has one
            # route per method here, so collect them all.
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return _error(exc.status_code, "http_error", str(exc.detail), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path")]
            fields.append({"field": ".".join(loc) or "(body)", "message": e.get("msg", "")})
        message = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
        return _error(422, "invalid_request", message, fields=fields)

    # -- open ------------------------------------------------------------------------------
    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    if cfg.api_docs:
        @app.get("/openapi.json", include_in_schema=False, dependencies=[read])
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        # Browsers send no bearer token by themselves: these pages work behind a proxy or
        # an extension that adds the header (docs/security.md).
        @app.get("/docs", include_in_schema=False, dependencies=[read])
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

        @app.get("/redoc", include_in_schema=False, dependencies=[read])
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    # -- regions ---------------------------------------------------------------------------
    @app.get("/v1/regions", tags=["regions"], responses=ERRORS, dependencies=[read])
    async def list_regions() -> list[Obj]:
        return await records.list_kind("regions")

    @app.post("/v1/regions", tags=["regions"], status_code=201, responses=ERRORS,
              dependencies=[admin])
    async def put_region(body: RegionIn) -> Obj:
        return await records.put_region(body)

    @app.get("/v1/regions/{name}", tags=["regions"], responses=ERRORS, dependencies=[read])
    async def get_region(name: str) -> Obj:
        return await records.read("regions", name, "region")

    @app.delete("/v1/regions/{name}", tags=["regions"], status_code=204, responses=ERRORS,
                dependencies=[admin])
    async def delete_region(name: str) -> None:
        await records.delete_region(name)

    # -- balancers -------------------------------------------------------------------------
    @app.get("/v1/balancers", tags=["balancers"], responses=ERRORS, dependencies=[read])
    async def list_balancers() -> list[Obj]:
        return await records.list_kind("balancers")

    @app.post("/v1/balancers", tags=["balancers"], status_code=201, responses=ERRORS)
    async def register_balancer(body: BalancerIn, who: Principal = agent) -> Obj:
        """Register a balancer, or re-register one the token owns (a restart)."""
        return await balancers.register(body, who)

    @app.put("/v1/balancers/{bid}", tags=["balancers"], responses=ERRORS)
    async def replace_balancer(bid: str, body: BalancerUpdate, who: Principal = agent) -> Obj:
        return await balancers.update(bid, given_policy(body, body.model_dump()), who)

    @app.patch("/v1/balancers/{bid}", tags=["balancers"], responses=ERRORS)
    async def patch_balancer(bid: str, body: BalancerPatch, who: Principal = agent) -> Obj:
        return await balancers.update(bid, body.model_dump(exclude_unset=True), who)

    @app.get("/v1/balancers/{bid}", tags=["balancers"], responses=ERRORS, dependencies=[read])
    async def get_balancer(bid: str) -> Obj:
        return await records.read("balancers", bid, "balancer")

    @app.delete("/v1/balancers/{bid}", tags=["balancers"], status_code=204, responses=ERRORS,
                dependencies=[admin])
    async def delete_balancer(bid: str) -> None:
        await balancers.delete(bid)

    @app.put("/v1/balancers/{bid}/policy", tags=["balancers"], responses=ERRORS,
             dependencies=[admin])
    async def set_policy(bid: str, body: PolicyIn) -> Obj:
        return await balancers.set_policy(bid, body)

    @app.get("/v1/balancers/{bid}/membership", tags=["balancers"], responses=ERRORS)
    async def membership(
        bid: str,
        after: Annotated[int, Query(ge=-1, description="return once the revision is past "
                                                       "this one (long poll)")] = -1,
        wait: Annotated[float, Query(ge=0, le=300, description="seconds to wait")] = 0.0,
        who: Principal = agent,
    ) -> Obj:
        me = await records.read("balancers", bid, "balancer")
        if not may_modify(me, who):  # only its own balancer: `after` is a drain's ack
            raise not_owner("balancer", bid, me)
        # It applied `after` (what a move's drain waits for), but no revision not yet made.
        await members.record_poll(bid, min(after, await changes.store.revision()))
        if after >= 0 and wait > 0:
            await changes.wait(after, wait)
        return await members.view(bid)

    @app.post("/v1/balancers/{bid}/telemetry", tags=["balancers"], response_model=None,
              responses={**ERRORS, 204: {"description": "taken (a report without tenants)"},
                         200: {"description": "a report with ``tenants``: the balancer's "
                               "tenants and its fractions of their limits (tenants.py)"}})
    async def telemetry_in(bid: str, body: TelemetryIn, who: Principal = agent) -> Response:
        """Take a report (204). One that carries ``tenants`` (their demand at the
        balancer) is answered with the balancer's tenants and its fractions of their
        limits, split by the demand reported (200; tenants.py)."""
        await reports.report(bid, body, who)
        if "tenants" not in body.model_fields_set:
            return Response(status_code=204)
        return JSONResponse(await members.tenants_for(bid))

    # -- replicas --------------------------------------------------------------------------
    @app.get("/v1/replicas", tags=["replicas"], responses=ERRORS, dependencies=[read])
    async def list_replicas() -> list[Obj]:
        return await records.list_kind("replicas")

    @app.post("/v1/replicas", tags=["replicas"], status_code=201, responses=ERRORS)
    async def add_replica(body: ReplicaIn, who: Principal = agent) -> Obj:
        """Register a replica, or re-register one the token may change."""
        return await replicas.add(body, who)

    @app.put("/v1/replicas/{rid}", tags=["replicas"], responses=ERRORS)
    async def replace_replica(rid: str, body: ReplicaUpdate, who: Principal = agent) -> Obj:
        return await replicas.update(rid, body.model_dump(), who)

    @app.patch("/v1/replicas/{rid}", tags=["replicas"], responses=ERRORS)
    async def patch_replica(rid: str, body: ReplicaPatch, who: Principal = agent) -> Obj:
        return await replicas.update(rid, body.model_dump(exclude_unset=True), who)

    @app.get("/v1/replicas/{rid}", tags=["replicas"], responses=ERRORS, dependencies=[read])
    async def get_replica(rid: str) -> Obj:
        return await records.read("replicas", rid, "replica")

    @app.delete("/v1/replicas/{rid}", tags=["replicas"], status_code=204, responses=ERRORS,
                dependencies=[admin])
    async def remove_replica(rid: str) -> None:
        await replicas.remove(rid)

    @app.post("/v1/replicas/{rid}/drain", tags=["replicas"], responses=ERRORS,
              dependencies=[admin])
    async def drain(rid: str) -> Obj:
        return (await replicas.drain(rid, True))[0]

    @app.post("/v1/replicas/{rid}/undrain", tags=["replicas"], responses=ERRORS,
              dependencies=[admin])
    async def undrain(rid: str) -> Obj:
        return (await replicas.drain(rid, False))[0]

    # -- models ----------------------------------------------------------------------------
    @app.get("/v1/models", tags=["models"], responses=ERRORS, dependencies=[read])
    async def list_models() -> list[Obj]:
        return await records.models()

    @app.post("/v1/models", tags=["models"], status_code=201, responses=ERRORS,
              dependencies=[admin])
    async def put_model(body: ModelIn) -> Obj:
        return await records.put_model(body)

    @app.delete("/v1/models/{name}", tags=["models"], status_code=204, responses=ERRORS,
                dependencies=[admin])
    async def delete_model(name: str) -> None:
        await records.delete_model(name)

    # -- tenants (pushed to the balancers with membership: tenants.py) ----------------------
    TenantName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                                     description="letters, digits, '.', '_' or '-'")]

    @app.get("/v1/tenants", tags=["tenants"], responses=ERRORS, dependencies=[read])
    async def list_tenants() -> list[Obj]:
        return await records.list_kind("tenants")

    @app.get("/v1/tenants/{name}", tags=["tenants"], responses=ERRORS, dependencies=[read])
    async def get_tenant(name: TenantName) -> Obj:
        return await records.read("tenants", name, "tenant")

    @app.put("/v1/tenants/{name}", tags=["tenants"], responses=ERRORS,
             dependencies=[tenant_admin])
    async def put_tenant(name: TenantName, body: TenantIn) -> Obj:
        """Create or replace a tenant: its key digests, classes and limits."""
        return await ctl.tenants.put(name, body)

    @app.delete("/v1/tenants/{name}", tags=["tenants"], status_code=204, responses=ERRORS,
                dependencies=[tenant_admin])
    async def delete_tenant(name: TenantName) -> None:
        await ctl.tenants.delete(name)

    # -- status and telemetry --------------------------------------------------------------
    @app.get("/v1/status", tags=["status"], responses=ERRORS, dependencies=[read])
    async def status() -> Obj:
        return await mesh_status(ctl.store, reports.latest, dns_syncer.last,
                                 ctl.started, ctl.leadership)

    @app.get("/v1/telemetry", tags=["status"], responses=ERRORS, dependencies=[read])
    async def telemetry(
        balancer: str | None = None, region: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
    ) -> list[Obj]:
        return await reports.samples(balancer, region, limit)

    @app.get("/v1/telemetry/series", tags=["status"], dependencies=[read], responses={
        **ERRORS, 200: {"content": {"text/csv": {"schema": {"type": "string"}}},
                        "description": "JSON, or CSV with format=csv"}})
    async def telemetry_series(
        model: str | None = None, region: str | None = None,
        window: Annotated[int, Query(ge=1, le=86_400, description="seconds")] = 600,
        format: Annotated[Literal["json", "csv"], Query()] = "json",
    ) -> Any:
        samples = await reports.samples(None, region, limit=cfg.telemetry_keep)
        series = telemetry_series_of(samples, window, model=model, region=region)
        if format == "csv":
            return PlainTextResponse(series_csv(series), media_type="text/csv")
        return series

    @app.get("/v1/forecast", tags=["status"], responses=ERRORS, dependencies=[read])
    async def forecast(
        model: str | None = None, region: str | None = None,
        metric: Annotated[Literal["requests", "prompt_tokens", "output_tokens"],
                          Query()] = "prompt_tokens",
        window: Annotated[int, Query(ge=1, le=86_400, description="seconds")] = 600,
        forecaster: Annotated[Literal["seasonal-naive", "ets", "arima"],
                              Query()] = "seasonal-naive",
        horizon: Annotated[int, Query(ge=0, le=288)] = 6,
    ) -> Obj:
        """Forecast versus actual demand per (model, region), from balancer telemetry."""
        samples = await reports.samples(None, region, limit=cfg.telemetry_keep)
        pairs = sorted({(m, s["region"]) for s in samples for m in s.get("models", {})})
        pairs = [(m, r) for m, r in pairs if model in (None, m)][:MAX_FORECAST_SERIES]
        out = []
        for m, r in pairs:
            series = telemetry_series_of(samples, window, model=m, region=r)
            key = (m, r, metric, window, forecaster, horizon, len(samples),
                   samples[-1]["ts"] if samples else 0)
            cached = forecast_cache.get(key)
            if cached is None:
                # statsmodels blocks: off the event loop, and cached until new telemetry.
                cached = await asyncio.to_thread(walk_forward, series[metric],
                                                 series["start"] or 0, window, forecaster,
                                                 horizon)
                if len(forecast_cache) > 256:  # bounded: keys change with every report
                    forecast_cache.clear()
                forecast_cache[key] = cached
            points, used = cached
            out.append({"model": m, "region": r, "metric": metric, "window_s": window,
                        "forecaster": used, "points": points})
        return {"series": out}

    @app.post("/v1/dns/sync", tags=["dns"], responses=ERRORS, dependencies=[admin])
    async def dns_sync(body: Annotated[DnsSyncIn | None, Body()] = None) -> Obj:
        return await dns_syncer.sync(body.dry_run if body is not None else False)

    mount_planner(app, cfg, ctl)  # /v1/plans; the planner itself when configured
    install_metrics(app, ctl.store, reports.latest, ctl.prober.counts,
                    ctl.refusals.counts, ctl)
    mount_dashboard(app)
    # The token and the size cap before any body byte is read (skymesh_controller.intake).
    app.add_middleware(BodyGate, known=lambda token: tokens.lookup(token) is not None,
                       max_bytes=cfg.max_body_bytes, refused=ctl.refusals)
    # Added last, so outermost: one access line (and span) per request, a 413 included.
    app.add_middleware(AccessLogMiddleware, access_log=cfg.logging.access_log,
                       tracing=tracing_from_config(cfg.tracing, "skymesh-controller"))
    return app
