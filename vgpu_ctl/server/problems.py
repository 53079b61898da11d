"""Errors as RFC 9457 problem details (`application/problem+json`), carrying the CLI's `code` and `reasons`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from vgpu_ctl.errors import Refused, VgpuCtlError

PROBLEM_TYPE = "application/problem+json"
_STATUS = {"invalid": 400, "catalog": 400, "inventory": 400, "not_found": 404, "permission_denied": 403,
           "unauthenticated": 401, "conflict": 409, "precondition_failed": 412, "host_failure": 502,
           "not_confirmed": 409, "idempotency_key_reused": 422, "idempotency_key_in_flight": 409,
           "draining": 503}
_TITLES = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
           412: "Precondition Failed", 422: "Unprocessable Content", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable"}


def status_of(code: str, refused: bool = False) -> int:
    """The HTTP status of an error code (a refusal, quota or capacity, is 409: valid, but not now)."""
    return 409 if refused else _STATUS.get(code, 500)


def problem(status: int, code: str, message: str, reasons: list[dict[str, Any]] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    """A problem+json response."""
    body = {"type": f"urn:vgpu-ctl:error:{code}", "title": _TITLES.get(status, "Error"), "status": status,
            "detail": message, "code": code, "message": message, "reasons": reasons or []}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_TYPE, headers=headers)


def problem_of(exc: VgpuCtlError) -> JSONResponse:
    """The problem response of a vgpu-ctl error."""
    status = status_of(exc.code, isinstance(exc, Refused))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return problem(status, exc.code, exc.message, exc.reasons, headers)



def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route for these error statuses: problem details (the app's schema hook
    gives them the `application/problem+json` media type)."""
    from .schemas import Problem
    return {s: {"model": Problem, "description": _TITLES.get(s, "Error")} for s in statuses}
