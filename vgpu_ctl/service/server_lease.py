"""The leader's lease in the store (`server_lease`): written by the elected server while it leads, read by
every replica's /readyz, so each can say who leads and whether its lease still runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection

from vgpu_ctl.service.operations import OPERATION
from vgpu_ctl.store.models import ServerLease, utcnow

SERVER_LEASE = ServerLease.__table__  # type: ignore[attr-defined]


def heartbeat(conn: Connection, holder: str, address: str, until: datetime) -> None:
    """Record `holder` (at `address`) as the leader until `until`."""
    if conn.execute(update(SERVER_LEASE).where(SERVER_LEASE.c.name == "leader")
                    .values(holder=holder, address=address, expires_at=until)).rowcount == 0:
        conn.execute(SERVER_LEASE.insert().values(name="leader", holder=holder, address=address, expires_at=until))


def resign(conn: Connection, holder: str) -> None:
    """Clear the leader's lease if `holder` still has it."""
    conn.execute(delete(SERVER_LEASE).where(SERVER_LEASE.c.name == "leader", SERVER_LEASE.c.holder == holder))


def current(conn: Connection) -> dict[str, Any] | None:
    """The leader as the store knows it (holder, address, until), if its lease still runs."""
    row = conn.execute(select(SERVER_LEASE).where(SERVER_LEASE.c.name == "leader")).first()
    if row is None:
        return None
    expires = row.expires_at if row.expires_at.tzinfo else row.expires_at.replace(tzinfo=UTC)
    if expires <= utcnow():
        return None
    return {"holder": row.holder, "address": row.address, "until": expires.isoformat()}


def operations_by_state(conn: Connection) -> dict[str, int]:
    """How many operations the store holds in each state."""
    rows = conn.execute(select(OPERATION.c.state, func.count()).group_by(OPERATION.c.state)).all()
    return {str(state): int(n) for state, n in rows}
