"""VMs in the store (`vm`): the row as read, and the compare-and-sets on its state and lease."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select, update

from vgpu_ctl.store.tables import DEVICE, GPU, HOST, POOL, TENANT, VM
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
    tenant_name: str | None = None  # filled by the reads that join the VM's tenant (`vms_by`, `tenant_vms`)


_COLUMNS = [VM.c[name] for name in VmRow._fields if name != "tenant_name"]
_NAMED = select(*_COLUMNS, TENANT.c.name.label("tenant_name")).join(TENANT, TENANT.c.id == VM.c.tenant_id)


class DeviceRow(NamedTuple):
    """A VM's device with its GPU's PCI address."""

    id: str
    gpu_id: int
    pci_address: str
    profile: str
    kind: str
    start: int
    size: int
    uuid: str
    backing: str
    state: str


class DeviceRef(NamedTuple):
    """A claimed device's UUID, VM and backing."""

    uuid: str
    vm_id: str
    backing: str


def all_vms(tx: Tx) -> list[VmRow]:
    """Every VM, in no particular order."""
    return [VmRow(*r) for r in tx.execute(select(*_COLUMNS))]


def device_refs(tx: Tx) -> list[DeviceRef]:
    """Every device a VM holds."""
    return [DeviceRef(str(r.uuid), str(r.vm_id), str(r.backing))
            for r in tx.execute(select(DEVICE.c.uuid, DEVICE.c.vm_id, DEVICE.c.backing))]


def reclaim_devices(tx: Tx, vm_id: str) -> None:
    """Mark every device of the VM claimed (to be made again on its host)."""
    tx.execute(DEVICE.update().where(DEVICE.c.vm_id == vm_id).values(state="claimed"))


def vms_by(tx: Tx, *, vm_id: str | None = None, tenant: str | None = None, name: str | None = None,
           id_prefix: str | None = None, limit: int | None = None) -> list[VmRow]:
    """The VMs (with their tenant's name) that have this id, this name (in `tenant` when given), or an id
    starting with `id_prefix` (at most `limit`)."""
    q = _NAMED
    if vm_id is not None:
        q = q.where(VM.c.id == vm_id)
    if name is not None:
        q = q.where(VM.c.name == name)
    if tenant is not None:
        q = q.where(TENANT.c.name == tenant)
    if id_prefix is not None:
        q = q.where(VM.c.id.like(f"{id_prefix}%"))
    if limit is not None:
        q = q.limit(limit)
    return [VmRow._make(r) for r in tx.execute(q).all()]


def tenant_vms(tx: Tx, tenant_id: int | None) -> list[VmRow]:
    """Every VM (only the tenant's when `tenant_id`), with its tenant's name, by tenant and VM name."""
    q = _NAMED.order_by(TENANT.c.name, VM.c.name)
    if tenant_id is not None:
        q = q.where(VM.c.tenant_id == tenant_id)
    return [VmRow._make(r) for r in tx.execute(q).all()]


def vm_devices(tx: Tx, vm_id: str) -> list[DeviceRow]:
    """The VM's devices, by GPU and start."""
    return [DeviceRow._make(r) for r in tx.execute(
        select(DEVICE.c.id, DEVICE.c.gpu_id, GPU.c.pci_address, DEVICE.c.profile, DEVICE.c.kind, DEVICE.c.start,
               DEVICE.c.size, DEVICE.c.uuid, DEVICE.c.backing, DEVICE.c.state)
        .join(GPU, GPU.c.id == DEVICE.c.gpu_id).where(DEVICE.c.vm_id == vm_id)
        .order_by(DEVICE.c.gpu_id, DEVICE.c.start)).all()]


def host_of(tx: Tx, host_id: int) -> tuple[str, str] | None:
    """The host's (name, driver)."""
    row = tx.execute(select(HOST.c.name, HOST.c.driver).where(HOST.c.id == host_id)).first()
    return (str(row.name), str(row.driver)) if row is not None else None


def pool_name(tx: Tx, pool_id: int) -> str | None:
    """The pool's name."""
    name = tx.execute(select(POOL.c.name).where(POOL.c.id == pool_id)).scalar()
    return None if name is None else str(name)


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
