"""Tenant limits: setting them (with usage recomputed from allocations) and reading usage against them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.engine import Connection

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import DEVICE, SCOPED, TENANT
from vgpu_ctl.service.requests import BASE_RESOURCES
from vgpu_ctl.store.models import Pool, Vm

VM: Table = Vm.__table__  # type: ignore[attr-defined]
POOL: Table = Pool.__table__  # type: ignore[attr-defined]
HOLDING = ("placed", "devices-ready", "defined", "running", "stopped", "releasing", "requested")


def allocated(conn: Connection, tenant_id: int, scope: str = "*") -> dict[str, int]:
    """What a tenant's VMs hold, summed from the VMs and devices themselves (all pools, or one)."""
    vm_where = [VM.c.tenant_id == tenant_id, VM.c.state.in_(HOLDING)]
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
