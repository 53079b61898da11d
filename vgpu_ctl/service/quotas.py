"""Tenant limits: setting them (with usage recomputed from allocations) and reading usage against them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.engine import Connection

from vgpu_ctl.core.vm_state import HOLDS_CLAIM
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import DEVICE, HOST, SCOPED, TENANT
from vgpu_ctl.service.requests import BASE_RESOURCES
from vgpu_ctl.store.models import Pool, Vm

VM: Table = Vm.__table__  # type: ignore[attr-defined]
POOL: Table = Pool.__table__  # type: ignore[attr-defined]


def allocated(conn: Connection, tenant_id: int, scope: str = "*") -> dict[str, int]:
    """What a tenant's VMs hold, summed from the VMs and devices themselves (all pools, or one)."""
    vm_where = [VM.c.tenant_id == tenant_id, VM.c.state.in_(HOLDS_CLAIM)]
    if scope != "*":
        vm_where.append(VM.c.pool_id == select(POOL.c.id).where(POOL.c.name == scope).scalar_subquery())
    vms, vcpus, mem = conn.execute(select(func.count(), func.coalesce(func.sum(VM.c.vcpus), 0),
                                          func.coalesce(func.sum(VM.c.memory_mib), 0)).where(*vm_where)).one()
    dev_rows = conn.execute(select(DEVICE.c.profile, func.count(), func.coalesce(func.sum(DEVICE.c.framebuffer_mib), 0))
                            .join(VM, VM.c.id == DEVICE.c.vm_id).where(*vm_where)
                            .group_by(DEVICE.c.profile)).all()
    out = {"vms": vms, "vcpus": vcpus, "memory_mib": mem,
           "vgpus": sum(r[1] for r in dev_rows), "framebuffer_mib": sum(r[2] for r in dev_rows)}
    for profile, n, _fb in dev_rows:
        out[f"profile:{profile}"] = n
    return {k: int(v) for k, v in out.items()}


def set_limits(conn: Connection, tenant_id: int, scope: str, limits: Mapping[str, int | None]) -> dict[str, Any]:
    """Set (int) or clear (None) limits of a tenant in a scope ('*' or a pool name); the changes made.
    The tenant row is updated first so concurrent claims of this tenant wait for this transaction."""
    for resource, value in limits.items():
        if resource not in BASE_RESOURCES and not resource.startswith("profile:"):
            raise InvalidInput(f"unknown quota resource {resource!r}; known: {', '.join(BASE_RESOURCES)}, "
                               "profile:NAME", reasons=[{"field": "resource", "value": resource}])
        if value is not None:
            check_int(resource, value)
    conn.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(vms_used=TENANT.c.vms_used))
    usage = allocated(conn, tenant_id, scope)
    changes: dict[str, Any] = {}
    for resource, value in limits.items():
        if scope == "*" and resource in BASE_RESOURCES:
            conn.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(**{f"{resource}_limit": value}))
        else:
            where = (SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope, SCOPED.c.resource == resource)
            conn.execute(SCOPED.delete().where(*where))
            if value is not None:
                conn.execute(SCOPED.insert().values(tenant_id=tenant_id, scope=scope, resource=resource,
                                                    limit_value=value, used=usage.get(resource, 0)))
        changes[resource] = value
    has_scoped = conn.execute(select(func.count()).select_from(SCOPED).where(SCOPED.c.tenant_id == tenant_id)).scalar()
    conn.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(has_scoped_limits=bool(has_scoped)))
    return changes


def repair_usage(conn: Connection) -> list[dict[str, Any]]:
    """Set every stored usage that differs from what allocations hold to what they hold (inside the caller's
    transaction): tenants' global usage, their per-pool and per-profile rows, hosts' vCPUs and memory; the
    changes, each with the object, resource, stored and allocated values. Each tenant and host row is locked
    (by a no-op update) before its allocations are summed, in the order claims lock them."""
    changes: list[dict[str, Any]] = []
    for t_id, name in conn.execute(select(TENANT.c.id, TENANT.c.name).order_by(TENANT.c.id)).all():
        conn.execute(TENANT.update().where(TENANT.c.id == t_id).values(vms_used=TENANT.c.vms_used))
        t = conn.execute(select(TENANT).where(TENANT.c.id == t_id)).one()._mapping
        actual = allocated(conn, t_id)
        fixed = {f"{r}_used": actual[r] for r in BASE_RESOURCES if t[f"{r}_used"] != actual[r]}
        changes += [{"object": f"tenant {name}", "resource": k.removesuffix("_used"), "stored": t[k],
                     "allocated": v} for k, v in fixed.items()]
        if fixed:
            conn.execute(TENANT.update().where(TENANT.c.id == t_id).values(**fixed))
        for row in conn.execute(select(SCOPED).where(SCOPED.c.tenant_id == t_id).order_by(SCOPED.c.id)).all():
            held = allocated(conn, t_id, row.scope).get(row.resource, 0)
            if row.used != held:
                where = "all pools" if row.scope == "*" else f"pool {row.scope}"
                changes.append({"object": f"tenant {name}", "resource": f"{row.resource} in {where}",
                                "stored": row.used, "allocated": held})
                conn.execute(SCOPED.update().where(SCOPED.c.id == row.id).values(used=held))
    for h_id, name in conn.execute(select(HOST.c.id, HOST.c.name).order_by(HOST.c.id)).all():
        conn.execute(HOST.update().where(HOST.c.id == h_id).values(used_vcpus=HOST.c.used_vcpus))
        h = conn.execute(select(HOST.c.used_vcpus, HOST.c.used_memory_mib).where(HOST.c.id == h_id)).one()
        vcpus, mem = conn.execute(select(func.coalesce(func.sum(VM.c.vcpus), 0),
                                         func.coalesce(func.sum(VM.c.memory_mib), 0))
                                  .where(VM.c.host_id == h_id, VM.c.state.in_(HOLDS_CLAIM))).one()
        fixed = {c: int(v) for c, v, stored in (("used_vcpus", vcpus, h.used_vcpus),
                                                 ("used_memory_mib", mem, h.used_memory_mib)) if stored != v}
        changes += [{"object": f"host {name}", "resource": k.removeprefix("used_"),
                     "stored": getattr(h, k), "allocated": v} for k, v in fixed.items()]
        if fixed:
            conn.execute(HOST.update().where(HOST.c.id == h_id).values(**fixed))
    return changes


def usage_report(conn: Connection, tenant_id: int) -> list[dict[str, Any]]:
    """Each limit of a tenant (and each base resource, limited or not) with its usage."""
    t = conn.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping
    actual = allocated(conn, tenant_id)
    rows = [{"scope": "*", "resource": r, "used": t[f"{r}_used"], "limit": t[f"{r}_limit"]} for r in BASE_RESOURCES]
    rows += [{"scope": "*", "resource": k, "used": v, "limit": None} for k, v in sorted(actual.items())
             if k.startswith("profile:")]
    for r in conn.execute(select(SCOPED).where(SCOPED.c.tenant_id == tenant_id)
                          .order_by(SCOPED.c.scope, SCOPED.c.resource)).all():
        existing = next((x for x in rows if x["scope"] == r.scope and x["resource"] == r.resource), None)
        if existing is not None:
            existing["limit"] = r.limit_value
            existing["used"] = r.used
        else:
            rows.append({"scope": r.scope, "resource": r.resource, "used": r.used, "limit": r.limit_value})
    return rows
