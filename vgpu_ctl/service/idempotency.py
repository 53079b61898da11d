"""Idempotent requests (the IETF httpapi Idempotency-Key draft), kept in the store so that every replica
answers a retry alike: per caller and key, the request's fingerprint and, once answered, the response. A
retry gets the stored response; the same key with another request is refused; a duplicate that arrives while
the first is still being answered is told so. Keys expire after `ttl`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.store.models import IdempotentRequest, utcnow

IDEMPOTENT = IdempotentRequest.__table__  # type: ignore[attr-defined]
DEFAULT_TTL = timedelta(hours=24)


@dataclass(frozen=True)
class Stored:
    """What the store holds for a key: `state` is new (this call owns it now), in-flight, mismatch (another
    request used the key) or done (with the response to replay)."""

    state: str
    status_code: int | None = None
    response: Any = None
    headers: dict[str, str] | None = None


def fingerprint(method: str, path: str, body: bytes) -> str:
    """A digest of what was asked: method, path and the body (JSON bodies compared by content)."""
    try:
        canon = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode() if body else b""
    except ValueError:
        canon = body
    return hashlib.sha256(method.encode() + b" " + path.encode() + b"\n" + canon).hexdigest()


def begin(conn: Connection, scope: str, key: str, print_: str, ttl: timedelta = DEFAULT_TTL,
          stale_after: timedelta | None = None) -> Stored:
    """Claim `key` for this request (in its own transaction on `conn`) or say what holds it. A request still
    in flight after `stale_after` is taken as abandoned (its server died before answering) and the key is
    claimed again, so that a retry is not refused until the key expires."""
    now = utcnow()
    conn.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key,
                                          IDEMPOTENT.c.expires_at <= now))
    try:
        with conn.begin_nested():
            conn.execute(IDEMPOTENT.insert().values(scope=scope, key=key, fingerprint=print_, state="in-flight",
                                                    headers={}, created_at=now, expires_at=now + ttl))
        return Stored("new")
    except IntegrityError:
        pass
    row = conn.execute(select(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key)).one()
    if row.fingerprint != print_:
        return Stored("mismatch")
    if row.state == "in-flight":
        if stale_after is not None and _aware(row.created_at) <= now - stale_after and conn.execute(
                update(IDEMPOTENT).where(IDEMPOTENT.c.id == row.id, IDEMPOTENT.c.state == "in-flight",
                                         IDEMPOTENT.c.created_at == row.created_at)
                .values(created_at=now, expires_at=now + ttl)).rowcount == 1:
            return Stored("new")
        return Stored("in-flight")
    return Stored("done", row.status_code, row.response, dict(row.headers))


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def complete(conn: Connection, scope: str, key: str, status_code: int, response: Any,
             headers: dict[str, str]) -> None:
    """Store the response a retry with this key will get."""
    conn.execute(update(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key)
                 .values(state="done", status_code=status_code, response=response, headers=headers))


def abandon(conn: Connection, scope: str, key: str) -> None:
    """Forget a key whose request ended without a response worth replaying (a server error): a retry runs."""
    conn.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key,
                                          IDEMPOTENT.c.state == "in-flight"))


def purge(conn: Connection) -> int:
    """Delete expired keys; how many."""
    return int(conn.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.expires_at <= utcnow())).rowcount)


__all__ = ["DEFAULT_TTL", "IDEMPOTENT", "Stored", "abandon", "begin", "complete", "fingerprint", "purge"]
