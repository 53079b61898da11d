"""Operations: long work a caller asked for (create or delete a VM), kept in the store so that any server
replica can report on it and the leader can finish it when the server that took it dies. The server that
accepts an operation holds its lease from the start and runs it on its workers, renewing the lease while it
works, then records the result or the error; an operation whose lease ran out (or whose holder's process is
gone) is taken over by another with a compare-and-set on the lease (`attempts` counts the takers)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.engine import Connection

from vgpu_ctl.core.vm_state import PROVISIONING
from vgpu_ctl.errors import NotFound, VgpuCtlError
from vgpu_ctl.service.leases import expiry, is_held
from vgpu_ctl.service.principals import Principal
from vgpu_ctl.service.requests import OperationInfo as OperationInfo  # its home, re-exported
from vgpu_ctl.store.models import Operation, utcnow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

OPERATION = Operation.__table__  # type: ignore[attr-defined]
KINDS = ("vm.create", "vm.delete")
UNFINISHED = ("pending", "running")
VM_WAIT_S = 600.0  # how long a create waits for a VM another process holds (its lease is 30 s, renewed as it works)
VM_POLL_S = 0.5


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def _info(conn: Connection, row: Any) -> OperationInfo:
    from vgpu_ctl.service.allocation import TENANT
    tenant = conn.execute(select(TENANT.c.name).where(TENANT.c.id == row.tenant_id)).scalar() \
        if row.tenant_id is not None else None
    return OperationInfo(row.id, row.kind, row.state, tenant, row.vm_id, dict(row.request), row.result, row.error,
                         row.created_at.isoformat(), row.updated_at.isoformat(), _iso(row.finished_at))


def submit(conn: Connection, principal: Principal, kind: str, request: Mapping[str, Any], *,
           tenant_id: int | None, vm_id: str | None, holder: str, lease_seconds: float) -> OperationInfo:
    """Record a new operation taken by `holder` (the worker pool that runs it next: running, first attempt)."""
    assert kind in KINDS
    now = utcnow()
    op_id = str(uuid.uuid4())
    conn.execute(OPERATION.insert().values(
        id=op_id, kind=kind, state="running", actor=principal.actor, role=principal.role, tenant_id=tenant_id,
        vm_id=vm_id, request=dict(request), lease_holder=holder, lease_expires=expiry(lease_seconds), attempts=1,
        created_at=now, updated_at=now))
    tenant = principal.tenant if principal.tenant_id == tenant_id else None
    if tenant is None and tenant_id is not None:
        from vgpu_ctl.service.allocation import TENANT
        tenant = conn.execute(select(TENANT.c.name).where(TENANT.c.id == tenant_id)).scalar()
    return OperationInfo(op_id, kind, "running", tenant, vm_id, dict(request), None, None, now.isoformat(),
                         now.isoformat(), None)


def get(conn: Connection, principal: Principal, op_id: str) -> OperationInfo:
    """One operation (a tenant sees only its own; another's is NotFound)."""
    row = conn.execute(select(OPERATION).where(OPERATION.c.id == op_id)).first()
    if row is None or (principal.tenant_id is not None and row.tenant_id != principal.tenant_id):
        raise NotFound(f"operation {op_id!r} not found", reasons=[{"field": "operation", "value": op_id}])
    return _info(conn, row)


def list_operations(conn: Connection, principal: Principal, states: Collection[str] | None = None,
                    limit: int = 100) -> list[OperationInfo]:
    """Operations, newest first (a tenant sees only its own), optionally only those in `states`."""
    q = select(OPERATION).order_by(OPERATION.c.created_at.desc()).limit(limit)
    if principal.tenant_id is not None:
        q = q.where(OPERATION.c.tenant_id == principal.tenant_id)
    if states:
        q = q.where(OPERATION.c.state.in_(list(states)))
    return [_info(conn, r) for r in conn.execute(q).all()]


def own(conn: Connection, op_id: str, holder: str) -> Any | None:
    """The operation's row if `holder` holds it and it is unfinished (submitted by it, not yet run)."""
    row = conn.execute(select(OPERATION).where(OPERATION.c.id == op_id)).first()
    return row if row is not None and row.state in UNFINISHED and row.lease_holder == holder else None


def take_over(conn: Connection, op_id: str, holder: str, lease_seconds: float) -> Any | None:
    """Take an unfinished operation nobody holds now for `holder` (a compare-and-set on the lease as read;
    one more attempt); its row, or None if it is finished or another live worker holds it."""
    row = conn.execute(select(OPERATION).where(OPERATION.c.id == op_id)).first()
    if row is None or row.state not in UNFINISHED or is_held(row.lease_holder, row.lease_expires):
        return None
    same = func.coalesce(OPERATION.c.lease_holder, "") == (row.lease_holder or "")
    res = conn.execute(update(OPERATION).where(OPERATION.c.id == op_id, OPERATION.c.state == row.state,
                                               OPERATION.c.attempts == row.attempts, same)
                       .values(state="running", lease_holder=holder, lease_expires=expiry(lease_seconds),
                               attempts=row.attempts + 1, updated_at=utcnow()))
    if res.rowcount != 1:
        return None
    return conn.execute(select(OPERATION).where(OPERATION.c.id == op_id)).first()


def renew(conn: Connection, holder: str, op_ids: Collection[str], lease_seconds: float) -> None:
    """Extend `holder`'s leases on these operations."""
    if op_ids:
        conn.execute(update(OPERATION).where(OPERATION.c.id.in_(list(op_ids)), OPERATION.c.lease_holder == holder,
                                             OPERATION.c.state.in_(UNFINISHED))
                     .values(lease_expires=expiry(lease_seconds)))


def finish(conn: Connection, op_id: str, holder: str, *, vm_id: str | None, result: dict[str, Any] | None,
           error: dict[str, Any] | None) -> bool:
    """Record the end of an operation `holder` runs: succeeded with `result`, or failed with `error`;
    whether it still held it."""
    now = utcnow()
    res = conn.execute(update(OPERATION).where(OPERATION.c.id == op_id, OPERATION.c.lease_holder == holder,
                                               OPERATION.c.state == "running")
                       .values(state="failed" if error is not None else "succeeded", result=result, error=error,
                               vm_id=vm_id, lease_holder=None, lease_expires=None, updated_at=now,
                               finished_at=now))
    return bool(res.rowcount == 1)


def orphaned(conn: Connection, limit: int = 100) -> list[str]:
    """Unfinished operations nobody holds now (their holder died or let the lease run out), oldest first."""
    rows = conn.execute(select(OPERATION.c.id, OPERATION.c.lease_holder, OPERATION.c.lease_expires)
                        .where(OPERATION.c.state.in_(UNFINISHED),
                               or_(OPERATION.c.lease_holder.is_(None), OPERATION.c.lease_expires.is_not(None)))
                        .order_by(OPERATION.c.created_at).limit(limit * 4)).all()
    return [r.id for r in rows if not is_held(r.lease_holder, r.lease_expires)][:limit]


def principal_of(conn: Connection, row: Any) -> Principal:
    """The principal who asked for the operation, as it was when it asked."""
    from vgpu_ctl.service.allocation import TENANT
    if row.tenant_id is not None and row.role == "tenant":
        name = conn.execute(select(TENANT.c.name).where(TENANT.c.id == row.tenant_id)).scalar()
        return Principal(row.actor, row.tenant_id, name, "tenant")
    return Principal(row.actor, role=row.role)


def _queued_before(ctl: Controller, row: Any, name: str) -> OperationInfo | None:
    """The queued request an earlier attempt of this create made, if any: a vm.create of the same tenant and
    VM name enqueued since this operation was submitted (a queued request's own request carries `deadline`)."""
    with ctl.engine.connect() as conn:
        rows = conn.execute(select(OPERATION).where(
            OPERATION.c.kind == "vm.create", OPERATION.c.tenant_id == row.tenant_id, OPERATION.c.id != row.id,
            OPERATION.c.created_at >= row.created_at).order_by(OPERATION.c.created_at)).all()
        for r in rows:
            if r.request.get("name") == name and "deadline" in r.request:
                return _info(conn, r)
    return None


def execute(ctl: Controller, row: Any) -> tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]:
    """Do what the operation asks, as the principal who asked (`ctl` acts for it): (vm_id, result, error).
    A create is made idempotent by the operation's id, so running it again after a crash finishes the same VM
    instead of making another; while another process still holds that VM's lease (a dead server on another
    machine, until its lease runs out) the create waits and tries again, so that it ends with the VM running,
    not half made. A create asked with `queue` that does not fit ends succeeded with the result
    `{"queued": OPERATION}`: the queued request's own operation, which ends when it is admitted (or cancelled, or
    past its deadline); run again after a crash, it finds the queued request the first attempt made rather than
    queueing a second one. A delete of a VM that is gone has done its work."""
    req = dict(row.request)
    try:
        if row.kind == "vm.create":
            key = req.pop("idempotency_key", None) or f"op-{row.id}"
            tenant, name = req.pop("tenant"), req.pop("name")
            vgpus = [(v["profile"], v["count"]) for v in req.pop("vgpus")]
            earlier = _queued_before(ctl, row, name) if req.get("queue") and row.attempts > 1 else None
            if earlier is not None:  # a first attempt queued it, then died before finishing: not twice
                return None, {"queued": earlier.to_dict()}, None
            vm = ctl.request_vm(tenant, name, vgpus, idempotency_key=key, **req)
            if isinstance(vm, OperationInfo):  # it did not fit and waits in the queue: point at its operation
                return None, {"queued": vm.to_dict()}, None
            deadline = time.monotonic() + VM_WAIT_S
            while vm.state in PROVISIONING and time.monotonic() < deadline:
                time.sleep(VM_POLL_S)
                vm = ctl.request_vm(tenant, name, vgpus, idempotency_key=key, **req)
            return vm.id, vm.to_dict(), None
        try:
            ctl.release_vm(str(row.vm_id), if_generation=req.get("if_generation"))
        except NotFound:
            if row.attempts <= 1:  # a first run: the VM was there when the delete was asked for
                raise
        return row.vm_id, {"deleted": row.vm_id}, None
    except VgpuCtlError as exc:
        return row.vm_id, None, exc.to_dict()


__all__ = ["KINDS", "OPERATION", "OperationInfo", "execute", "finish", "get", "list_operations", "orphaned",
           "own", "principal_of", "renew", "submit", "take_over"]
