"""The store's fleet as plain planning values, read in one read-only transaction (for `vgpuctl plan --from-store`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select

from vgpu_ctl.errors import PermissionDenied
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost
from vgpu_ctl.service.allocation import GPU, HOST, occupancy_of
from vgpu_ctl.store.models import Pool

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

POOL = Pool.__table__  # type: ignore[attr-defined]


def fleet_snapshot(ctl: Controller) -> Fleet:
    """Every host and GPU of the store with what it holds now (devices, used vCPUs and memory), as a planning
    Fleet; reads only, never writes. Admin only: a tenant sees no fleet."""
    if not ctl.principal.is_admin:
        raise PermissionDenied(f"planning on the store is an admin command; tenant {ctl.principal.tenant!r} may not "
                               "run it")
    with ctl.engine.connect() as conn:
        pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
        gpus: dict[int, list[PlanGpu]] = {}
        for g in conn.execute(select(GPU).order_by(GPU.c.host_id, GPU.c.pci_address)).mappings():
            gpus.setdefault(g["host_id"], []).append(
                PlanGpu(g["pci_address"], g["model"], pools.get(g["pool_id"]), occupancy_of(ctl.catalog, g)))
        hosts = []
        for h in conn.execute(select(HOST).order_by(HOST.c.name)).mappings():
            vcpus = h["vcpus"] * h["cpu_overcommit"]
            memory = h["memory_mib"] * h["memory_overcommit"]
            hosts.append(PlanHost(h["name"], vcpus, memory, vcpus - h["used_vcpus"], memory - h["used_memory_mib"],
                                  tuple(gpus.get(h["id"], ())), h["state"], dict(h["labels"] or {})))
    return Fleet(tuple(hosts), f"store {ctl.engine.url.render_as_string(hide_password=True)}")
