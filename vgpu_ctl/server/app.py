"""The FastAPI application: routes, errors as problem details, health, readiness and metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vgpu_ctl.errors import VgpuCtlError

from . import routes_admin, routes_candidates, routes_scheduling, routes_vms
from .deps import IDEMPOTENCY_KEY, principal_of, runtime
from .idempotent import IdempotencyKeys
from .problems import PROBLEM_TYPE, problem, problem_of, problem_responses
from .runtime import Runtime
from .schemas import Problem

log = logging.getLogger("vgpu_ctl.server")
LOOPBACK = ("127.0.0.1", "::1")
ANONYMOUS = ("/healthz",)  # the only paths that need no bearer token
_SHOWN = 120  # characters of a bad value quoted in a message


def _field(loc: Any) -> str:
    parts = [str(x) for x in loc if x not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _shown(value: Any) -> Any:
    """A bad value as a problem quotes it: long strings and containers cut short."""
    if isinstance(value, str) and len(value) > _SHOWN:
        return f"{value[:_SHOWN]}... ({len(value)} characters)"
    if isinstance(value, list | dict) and len(repr(value)) > _SHOWN:
        return f"{repr(value)[:_SHOWN]}... ({type(value).__name__} of {len(value)})"
    return value


def _invalid(errors: list[Any]) -> JSONResponse:
    """A request that does not match its schema as a 400 problem naming each bad field and its value."""
    reasons: list[dict[str, Any]] = []
    for e in errors or [{"loc": ("body",), "msg": "invalid", "type": "invalid"}]:
        name = _field(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            reasons.append({"field": "body", "problem": f"not valid JSON: {e.get('msg')}"})
        elif e.get("type") == "missing":
            reasons.append({"field": name, "problem": "required"})
        else:
            value = _shown(e.get("input"))
            reasons.append({"field": name, "value": value if _jsonable(value) else repr(value),
                            "problem": e.get("msg")})
    first = reasons[0]
    if "value" in first:
        message = f"{first['field']} {first['value']!r}: {first['problem']}"
    else:
        message = f"{first['field']}: {first['problem']}"
    if len(reasons) > 1:
        message += f" (and {len(reasons) - 1} more)"
    return problem(400, "invalid", message, reasons)


def _nul_in(value: Any, where: str) -> str | None:
    """The field (dotted) of the first string holding a NUL character in a parsed JSON value, else None."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _nul_in(k, where) or _nul_in(v, f"{where}.{k}" if where else str(k))
            if found is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _nul_in(v, f"{where}.{i}" if where else str(i))
            if found is not None:
                return found
    return None


class Guard:
    """The outermost layer, plain ASGI (cheaper than a BaseHTTPMiddleware): the caller's token first (401
    before anything is read of the request, but on /healthz, and /metrics, which says itself who may read
    it), then 400 for a NUL character anywhere in the path, the query or a JSON body (no name, profile or
    label holds one, and PostgreSQL can't store one: it was a 500 there), and a bug's exception as a logged
    500 problem (caught here, it does not reach the server, which would drop the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the request, then pass it on."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in ANONYMOUS and scope["path"] != "/metrics":
            try:  # cached on the request's state, which the routes' own Request objects share
                await run_in_threadpool(principal_of, Request(scope))
            except VgpuCtlError as exc:
                await problem_of(exc)(scope, receive, send)
                return
            except Exception as exc:
                await self._failed(scope, receive, send, exc)
                return
        field: str | None = "path" if "\x00" in scope["path"] else None
        query = scope.get("query_string", b"")
        if field is None and b"%00" in query:
            field = next((k for k, v in parse_qsl(query.decode("latin-1"), keep_blank_values=True)
                          if "\x00" in k or "\x00" in v), "query")
        headers = dict(scope.get("headers") or [])
        if field is None and scope["method"] in ("POST", "PUT", "PATCH") \
                and headers.get(b"content-type", b"").startswith(b"application/json"):
            body, receive = await _buffered(receive)
            if b"\\u0000" in body or b"\x00" in body:
                try:
                    field = _nul_in(json.loads(body), "") or "body"
                except ValueError:
                    field = "body"
        if field is not None:
            await problem(400, "invalid", f"{field} holds a NUL character (\\u0000), which no value may hold",
                          [{"field": field, "problem": "NUL character"}])(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:  # too late for a problem: the server ends the response
                log.error("%s %s failed", scope["method"], scope["path"], exc_info=exc)
                raise
            await self._failed(scope, receive, send, exc)

    @staticmethod
    async def _failed(scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
        log.error("%s %s failed", scope["method"], scope["path"], exc_info=exc)
        await problem(500, "internal", f"the server failed ({type(exc).__name__}); it is logged, please "
                      "report it")(scope, receive, send)


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a `receive` that hands it on again."""
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: pass that on as it came
            return b"".join(chunks), _once(message, receive)
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    return body, _once({"type": "http.request", "body": body, "more_body": False}, receive)


def _once(first: Message, receive: Receive) -> Receive:
    """A `receive` that gives `first`, then what `receive` gives."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()
    return replay


def _problem_schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with every error response as `application/problem+json` (FastAPI's own 422
    validation response dropped: a request that does not match is a 400 problem here) and the bearer token
    required everywhere but /healthz."""
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, item in schema["paths"].items():
        for op in item.values():
            responses = op.get("responses", {})
            validation = responses.get("422", {}).get("content", {}).get("application/json", {})
            if validation.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                del responses["422"]
            for status, resp in responses.items():
                typed = [c for c in resp.get("content", {}).values() if "schema" in c]
                if status[:1] in "45" and typed:  # under the route's own media type (JSON, text) until now
                    resp["content"] = {PROBLEM_TYPE: typed[0]}
            if path not in ANONYMOUS:
                op["security"] = [{"bearer": []}]
            if op is item.get("post"):  # the Idempotency-Key layer serves every POST: its header, 409, 422
                op["parameters"] = [*op.get("parameters", []), dict(IDEMPOTENCY_KEY)]
                for status, why in (("409", "A request with this Idempotency-Key is still being answered"),
                                    ("422", "This Idempotency-Key was used for another request")):
                    responses.setdefault(status, {"description": why, "content": {
                        PROBLEM_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}})
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).setdefault("Problem", Problem.model_json_schema())
    for unused in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(unused, None)
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                "description": "A tenant's token or an API token (admin, reader)"}}
    return schema


def create_app(make_runtime: Callable[[], Runtime]) -> FastAPI:
    """The API; `make_runtime` opens the store and starts the workers when the server starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.runtime = make_runtime()
        try:
            yield
        finally:
            app.state.runtime.close()

    from vgpu_ctl import __version__
    app = FastAPI(title="vgpu-ctl", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None,
                  description="Pools of virtual GPUs on KVM hosts, handed to tenants' VMs under quotas.")
    app.add_middleware(IdempotencyKeys)
    app.add_middleware(Guard)  # added last: runs first

    def openapi() -> dict[str, Any]:
        """The OpenAPI document, built once (see _problem_schema)."""
        if app.openapi_schema is None:
            app.openapi_schema = _problem_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(VgpuCtlError)
    async def on_error(request: Request, exc: VgpuCtlError) -> JSONResponse:
        return problem_of(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return problem(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))  # a 405's Allow

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(principal_of)])
    def openapi_document() -> JSONResponse:
        """The OpenAPI document (any valid token: only /healthz is anonymous)."""
        return JSONResponse(app.openapi())

    @app.get("/healthz", tags=["health"], summary="Alive")
    def healthz() -> dict[str, str]:
        """The process answers (no credentials needed)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Ready to serve",
             responses={503: {"description": "Not ready: the same object, `ok` false"},
                        **problem_responses(401)})
    def readyz(request: Request) -> JSONResponse:
        """The store answers, its schema is at head and a leader is known (200), else 503."""
        principal_of(request)
        state = runtime(request).ready()
        return JSONResponse(state, status_code=200 if state["ok"] else 503)

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse, summary="Prometheus metrics",
             responses=problem_responses(401, 403))
    def metrics(request: Request) -> Response:
        """The store's metrics and the server's own (an admin or reader token, or as configured)."""
        rt = runtime(request)
        client = request.client.host if request.client else ""
        if not (rt.cfg.metrics_access == "open" or (rt.cfg.metrics_access == "loopback" and client in LOOPBACK)
                or principal_of(request).sees_all):
            principal_of(request).require_reader("metrics")
        from vgpu_ctl.ops.metrics import dump

        from .metrics import server_metrics
        return PlainTextResponse(dump(rt.server) + server_metrics(rt),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(routes_candidates.router)
    app.include_router(routes_vms.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_scheduling.router)
    return app


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool | list | dict)
