"""Hosts in the store (`host`): their scheduling state and the VMs on them."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import select

from vgpu_ctl.store.tables import GPU, HOST, TENANT, VM
from vgpu_ctl.store.unit import Tx


class HostState(NamedTuple):
    """A host's id and scheduling state."""

    id: int
    state: str


def host_state(tx: Tx, name: str) -> HostState | None:
    """The host named `name`, if there is one."""
    row = tx.execute(select(HOST.c.id, HOST.c.state).where(HOST.c.name == name)).first()
    return HostState(row.id, row.state) if row is not None else None


def host_names(tx: Tx) -> list[str]:
    """Every host's name, sorted."""
    return [str(r[0]) for r in tx.execute(select(HOST.c.name).order_by(HOST.c.name))]


def set_host_state(tx: Tx, host_id: int, state: str) -> None:
    """Set the host's scheduling state."""
    tx.execute(HOST.update().where(HOST.c.id == host_id).values(state=state))


def vms_on_host(tx: Tx, host_id: int, but_state: str) -> list[tuple[str, str]]:
    """(tenant, VM name) of the VMs on the host that are not in `but_state`."""
    return [(str(r.tenant), str(r.name)) for r in tx.execute(
        select(VM.c.name, TENANT.c.name.label("tenant")).join(TENANT, TENANT.c.id == VM.c.tenant_id)
        .where(VM.c.host_id == host_id, VM.c.state != but_state))]


class HostRow(NamedTuple):
    """A host as stored."""

    id: int
    name: str
    uri: str
    driver: str
    vgpu_backing: str
    labels: dict[str, str]
    vcpus: int
    memory_mib: int
    cpu_overcommit: float
    memory_overcommit: float
    used_vcpus: int
    used_memory_mib: int
    state: str
    victim_modes: dict[str, list[str]] | None


_HOST_COLUMNS = [HOST.c[name] for name in HostRow._fields]


def host_rows(tx: Tx) -> list[HostRow]:
    """Every host, by name."""
    return [HostRow(*r) for r in tx.execute(select(*_HOST_COLUMNS).order_by(HOST.c.name))]


def host_named(tx: Tx, name: str) -> HostRow | None:
    """The host named `name`, if there is one."""
    row = tx.execute(select(*_HOST_COLUMNS).where(HOST.c.name == name)).first()
    return HostRow(*row) if row is not None else None


class HostGpu(NamedTuple):
    """A GPU of a host: its id, PCI address and pool."""

    id: int
    pci_address: str
    pool_id: int | None


def gpus_of_host(tx: Tx, name: str) -> dict[str, HostGpu]:
    """The GPUs of the host named `name`, by PCI address."""
    return {str(r.pci_address): HostGpu(int(r.id), str(r.pci_address), r.pool_id) for r in tx.execute(
        select(GPU.c.id, GPU.c.pci_address, GPU.c.pool_id).join(HOST, HOST.c.id == GPU.c.host_id)
        .where(HOST.c.name == name))}


def host_of_gpu(tx: Tx, gpu_id: int) -> HostRow:
    """The host of a GPU."""
    return HostRow(*tx.execute(select(*_HOST_COLUMNS).join(GPU, GPU.c.host_id == HOST.c.id)
                               .where(GPU.c.id == gpu_id)).one())
