"""What every route needs: the caller (from its bearer token), its Controller, ETags and waits."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from vgpu_ctl.errors import InvalidInput, PermissionDenied, VgpuCtlError
from vgpu_ctl.service.controller import Controller
from vgpu_ctl.service.operations import OperationInfo
from vgpu_ctl.service.principals import Principal, authenticate

from .runtime import Runtime
from .waiting import until_done

_WAIT = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m)?")
MAX_WAIT_S = 300.0


@dataclass
class Unauthenticated(PermissionDenied):
    """No credential, or one that is not valid: HTTP 401 (a dataclass, so that the code is its default)."""

    code: str = "unauthenticated"


def runtime(request: Request) -> Runtime:
    """The server's runtime."""
    rt: Runtime = request.app.state.runtime
    return rt


def principal_of(request: Request) -> Principal:
    """The caller named by `Authorization: Bearer TOKEN` (cached on the request); 401 without a valid one."""
    cached: Principal | None = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    header = request.headers.get("authorization")
    if header is None:
        raise Unauthenticated("no credentials: send `Authorization: Bearer TOKEN` (a tenant's or an API token)",
                              reasons=[{"field": "Authorization"}])
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthenticated(f"Authorization scheme {scheme!r} is not Bearer",
                              reasons=[{"field": "Authorization", "value": scheme}])
    try:
        with runtime(request).ctx.read() as conn:
            p = authenticate(conn, token.strip())
    except VgpuCtlError as exc:
        raise Unauthenticated(exc.message, exc.reasons) from None
    request.state.principal = p
    return p


def controller(request: Request) -> Controller:
    """A Controller acting for the caller."""
    return runtime(request).controller(principal_of(request))


def writer(request: Request) -> Controller:
    """A Controller acting for the caller on a route that changes something: 403 for a reader token, which
    may read everything and change nothing."""
    p = principal_of(request)
    if p.role == "reader":
        raise PermissionDenied(f"{request.method} {request.url.path} changes the store; a reader token "
                               f"({p.actor}) may only read", reasons=[{"field": "role", "value": p.role}])
    return runtime(request).controller(p)


def etag(generation: int) -> str:
    """The ETag of an object at `generation`."""
    return f'"{generation}"'


# The headers the routes read themselves, declared in the OpenAPI document (`openapi_extra` of a route).
IF_MATCH: dict[str, Any] = {"parameters": [{
    "name": "If-Match", "in": "header", "required": False,
    "description": "The ETag the caller read (or *): 412, nothing changed, if the object has changed since",
    "schema": {"type": "string", "pattern": r'^\s*(\*|(W/)?"[0-9]{1,18}")\s*$', "examples": ['"3"']}}]}
IDEMPOTENCY_KEY: dict[str, Any] = {
    "name": "Idempotency-Key", "in": "header", "required": False,
    "description": "A retry with the same key gets the stored response (same key, other request: 422; still "
                   "being answered: 409); per caller, kept for the server's idempotency_ttl_s",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255}}


def if_match(request: Request) -> int | None:
    """The generation an `If-Match` header asks for (None without one, or for `*`); 400 when malformed."""
    value = request.headers.get("if-match")
    if value is None or value.strip() == "*":
        return None
    m = re.fullmatch(r'\s*(?:W/)?"(\d{1,18})"\s*', value)
    if m is None:
        raise InvalidInput(f"If-Match {value!r} is not an ETag this server gave (e.g. \"3\")",
                           reasons=[{"field": "If-Match", "value": value}])
    return int(m.group(1))


def wait_seconds(value: str | None) -> float:
    """`?wait=30s` (also 500ms, 2m, or plain seconds) in seconds, at most MAX_WAIT_S; 0 without one."""
    if value is None:
        return 0.0
    m = _WAIT.fullmatch(value.strip())
    if m is None:
        raise InvalidInput(f"wait {value!r} is not a duration (e.g. 30s, 500ms, 2m)",
                           reasons=[{"field": "wait", "value": value}])
    seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2) or "s"]
    if seconds > MAX_WAIT_S:
        raise InvalidInput(f"wait {value!r} is longer than {MAX_WAIT_S:.0f}s",
                           reasons=[{"field": "wait", "value": value}])
    return seconds


async def wait_done(request: Request, info: OperationInfo, seconds: float) -> OperationInfo:
    """The operation once it is done, or as it is after `seconds` (`waiting.until_done`: woken when this
    process's worker ends it, the store polled for one another replica runs)."""
    rt = runtime(request)
    return await until_done(rt.ends, rt.runs_here, controller(request).get_operation, info, seconds)
