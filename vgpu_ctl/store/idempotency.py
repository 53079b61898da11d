"""Idempotency keys in the store (`idempotent_request`): per caller scope and key, the request's fingerprint,
its state (in-flight, done) and, once answered, the response."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.store.tables import IDEMPOTENT
from vgpu_ctl.store.unit import Tx


class KeyRow(NamedTuple):
    """What the store holds for one scope and key."""

    id: int
    fingerprint: str
    state: str
    status_code: int | None
    response: Any
    headers: dict[str, str]
    created_at: datetime


def drop_expired_key(tx: Tx, scope: str, key: str, now: datetime) -> None:
    """Delete the scope's key if it expired by `now`."""
    tx.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key,
                                        IDEMPOTENT.c.expires_at <= now))


def add_key(tx: Tx, scope: str, key: str, fingerprint: str, now: datetime, expires: datetime) -> bool:
    """Record the key as in flight since `now`; False (nothing stored) when the scope holds it already."""
    try:
        with tx.begin_nested():
            tx.execute(IDEMPOTENT.insert().values(scope=scope, key=key, fingerprint=fingerprint, state="in-flight",
                                                  headers={}, created_at=now, expires_at=expires))
    except IntegrityError:
        return False
    return True


def key_row(tx: Tx, scope: str, key: str) -> KeyRow | None:
    """The scope's key as stored, if it is."""
    row = tx.execute(select(IDEMPOTENT.c.id, IDEMPOTENT.c.fingerprint, IDEMPOTENT.c.state, IDEMPOTENT.c.status_code,
                            IDEMPOTENT.c.response, IDEMPOTENT.c.headers, IDEMPOTENT.c.created_at)
                     .where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key)).first()
    return KeyRow(*row) if row is not None else None


def restart_key(tx: Tx, row: KeyRow, now: datetime, expires: datetime) -> bool:
    """Claim an in-flight key again from `now` if it is still as `row` read it (a compare-and-set); whether
    this call did."""
    return bool(tx.execute(update(IDEMPOTENT).where(IDEMPOTENT.c.id == row.id, IDEMPOTENT.c.state == "in-flight",
                                                    IDEMPOTENT.c.created_at == row.created_at)
                           .values(created_at=now, expires_at=expires)).rowcount == 1)


def complete_key(tx: Tx, scope: str, key: str, status_code: int, response: Any, headers: dict[str, str]) -> None:
    """Mark the key done with the response a retry will get."""
    tx.execute(update(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key)
               .values(state="done", status_code=status_code, response=response, headers=headers))


def drop_in_flight_key(tx: Tx, scope: str, key: str) -> None:
    """Delete the key if it is still in flight."""
    tx.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.scope == scope, IDEMPOTENT.c.key == key,
                                        IDEMPOTENT.c.state == "in-flight"))


def purge_keys(tx: Tx, now: datetime) -> int:
    """Delete every key expired by `now`; how many."""
    return int(tx.execute(delete(IDEMPOTENT).where(IDEMPOTENT.c.expires_at <= now)).rowcount)
