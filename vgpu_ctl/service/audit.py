"""The audit trail: one event per change, written in the same transaction as the change."""

from __future__ import annotations

from typing import Any

from vgpu_ctl.service.ports import STORE, Tx


def record(conn: Tx, actor: str, action: str, target: str, *, tenant: str | None = None,
           params: dict[str, Any] | None = None, result: str = "ok", error: str | None = None) -> None:
    """Write one audit event on `conn` (inside the caller's transaction)."""
    STORE.events.add_event(conn, actor, action, target, tenant, params or {}, result, error)
