"""Operations in the store (`operation`): long work a caller asked for, with its lease; every change of a
lease is a compare-and-set on what was read."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, or_, select, update

from vgpu_ctl.store.tables import OPERATION
from vgpu_ctl.store.unit import Tx

UNFINISHED = ("pending", "running")


class OperationRow(NamedTuple):
    """One operation as stored."""

    id: str
    kind: str
    state: str
    actor: str
    role: str
    tenant_id: int | None
    vm_id: str | None
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    lease_holder: str | None
    lease_expires: datetime | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class OperationLease(NamedTuple):
    """An unfinished operation's lease."""

    id: str
    lease_holder: str | None
    lease_expires: datetime | None


_COLUMNS = [OPERATION.c[name] for name in OperationRow._fields]


def add_operation(tx: Tx, row: OperationRow) -> None:
    """Insert a new operation (its empty fields left to the table: NULL, not JSON null)."""
    tx.execute(OPERATION.insert().values({k: v for k, v in row._asdict().items() if v is not None}))


def operation(tx: Tx, op_id: str) -> OperationRow | None:
    """The operation `op_id`, if there is one."""
    row = tx.execute(select(*_COLUMNS).where(OPERATION.c.id == op_id)).first()
    return OperationRow(*row) if row is not None else None


def operations(tx: Tx, tenant_id: int | None, states: Collection[str] | None, limit: int) -> list[OperationRow]:
    """Up to `limit` operations, newest first: only the tenant's when `tenant_id`, only those in `states`
    when given."""
    q = select(*_COLUMNS).order_by(OPERATION.c.created_at.desc()).limit(limit)
    if tenant_id is not None:
        q = q.where(OPERATION.c.tenant_id == tenant_id)
    if states:
        q = q.where(OPERATION.c.state.in_(list(states)))
    return [OperationRow(*r) for r in tx.execute(q).all()]


def creates_since(tx: Tx, tenant_id: int | None, since: datetime, other_than: str) -> list[OperationRow]:
    """The tenant's vm.create operations made since `since` (but `other_than`), oldest first."""
    return [OperationRow(*r) for r in tx.execute(select(*_COLUMNS).where(
        OPERATION.c.kind == "vm.create", OPERATION.c.tenant_id == tenant_id, OPERATION.c.id != other_than,
        OPERATION.c.created_at >= since).order_by(OPERATION.c.created_at)).all()]


def retake_operation(tx: Tx, row: OperationRow, holder: str, expires: datetime, now: datetime) -> bool:
    """Give the operation to `holder` (running, one more attempt) if its state, attempts and lease holder are
    still as `row` read them; whether this call did."""
    same = func.coalesce(OPERATION.c.lease_holder, "") == (row.lease_holder or "")
    res = tx.execute(update(OPERATION).where(OPERATION.c.id == row.id, OPERATION.c.state == row.state,
                                             OPERATION.c.attempts == row.attempts, same)
                     .values(state="running", lease_holder=holder, lease_expires=expires,
                             attempts=row.attempts + 1, updated_at=now))
    return bool(res.rowcount == 1)


def renew_operations(tx: Tx, holder: str, op_ids: Collection[str], expires: datetime) -> None:
    """Extend to `expires` the leases `holder` has on these unfinished operations."""
    tx.execute(update(OPERATION).where(OPERATION.c.id.in_(list(op_ids)), OPERATION.c.lease_holder == holder,
                                       OPERATION.c.state.in_(UNFINISHED))
               .values(lease_expires=expires))


def end_operation(tx: Tx, op_id: str, holder: str, state: str, *, vm_id: str | None,
                  result: dict[str, Any] | None, error: dict[str, Any] | None, now: datetime) -> bool:
    """Move a running operation `holder` holds to `state` with its result or error, ending the lease;
    whether it still held it."""
    res = tx.execute(update(OPERATION).where(OPERATION.c.id == op_id, OPERATION.c.lease_holder == holder,
                                             OPERATION.c.state == "running")
                     .values(state=state, result=result, error=error, vm_id=vm_id, lease_holder=None,
                             lease_expires=None, updated_at=now, finished_at=now))
    return bool(res.rowcount == 1)


def unfinished_leases(tx: Tx, limit: int) -> list[OperationLease]:
    """Up to `limit` unfinished operations that have no holder or a lease that runs out, oldest first."""
    rows = tx.execute(select(OPERATION.c.id, OPERATION.c.lease_holder, OPERATION.c.lease_expires)
                      .where(OPERATION.c.state.in_(UNFINISHED),
                             or_(OPERATION.c.lease_holder.is_(None), OPERATION.c.lease_expires.is_not(None)))
                      .order_by(OPERATION.c.created_at).limit(limit)).all()
    return [OperationLease(*r) for r in rows]


def operation_counts(tx: Tx) -> dict[str, int]:
    """How many operations are in each state."""
    rows = tx.execute(select(OPERATION.c.state, func.count()).group_by(OPERATION.c.state)).all()
    return {str(state): int(n) for state, n in rows}
