"""``GET /dashboard``: a live view of the mesh, drawn in the browser from the admin API.

The page and its assets carry no data and need no token: the page's script asks for a
token once (or takes it from ``#token=...``), keeps it in sessionStorage and polls the
authenticated ``/v1/`` endpoints every 2 s. Everything is served from the package's
``static/`` folder (no CDN, no external library), so it works on an air-gapped machine.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")

# The page only talks to its own origin; with no inline script and no third-party origin
# allowed, an injected string in, say, a replica's model name cannot run as code.
HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; "
                                "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def mount_dashboard(app: FastAPI) -> None:
    """Add ``GET /dashboard`` and its assets under ``/dashboard/static/`` (not in OpenAPI)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=HEADERS)

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
