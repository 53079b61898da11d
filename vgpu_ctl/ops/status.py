"""Fleet status: what occupies each GPU, what still fits per pool, and each tenant's usage against limits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from vgpu_ctl.core.geometry import Mode, Occupancy, geometry_for
from vgpu_ctl.errors import NotFound
from vgpu_ctl.service.allocation import GPU, HOST, TENANT, occupancy_of
from vgpu_ctl.service.inventory_apply import POOL
from vgpu_ctl.service.quotas import usage_report

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

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


def _gpu_row(ctl: Controller, g: Any, host: Any, pools: Mapping[int, str]) -> dict[str, Any]:
    occ = occupancy_of(ctl.catalog, g._mapping)
    return {"host": host.name, "host_state": host.state, "pci": g.pci_address, "model": g.model,
            "mode": g.mode, "pool": pools.get(g.pool_id) if g.pool_id else None, "vgpu_type": occ.active_type,
            "devices": len(occ.slots), "free_units": occ.free_units, "axis_units": occ.geometry.axis,
            "slots": [{"profile": s.profile, "start": s.start, "size": s.size} for s in occ.slots],
            "occupancy": describe(occ)}


def pool_fits(ctl: Controller, conn: Connection, pool_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Per pool, how many more of each offered profile fit right now (alone), over GPUs of active hosts."""
    out = []
    for p in conn.execute(select(POOL).where(POOL.c.id.in_(list(pool_ids))).order_by(POOL.c.name)).all():
        rows = conn.execute(select(GPU, HOST.c.state.label("host_state"))
                            .join(HOST, HOST.c.id == GPU.c.host_id).where(GPU.c.pool_id == p.id)).all()
        fits: dict[str, int] = {}
        for r in rows:
            for name in geometry_for(ctl.catalog, r.model, r.mode).shapes:
                fits.setdefault(name, 0)
            if r.host_state == "active":
                occ = occupancy_of(ctl.catalog, dict(r._mapping))
                for name in occ.geometry.shapes:
                    fits[name] += occ.capacity(name)
        out.append({"name": p.name, "gpus": len(rows), "fits": dict(sorted(fits.items()))})
    return out


def _tenants(conn: Connection, tenant_id: int | None) -> list[dict[str, Any]]:
    q = select(TENANT.c.id, TENANT.c.name).order_by(TENANT.c.name)
    if tenant_id is not None:
        q = q.where(TENANT.c.id == tenant_id)
    return [{"name": t.name, "usage": usage_report(conn, t.id)} for t in conn.execute(q).all()]


def fleet_status(ctl: Controller, pool: str | None = None, host: str | None = None) -> dict[str, Any]:
    """`{"gpus": [...], "pools": [{"name", "gpus", "fits": {profile: n}}], "tenants": [{"name", "usage"}]}`.
    A tenant caller sees what fits per pool and its own usage, but no GPUs (they show others' devices)."""
    with ctl.engine.connect() as conn:
        pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
        pool_ids = list(pools)
        if pool is not None:
            pool_ids = [i for i, n in pools.items() if n == pool]
            if not pool_ids:
                known = ", ".join(sorted(pools.values())) or "none"
                raise NotFound(f"pool {pool!r} not found (known: {known})",
                               reasons=[{"field": "pool", "value": pool}])
        hq = select(HOST).order_by(HOST.c.name)
        if host is not None:
            hq = hq.where(HOST.c.name == host)
        hosts = conn.execute(hq).all()
        if host is not None and not hosts:
            raise NotFound(f"host {host!r} not found", reasons=[{"field": "host", "value": host}])
        gpus: list[dict[str, Any]] = []
        if ctl.principal.is_admin:
            for h in hosts:
                gq = select(GPU).where(GPU.c.host_id == h.id).order_by(GPU.c.pci_address)
                if pool is not None:
                    gq = gq.where(GPU.c.pool_id.in_(pool_ids))
                gpus += [_gpu_row(ctl, g, h, pools) for g in conn.execute(gq).all()]
        return {"gpus": gpus, "pools": pool_fits(ctl, conn, pool_ids),
                "tenants": _tenants(conn, ctl.principal.tenant_id)}
