"""Fleet status: what occupies each GPU, what still fits per pool, and each tenant's usage against limits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.geometry import Mode, Occupancy, geometry_for
from vgpu_ctl.errors import NotFound
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.quotas import usage_report
from vgpu_ctl.store.reports import ModeSummary, PagedGpu

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller
    from vgpu_ctl.service.utilization import IdleRule

FREE = "·"
BLOCKS = ("█", "▓")
MAX_CELLS = 20


def cells_of(axis: int, max_cells: int = MAX_CELLS) -> list[tuple[int, int]]:
    """The unit ranges [lo, hi) drawn as one cell each: one per unit up to `max_cells` units, else scaled."""
    n = min(axis, max_cells)
    out = []
    for i in range(n):
        lo = i * axis // n
        out.append((lo, max(lo + 1, (i + 1) * axis // n)))
    return out


def occupancy_bar(occ: Occupancy, max_cells: int = MAX_CELLS) -> str:
    """The GPU's axis as a bar: MIG cells show the compute slices of the instance there (`[33332211]`),
    other axes alternate block characters per device; free cells are `·`. A cell is drawn occupied
    if any unit in it is."""
    glyphs: list[str] = []
    for i, slot in enumerate(occ.slots):
        shape = occ.geometry.shapes.get(slot.profile)
        if occ.geometry.mode is Mode.MIG and shape is not None and 0 < shape.compute < 10:
            glyphs.append(str(shape.compute))
        else:
            glyphs.append(BLOCKS[i % 2])
    out = []
    for lo, hi in cells_of(occ.geometry.axis, max_cells):
        hit = next((g for s, g in zip(occ.slots, glyphs, strict=True)
                    if s.start < hi and lo < s.start + s.size), FREE)
        out.append(hit)
    return "[" + "".join(out) + "]"


def describe(occ: Occupancy) -> str:
    """A short text of what occupies a GPU: the bar, or for equal-size GPUs the type and count."""
    geom = occ.geometry
    if geom.mode is Mode.VGPU_EQUAL:
        typ = occ.active_type
        if typ is None:
            return "empty (any type)"
        shape = geom.shapes.get(typ)
        most = shape.max_count if shape is not None else "?"
        return f"{typ} ×{len(occ.slots)}/{most}"
    if geom.mode is Mode.PASSTHROUGH:
        return "passed through" if occ.slots else "free (whole GPU)"
    if geom.mode is Mode.UNMANAGED:
        return "unmanaged"
    return occupancy_bar(occ)


MAX_PAGE = 1_000_000  # most GPU rows one status call returns
DEFAULT_PAGE = 100  # GPU rows per page of `vgpuctl status --gpus`


def _gpu_row(ctl: Controller, paged: PagedGpu, pools: Mapping[int, str]) -> dict[str, Any]:
    g = paged.gpu
    occ = occupancy_of(ctl.catalog, g._asdict())
    return {"host": paged.host_name, "host_state": paged.host_state, "pci": g.pci_address, "model": g.model,
            "mode": g.mode, "pool": pools.get(g.pool_id) if g.pool_id else None, "vgpu_type": occ.active_type,
            "devices": len(occ.slots), "free_units": occ.free_units, "axis_units": occ.geometry.axis,
            "slots": [{"profile": s.profile, "start": s.start, "size": s.size} for s in occ.slots],
            "occupancy": describe(occ)}


def pool_fits(ctl: Controller, conn: Tx, pool_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Per pool (of `pool_ids`, or all), how many more of each offered profile fit right now (alone), over GPUs
    of active hosts. GPUs in the same state are counted together (one row per pool and distinct GPU state, not
    per GPU)."""
    names = STORE.reports.pool_names(conn, pool_ids)
    rows = STORE.reports.pool_gpu_states(conn, names)
    gpus: dict[int, int] = dict.fromkeys(names, 0)
    fits: dict[int, dict[str, int]] = {i: {} for i in names}
    for r in rows:
        gpus[r.pool_id] += r.n
        here = fits[r.pool_id]
        for name in geometry_for(ctl.catalog, r.model, r.mode).shapes:
            here.setdefault(name, 0)
        if r.active:
            occ = occupancy_of(ctl.catalog, r._asdict())
            for name in occ.geometry.shapes:
                here[name] += occ.capacity(name) * r.n
    return [{"name": names[i], "gpus": gpus[i], "fits": dict(sorted(fits[i].items()))}
            for i in sorted(names, key=lambda i: names[i])]


def _tenants(conn: Tx, tenant_id: int | None) -> list[dict[str, Any]]:
    return [{"name": t.name, "usage": usage_report(conn, t.id)} for t in STORE.tenants.tenant_rows(conn, tenant_id)]


def _summary(conn: Tx, pool_ids: Sequence[int] | None, host_id: int | None) -> dict[str, Any]:
    """Hosts by state, and GPUs by mode: how many, how many hold devices, devices, units free of all."""
    hosts = STORE.reports.hosts_by_state(conn, pool_ids, host_id)
    counted = ModeSummary._fields[1:]  # all but the mode
    modes = {r.mode: dict(zip(counted, r[1:], strict=True))
             for r in STORE.reports.mode_summaries(conn, pool_ids, host_id)}
    total = {k: sum(m[k] for m in modes.values()) for k in counted}
    return {"hosts": sum(hosts.values()), "hosts_by_state": dict(sorted(hosts.items())), **total,
            "by_mode": modes}


def fleet_status(ctl: Controller, pool: str | None = None, host: str | None = None, *, gpus: bool = True,
                 limit: int | None = None, offset: int = 0, idle: IdleRule | None = None) -> dict[str, Any]:
    """`{"summary": {...}, "pools": [{"name", "gpus", "fits": {profile: n}}], "tenants": [{"name", "usage"}]}`,
    and with `gpus` the GPU rows, ordered by host and PCI address: `"gpus": [...]` (at most `limit` of them
    from `offset`; all without a limit) and `"page": {"offset", "limit", "total"}`.
    The summary counts hosts by state and GPUs by mode (in use, devices, free units) of the pool or host asked.
    A tenant caller sees what fits per pool and its own usage, but no summary and no GPUs (they show others'
    devices). With `idle` (a rule), `"idle"`: the allocated vGPUs below its threshold in the samples the store keeps
    (ops.utilization.idle_vgpus; admin and readers). InvalidInput naming the field for a limit or offset out of
    range."""
    if limit is not None:
        check_int("limit", limit, 1, MAX_PAGE)
    check_int("offset", offset, 0)
    with ctl.read() as conn:
        pools = STORE.reports.pool_names(conn)
        pool_ids: list[int] | None = None
        host_id: int | None = None
        if pool is not None:
            pool_ids = [i for i, n in pools.items() if n == pool]
            if not pool_ids:
                known = ", ".join(sorted(pools.values())) or "none"
                raise NotFound(f"pool {pool!r} not found (known: {known})",
                               reasons=[{"field": "pool", "value": pool}])
        if host is not None:
            host_id = STORE.reports.host_id(conn, host)
            if host_id is None:
                raise NotFound(f"host {host!r} not found", reasons=[{"field": "host", "value": host}])
        out: dict[str, Any] = {"summary": _summary(conn, pool_ids, host_id) if ctl.principal.sees_all else None}
        if gpus:
            rows: list[dict[str, Any]] = []
            total = 0
            if ctl.principal.sees_all:  # the admin and readers
                total = STORE.reports.gpu_total(conn, pool_ids, host_id)
                rows = [_gpu_row(ctl, g, pools)
                        for g in STORE.reports.gpu_page(conn, pool_ids, host_id, offset, limit)]
            out["gpus"] = rows
            out["page"] = {"offset": offset, "limit": limit, "total": total}
        out["pools"] = pool_fits(ctl, conn, pool_ids)
        out["tenants"] = _tenants(conn, ctl.principal.tenant_id)
    if idle is not None:  # the kept utilization samples (ops.utilization)
        from vgpu_ctl.ops.utilization import idle_vgpus
        out["idle"] = idle_vgpus(ctl, idle, pool=pool, host=host)
    return out
