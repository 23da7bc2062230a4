"""One error tree for the data path, mapped once at the HTTP edge to a status and an
OpenAI error body (``{"error": {"message", "type", "param", "code"}}``).

    SkyMeshError
    ├── BadRequest            400 invalid_request_error
    ├── Unauthorized          401 invalid_api_key (with WWW-Authenticate)
    ├── NotFound              404 not_found: no such route here
    ├── ModelNotFound         404 model_not_found
    ├── MethodNotAllowed      405 method_not_allowed (with Allow)
    ├── PayloadTooLarge       413 payload_too_large
    ├── Overloaded            429 rate_limit_exceeded (with Retry-After)
    │   └── KeyAtCap          429 the same, for one API key at its in-flight cap
    ├── NoCapacity            503 no_capacity: queue timeout (with Retry-After)
    │   └── NoHealthyReplica  503 no_healthy_replica: nothing up serves the model
    └── UpstreamFailed        502 every attempt failed before the first byte

A ``Retry-After`` goes out twice: whole seconds, rounded up (RFC 9110), and
``retry-after-ms``, which the official OpenAI SDKs read first: the jitter of
``skymesh.balancer.overload`` survives there below one second.
"""

from __future__ import annotations

import math
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


class NotFound(SkyMeshError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(SkyMeshError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: list[str]) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allow)}


def retry_headers(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(max(1, round(seconds * 1000)))}


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
        return retry_headers(self.retry_after_s)


class KeyAtCap(Overloaded):
    """One client key has ``auth.max_in_flight_per_key`` requests here already: its own
    class so ``skymesh_requests_total{outcome}`` tells it from a full queue."""


class NoCapacity(SkyMeshError):
    status = 503
    type = "server_error"
    code = "no_capacity"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_headers(self.retry_after_s)


class NoHealthyReplica(NoCapacity):
    """Nothing that is up serves the model (or no replica has answered yet): answered at
    once rather than after the queue timeout; 503, so clients retry it."""

    code = "no_healthy_replica"


class UpstreamFailed(SkyMeshError):
    status = 502
    type = "server_error"
    code = "upstream_failed"
