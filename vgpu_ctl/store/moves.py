"""Rebalance moves in the store (`vm_move`, a row per move under way, advanced in each step's transaction, and the
`vm.move` audit events of those done), with what a move reads of the VM's devices and its hosts and GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Table, delete, insert, select, update

from vgpu_ctl.store.fleet import FleetGpu
from vgpu_ctl.store.hosts import HostRow
from vgpu_ctl.store.models import VmMove
from vgpu_ctl.store.tables import DEVICE, EVENT, GPU, HOST, VM
from vgpu_ctl.store.unit import Tx, utcnow

MOVE: Table = VmMove.__table__  # type: ignore[attr-defined]


class MoveRow(NamedTuple):
    """A move under way: the step it reached, where from and to, the devices old and new, and what vm.move
    will record."""

    vm_id: str
    step: str
    from_host_id: int
    to_host_id: int | None
    old_devices: list[str]
    new_devices: list[str]
    was_running: bool
    domain_uuid: str | None
    params: dict[str, Any]
    started_at: datetime
    updated_at: datetime


class PendingMove(NamedTuple):
    """A move under way with its VM's name, state and lease, and the hosts' names (`to_host`: None before the
    claim)."""

    vm_id: str
    step: str
    name: str
    state: str
    lease_holder: str | None
    lease_expires: datetime | None
    from_host: str
    to_host: str | None


class PlacedDevice(NamedTuple):
    """Where a VM's device sits: its GPU's PCI address, its profile and position."""

    vm_id: str
    pci_address: str
    profile: str
    start: int
    size: int


class HeldDevice(NamedTuple):
    """A VM's device as stored, with its GPU's PCI address, model and mode."""

    id: str
    gpu_id: int
    vm_id: str
    profile: str
    kind: str
    start: int
    size: int
    framebuffer_mib: int
    uuid: str
    backing: str
    handle: dict[str, Any]
    state: str
    pci_address: str
    model: str
    gpu_mode: str


class TargetGpu(NamedTuple):
    """A GPU a move may place on: its id, the version its compare-and-set checks, and its address, pool and what
    its occupancy is made of."""

    id: int
    version: int
    gpu: FleetGpu


class MoveEvent(NamedTuple):
    """A `vm.move` audit event: its id and params (`from`, `to`: host and devices)."""

    id: int
    params: dict[str, Any]


_HOST_COLUMNS = [HOST.c[name] for name in HostRow._fields]
_DEVICE_COLUMNS = [DEVICE.c[name] for name in HeldDevice._fields[:-3]]


def placed_devices(tx: Tx) -> list[PlacedDevice]:
    """Every device a VM holds, where it sits."""
    return [PlacedDevice._make(r) for r in tx.execute(
        select(DEVICE.c.vm_id, GPU.c.pci_address, DEVICE.c.profile, DEVICE.c.start, DEVICE.c.size)
        .join(GPU, GPU.c.id == DEVICE.c.gpu_id))]


def held_devices(tx: Tx, vm_id: str) -> list[HeldDevice]:
    """The VM's devices, by id."""
    return [HeldDevice._make(r) for r in tx.execute(
        select(*_DEVICE_COLUMNS, GPU.c.pci_address, GPU.c.model, GPU.c.mode.label("gpu_mode"))
        .join(GPU, GPU.c.id == DEVICE.c.gpu_id).where(DEVICE.c.vm_id == vm_id).order_by(DEVICE.c.id))]


def host_row(tx: Tx, host_id: int) -> HostRow:
    """The host `host_id` (one a VM or a move refers to, so it exists)."""
    return HostRow._make(tx.execute(select(*_HOST_COLUMNS).where(HOST.c.id == host_id)).one())


def host_gpus(tx: Tx, host_id: int) -> list[TargetGpu]:
    """The host's GPUs."""
    return [TargetGpu(r[0], r[1], FleetGpu._make(r[2:])) for r in tx.execute(
        select(GPU.c.id, GPU.c.version, *[GPU.c[name] for name in FleetGpu._fields]).where(GPU.c.host_id == host_id))]


def last_move(tx: Tx, vm_id: str) -> MoveEvent | None:
    """The VM's latest `vm.move` that succeeded."""
    row = tx.execute(select(EVENT.c.id, EVENT.c.params).where(
        EVENT.c.action == "vm.move", EVENT.c.target == f"vm:{vm_id}", EVENT.c.result == "ok")
        .order_by(EVENT.c.id.desc()).limit(1)).first()
    return None if row is None else MoveEvent._make(row)


def add_move(tx: Tx, vm_id: str, from_host_id: int, old_devices: Sequence[str], was_running: bool,
             params: dict[str, Any]) -> None:
    """Record a move starting (step `stopping`) from the VM's host and devices."""
    now = utcnow()
    tx.execute(insert(MOVE).values(vm_id=vm_id, step="stopping", from_host_id=from_host_id,
                                   old_devices=list(old_devices), new_devices=[], was_running=was_running,
                                   params=params, started_at=now, updated_at=now))


def set_move_step(tx: Tx, vm_id: str, step: str, *, to_host_id: int | None = None,
                  new_devices: Sequence[str] | None = None, domain_uuid: str | None = None) -> None:
    """Record that the VM's move reached `step`, with the new host and devices (step `claimed`) or the new
    domain (step `defined`) when given."""
    values: dict[str, Any] = {"step": step, "updated_at": utcnow()}
    if to_host_id is not None:
        values["to_host_id"] = to_host_id
    if new_devices is not None:
        values["new_devices"] = list(new_devices)
    if domain_uuid is not None:
        values["domain_uuid"] = domain_uuid
    tx.execute(update(MOVE).where(MOVE.c.vm_id == vm_id).values(**values))


def end_move(tx: Tx, vm_id: str, holder: str, values: dict[str, Any]) -> None:
    """The move is over: set `values` on the VM and release its lease if `holder` holds it, and delete the
    move's row."""
    tx.execute(update(VM).where(VM.c.id == vm_id, VM.c.lease_holder == holder).values(
        **values, lease_holder=None, lease_expires=None, updated_at=utcnow()))
    tx.execute(delete(MOVE).where(MOVE.c.vm_id == vm_id))


def move_row(tx: Tx, vm_id: str) -> MoveRow | None:
    """The VM's move, if one is under way."""
    row = tx.execute(select(*[MOVE.c[name] for name in MoveRow._fields]).where(MOVE.c.vm_id == vm_id)).first()
    return None if row is None else MoveRow._make(row)


def pending_moves(tx: Tx) -> list[PendingMove]:
    """Every move under way or interrupted, oldest first."""
    to_host = HOST.alias("to_host")
    return [PendingMove._make(r) for r in tx.execute(
        select(MOVE.c.vm_id, MOVE.c.step, VM.c.name, VM.c.state, VM.c.lease_holder, VM.c.lease_expires,
               HOST.c.name.label("from_host"), to_host.c.name.label("to_host"))
        .join(VM, VM.c.id == MOVE.c.vm_id).join(HOST, HOST.c.id == MOVE.c.from_host_id)
        .outerjoin(to_host, to_host.c.id == MOVE.c.to_host_id).order_by(MOVE.c.started_at))]
