"""The audit trail: one event per change, written in the same transaction as the change."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection

from vgpu_ctl.store.models import Event, utcnow
from vgpu_ctl.store.prepared import insert_all

EVENT: Table = Event.__table__  # type: ignore[attr-defined]
_INSERT_EVENT = insert_all(EVENT)


def record(conn: Connection, actor: str, action: str, target: str, *, tenant: str | None = None,
           params: dict[str, Any] | None = None, result: str = "ok", error: str | None = None) -> None:
    """Write one audit event on `conn` (inside the caller's transaction)."""
    _INSERT_EVENT.run(conn, {"time": utcnow(), "actor": actor, "tenant": tenant, "action": action,
                             "target": target, "params": params or {}, "result": result, "error": error})
