"""The leader's lease in the store (`server_lease`): written by the elected server while it leads, read by
every replica's /readyz, so each can say who leads and whether its lease still runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vgpu_ctl.service.ports import STORE, Tx, utcnow


def heartbeat(conn: Tx, holder: str, address: str, until: datetime) -> None:
    """Record `holder` (at `address`) as the leader until `until`."""
    STORE.leader_lease.write_leader(conn, holder, address, until)


def resign(conn: Tx, holder: str) -> None:
    """Clear the leader's lease if `holder` still has it."""
    STORE.leader_lease.clear_leader(conn, holder)


def current(conn: Tx) -> dict[str, Any] | None:
    """The leader as the store knows it (holder, address, until), if its lease still runs."""
    row = STORE.leader_lease.leader(conn)
    if row is None:
        return None
    expires = row.expires_at if row.expires_at.tzinfo else row.expires_at.replace(tzinfo=UTC)
    if expires <= utcnow():
        return None
    return {"holder": row.holder, "address": row.address, "until": expires.isoformat()}


def operations_by_state(conn: Tx) -> dict[str, int]:
    """How many operations the store holds in each state."""
    return STORE.operations.operation_counts(conn)
