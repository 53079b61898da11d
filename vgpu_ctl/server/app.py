"""The FastAPI application: routes, errors as problem details, health, readiness and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vgpu_ctl.errors import VgpuCtlError

from . import routes_admin, routes_vms
from .deps import principal_of, runtime
from .idempotent import idempotency_middleware
from .problems import problem, problem_of
from .runtime import Runtime

LOOPBACK = ("127.0.0.1", "::1")


def _field(loc: Any) -> str:
    parts = [str(x) for x in loc if x not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


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
    app = FastAPI(title="vgpu-ctl", version=__version__, lifespan=lifespan,
                  description="Pools of virtual GPUs on KVM hosts, handed to tenants' VMs under quotas.")
    app.middleware("http")(idempotency_middleware)

    @app.exception_handler(VgpuCtlError)
    async def on_error(request: Request, exc: VgpuCtlError) -> JSONResponse:
        return problem_of(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid"}
        name = _field(first.get("loc", ()))
        reasons = [{"field": _field(e.get("loc", ())), "value": e.get("input"), "problem": e.get("msg")}
                   for e in errors]
        value = first.get("input")
        return problem(400, "invalid", f"{name} {value!r}: {first.get('msg')}",
                       [{k: v for k, v in r.items() if _jsonable(v)} for r in reasons])

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return problem(exc.status_code, code, str(exc.detail))

    @app.get("/healthz", tags=["health"], summary="Alive")
    def healthz() -> dict[str, str]:
        """The process answers (no credentials needed)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Ready to serve")
    def readyz(request: Request) -> JSONResponse:
        """The store answers, its schema is at head and a leader is known (200), else 503."""
        principal_of(request)
        state = runtime(request).ready()
        return JSONResponse(state, status_code=200 if state["ok"] else 503)

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse, summary="Prometheus metrics")
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

    app.include_router(routes_vms.router)
    app.include_router(routes_admin.router)
    return app


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool | list | dict)
