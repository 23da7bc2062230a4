"""The admin API's errors: raised anywhere in the controller, answered by the API as
``{"error": {"type", "message", "fields"?}}`` with the status they carry."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str,
                 fields: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.fields = status, kind, message, fields


def not_found(what: str, key: str) -> ApiError:
    return ApiError(404, "not_found", f"no {what} named {key!r}")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


def invalid_field(field: str, kind: str, why: str) -> ApiError:
    return ApiError(422, kind, f"{field}: {why}", [{"field": field, "message": why}])
