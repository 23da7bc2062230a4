"""One error tree for the data path, mapped once at the HTTP edge to a status and an
OpenAI error body (``{"error": {"message", "type", "param", "code"}}``).

    SkyMeshError
    ├── BadRequest            400 invalid_request_error
    ├── Unauthorized          401 invalid_api_key (with WWW-Authenticate)
    ├── ModelNotFound         404 model_not_found
    ├── PayloadTooLarge       413 payload_too_large
    ├── Overloaded            429 rate_limit_exceeded (with Retry-After)
    │   └── KeyAtCap          429 the same, for one API key at its in-flight cap
    ├── NoCapacity            503 queue timeout / no healthy replica
    └── UpstreamFailed        502 every attempt failed before the first byte
"""

from __future__ import annotations

from typing import Any


class SkyMeshError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(SkyMeshError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(SkyMeshError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="skymesh"'}


class ModelNotFound(SkyMeshError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(SkyMeshError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(SkyMeshError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}


class KeyAtCap(Overloaded):
    """One client key has ``auth.max_in_flight_per_key`` requests here already: its own
    class so ``skymesh_requests_total{outcome}`` tells it from a full queue."""


class NoCapacity(SkyMeshError):
    status = 503
    type = "server_error"
    code = "no_capacity"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class UpstreamFailed(SkyMeshError):
    status = 502
    type = "server_error"
    code = "upstream_failed"
