"""VMs in the store (`vm`): the row as read, and the compare-and-sets on its state and lease."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select, update

from vgpu_ctl.store.tables import VM
from vgpu_ctl.store.unit import Tx


class VmRow(NamedTuple):
    """One VM as stored."""

    id: str
    tenant_id: int
    name: str
    pool_id: int | None
    host_id: int | None
    vcpus: int
    memory_mib: int
    framebuffer_mib: int
    state: str
    idempotency_key: str | None
    anti_affinity: str | None
    domain_uuid: str | None
    template: str
    spec: dict[str, Any]
    error: str | None
    lease_holder: str | None
    lease_expires: datetime | None
    created_at: datetime
    updated_at: datetime
    generation: int


_COLUMNS = [VM.c[name] for name in VmRow._fields]


def vm_row(tx: Tx, vm_id: str) -> VmRow | None:
    """The VM `vm_id`, if there is one."""
    row = tx.execute(select(*_COLUMNS).where(VM.c.id == vm_id)).first()
    return VmRow(*row) if row is not None else None


def retake_vm(tx: Tx, row: VmRow, values: dict[str, Any]) -> bool:
    """Set `values` (a lease, a state) on the VM if its state and lease holder are still as `row` read them;
    whether this call did."""
    same = func.coalesce(VM.c.lease_holder, "") == (row.lease_holder or "")
    return bool(tx.execute(update(VM).where(VM.c.id == row.id, VM.c.state == row.state, same)
                           .values(**values)).rowcount == 1)


def move_vm(tx: Tx, vm_id: str, holder: str, from_states: Collection[str], values: dict[str, Any]) -> bool:
    """Set `values` on the VM if it is in one of `from_states` and `holder` holds its lease; whether it did."""
    return bool(tx.execute(update(VM).where(VM.c.id == vm_id, VM.c.state.in_(list(from_states)),
                                            VM.c.lease_holder == holder).values(**values)).rowcount == 1)


def set_vm_lease(tx: Tx, vm_id: str, holder: str, holder_after: str | None, expires: datetime | None) -> bool:
    """Set the VM's lease (holder and expiry) if `holder` has it; whether it did."""
    return bool(tx.execute(update(VM).where(VM.c.id == vm_id, VM.c.lease_holder == holder)
                           .values(lease_holder=holder_after, lease_expires=expires)).rowcount == 1)
