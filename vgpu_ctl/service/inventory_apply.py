"""Applying an inventory file to the store: the changes, made in one transaction or not at all.

A file adds and updates what it declares. Removing what it leaves out (hosts, their GPUs, pools) happens only
with `prune`; without it, each such object is reported as a `keep` change and left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import encode_layout, fit_mask, geometry_for, parse_mig_layout
from vgpu_ctl.errors import Conflict
from vgpu_ctl.inventory import GpuDecl, HostDecl, InventoryDecl, PoolDecl, paused_gc
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.ports import STORE, Tx

Change = dict[str, Any]


def _pool_fields(p: PoolDecl) -> dict[str, Any]:
    demand = [t.model_dump() for t in p.demand] if p.demand is not None else None
    return {"policy": p.policy, "template": p.template, "description": p.description, "demand": demand}


def _host_fields(h: HostDecl, new: bool) -> dict[str, Any]:
    """The host's columns from its declaration; a `state` the file does not give is left as the store has it
    (so `vgpuctl host cordon` outlives the next apply), except on a new host."""
    fields = {"uri": h.uri, "driver": h.driver, "vgpu_backing": h.vgpu_backing, "labels": dict(h.labels),
              "vcpus": h.vcpus, "memory_mib": h.memory_mib, "cpu_overcommit": h.cpu_overcommit,
              "memory_overcommit": h.memory_overcommit, "victim_modes": h.victim_modes}
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


def apply_inventory(conn: Tx, catalog: Catalog, inv: InventoryDecl,
                    progress: Callable[[int, int, str], None] | None = None, prune: bool = False,
                    expected_removals: Collection[tuple[str, str]] | None = None) -> list[Change]:
    """Add and update the declared pools, hosts and GPUs; with `prune`, also remove those the declaration leaves
    out (else they are kept and reported as `keep`). The changes, in order. Conflict (naming the VMs) if a host or
    GPU that holds devices would be removed or re-carved, or if `expected_removals` is given and a removal is
    not in it (the store changed since the preview that was confirmed).

    The store is read once (every pool, host and GPU) and new hosts and GPUs are written with one multi-row
    statement per table, so a fleet of 100k GPUs is a handful of round trips; an unchanged declaration writes
    nothing."""
    with paused_gc():  # a 100k-GPU fleet is a million small objects: no collection is worth it meanwhile
        return _apply(conn, catalog, inv, progress, prune, expected_removals)


def _apply(conn: Tx, catalog: Catalog, inv: InventoryDecl, progress: Callable[[int, int, str], None] | None,
           prune: bool, expected_removals: Collection[tuple[str, str]] | None) -> list[Change]:
    changes: list[Change] = []
    store = STORE.inventory
    pools = store.pool_rows(conn)
    for p in inv.pools:
        fields = _pool_fields(p)
        if p.name not in pools:
            store.add_pool(conn, p.name, fields)
            changes.append({"action": "add", "kind": "pool", "name": p.name, "fields": fields})
        elif d := _diff(pools[p.name], fields):
            store.update_pool(conn, pools[p.name]["id"], fields)
            changes.append({"action": "update", "kind": "pool", "name": p.name, "fields": d})
    pool_ids = store.pool_ids(conn)

    hosts = store.host_rows(conn)
    gpus_of = store.gpu_declarations(conn, _DECLARED)
    declared_hosts = {h.name for h in inv.hosts}
    gpus = _GpuWriter(conn, catalog, pool_ids)
    new_hosts: list[dict[str, Any]] = []
    for i, h in enumerate(inv.hosts):
        if progress is not None:
            progress(i, len(inv.hosts), h.name)
        fields = _host_fields(h, new=h.name not in hosts)
        if h.name not in hosts:
            new_hosts.append({"name": h.name, **fields})
            changes.append({"action": "add", "kind": "host", "name": h.name,
                            "fields": {k: v for k, v in fields.items() if k != "labels" or v}})
            changes.extend(gpus.plan(h, None, {}, prune))
        else:
            host_id = hosts[h.name]["id"]
            if d := _diff(hosts[h.name], fields):
                store.update_host(conn, host_id, fields)
                changes.append({"action": "update", "kind": "host", "name": h.name, "fields": d})
            changes.extend(gpus.plan(h, host_id, gpus_of.get(host_id, {}), prune))
    gpus.write(store.add_hosts(conn, new_hosts) if new_hosts else {})
    for name, row in hosts.items():
        if name in declared_hosts:
            continue
        if not prune:
            changes.append(_keep("host", name))
            continue
        if vms := store.vms_on_gpus(conn, store.host_gpu_ids(conn, row["id"])) or \
                store.vms_placed_on(conn, row["id"]):
            raise Conflict(f"host {name!r} is not in the file but holds VMs: {', '.join(vms)}; "
                           "delete or move them first", reasons=[{"host": name, "vms": vms}])
        store.remove_host(conn, row["id"])
        changes.append({"action": "remove", "kind": "host", "name": name})

    declared_pools = {p.name for p in inv.pools}
    for name, row in pools.items():
        if name in declared_pools:
            continue
        if not prune:
            changes.append(_keep("pool", name))
            continue
        vms = store.vms_in_pool(conn, row["id"])
        if vms:
            raise Conflict(f"pool {name!r} is not in the file but VMs use it: {', '.join(vms)}",
                           reasons=[{"pool": name, "vms": vms}])
        store.remove_pool(conn, row["id"])
        changes.append({"action": "remove", "kind": "pool", "name": name})
    if expected_removals is not None:
        unconfirmed = [f"{kind} {name}" for kind, name in removals(changes)
                       if (kind, name) not in set(map(tuple, expected_removals))]
        if unconfirmed:
            raise Conflict(f"the store changed since the preview: applying would now also remove "
                           f"{', '.join(unconfirmed)}; nothing was changed, run it again",
                           reasons=[{"unconfirmed": unconfirmed}])
    return changes


_DECLARED = ("model", "mode", "pool_id", "pinned_type", "mig_layout")  # the GPU columns a declaration sets


class _GpuWriter:
    """The GPUs of each declared host compared with the store's: changes reported at once, in the order of the
    file; updates and removals written at once (they are few), new GPUs gathered and inserted together by
    `write` once their hosts have ids. A GPU's declared columns, axis and fit mask are worked out once per
    distinct declaration (a fleet repeats a few kinds of GPU many times)."""

    def __init__(self, conn: Tx, catalog: Catalog, pool_ids: Mapping[str, int]) -> None:
        self.conn = conn
        self.catalog = catalog
        self.pool_ids = pool_ids
        self.pool_names = {v: k for k, v in pool_ids.items()}
        self._fields: dict[tuple[Any, ...], tuple[dict[str, Any], int, int, tuple[Any, ...]]] = {}
        self._new: list[tuple[str | int, dict[str, Any]]] = []  # (host id, or name while it has none; row)

    def _declared(self, g: GpuDecl) -> tuple[dict[str, Any], int, int, tuple[Any, ...]]:
        """(columns the declaration sets, axis units, fit mask of the GPU empty, the columns' values in the order
        of _DECLARED) for a GPU declaration."""
        key = (g.model, g.mode, g.pool, g.vgpu_type, tuple(g.mig_layout) if g.mig_layout is not None else None)
        found = self._fields.get(key)
        if found is None:
            fields = _gpu_fields(self.catalog, g, self.pool_ids)
            axis = geometry_for(self.catalog, g.model, g.mode).axis
            found = self._fields[key] = (fields, axis, _fits(self.catalog, {**fields, "layout": ""}),
                                         tuple(fields[c] for c in _DECLARED))
        return found

    def plan(self, h: HostDecl, host_id: int | None, existing: Mapping[str, tuple[int, tuple[Any, ...]]],
             prune: bool) -> list[Change]:
        """The changes to host `h`'s GPUs (`existing`: the store's ids and declared columns, by PCI address;
        `host_id` None for a host being added). A GPU's whole row is read only when it changes or goes."""
        changes: list[Change] = []
        for g in h.gpus:
            fields, axis, fits, values_now = self._declared(g)
            label = f"{h.name}/{g.pci}"
            found = existing.get(g.pci)
            if found is None:
                self._new.append((h.name if host_id is None else host_id,
                                  {"pci_address": g.pci, "axis_units": axis, "free_units": axis, "fits": fits,
                                   **fields}))
                shown = {k: v for k, v in fields.items() if v not in (None, "")}
                changes.append({"action": "add", "kind": "gpu", "name": label,
                                "fields": _named(shown, self.pool_names)})
                continue
            if found[1] == values_now:  # as declared: the common case of a re-apply
                continue
            row = STORE.inventory.gpu_row(self.conn, found[0])
            d = _diff(row, fields)
            if not d:
                continue
            recarve = {"model", "mode", "mig_layout"} & d.keys() or (
                "pinned_type" in d and row["active_type"] not in (None, fields["pinned_type"]))
            if recarve and row["device_count"]:
                vms = STORE.inventory.vms_on_gpus(self.conn, [row["id"]])
                raise Conflict(f"GPU {label} holds devices of VMs {', '.join(vms)}; it can't change "
                               f"{', '.join(sorted(recarve if isinstance(recarve, set) else {'pinned_type'}))} "
                               "until they are deleted", reasons=[{"gpu": label, "vms": vms}])
            values: dict[str, Any] = dict(fields)
            remode = bool({"model", "mode"} & d.keys())
            if remode:  # what the host lacked was for the old mode: discovery reads it again
                values.update(axis_units=axis, free_units=axis, layout="", active_type=None, lacks=0,
                              lacked_types=None)
            STORE.inventory.update_gpu(self.conn, row["id"], values, _fits(self.catalog, {**row, **values}),
                                       less_lacked=not remode)
            changes.append({"action": "update", "kind": "gpu", "name": label,
                            "fields": _named(d, self.pool_names)})
        declared = {g.pci for g in h.gpus}
        for pci, (gpu_id, _) in existing.items():
            if pci in declared:
                continue
            if not prune:
                changes.append(_keep("gpu", f"{h.name}/{pci}"))
                continue
            row = STORE.inventory.gpu_row(self.conn, gpu_id)
            if row["device_count"]:
                vms = STORE.inventory.vms_on_gpus(self.conn, [row["id"]])
                raise Conflict(f"GPU {h.name}/{pci} is not in the file but holds devices of VMs {', '.join(vms)}",
                               reasons=[{"gpu": f"{h.name}/{pci}", "vms": vms}])
            STORE.inventory.remove_gpu(self.conn, row["id"])
            changes.append({"action": "remove", "kind": "gpu", "name": f"{h.name}/{pci}"})
        return changes

    def write(self, new_host_ids: Mapping[str, int]) -> None:
        """Insert the new GPUs, in multi-row statements (`new_host_ids`: the ids of the hosts just added)."""
        STORE.inventory.add_gpus(self.conn, [{"host_id": new_host_ids[h] if isinstance(h, str) else h, **row}
                                             for h, row in self._new])
        self._new.clear()
