"""The Idempotency-Key of every POST: a retry gets the stored response, the same key with another body is
422, a duplicate still in flight is 409. Keys are per caller (a tenant, or an API token) and expire after the
configured time."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from urllib.parse import urlencode

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from vgpu_ctl.errors import VgpuCtlError
from vgpu_ctl.service import idempotency as idem

from .deps import principal_of, runtime
from .problems import problem, problem_of
from .runtime import Runtime

HEADER = "idempotency-key"
# A request with a key still unanswered after this long was abandoned (its server died): a retry runs it
# again instead of getting 409 until the key expires. Longer than any request takes: a wait is at most 300 s.
IN_FLIGHT_STALE = timedelta(minutes=10)
_KEPT_HEADERS = ("location", "etag", "content-type", "operation-location", "retry-after")


def _target(request: Request) -> str:
    """What the key names besides the body: the path and the query (sorted; `wait` aside, which changes how
    long the caller waits, not what it asks), so that `?dry_run=true` and a real apply are two requests."""
    query = sorted((k, v) for k, v in request.query_params.multi_items() if k != "wait")
    return request.url.path + ("?" + urlencode(query) if query else "")


def _abandon(rt: Runtime, scope: str, key: str) -> None:
    with rt.ctx.tx() as conn:
        idem.abandon(conn, scope, key)


async def idempotency_middleware(request: Request,
                                 call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Apply the Idempotency-Key semantics to POST requests that carry one."""
    key = request.headers.get(HEADER)
    if request.method != "POST" or key is None:
        return await call_next(request)
    if not 0 < len(key) <= 255 or not key.isprintable():
        return problem(400, "invalid", f"Idempotency-Key {key!r} must be 1-255 printable characters",
                       [{"field": "Idempotency-Key", "value": key}])
    try:
        who = await run_in_threadpool(principal_of, request)
    except VgpuCtlError as exc:
        return problem_of(exc)
    scope = f"tenant:{who.tenant}" if who.tenant is not None else f"{who.role}:{who.actor}"
    body = await request.body()
    print_ = idem.fingerprint(request.method, _target(request), body)
    rt = runtime(request)
    ttl = timedelta(seconds=rt.cfg.idempotency_ttl_s)

    def begin() -> idem.Stored:
        with rt.ctx.tx() as conn:
            return idem.begin(conn, scope, key, print_, ttl, stale_after=IN_FLIGHT_STALE)

    stored = await run_in_threadpool(begin)
    if stored.state == "mismatch":
        return problem(422, "idempotency_key_reused", f"Idempotency-Key {key!r} was already used for a different "
                       "request; use a new key", [{"field": "Idempotency-Key", "value": key}])
    if stored.state == "in-flight":
        return problem(409, "idempotency_key_in_flight", f"a request with Idempotency-Key {key!r} is still being "
                       "answered; retry later", [{"field": "Idempotency-Key", "value": key}],
                       headers={"Retry-After": "1"})
    if stored.state == "done":
        headers = dict(stored.headers or {})
        headers["Idempotent-Replayed"] = "true"
        media = headers.pop("content-type", "application/json")
        return JSONResponse(stored.response, status_code=stored.status_code or 200, headers=headers,
                            media_type=media)
    try:
        response = await call_next(request)
        chunks = [chunk async for chunk in response.body_iterator]  # type: ignore[attr-defined]
    except BaseException:  # no answer to replay (a bug, a cancelled request): a retry runs again
        await run_in_threadpool(_abandon, rt, scope, key)
        raise
    raw = b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks)
    kept = {k: v for k, v in response.headers.items() if k in _KEPT_HEADERS}

    def end() -> None:
        with rt.ctx.tx() as conn:
            if response.status_code >= 500:  # a retry may succeed: it runs again
                idem.abandon(conn, scope, key)
            else:
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = raw.decode(errors="replace")
                idem.complete(conn, scope, key, response.status_code, payload, kept)

    await run_in_threadpool(end)
    return Response(raw, status_code=response.status_code, headers=dict(response.headers),
                    media_type=response.media_type)


class IdempotencyKeys:
    """The Idempotency-Key layer, plain ASGI: a POST with the header goes through idempotency_middleware,
    every other request straight on (without the cost of a BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.keyed = BaseHTTPMiddleware(app, dispatch=idempotency_middleware)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route the request by its method and headers."""
        if scope["type"] == "http" and scope["method"] == "POST" \
                and any(k == b"idempotency-key" for k, _ in scope.get("headers") or []):
            await self.keyed(scope, receive, send)
        else:
            await self.app(scope, receive, send)
