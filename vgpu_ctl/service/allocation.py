"""Claiming and releasing placements in the store: candidate queries and conditional updates.

All statements run on one connection inside the caller's transaction. Every change of a GPU's occupancy is
a compare-and-set on its `version`, and every change of usage a conditional UPDATE, so concurrent claims by
several processes can never take the same space or pass a limit.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from sqlalchemy import Integer, Table, and_, bindparam, func, literal, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select, Update

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import Mode, Occupancy, decode_layout, encode_layout, geometry_for
from vgpu_ctl.core.placement import GpuView, HostView, PlacementPlan, PlacementRequest
from vgpu_ctl.errors import QuotaExceeded
from vgpu_ctl.store.models import Device, Gpu, Host, ScopedQuota, Tenant

GPU: Table = Gpu.__table__  # type: ignore[attr-defined]
HOST: Table = Host.__table__  # type: ignore[attr-defined]
TENANT: Table = Tenant.__table__  # type: ignore[attr-defined]
SCOPED: Table = ScopedQuota.__table__  # type: ignore[attr-defined]
DEVICE: Table = Device.__table__  # type: ignore[attr-defined]

PAGE = 16


class ClaimConflict(Exception):
    """Another claim changed a GPU or host between reading and writing: retry."""


def modes_for(kind: ProfileKind) -> tuple[str, ...]:
    """The GPU modes in which a profile of this kind can be placed."""
    return {
        ProfileKind.VGPU: (Mode.VGPU_EQUAL.value, Mode.VGPU_MIXED.value),
        ProfileKind.MIG: (Mode.MIG.value,),
        ProfileKind.MIG_VGPU: (Mode.MIG.value,),
        ProfileKind.PASSTHROUGH: (Mode.PASSTHROUGH.value,),
    }[kind]


def occupancy_of(catalog: Catalog, row: Mapping[Any, Any]) -> Occupancy:
    """The occupancy of a GPU row (a mapping with model, mode, mig_layout, layout and pinned_type)."""
    return _occupancy(catalog, row["model"], row["mode"], row["mig_layout"], row["layout"],
                      row["pinned_type"])


@lru_cache(maxsize=65536)
def _occupancy(catalog: Catalog, model: str, mode: str, mig_layout: str, layout: str,
               pinned_type: str | None) -> Occupancy:
    # Occupancies are immutable: GPUs in the same state share one (and the policies' caches hit on it).
    geom = geometry_for(catalog, model, mode)
    fixed = frozenset((geom.shapes[s.profile].group, s.start) for s in decode_layout(mig_layout)) \
        if mig_layout else None
    return Occupancy(geom, decode_layout(layout), pinned_type, fixed)


@lru_cache(maxsize=1024)
def _gpu_filter_for(catalog: Catalog, profiles: frozenset[str]) -> Any:
    """SQL condition: a GPU whose model and mode offer one of the profiles and that has room for it."""
    clauses = _gpu_clauses(catalog, profiles)
    return or_(*clauses) if clauses else literal(False)


@lru_cache(maxsize=1024)
def _gpu_clauses(catalog: Catalog, profiles: frozenset[str]) -> tuple[Any, ...]:
    """One condition per (profile, model, mode) that can hold it; `_gpu_filter_for` is their OR."""
    clauses = []
    for name in sorted(profiles):
        for model in catalog.models_offering(name):
            p = catalog.profile(model, name)
            assert p is not None
            for mode in modes_for(p.kind):
                shape = geometry_for(catalog, model, mode).shape(name)
                if shape is None:
                    continue
                cond = [GPU.c.model == model, GPU.c.mode == mode, GPU.c.free_units >= shape.size]
                if mode == Mode.VGPU_EQUAL.value:
                    cond.append(or_(GPU.c.active_type.is_(None), GPU.c.active_type == name))
                    cond.append(or_(GPU.c.pinned_type.is_(None), GPU.c.pinned_type == name))
                clauses.append(and_(*cond))
    return tuple(clauses)


# The host condition of a request, its sizes bound at execution (req_vcpus, req_memory_mib).
@lru_cache(maxsize=1024)
def _offer_statement(catalog: Catalog, profile: str) -> Any:
    pairs = []
    for model in catalog.models_offering(profile):
        p = catalog.profile(model, profile)
        assert p is not None
        pairs += [and_(GPU.c.mode == mode, GPU.c.model == model) for mode in modes_for(p.kind)
                  if geometry_for(catalog, model, mode).shape(profile) is not None]
    return select(GPU.c.id).where(GPU.c.pool_id == bindparam("pool_id"), or_(*pairs) if pairs else literal(False)) \
        .limit(1)


def pool_offers(conn: Connection, catalog: Catalog, pool_id: int, profile: str) -> bool:
    """True when some GPU of the pool, by its model and mode, can hold `profile` (an indexed lookup)."""
    return conn.execute(_offer_statement(catalog, profile), {"pool_id": pool_id}).first() is not None


_HOST_FILTER = and_(
    HOST.c.state == "active",
    HOST.c.used_vcpus + bindparam("req_vcpus", type_=Integer) <= HOST.c.vcpus * HOST.c.cpu_overcommit,
    HOST.c.used_memory_mib + bindparam("req_memory_mib", type_=Integer)
    <= HOST.c.memory_mib * HOST.c.memory_overcommit,
)


_GPU_COLS = (GPU.c.id, GPU.c.host_id, GPU.c.pci_address, GPU.c.model, GPU.c.mode, GPU.c.pool_id,
             GPU.c.pinned_type, GPU.c.mig_layout, GPU.c.layout, GPU.c.version, GPU.c.free_units)
_HOST_COLS = (HOST.c.id, HOST.c.name, HOST.c.vgpu_backing, HOST.c.driver, HOST.c.vcpus, HOST.c.memory_mib,
              HOST.c.cpu_overcommit,
              HOST.c.memory_overcommit, HOST.c.used_vcpus, HOST.c.used_memory_mib, HOST.c.state,
              HOST.c.labels)
# Statements built once and reused (SQLAlchemy then memoizes their cache keys); values are bound per call.
_HOSTS_BY_ID = select(*_HOST_COLS).where(HOST.c.id.in_(bindparam("host_ids", expanding=True)))
_HOSTS_BY_ID_NO_LABELS = select(*_HOST_COLS[:-1]).where(HOST.c.id.in_(bindparam("host_ids", expanding=True)))


def _order(policy: str) -> list[Any]:
    # Only columns of the gpu_candidates index (which ends in the row id): SQLite then reads the first page
    # straight from the index instead of sorting every GPU with the same free space. GPU ids follow the
    # order hosts were declared in, which is the fixed host order placement breaks ties by.
    if policy == "spread":
        return [GPU.c.free_units.desc(), GPU.c.id]
    if policy == "first-fit":
        return [GPU.c.id]
    return [GPU.c.free_units, GPU.c.id]


def _order_key(policy: str) -> Callable[[Any], tuple[int, ...]]:
    """`_order` in Python, on rows of the per-clause page queries (which carry `host_used_vcpus`)."""
    if policy == "spread":
        return lambda r: (-r.free_units, r.id)
    if policy == "first-fit":
        return lambda r: (r.id,)
    return lambda r: (r.free_units, r.id)


@dataclass
class Candidates:
    """Candidate hosts for a request, with what the claim needs of them: each GPU's version (for the
    compare-and-set) and PCI address, and each host's vGPU backing."""

    hosts: list[HostView]
    versions: dict[int, int]
    pcis: dict[int, str] = field(default_factory=dict)
    backings: dict[int, str] = field(default_factory=dict)
    simulated: dict[int, bool] = field(default_factory=dict)


def _labels(raw: Any) -> dict[str, str]:
    return json.loads(raw) if isinstance(raw, str) else dict(raw or {})


def _views(conn: Connection, catalog: Catalog, rows: Sequence[Any], anti_affinity: str | None,
           pool_names: Mapping[int, str], labels: bool = True) -> Candidates:
    """Candidate views of the GPU rows' hosts. Without `labels` the hosts' labels are not read (placement
    looks at them only for a request with labels)."""
    by_host: dict[int, list[Any]] = {}
    for r in rows:
        by_host.setdefault(r.host_id, []).append(r)
    hosts = conn.execute(_HOSTS_BY_ID if labels else _HOSTS_BY_ID_NO_LABELS,
                         {"host_ids": list(by_host)}).all() if by_host else []
    groups: dict[int, set[str]] = {}
    if anti_affinity and by_host:
        from vgpu_ctl.store.models import Vm
        vm = Vm.__table__  # type: ignore[attr-defined]
        for hid, in conn.execute(select(vm.c.host_id).where(vm.c.anti_affinity == anti_affinity,
                                                             vm.c.host_id.in_(list(by_host)))):
            groups.setdefault(hid, set()).add(anti_affinity)
    out = Candidates([], {})
    for h in hosts:
        gpus = []
        out.backings[h.id] = h.vgpu_backing
        out.simulated[h.id] = h.driver == "simulated"
        for r in by_host[h.id]:
            gpus.append(GpuView(r.id, r.pci_address, occupancy_of(catalog, r._mapping),
                                pool_names.get(r.pool_id) if r.pool_id else None))
            out.versions[r.id] = r.version
            out.pcis[r.id] = r.pci_address
        out.hosts.append(HostView(
            h.id, h.name, h.vcpus * h.cpu_overcommit - h.used_vcpus,
            h.memory_mib * h.memory_overcommit - h.used_memory_mib, tuple(gpus), h.state,
            _labels(h.labels) if labels else {}, frozenset(groups.get(h.id, ())), order=h.id))
    out.hosts.sort(key=lambda v: v.order)
    return out


@lru_cache(maxsize=1024)
def _candidate_statements(catalog: Catalog, profiles: frozenset[str], policy: str,
                          multi: bool) -> tuple[tuple[Select[Any], ...], Select[Any] | None]:
    """Single GPU: one page query per clause of the GPU filter (each a range of the gpu_candidates index,
    ordered by the policy, the first page_limit rows), merged by the caller: the same rows and order as
    the OR of the clauses, which SQLite can only answer by reading and sorting every matching GPU.
    Multi-GPU: the host page query and the query of those hosts' GPUs. Bound at execution: pool_ids,
    req_vcpus, req_memory_mib, page_limit (multi: page_offset, ndev, host_ids)."""
    in_pools = GPU.c.pool_id.in_(bindparam("pool_ids", expanding=True))
    limit = bindparam("page_limit", type_=Integer)
    if not multi:
        cols = (*_GPU_COLS, HOST.c.used_vcpus.label("host_used_vcpus"))
        return tuple(select(*cols).join(HOST, HOST.c.id == GPU.c.host_id)
                     .where(in_pools, clause, _HOST_FILTER).order_by(*_order(policy)).limit(limit)
                     for clause in _gpu_clauses(catalog, profiles)), None
    where = and_(in_pools, _gpu_filter_for(catalog, profiles), _HOST_FILTER)
    free = func.sum(GPU.c.free_units)
    hq = (select(GPU.c.host_id).join(HOST, HOST.c.id == GPU.c.host_id).where(where)
          .group_by(GPU.c.host_id).having(func.count() >= bindparam("ndev", type_=Integer))
          .order_by(free if policy != "spread" else free.desc(), GPU.c.host_id)
          .limit(limit).offset(bindparam("page_offset", type_=Integer)))
    rows_q = select(*_GPU_COLS).join(HOST, HOST.c.id == GPU.c.host_id).where(
        where, GPU.c.host_id.in_(bindparam("host_ids", expanding=True)))
    return (hq,), rows_q


def candidate_pages(conn: Connection, catalog: Catalog, req: PlacementRequest, pool_ids: Sequence[int],
                    policy: str, pool_names: Mapping[int, str]) -> Iterable[Candidates]:
    """Pages of candidate hosts, best first by the policy's order; each page is a few GPUs or hosts."""
    ndev = len(req.profiles)
    page_qs, rows_q = _candidate_statements(catalog, frozenset(req.profiles), policy, ndev > 1)
    if not page_qs:
        return
    params: dict[str, Any] = {"pool_ids": list(pool_ids), "req_vcpus": req.vcpus,
                              "req_memory_mib": req.memory_mib}
    labels = bool(req.labels)
    offset = 0
    rows: Sequence[Any]
    while True:
        if rows_q is None:
            # Rows offset .. offset+PAGE of the merged order (a GPU matching several clauses counts once).
            params["page_limit"] = offset + PAGE
            merged: dict[int, Any] = {}
            for q in page_qs:
                for r in conn.execute(q, params):
                    merged.setdefault(r.id, r)
            rows = sorted(merged.values(), key=_order_key(policy))[offset:offset + PAGE]
            if not rows:
                return
        else:
            host_ids = [r[0] for r in conn.execute(page_qs[0], {**params, "page_limit": PAGE // 2,
                                                                "page_offset": offset, "ndev": ndev})]
            if not host_ids:
                return
            rows = conn.execute(rows_q, {**params, "host_ids": host_ids}).all()
        yield _views(conn, catalog, rows, req.anti_affinity, pool_names, labels)
        offset += PAGE if ndev == 1 else PAGE // 2


def all_candidates(conn: Connection, catalog: Catalog, pool_ids: Sequence[int], profiles: Sequence[str],
                   anti_affinity: str | None, pool_names: Mapping[int, str]) -> Candidates:
    """Every GPU of the pools whose model offers a profile (any mode), for explaining a refusal."""
    models = {m for p in set(profiles) for m in catalog.models_offering(p)}
    rows = conn.execute(select(*_GPU_COLS).where(GPU.c.pool_id.in_(list(pool_ids)))).all()
    rows = [r for r in rows if r.model in models] or rows
    return _views(conn, catalog, rows, anti_affinity, pool_names)


def charge_tenant(conn: Connection, tenant_id: int, delta: Mapping[str, int]) -> bool | None:
    """Add `delta` to the tenant's global usage if no limit is passed: None if one would be, else whether the
    tenant has scoped limits (read under the row lock this update takes)."""
    stmt = _charge_tenant_stmt(tuple(delta), tuple(r for r, n in delta.items() if n > 0))
    row = conn.execute(stmt, {"t_id": tenant_id, **{f"d_{r}": n for r, n in delta.items()}}).first()
    return None if row is None else bool(row[0])


@lru_cache(maxsize=256)
def _charge_tenant_stmt(resources: tuple[str, ...], limited: tuple[str, ...]) -> Update:
    d = {r: bindparam(f"d_{r}", type_=Integer) for r in resources}
    values = {f"{r}_used": TENANT.c[f"{r}_used"] + d[r] for r in resources}
    conds = [or_(TENANT.c[f"{r}_limit"].is_(None), TENANT.c[f"{r}_used"] + d[r] <= TENANT.c[f"{r}_limit"])
             for r in limited]
    return update(TENANT).where(TENANT.c.id == bindparam("t_id"), *conds).values(**values) \
        .returning(TENANT.c.has_scoped_limits)


_SCOPED_ROWS = select(SCOPED.c.scope, SCOPED.c.resource).where(SCOPED.c.tenant_id == bindparam("t_id"))
_SCOPED_CHARGE = update(SCOPED).where(
    SCOPED.c.tenant_id == bindparam("t_id"), SCOPED.c.scope == bindparam("s_scope"),
    SCOPED.c.resource == bindparam("s_resource"),
    SCOPED.c.used + bindparam("s_n", type_=Integer) <= SCOPED.c.limit_value,
).values(used=SCOPED.c.used + bindparam("s_n", type_=Integer))


def charge_scoped(conn: Connection, tenant_id: int,
                  charges: Mapping[tuple[str, str], int]) -> list[tuple[str, str]]:
    """Add to each scoped limit row that exists; returns the (scope, resource) pairs whose limit would
    pass."""
    failed = []
    rows = conn.execute(_SCOPED_ROWS, {"t_id": tenant_id}).all()
    for scope, resource in rows:
        n = charges.get((scope, resource), 0)
        if n == 0:
            continue
        res = conn.execute(_SCOPED_CHARGE, {"t_id": tenant_id, "s_scope": scope, "s_resource": resource,
                                            "s_n": n})
        if res.rowcount != 1:
            failed.append((scope, resource))
    return failed


def uncharge(conn: Connection, tenant_id: int, delta: Mapping[str, int],
             scoped: Mapping[tuple[str, str], int]) -> None:
    """Give back what a VM held (global usage and every scoped row that exists)."""
    if delta:
        conn.execute(update(TENANT).where(TENANT.c.id == tenant_id)
                     .values(**{f"{r}_used": TENANT.c[f"{r}_used"] - n for r, n in delta.items()}))
    for (scope, resource), n in scoped.items():
        conn.execute(update(SCOPED).where(SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope,
                                          SCOPED.c.resource == resource).values(used=SCOPED.c.used - n))


def quota_refusal(conn: Connection, tenant_id: int, tenant: str, delta: Mapping[str, int],
                  scoped_failed: Sequence[tuple[str, str]],
                  charges: Mapping[tuple[str, str], int]) -> QuotaExceeded:
    """The error for a request that would pass a limit, naming each limit with its usage and the request."""
    t = conn.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping
    reasons: list[dict[str, Any]] = []
    for r, n in delta.items():
        limit = t[f"{r}_limit"]
        if n > 0 and limit is not None and t[f"{r}_used"] + n > limit:
            reasons.append({"kind": "quota", "tenant": tenant, "scope": "*", "resource": r,
                            "limit": limit, "used": t[f"{r}_used"], "requested": n})
    for scope, resource in scoped_failed:
        row = conn.execute(select(SCOPED).where(SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope,
                                                SCOPED.c.resource == resource)).one()._mapping
        reasons.append({"kind": "quota", "tenant": tenant, "scope": scope, "resource": resource,
                        "limit": row["limit_value"], "used": row["used"],
                        "requested": charges[(scope, resource)]})
    text = "; ".join(f"{x['resource']}{'' if x['scope'] == '*' else ' in pool ' + x['scope']}: "
                     f"{x['used']} used + {x['requested']} requested > limit {x['limit']}" for x in reasons)
    return QuotaExceeded(f"tenant {tenant!r} is over quota: {text}", reasons=reasons)


_CLAIM_HOST = update(HOST).where(
    HOST.c.id == bindparam("h_id"), HOST.c.state == "active",
    HOST.c.used_vcpus + bindparam("d_vcpus", type_=Integer) <= HOST.c.vcpus * HOST.c.cpu_overcommit,
    HOST.c.used_memory_mib + bindparam("d_memory_mib", type_=Integer)
    <= HOST.c.memory_mib * HOST.c.memory_overcommit,
).values(used_vcpus=HOST.c.used_vcpus + bindparam("d_vcpus", type_=Integer),
         used_memory_mib=HOST.c.used_memory_mib + bindparam("d_memory_mib", type_=Integer))


def claim_host(conn: Connection, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Take vCPUs and memory on the host if it is active and has room (overcommit applied)."""
    res = conn.execute(_CLAIM_HOST, {"h_id": host_id, "d_vcpus": vcpus, "d_memory_mib": memory_mib})
    if res.rowcount != 1:
        raise ClaimConflict(f"host {host_id} changed")


def release_host(conn: Connection, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Give back a VM's vCPUs and memory."""
    conn.execute(update(HOST).where(HOST.c.id == host_id).values(
        used_vcpus=HOST.c.used_vcpus - vcpus, used_memory_mib=HOST.c.used_memory_mib - memory_mib))


_WRITE_GPU = update(GPU).where(GPU.c.id == bindparam("g_id"), GPU.c.version == bindparam("g_version")).values(
    layout=bindparam("g_layout"), free_units=bindparam("g_free_units"),
    active_type=bindparam("g_active_type"), device_count=bindparam("g_device_count"),
    version=GPU.c.version + 1)


def write_gpu(conn: Connection, gpu_id: int, version: int, occ: Occupancy) -> None:
    """Store a GPU's new occupancy if nobody changed it since `version` was read."""
    res = conn.execute(_WRITE_GPU, {
        "g_id": gpu_id, "g_version": version, "g_layout": encode_layout(occ.slots),
        "g_free_units": occ.free_units,
        "g_active_type": occ.slots[0].profile if occ.geometry.homogeneous and occ.slots else None,
        "g_device_count": len(occ.slots)})
    if res.rowcount != 1:
        raise ClaimConflict(f"gpu {gpu_id} changed")


_INSERT_DEVICE = DEVICE.insert()


def insert_devices(conn: Connection, catalog: Catalog, vm_id: str, plan: PlacementPlan,
                   backing_of: Mapping[int, str]) -> list[dict[str, Any]]:
    """Insert a device row per planned vGPU; the unique position and the overlap trigger guard them."""
    rows = []
    for d in plan.devices:
        shape = plan.occupancies[d.gpu_id].geometry.shapes[d.profile]
        dev_id = str(uuid.uuid4())
        rows.append({"id": dev_id, "gpu_id": d.gpu_id, "vm_id": vm_id, "profile": d.profile,
                     "kind": shape.kind.value, "start": d.start, "size": d.size,
                     "framebuffer_mib": shape.framebuffer_mib, "uuid": dev_id,
                     "backing": backing_of[d.gpu_id],
                     "handle": {}, "state": "claimed"})
    conn.execute(_INSERT_DEVICE, rows)
    return rows


def free_devices(conn: Connection, catalog: Catalog, devices: Sequence[Mapping[str, Any]]) -> None:
    """Delete device rows and take their slots off their GPUs (compare-and-set, retried on conflict)."""
    for gpu_id in sorted({d["gpu_id"] for d in devices}):  # id order, as claims lock them
        starts = {d["start"] for d in devices if d["gpu_id"] == gpu_id}
        for _ in range(20):
            row = conn.execute(select(*_GPU_COLS).where(GPU.c.id == gpu_id)).one()
            occ = occupancy_of(catalog, row._mapping)
            for s in starts:
                if any(x.start == s for x in occ.slots):
                    occ = occ.remove(s)
            try:
                write_gpu(conn, gpu_id, row.version, occ)
                break
            except ClaimConflict:
                continue
    conn.execute(DEVICE.delete().where(DEVICE.c.id.in_([d["id"] for d in devices])))
