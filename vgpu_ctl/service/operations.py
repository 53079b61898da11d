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
from typing import TYPE_CHECKING, Any, Protocol, cast

from vgpu_ctl.core.vm_state import PROVISIONING
from vgpu_ctl.errors import NotFound, VgpuCtlError
from vgpu_ctl.service.leases import expiry, is_held
from vgpu_ctl.service.ports import STORE, Tx, utcnow
from vgpu_ctl.service.principals import Principal, Role
from vgpu_ctl.service.requests import OperationInfo as OperationInfo  # its home, re-exported
from vgpu_ctl.store.operations import UNFINISHED, OperationRow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

KINDS = ("vm.create", "vm.delete")
VM_WAIT_S = 600.0  # how long a create waits for a VM another process holds (its lease is 30 s, renewed as it works)
VM_POLL_S = 0.5


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


class Asker(Protocol):
    """Who asked for an operation, as its row records it."""

    @property
    def actor(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def tenant_id(self) -> int | None: ...


def _info(conn: Tx, row: OperationRow) -> OperationInfo:
    tenant = STORE.tenants.tenant_name(conn, row.tenant_id) if row.tenant_id is not None else None
    return OperationInfo(row.id, row.kind, row.state, tenant, row.vm_id, dict(row.request), row.result, row.error,
                         row.created_at.isoformat(), row.updated_at.isoformat(), _iso(row.finished_at))


def submit(conn: Tx, principal: Principal, kind: str, request: Mapping[str, Any], *,
           tenant_id: int | None, vm_id: str | None, holder: str, lease_seconds: float) -> OperationInfo:
    """Record a new operation taken by `holder` (the worker pool that runs it next: running, first attempt)."""
    assert kind in KINDS
    now = utcnow()
    op_id = str(uuid.uuid4())
    STORE.operations.add_operation(conn, OperationRow(
        id=op_id, kind=kind, state="running", actor=principal.actor, role=principal.role, tenant_id=tenant_id,
        vm_id=vm_id, request=dict(request), result=None, error=None, lease_holder=holder,
        lease_expires=expiry(lease_seconds), attempts=1, created_at=now, updated_at=now, finished_at=None))
    tenant = principal.tenant if principal.tenant_id == tenant_id else None
    if tenant is None and tenant_id is not None:
        tenant = STORE.tenants.tenant_name(conn, tenant_id)
    return OperationInfo(op_id, kind, "running", tenant, vm_id, dict(request), None, None, now.isoformat(),
                         now.isoformat(), None)


def get(conn: Tx, principal: Principal, op_id: str) -> OperationInfo:
    """One operation (a tenant sees only its own; another's is NotFound)."""
    row = STORE.operations.operation(conn, op_id)
    if row is None or (principal.tenant_id is not None and row.tenant_id != principal.tenant_id):
        raise NotFound(f"operation {op_id!r} not found", reasons=[{"field": "operation", "value": op_id}])
    return _info(conn, row)


def list_operations(conn: Tx, principal: Principal, states: Collection[str] | None = None,
                    limit: int = 100) -> list[OperationInfo]:
    """Operations, newest first (a tenant sees only its own), optionally only those in `states`."""
    return [_info(conn, r) for r in STORE.operations.operations(conn, principal.tenant_id, states, limit)]


def own(conn: Tx, op_id: str, holder: str) -> OperationRow | None:
    """The operation's row if `holder` holds it and it is unfinished (submitted by it, not yet run)."""
    row = STORE.operations.operation(conn, op_id)
    return row if row is not None and row.state in UNFINISHED and row.lease_holder == holder else None


def take_over(conn: Tx, op_id: str, holder: str, lease_seconds: float) -> OperationRow | None:
    """Take an unfinished operation nobody holds now for `holder` (a compare-and-set on the lease as read;
    one more attempt); its row, or None if it is finished or another live worker holds it."""
    row = STORE.operations.operation(conn, op_id)
    if row is None or row.state not in UNFINISHED or is_held(row.lease_holder, row.lease_expires):
        return None
    if not STORE.operations.retake_operation(conn, row, holder, expiry(lease_seconds), utcnow()):
        return None
    return STORE.operations.operation(conn, op_id)


def renew(conn: Tx, holder: str, op_ids: Collection[str], lease_seconds: float) -> None:
    """Extend `holder`'s leases on these operations."""
    if op_ids:
        STORE.operations.renew_operations(conn, holder, op_ids, expiry(lease_seconds))


def finish(conn: Tx, op_id: str, holder: str, *, vm_id: str | None, result: dict[str, Any] | None,
           error: dict[str, Any] | None) -> bool:
    """Record the end of an operation `holder` runs: succeeded with `result`, or failed with `error`;
    whether it still held it."""
    return STORE.operations.end_operation(conn, op_id, holder, "failed" if error is not None else "succeeded",
                                          vm_id=vm_id, result=result, error=error, now=utcnow())


def orphaned(conn: Tx, limit: int = 100) -> list[str]:
    """Unfinished operations nobody holds now (their holder died or let the lease run out), oldest first."""
    rows = STORE.operations.unfinished_leases(conn, limit * 4)
    return [r.id for r in rows if not is_held(r.lease_holder, r.lease_expires)][:limit]


def principal_of(conn: Tx, row: Asker) -> Principal:
    """The principal who asked for the operation, as it was when it asked."""
    if row.tenant_id is not None and row.role == "tenant":
        name = STORE.tenants.tenant_name(conn, row.tenant_id)
        return Principal(row.actor, row.tenant_id, name, "tenant")
    return Principal(row.actor, role=cast(Role, row.role))


def _queued_before(ctl: Controller, row: OperationRow, name: str) -> OperationInfo | None:
    """The queued request an earlier attempt of this create made, if any: a vm.create of the same tenant and
    VM name enqueued since this operation was submitted (a queued request's own request carries `deadline`)."""
    with ctl.read() as conn:
        for r in STORE.operations.creates_since(conn, row.tenant_id, row.created_at, row.id):
            if r.request.get("name") == name and "deadline" in r.request:
                return _info(conn, r)
    return None


def execute(ctl: Controller, row: OperationRow) -> tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]:
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


__all__ = ["KINDS", "Asker", "OperationInfo", "execute", "finish", "get", "list_operations", "orphaned",
           "own", "principal_of", "renew", "submit", "take_over"]
