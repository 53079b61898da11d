"""VMs in the store (`vm`): the row as read, and the compare-and-sets on its state and lease."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import bindparam, func, or_, select, tuple_, update

from vgpu_ctl.store.moves import HeldDevice
from vgpu_ctl.store.prepared import Prepared, end_read
from vgpu_ctl.store.tables import DEVICE, GPU, HOST, POOL, TENANT, VM
from vgpu_ctl.store.unit import Tx, utcnow


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


class VmStatus(NamedTuple):
    """A VM's host and state, and who holds its lease: what reconcile checks a VM by."""

    id: str
    name: str
    host_id: int | None
    state: str
    lease_holder: str | None
    lease_expires: datetime | None


class DeviceRef(NamedTuple):
    """A claimed device's UUID, VM and backing."""

    uuid: str
    vm_id: str
    backing: str


def all_vms(tx: Tx) -> list[VmRow]:
    """Every VM, in no particular order."""
    return [VmRow(*r) for r in tx.execute(select(*_COLUMNS))]


def vm_statuses(tx: Tx) -> list[VmStatus]:
    """Every VM's host, state and lease, in no particular order (not its spec: decoding 30,000 specs was a
    sixth of a reconcile of that many VMs)."""
    return [VmStatus(*r) for r in tx.execute(select(*(VM.c[name] for name in VmStatus._fields))).all()]


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


@lru_cache(maxsize=64)
def _move(columns: tuple[str, ...], n_states: int) -> Prepared:
    """The compare-and-set `move_vm` runs for these columns and this many states, prepared once."""
    return Prepared(update(VM).where(
        VM.c.id == bindparam("m_id"), or_(*(VM.c.state == bindparam(f"m_s{i}") for i in range(n_states))),
        VM.c.lease_holder == bindparam("m_holder")).values({c: bindparam(f"v_{c}", type_=VM.c[c].type)
                                                            for c in columns}))


def move_vm(tx: Tx, vm_id: str, holder: str, from_states: Collection[str], values: dict[str, Any]) -> bool:
    """Set `values` on the VM if it is in one of `from_states` and `holder` holds its lease; whether it did."""
    states = list(from_states)
    params = {"m_id": vm_id, "m_holder": holder, **{f"m_s{i}": s for i, s in enumerate(states)},
              **{f"v_{c}": v for c, v in values.items()}}
    return bool(_move(tuple(values), len(states)).run(tx, params).rowcount == 1)


_SET_LEASE = Prepared(update(VM).where(VM.c.id == bindparam("m_id"), VM.c.lease_holder == bindparam("m_holder"))
                      .values(lease_holder=bindparam("v_holder"),
                              lease_expires=bindparam("v_expires", type_=VM.c.lease_expires.type)))


def set_vm_lease(tx: Tx, vm_id: str, holder: str, holder_after: str | None, expires: datetime | None) -> bool:
    """Set the VM's lease (holder and expiry) if `holder` has it; whether it did."""
    return bool(_SET_LEASE.run(tx, {"m_id": vm_id, "m_holder": holder, "v_holder": holder_after,
                                    "v_expires": expires}).rowcount == 1)


def renew_vm_leases(tx: Tx, leases: Collection[tuple[str, str]], expires: datetime) -> set[str]:
    """Extend to `expires` each lease of `leases` (VM id, holder) whose holder still has it, in one statement;
    the ids of the VMs whose lease it extended."""
    if not leases:
        return set()
    pairs = tuple_(VM.c.id, VM.c.lease_holder).in_([tuple(p) for p in leases])
    return set(tx.execute(update(VM).where(pairs).values(lease_expires=expires).returning(VM.c.id)).scalars())


class VmHost(NamedTuple):
    """The host a VM is placed on, as its driver needs it."""

    id: int
    name: str
    uri: str
    driver: str
    vgpu_backing: str


class VmPlace(NamedTuple):
    """A VM (with its tenant's name) and where it is: its host (None: placed nowhere), its pool's name, and its
    devices by id: what provisioning, a release and a power change work on, read once."""

    vm: VmRow
    host: VmHost | None
    pool_name: str | None
    devices: list[HeldDevice]


_PLACE_VM = Prepared(
    select(*_COLUMNS, TENANT.c.name.label("tenant_name"), HOST.c.name.label("host_name"), HOST.c.uri,
           HOST.c.driver, HOST.c.vgpu_backing, POOL.c.name.label("pool_name"))
    .join(TENANT, TENANT.c.id == VM.c.tenant_id).outerjoin(HOST, HOST.c.id == VM.c.host_id)
    .outerjoin(POOL, POOL.c.id == VM.c.pool_id).where(VM.c.id == bindparam("vm_id")))
_PLACE_DEVICES = Prepared(
    select(*(DEVICE.c[name] for name in HeldDevice._fields[:-3]), GPU.c.pci_address, GPU.c.model,
           GPU.c.mode.label("gpu_mode"))
    .join(GPU, GPU.c.id == DEVICE.c.gpu_id).where(DEVICE.c.vm_id == bindparam("vm_id")).order_by(DEVICE.c.id))
_N_VM = len(VmRow._fields)


def vm_place(tx: Tx, vm_id: str) -> VmPlace | None:
    """The VM `vm_id` with its tenant's name, host, pool's name and devices, if there is such a VM (two
    statements, prepared)."""
    rows = _PLACE_VM.rows(tx, {"vm_id": vm_id})
    devices = [HeldDevice._make(r) for r in _PLACE_DEVICES.rows(tx, {"vm_id": vm_id})] if rows else []
    if not tx.in_transaction():
        end_read(tx)
    if not rows:
        return None
    r = rows[0]
    vm = VmRow._make(r[:_N_VM])
    host = VmHost(vm.host_id, *r[_N_VM:_N_VM + 4]) if vm.host_id is not None else None
    return VmPlace(vm, host, r[_N_VM + 4], devices)


_DEVICE_READY = Prepared(update(DEVICE).where(DEVICE.c.id == bindparam("d_id"))
                         .values(state="ready", handle=bindparam("d_handle", type_=DEVICE.c.handle.type)))


def set_devices_ready(tx: Tx, handles: Mapping[str, dict[str, Any]]) -> None:
    """Mark each device (by id) made on its host, as its handle says."""
    for device_id, handle in handles.items():
        _DEVICE_READY.run(tx, {"d_id": device_id, "d_handle": handle})


_GENERATION = Prepared(select(VM.c.generation).where(VM.c.id == bindparam("vm_id")))


def vm_generation(tx: Tx, vm_id: str) -> int | None:
    """The VM's generation now (None: no such VM)."""
    row = _GENERATION.run(tx, {"vm_id": vm_id}).fetchone()
    return None if row is None else int(row[0])


def set_vm_error(tx: Tx, vm_id: str, error: str | None) -> None:
    """Set (or clear) the error the VM shows."""
    tx.execute(update(VM).where(VM.c.id == vm_id).values(error=error))


def set_power_state(tx: Tx, row: VmRow, state: str) -> bool:
    """Move a VM no process holds from the state and generation `row` read to `state`; whether it did."""
    return bool(tx.execute(update(VM).where(VM.c.id == row.id, VM.c.state == row.state,
                                            VM.c.lease_holder.is_(None), VM.c.generation == row.generation)
                           .values(state=state, updated_at=utcnow())).rowcount == 1)


def remove_failed_vm(tx: Tx, vm_id: str) -> bool:
    """Delete the VM if it failed (it holds nothing then); whether it did."""
    return bool(tx.execute(VM.delete().where(VM.c.id == vm_id, VM.c.state == "failed")).rowcount == 1)


def remove_vm(tx: Tx, vm_id: str) -> None:
    """Delete the VM and its device rows."""
    tx.execute(DEVICE.delete().where(DEVICE.c.vm_id == vm_id))
    tx.execute(VM.delete().where(VM.c.id == vm_id))


def tenant_has_scoped(tx: Tx, tenant_id: int) -> bool:
    """Whether the VM's tenant has scoped limits (read under the tenant row's lock a release takes first)."""
    return bool(tx.execute(select(TENANT.c.has_scoped_limits).where(TENANT.c.id == tenant_id)).scalar())


def adopt_device(tx: Tx, device_id: str, new_id: str, uuid: str, handle: dict[str, Any]) -> None:
    """Give a just-claimed device the id, UUID and handle it has on its host, made there already."""
    tx.execute(update(DEVICE).where(DEVICE.c.id == device_id)
               .values(id=new_id, uuid=uuid, state="ready", handle=handle))


def set_adopted(tx: Tx, vm_id: str, state: str, domain_uuid: str) -> None:
    """Set an adopted VM's state and domain, with no lease on it."""
    tx.execute(update(VM).where(VM.c.id == vm_id).values(state=state, domain_uuid=domain_uuid, lease_holder=None,
                                                         lease_expires=None))
