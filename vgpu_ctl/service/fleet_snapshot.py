"""The store's fleet as plain planning values, read in one read-only transaction (for `vgpuctl plan --from-store`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vgpu_ctl.errors import InvalidInput, PermissionDenied
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.ports import STORE
from vgpu_ctl.store.engine import default_url
from vgpu_ctl.store.unit import StoreError
from vgpu_ctl.store.urls import masked, missing_sqlite_file, shown

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller


def require_store(url: str | None) -> None:
    """InvalidInput when `url` (None: the default store) is a SQLite file that does not exist: opening it would
    create an empty store, and planning must leave no trace."""
    text = url or default_url()
    if missing_sqlite_file(text):
        raise InvalidInput(f"--db {shown(text)}: no store there (field db): --from-store plans on an existing store "
                           "(vgpuctl init, then inventory apply)", reasons=[{"field": "db", "value": shown(text)}])


def fleet_snapshot(ctl: Controller) -> Fleet:
    """Every host and GPU of the store with what it holds now (devices, used vCPUs and memory), as a planning
    Fleet; reads only, never writes. Admin only: a tenant sees no fleet."""
    if not ctl.principal.is_admin:
        raise PermissionDenied(f"planning on the store is an admin command; tenant {ctl.principal.tenant!r} may not "
                               "run it")
    try:
        return _read(ctl)
    except StoreError as exc:
        detail = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidInput(f"the store can't be read for planning: {detail} (has `vgpuctl init` been run?)",
                           reasons=[{"field": "db", "error": detail}]) from None


def _read(ctl: Controller) -> Fleet:
    with ctl.read() as conn:
        rows = STORE.fleet.fleet_rows(conn)
    gpus: dict[int, list[PlanGpu]] = {}
    for g in rows.gpus:
        gpus.setdefault(g.host_id, []).append(
            PlanGpu(g.pci_address, g.model, rows.pools.get(g.pool_id) if g.pool_id is not None else None,
                    occupancy_of(ctl.catalog, g.occupancy_row())))
    hosts = []
    for h in rows.hosts:
        vcpus = h.vcpus * h.cpu_overcommit
        memory = h.memory_mib * h.memory_overcommit
        hosts.append(PlanHost(h.name, vcpus, memory, vcpus - h.used_vcpus, memory - h.used_memory_mib,
                              tuple(gpus.get(h.id, ())), h.state, dict(h.labels or {})))
    return Fleet(tuple(hosts), f"store {masked(ctl.engine.url)}")
