"""The audit trail: one event per change, written in the same transaction as the change."""

from __future__ import annotations

from typing import Any

from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.events import NewEvent


def event(actor: str, action: str, target: str, *, tenant: str | None = None, params: dict[str, Any] | None = None,
          result: str = "ok", error: str | None = None) -> NewEvent:
    """An audit event, to be written with others (`STORE.events.add_events`)."""
    return NewEvent(actor, action, target, tenant, params or {}, result, error)


def record(conn: Tx, actor: str, action: str, target: str, *, tenant: str | None = None,
           params: dict[str, Any] | None = None, result: str = "ok", error: str | None = None) -> None:
    """Write one audit event on `conn` (inside the caller's transaction)."""
    STORE.events.add_events(conn, [event(actor, action, target, tenant=tenant, params=params, result=result,
                                         error=error)])
