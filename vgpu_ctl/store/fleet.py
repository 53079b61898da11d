"""The fleet as the store holds it: every pool, host and GPU, for planning on a copy of the fleet."""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import select

from vgpu_ctl.store.tables import GPU, HOST, POOL
from vgpu_ctl.store.unit import Tx


class FleetGpu(NamedTuple):
    """A GPU with what its occupancy is made of (`occupancy_row` gives the mapping allocation reads)."""

    host_id: int
    pci_address: str
    model: str
    pool_id: int | None
    mode: str
    mig_layout: str
    layout: str
    pinned_type: str | None

    def occupancy_row(self) -> dict[str, Any]:
        """The GPU as the mapping `allocation.occupancy_of` takes."""
        return self._asdict()


class FleetHost(NamedTuple):
    """A host with its capacity and what is used of it."""

    id: int
    name: str
    vcpus: int
    memory_mib: int
    cpu_overcommit: float
    memory_overcommit: float
    used_vcpus: int
    used_memory_mib: int
    state: str
    labels: dict[str, str] | None


class FleetRows(NamedTuple):
    """Pools by id, GPUs by host and PCI address, hosts by name."""

    pools: dict[int, str]
    gpus: list[FleetGpu]
    hosts: list[FleetHost]


def fleet_rows(tx: Tx) -> FleetRows:
    """Every pool, GPU and host."""
    pools = {int(r.id): str(r.name) for r in tx.execute(select(POOL.c.id, POOL.c.name))}
    gpus = [FleetGpu(*r) for r in tx.execute(select(*[GPU.c[n] for n in FleetGpu._fields])
                                             .order_by(GPU.c.host_id, GPU.c.pci_address))]
    hosts = [FleetHost(*r) for r in tx.execute(select(*[HOST.c[n] for n in FleetHost._fields])
                                               .order_by(HOST.c.name))]
    return FleetRows(pools, gpus, hosts)
