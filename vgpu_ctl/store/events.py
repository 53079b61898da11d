"""The audit trail in the store: one `event` row per change, written inside the change's own transaction."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import select

from vgpu_ctl.store.models import utcnow
from vgpu_ctl.store.prepared import insert_all
from vgpu_ctl.store.tables import EVENT
from vgpu_ctl.store.unit import Tx

_INSERT_EVENT = insert_all(EVENT)


class NewEvent(NamedTuple):
    """An audit event to write: who did what to which object (for which tenant), with what outcome."""

    actor: str
    action: str
    target: str
    tenant: str | None
    params: dict[str, Any]
    result: str
    error: str | None


def add_events(tx: Tx, events: Sequence[NewEvent]) -> None:
    """Write audit events, stamped now, in as few statements as the store allows."""
    now = utcnow()
    _INSERT_EVENT.run_many(tx, [{"time": now, **e._asdict()} for e in events])


class EventRow(NamedTuple):
    """One audit event."""

    id: int
    time: datetime
    actor: str
    tenant: str | None
    action: str
    target: str
    params: dict[str, Any]
    result: str
    error: str | None


def event_rows(tx: Tx, tenant: str | None, since: Any, limit: int) -> list[EventRow]:
    """Up to `limit` events, oldest first: only the tenant's when given, only those at or after `since`."""
    q = select(*[EVENT.c[n] for n in EventRow._fields]).order_by(EVENT.c.id)
    if tenant is not None:
        q = q.where(EVENT.c.tenant == tenant)
    if since is not None:
        q = q.where(EVENT.c.time >= since)
    return [EventRow(*r) for r in tx.execute(q.limit(limit)).all()]
