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

from vgpu_ctl.service.ports import STORE, Tx, utcnow

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


def begin(conn: Tx, scope: str, key: str, print_: str, ttl: timedelta = DEFAULT_TTL,
          stale_after: timedelta | None = None) -> Stored:
    """Claim `key` for this request (in its own transaction on `conn`) or say what holds it. A request still
    in flight after `stale_after` is taken as abandoned (its server died before answering) and the key is
    claimed again, so that a retry is not refused until the key expires."""
    now = utcnow()
    keys = STORE.idempotency
    keys.drop_expired_key(conn, scope, key, now)
    if keys.add_key(conn, scope, key, print_, now, now + ttl):
        return Stored("new")
    row = keys.key_row(conn, scope, key)
    assert row is not None, "a key that could not be added is there"
    if row.fingerprint != print_:
        return Stored("mismatch")
    if row.state == "in-flight":
        if stale_after is not None and _aware(row.created_at) <= now - stale_after \
                and keys.restart_key(conn, row, now, now + ttl):
            return Stored("new")
        return Stored("in-flight")
    return Stored("done", row.status_code, row.response, dict(row.headers))


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def complete(conn: Tx, scope: str, key: str, status_code: int, response: Any,
             headers: dict[str, str]) -> None:
    """Store the response a retry with this key will get."""
    STORE.idempotency.complete_key(conn, scope, key, status_code, response, headers)


def abandon(conn: Tx, scope: str, key: str) -> None:
    """Forget a key whose request ended without a response worth replaying (a server error): a retry runs."""
    STORE.idempotency.drop_in_flight_key(conn, scope, key)


def purge(conn: Tx) -> int:
    """Delete expired keys; how many."""
    return STORE.idempotency.purge_keys(conn, utcnow())


__all__ = ["DEFAULT_TTL", "Stored", "abandon", "begin", "complete", "fingerprint", "purge"]
