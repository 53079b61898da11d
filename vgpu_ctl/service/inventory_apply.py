"""Applying an inventory file to the store: the changes, made in one transaction or not at all.

A file adds and updates what it declares. Removing what it leaves out (hosts, their GPUs, pools) happens only
with `prune`; without it, each such object is reported as a `keep` change and left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.engine import Connection

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import encode_layout, fit_mask, geometry_for, parse_mig_layout
from vgpu_ctl.errors import Conflict
from vgpu_ctl.inventory import GpuDecl, HostDecl, InventoryDecl, PoolDecl
from vgpu_ctl.service.allocation import DEVICE, GPU, HOST, occupancy_of
from vgpu_ctl.store.models import Pool, Vm

POOL: Table = Pool.__table__  # type: ignore[attr-defined]
VM: Table = Vm.__table__  # type: ignore[attr-defined]

Change = dict[str, Any]


def _pool_fields(p: PoolDecl) -> dict[str, Any]:
    demand = [t.model_dump() for t in p.demand] if p.demand is not None else None
    return {"policy": p.policy, "template": p.template, "description": p.description, "demand": demand}


def _host_fields(h: HostDecl, new: bool) -> dict[str, Any]:
    """The host's columns from its declaration; a `state` the file does not give is left as the store has it
    (so `vgpuctl host cordon` outlives the next apply), except on a new host."""
    fields = {"uri": h.uri, "driver": h.driver, "vgpu_backing": h.vgpu_backing, "labels": dict(h.labels),
              "vcpus": h.vcpus, "memory_mib": h.memory_mib, "cpu_overcommit": h.cpu_overcommit,
              "memory_overcommit": h.memory_overcommit}
    if new or "state" in h.model_fields_set:
        fields["state"] = h.state
    return fields


def _keep(kind: str, name: str) -> Change:
    return {"action": "keep", "kind": kind, "name": name, "reason": "not in the file; --prune removes it"}


def removals(changes: Collection[Change]) -> list[tuple[str, str]]:
    """(kind, name) of each removal among `changes`."""
    return [(c["kind"], c["name"]) for c in changes if c["action"] == "remove"]


def _gpu_fields(catalog: Catalog, g: GpuDecl, pool_ids: Mapping[str, int]) -> dict[str, Any]:
    geom = geometry_for(catalog, g.model, g.mode)
    layout = encode_layout(parse_mig_layout(geom, g.mig_layout)) if g.mig_layout else ""
    return {"model": g.model, "mode": g.mode.value, "pool_id": pool_ids.get(g.pool) if g.pool else None,
            "pinned_type": g.vgpu_type, "mig_layout": layout}


def _fits(catalog: Catalog, row: Mapping[str, Any]) -> int:
    """The fit mask of a GPU row as it will be written."""
    return fit_mask(occupancy_of(catalog, row))


def _diff(old: Mapping[Any, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    return {k: {"from": old[k], "to": v} for k, v in new.items() if old[k] != v}


def _named(fields: Mapping[str, Any], pool_names: Mapping[int, str]) -> dict[str, Any]:
    """Fields as a change reports them: the pool by name, not by its row id."""
    def name(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: pool_names.get(x, x) for k, x in v.items()}
        return pool_names.get(v, v)
    return {("pool" if k == "pool_id" else k): (name(v) if k == "pool_id" else v) for k, v in fields.items()}


def _vms_on(conn: Connection, gpu_ids: list[int]) -> list[str]:
    rows = conn.execute(select(VM.c.name).join(DEVICE, DEVICE.c.vm_id == VM.c.id)
                        .where(DEVICE.c.gpu_id.in_(gpu_ids)).distinct()).all()
    return sorted(r[0] for r in rows)


def apply_inventory(conn: Connection, catalog: Catalog, inv: InventoryDecl,
                    progress: Callable[[int, int, str], None] | None = None, prune: bool = False,
                    expected_removals: Collection[tuple[str, str]] | None = None) -> list[Change]:
    """Add and update the declared pools, hosts and GPUs; with `prune`, also remove those the declaration leaves
    out (else they are kept and reported as `keep`). The changes, in order. Conflict (naming the VMs) if a host or
    GPU that holds devices would be removed or re-carved, or if `expected_removals` is given and a removal is
    not in it (the store changed since the preview that was confirmed)."""
    changes: list[Change] = []
    pools = {r.name: r for r in conn.execute(select(POOL)).all()}
    for p in inv.pools:
        fields = _pool_fields(p)
        if p.name not in pools:
            conn.execute(POOL.insert().values(name=p.name, **fields))
            changes.append({"action": "add", "kind": "pool", "name": p.name, "fields": fields})
        elif d := _diff(pools[p.name]._mapping, fields):
            conn.execute(POOL.update().where(POOL.c.id == pools[p.name].id).values(**fields))
            changes.append({"action": "update", "kind": "pool", "name": p.name, "fields": d})
    pool_ids = {r.name: r.id for r in conn.execute(select(POOL.c.name, POOL.c.id)).all()}

    hosts = {r.name: r for r in conn.execute(select(HOST)).all()}
    declared_hosts = {h.name for h in inv.hosts}
    for i, h in enumerate(inv.hosts):
        if progress is not None:
            progress(i, len(inv.hosts), h.name)
        fields = _host_fields(h, new=h.name not in hosts)
        if h.name not in hosts:
            inserted = conn.execute(HOST.insert().values(name=h.name, **fields)).inserted_primary_key
            assert inserted is not None
            host_id = inserted[0]
            changes.append({"action": "add", "kind": "host", "name": h.name,
                            "fields": {k: v for k, v in fields.items() if k != "labels" or v}})
        else:
            host_id = hosts[h.name].id
            if d := _diff(hosts[h.name]._mapping, fields):
                conn.execute(HOST.update().where(HOST.c.id == host_id).values(**fields))
                changes.append({"action": "update", "kind": "host", "name": h.name, "fields": d})
        changes.extend(_apply_gpus(conn, catalog, h, host_id, pool_ids, prune))
    for name, row in hosts.items():
        if name in declared_hosts:
            continue
        if not prune:
            changes.append(_keep("host", name))
            continue
        gpu_ids = [r[0] for r in conn.execute(select(GPU.c.id).where(GPU.c.host_id == row.id))]
        if vms := _vms_on(conn, gpu_ids) or sorted(
                r[0] for r in conn.execute(select(VM.c.name).where(VM.c.host_id == row.id))):
            raise Conflict(f"host {name!r} is not in the file but holds VMs: {', '.join(vms)}; "
                           "delete or move them first", reasons=[{"host": name, "vms": vms}])
        conn.execute(GPU.delete().where(GPU.c.host_id == row.id))
        conn.execute(HOST.delete().where(HOST.c.id == row.id))
        changes.append({"action": "remove", "kind": "host", "name": name})

    declared_pools = {p.name for p in inv.pools}
    for name, row in pools.items():
        if name in declared_pools:
            continue
        if not prune:
            changes.append(_keep("pool", name))
            continue
        vms = sorted(r[0] for r in conn.execute(select(VM.c.name).where(VM.c.pool_id == row.id)))
        if vms:
            raise Conflict(f"pool {name!r} is not in the file but VMs use it: {', '.join(vms)}",
                           reasons=[{"pool": name, "vms": vms}])
        conn.execute(GPU.update().where(GPU.c.pool_id == row.id).values(pool_id=None))
        conn.execute(POOL.delete().where(POOL.c.id == row.id))
        changes.append({"action": "remove", "kind": "pool", "name": name})
    if expected_removals is not None:
        unconfirmed = [f"{kind} {name}" for kind, name in removals(changes)
                       if (kind, name) not in set(map(tuple, expected_removals))]
        if unconfirmed:
            raise Conflict(f"the store changed since the preview: applying would now also remove "
                           f"{', '.join(unconfirmed)}; nothing was changed, run it again",
                           reasons=[{"unconfirmed": unconfirmed}])
    return changes


def _apply_gpus(conn: Connection, catalog: Catalog, h: HostDecl, host_id: int,
                pool_ids: Mapping[str, int], prune: bool) -> list[Change]:
    changes: list[Change] = []
    pool_names = {v: k for k, v in pool_ids.items()}
    existing = {r.pci_address: r for r in conn.execute(select(GPU).where(GPU.c.host_id == host_id)).all()}
    for g in h.gpus:
        fields = _gpu_fields(catalog, g, pool_ids)
        label = f"{h.name}/{g.pci}"
        row = existing.get(g.pci)
        if row is None:
            axis = geometry_for(catalog, g.model, g.mode).axis
            conn.execute(GPU.insert().values(host_id=host_id, pci_address=g.pci, axis_units=axis,
                                             free_units=axis, fits=_fits(catalog, {**fields, "layout": ""}),
                                             **fields))
            shown = {k: v for k, v in fields.items() if v not in (None, "")}
            changes.append({"action": "add", "kind": "gpu", "name": label,
                            "fields": _named(shown, pool_names)})
            continue
        d = _diff(row._mapping, fields)
        if not d:
            continue
        recarve = {"model", "mode", "mig_layout"} & d.keys() or (
            "pinned_type" in d and row.active_type not in (None, fields["pinned_type"]))
        if recarve and row.device_count:
            vms = _vms_on(conn, [row.id])
            raise Conflict(f"GPU {label} holds devices of VMs {', '.join(vms)}; it can't change "
                           f"{', '.join(sorted(recarve if isinstance(recarve, set) else {'pinned_type'}))} "
                           "until they are deleted", reasons=[{"gpu": label, "vms": vms}])
        values = dict(fields)
        if {"model", "mode"} & d.keys():
            axis = geometry_for(catalog, g.model, g.mode).axis
            values.update(axis_units=axis, free_units=axis, layout="", active_type=None)
        values["fits"] = _fits(catalog, {**row._mapping, **values})
        conn.execute(GPU.update().where(GPU.c.id == row.id).values(version=GPU.c.version + 1, **values))
        changes.append({"action": "update", "kind": "gpu", "name": label, "fields": _named(d, pool_names)})
    declared = {g.pci for g in h.gpus}
    for pci, row in existing.items():
        if pci in declared:
            continue
        if not prune:
            changes.append(_keep("gpu", f"{h.name}/{pci}"))
            continue
        if row.device_count:
            vms = _vms_on(conn, [row.id])
            raise Conflict(f"GPU {h.name}/{pci} is not in the file but holds devices of VMs {', '.join(vms)}",
                           reasons=[{"gpu": f"{h.name}/{pci}", "vms": vms}])
        conn.execute(GPU.delete().where(GPU.c.id == row.id))
        changes.append({"action": "remove", "kind": "gpu", "name": f"{h.name}/{pci}"})
    return changes
