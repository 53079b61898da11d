"""The operations views' reads (status, the doctor, metrics): fleet summaries, counts by kind, and the rows the
doctor checks its invariants on. Only reads; the views work on the typed rows these return."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import case, func, select
from sqlalchemy.sql.elements import ColumnElement

from vgpu_ctl.store.tables import DEVICE, EVENT, GPU, HOST, POOL, SCOPED, TENANT, VM
from vgpu_ctl.store.unit import Tx


class ReportGpu(NamedTuple):
    """A GPU row as stored: its place, its state (what `occupancy_of` reads) and the mirror of its devices."""

    id: int
    host_id: int
    pci_address: str
    model: str
    mode: str
    pool_id: int | None
    pinned_type: str | None
    mig_layout: str
    layout: str
    axis_units: int
    free_units: int
    active_type: str | None
    device_count: int
    fits: int


_GPU_COLUMNS = [GPU.c[name] for name in ReportGpu._fields]


class PagedGpu(NamedTuple):
    """A GPU row of a status page with its host's name and state."""

    gpu: ReportGpu
    host_name: str
    host_state: str


class GpuState(NamedTuple):
    """How many GPUs of a pool are in one state (model, mode, MIG layout, layout, pinned type) on hosts that are
    active or not."""

    pool_id: int
    model: str
    mode: str
    mig_layout: str
    layout: str
    pinned_type: str | None
    active: bool
    n: int


class ModeSummary(NamedTuple):
    """GPUs of one mode: how many, how many hold devices, their devices, units free and units in all."""

    mode: str
    gpus: int
    in_use: int
    devices: int
    free_units: int
    axis_units: int


class Count(NamedTuple):
    """How many rows have the values `keys` (of the columns a count is by)."""

    keys: tuple[Any, ...]
    n: int


class ReportDevice(NamedTuple):
    """A device's place on its GPU."""

    gpu_id: int
    start: int
    size: int
    profile: str


class HeldDevices(NamedTuple):
    """A VM and how many devices it holds."""

    vm_id: str
    name: str
    devices: int


class OrphanDevice(NamedTuple):
    """A device whose VM is gone."""

    id: str
    vm_id: str
    gpu_id: int


class MisplacedDevice(NamedTuple):
    """A device on a GPU of another host than its VM's."""

    id: str
    vm_name: str


class VmSince(NamedTuple):
    """A VM, its state and when it last changed."""

    id: str
    name: str
    state: str
    updated_at: datetime


class ScopedUsage(NamedTuple):
    """A tenant's stored usage of a resource in a scope ('*' or a pool's name)."""

    tenant_id: int
    tenant: str
    scope: str
    resource: str
    used: int


class ProvisionEvent(NamedTuple):
    """A `vm.create` or `vm.start` event of a VM."""

    action: str
    target: str
    time: datetime
    result: str


def pool_names(tx: Tx, pool_ids: Collection[int] | None = None) -> dict[int, str]:
    """Pools' names by id (only those of `pool_ids` when given)."""
    q = select(POOL.c.id, POOL.c.name)
    if pool_ids is not None:
        q = q.where(POOL.c.id.in_(list(pool_ids)))
    return {int(r.id): str(r.name) for r in tx.execute(q)}


def host_id(tx: Tx, name: str) -> int | None:
    """The id of the host named `name`, if there is one."""
    found = tx.execute(select(HOST.c.id).where(HOST.c.name == name)).scalar()
    return int(found) if found is not None else None


def _gpu_where(pool_ids: Sequence[int] | None, host: int | None) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if pool_ids is not None:
        where.append(GPU.c.pool_id.in_(list(pool_ids)))
    if host is not None:
        where.append(GPU.c.host_id == host)
    return where


def hosts_by_state(tx: Tx, pool_ids: Sequence[int] | None = None, host: int | None = None) -> dict[str, int]:
    """How many hosts are in each state, of those with a GPU in `pool_ids` and of `host` when given."""
    where: list[ColumnElement[bool]] = []
    if pool_ids is not None:
        where.append(HOST.c.id.in_(select(GPU.c.host_id).where(GPU.c.pool_id.in_(list(pool_ids)))))
    if host is not None:
        where.append(HOST.c.id == host)
    return {str(state): int(n) for state, n in tx.execute(
        select(HOST.c.state, func.count()).where(*where).group_by(HOST.c.state))}


def mode_summaries(tx: Tx, pool_ids: Sequence[int] | None = None, host: int | None = None) -> list[ModeSummary]:
    """The GPUs by mode (of `pool_ids` and `host` when given), by mode's name."""
    busy = func.sum(case((GPU.c.device_count > 0, 1), else_=0))
    rows = tx.execute(select(GPU.c.mode, func.count(), busy, func.sum(GPU.c.device_count),
                             func.sum(GPU.c.free_units), func.sum(GPU.c.axis_units))
                      .where(*_gpu_where(pool_ids, host)).group_by(GPU.c.mode).order_by(GPU.c.mode))
    return [ModeSummary(str(mode), int(n), *(int(v or 0) for v in sums)) for mode, n, *sums in rows]


def gpu_total(tx: Tx, pool_ids: Sequence[int] | None = None, host: int | None = None) -> int:
    """How many GPUs there are (of `pool_ids` and `host` when given)."""
    return int(tx.execute(select(func.count()).select_from(GPU).where(*_gpu_where(pool_ids, host))).scalar_one())


def gpu_page(tx: Tx, pool_ids: Sequence[int] | None, host: int | None, offset: int,
             limit: int | None) -> list[PagedGpu]:
    """GPUs (of `pool_ids` and `host` when given) by host name and PCI address, `limit` of them (all without)
    from `offset`."""
    q = (select(*_GPU_COLUMNS, HOST.c.name, HOST.c.state).join(HOST, HOST.c.id == GPU.c.host_id)
         .where(*_gpu_where(pool_ids, host)).order_by(HOST.c.name, GPU.c.pci_address).offset(offset))
    if limit is not None:
        q = q.limit(limit)
    return [PagedGpu(ReportGpu(*r[:-2]), r[-2], r[-1]) for r in tx.execute(q)]


_STATE_COLUMNS = (GPU.c.model, GPU.c.mode, GPU.c.mig_layout, GPU.c.layout, GPU.c.pinned_type)


def pool_gpu_states(tx: Tx, pool_ids: Collection[int]) -> list[GpuState]:
    """The GPUs of `pool_ids` counted by pool, state and whether their host is active (one row per distinct
    state, not per GPU)."""
    active = HOST.c.state == "active"
    rows = tx.execute(select(GPU.c.pool_id, *_STATE_COLUMNS, active, func.count())
                      .join(HOST, HOST.c.id == GPU.c.host_id).where(GPU.c.pool_id.in_(list(pool_ids)))
                      .group_by(GPU.c.pool_id, *_STATE_COLUMNS, active))
    return [GpuState(int(pool), model, mode, mig_layout, layout, pinned, bool(on), int(n))
            for pool, model, mode, mig_layout, layout, pinned, on, n in rows]


def all_gpus(tx: Tx, mode: str | None = None) -> list[ReportGpu]:
    """Every GPU (only those in `mode` when given), in no particular order."""
    q = select(*_GPU_COLUMNS)
    if mode is not None:
        q = q.where(GPU.c.mode == mode)
    return [ReportGpu(*r) for r in tx.execute(q)]


def all_devices(tx: Tx) -> list[ReportDevice]:
    """Every device's GPU and slot, in no particular order."""
    return [ReportDevice(*r) for r in tx.execute(select(DEVICE.c.gpu_id, DEVICE.c.start, DEVICE.c.size,
                                                               DEVICE.c.profile))]


def vms_holding_devices(tx: Tx, state: str) -> list[HeldDevices]:
    """The VMs in `state` that hold devices, with how many."""
    return [HeldDevices(*r) for r in tx.execute(
        select(VM.c.id, VM.c.name, func.count(DEVICE.c.id)).join(DEVICE, DEVICE.c.vm_id == VM.c.id)
        .where(VM.c.state == state).group_by(VM.c.id, VM.c.name))]


def host_vm_usage(tx: Tx, states: Collection[str]) -> dict[int, tuple[int, int]]:
    """Per host, the (vCPUs, memory MiB) its VMs in `states` take (hosts without such VMs left out)."""
    rows = tx.execute(select(VM.c.host_id, func.coalesce(func.sum(VM.c.vcpus), 0),
                             func.coalesce(func.sum(VM.c.memory_mib), 0))
                      .where(VM.c.host_id.is_not(None), VM.c.state.in_([str(s) for s in states]))
                      .group_by(VM.c.host_id))
    return {int(h): (int(c), int(m)) for h, c, m in rows}


def orphan_devices(tx: Tx) -> list[OrphanDevice]:
    """The devices whose VM is gone."""
    return [OrphanDevice(*r) for r in tx.execute(
        select(DEVICE.c.id, DEVICE.c.vm_id, DEVICE.c.gpu_id).outerjoin(VM, VM.c.id == DEVICE.c.vm_id)
        .where(VM.c.id.is_(None)))]


def misplaced_devices(tx: Tx) -> list[MisplacedDevice]:
    """The devices on a GPU of another host than their VM's."""
    return [MisplacedDevice(*r) for r in tx.execute(
        select(DEVICE.c.id, VM.c.name).join(VM, VM.c.id == DEVICE.c.vm_id).join(GPU, GPU.c.id == DEVICE.c.gpu_id)
        .where(GPU.c.host_id != VM.c.host_id))]


def vms_since(tx: Tx, states: Collection[str], before: datetime) -> list[VmSince]:
    """The VMs in `states` that have not changed since `before`."""
    return [VmSince(*r) for r in tx.execute(
        select(VM.c.id, VM.c.name, VM.c.state, VM.c.updated_at)
        .where(VM.c.state.in_([str(s) for s in states]), VM.c.updated_at < before))]


def scoped_usages(tx: Tx) -> list[ScopedUsage]:
    """Every tenant's stored scoped usage, with the tenant's name."""
    return [ScopedUsage(*r) for r in tx.execute(
        select(SCOPED.c.tenant_id, TENANT.c.name, SCOPED.c.scope, SCOPED.c.resource, SCOPED.c.used)
        .join(TENANT, TENANT.c.id == SCOPED.c.tenant_id))]


def _counts(tx: Tx, *columns: Any, where: Sequence[ColumnElement[bool]] = ()) -> list[Count]:
    return [Count(tuple(keys), int(n))
            for *keys, n in tx.execute(select(*columns, func.count()).where(*where).group_by(*columns))]


def gpu_counts(tx: Tx) -> list[Count]:
    """GPUs by (model, mode, pool id)."""
    return _counts(tx, GPU.c.model, GPU.c.mode, GPU.c.pool_id)


def host_counts(tx: Tx) -> list[Count]:
    """Hosts by (state,)."""
    return _counts(tx, HOST.c.state)


def device_counts(tx: Tx) -> list[Count]:
    """Devices by (profile, state)."""
    return _counts(tx, DEVICE.c.profile, DEVICE.c.state)


def vm_counts(tx: Tx) -> list[Count]:
    """VMs by (state,)."""
    return _counts(tx, VM.c.state)


def event_counts(tx: Tx) -> list[Count]:
    """Audit events by (action, result)."""
    return _counts(tx, EVENT.c.action, EVENT.c.result)


def refusal_counts(tx: Tx) -> list[Count]:
    """Refused requests' events by (error code,)."""
    return _counts(tx, EVENT.c.error, where=[EVENT.c.result == "refused"])


def provision_events(tx: Tx) -> list[ProvisionEvent]:
    """Every VM's `vm.create` and `vm.start` events, oldest first."""
    return [ProvisionEvent(*r) for r in tx.execute(
        select(EVENT.c.action, EVENT.c.target, EVENT.c.time, EVENT.c.result)
        .where(EVENT.c.action.in_(("vm.create", "vm.start")), EVENT.c.target.like("vm:%")).order_by(EVENT.c.id))]
