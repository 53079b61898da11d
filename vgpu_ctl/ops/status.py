"""Fleet status: what occupies each GPU, what still fits per pool, and each tenant's usage against limits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection

from vgpu_ctl.core.geometry import Mode, Occupancy, geometry_for
from vgpu_ctl.errors import NotFound
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import GPU, HOST, TENANT, occupancy_of
from vgpu_ctl.service.inventory_apply import POOL
from vgpu_ctl.service.quotas import usage_report

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


def _gpu_row(ctl: Controller, g: Any, pools: Mapping[int, str]) -> dict[str, Any]:
    occ = occupancy_of(ctl.catalog, g._mapping)
    return {"host": g.host_name, "host_state": g.host_state, "pci": g.pci_address, "model": g.model,
            "mode": g.mode, "pool": pools.get(g.pool_id) if g.pool_id else None, "vgpu_type": occ.active_type,
            "devices": len(occ.slots), "free_units": occ.free_units, "axis_units": occ.geometry.axis,
            "slots": [{"profile": s.profile, "start": s.start, "size": s.size} for s in occ.slots],
            "occupancy": describe(occ)}


_STATE_COLUMNS = (GPU.c.model, GPU.c.mode, GPU.c.mig_layout, GPU.c.layout, GPU.c.pinned_type)


def pool_fits(ctl: Controller, conn: Connection, pool_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Per pool, how many more of each offered profile fit right now (alone), over GPUs of active hosts.
    GPUs in the same state are counted together (one row per pool and distinct GPU state, not per GPU)."""
    names = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name)
                                                .where(POOL.c.id.in_(list(pool_ids))))}
    active = (HOST.c.state == "active").label("active")
    rows = conn.execute(select(GPU.c.pool_id, *_STATE_COLUMNS, active, func.count().label("n"))
                        .join(HOST, HOST.c.id == GPU.c.host_id).where(GPU.c.pool_id.in_(list(names)))
                        .group_by(GPU.c.pool_id, *_STATE_COLUMNS, active)).all()
    gpus: dict[int, int] = dict.fromkeys(names, 0)
    fits: dict[int, dict[str, int]] = {i: {} for i in names}
    for r in rows:
        gpus[r.pool_id] += r.n
        here = fits[r.pool_id]
        for name in geometry_for(ctl.catalog, r.model, r.mode).shapes:
            here.setdefault(name, 0)
        if r.active:
            occ = occupancy_of(ctl.catalog, r._mapping)
            for name in occ.geometry.shapes:
                here[name] += occ.capacity(name) * r.n
    return [{"name": names[i], "gpus": gpus[i], "fits": dict(sorted(fits[i].items()))}
            for i in sorted(names, key=lambda i: names[i])]


def _tenants(conn: Connection, tenant_id: int | None) -> list[dict[str, Any]]:
    q = select(TENANT.c.id, TENANT.c.name).order_by(TENANT.c.name)
    if tenant_id is not None:
        q = q.where(TENANT.c.id == tenant_id)
    return [{"name": t.name, "usage": usage_report(conn, t.id)} for t in conn.execute(q).all()]


def _summary(conn: Connection, where: list[Any], host_where: list[Any]) -> dict[str, Any]:
    """Hosts by state, and GPUs by mode: how many, how many hold devices, devices, units free of all."""
    hosts: dict[str, int] = {str(state): int(n) for state, n in conn.execute(
        select(HOST.c.state, func.count()).where(*host_where).group_by(HOST.c.state))}
    busy = func.sum(case((GPU.c.device_count > 0, 1), else_=0))
    modes: dict[str, dict[str, int]] = {}
    for r in conn.execute(select(GPU.c.mode, func.count().label("gpus"), busy.label("in_use"),
                                 func.sum(GPU.c.device_count).label("devices"),
                                 func.sum(GPU.c.free_units).label("free_units"),
                                 func.sum(GPU.c.axis_units).label("axis_units"))
                          .join(HOST, HOST.c.id == GPU.c.host_id).where(*where)
                          .group_by(GPU.c.mode).order_by(GPU.c.mode)).all():
        modes[r.mode] = {"gpus": r.gpus, "in_use": int(r.in_use or 0), "devices": int(r.devices or 0),
                         "free_units": int(r.free_units or 0), "axis_units": int(r.axis_units or 0)}
    total = {k: sum(m[k] for m in modes.values()) for k in ("gpus", "in_use", "devices", "free_units",
                                                            "axis_units")}
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
    with ctl.engine.connect() as conn:
        pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
        pool_ids = list(pools)
        where: list[Any] = []
        host_where: list[Any] = []
        if pool is not None:
            pool_ids = [i for i, n in pools.items() if n == pool]
            if not pool_ids:
                known = ", ".join(sorted(pools.values())) or "none"
                raise NotFound(f"pool {pool!r} not found (known: {known})",
                               reasons=[{"field": "pool", "value": pool}])
            where.append(GPU.c.pool_id.in_(pool_ids))
            host_where.append(HOST.c.id.in_(select(GPU.c.host_id).where(GPU.c.pool_id.in_(pool_ids))))
        if host is not None:
            host_id = conn.execute(select(HOST.c.id).where(HOST.c.name == host)).scalar()
            if host_id is None:
                raise NotFound(f"host {host!r} not found", reasons=[{"field": "host", "value": host}])
            where.append(GPU.c.host_id == host_id)
            host_where.append(HOST.c.id == host_id)
        out: dict[str, Any] = {"summary": _summary(conn, where, host_where) if ctl.principal.sees_all else None}
        if gpus:
            rows: list[dict[str, Any]] = []
            total = 0
            if ctl.principal.sees_all:  # the admin and readers
                total = conn.execute(select(func.count()).select_from(GPU).where(*where)).scalar_one()
                gq = (select(GPU, HOST.c.name.label("host_name"), HOST.c.state.label("host_state"))
                      .join(HOST, HOST.c.id == GPU.c.host_id).where(*where)
                      .order_by(HOST.c.name, GPU.c.pci_address).offset(offset))
                if limit is not None:
                    gq = gq.limit(limit)
                rows = [_gpu_row(ctl, g, pools) for g in conn.execute(gq).all()]
            out["gpus"] = rows
            out["page"] = {"offset": offset, "limit": limit, "total": total}
        out["pools"] = pool_fits(ctl, conn, pool_ids)
        out["tenants"] = _tenants(conn, ctl.principal.tenant_id)
    if idle is not None:  # the kept utilization samples (ops.utilization)
        from vgpu_ctl.ops.utilization import idle_vgpus
        out["idle"] = idle_vgpus(ctl, idle, pool=pool, host=host)
    return out
