"""Tenant limits: setting them (with usage recomputed from allocations) and reading usage against them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.engine import Connection

from vgpu_ctl.core.vm_state import HOLDS_CLAIM
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import DEVICE, GUARANTEED, HOST, SCOPED, TENANT
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


def _field(resource: str) -> str:
    """The name of a guarantee's field in errors (the CLI option without its dashes)."""
    return f"guarantee_{resource}"


def check_guarantees(conn: Connection, tenant_id: int, scope: str, limits: Mapping[str, int | None],
                     guarantees: Mapping[str, int | None]) -> None:
    """InvalidInput naming the field, before anything changes, for a guarantee of an unknown or profile resource,
    one that is not a whole number >= 0, one above its limit (as it will be after this change), or one in a pool
    without a limit there (a pool's guarantee is part of its limit, the burst)."""
    for resource, value in guarantees.items():
        if resource not in GUARANTEED:
            raise InvalidInput(f"a guarantee is for one of {', '.join(GUARANTEED)}, not {resource!r}",
                               reasons=[{"field": "guarantee", "value": resource}])
        if value is not None:
            check_int(_field(resource), value)
    t = conn.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping
    scoped = {r.resource: r for r in conn.execute(select(SCOPED).where(SCOPED.c.tenant_id == tenant_id,
                                                                         SCOPED.c.scope == scope))}
    for resource in GUARANTEED:
        if resource not in limits and resource not in guarantees:
            continue
        if scope == "*":
            limit, guarantee = t[f"{resource}_limit"], t[f"{resource}_guarantee"]
        else:
            row = scoped.get(resource)
            limit, guarantee = (row.limit_value, row.guarantee) if row is not None else (None, None)
        limit = limits.get(resource, limit)
        guarantee = guarantees.get(resource, guarantee)
        if guarantee is None:
            continue
        field = _field(resource) if resource in guarantees else resource
        where = "" if scope == "*" else f" in pool {scope}"
        if limit is None and scope != "*":
            raise InvalidInput(f"a guarantee of {resource}{where} needs a limit of {resource} there (the burst it "
                               f"is part of) (field {field})", reasons=[{"field": field, "value": guarantee}])
        if limit is not None and guarantee > limit:
            raise InvalidInput(f"the guarantee of {resource}{where} ({guarantee}) can't be above its limit ({limit}) "
                               f"(field {field})",
                               reasons=[{"field": field, "value": guarantees.get(resource, limits.get(resource)),
                                         "guarantee": guarantee, "limit": limit}])


def set_limits(conn: Connection, tenant_id: int, scope: str, limits: Mapping[str, int | None],
               guarantees: Mapping[str, int | None] | None = None) -> dict[str, Any]:
    """Set (int) or clear (None) limits, and the guaranteed part of them (`guarantees`, by resource: usage above
    a guarantee is borrowed), of a tenant in a scope ('*' or a pool name); the changes made (guarantees as
    `guarantee:RESOURCE`). Everything is checked before anything changes (`check_guarantees`). The tenant row is
    updated first so concurrent claims of this tenant wait for this transaction."""
    guarantees = dict(guarantees or {})
    for resource, value in limits.items():
        if resource not in BASE_RESOURCES and not resource.startswith("profile:"):
            raise InvalidInput(f"unknown quota resource {resource!r}; known: {', '.join(BASE_RESOURCES)}, "
                               "profile:NAME", reasons=[{"field": "resource", "value": resource}])
        if value is not None:
            check_int(resource, value)
    conn.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(vms_used=TENANT.c.vms_used))
    check_guarantees(conn, tenant_id, scope, limits, guarantees)
    usage = allocated(conn, tenant_id, scope)
    changes: dict[str, Any] = {}
    for resource in dict.fromkeys([*limits, *guarantees]):
        values: dict[str, Any] = {}
        if resource in limits:
            values["limit_value"] = limits[resource]
            changes[resource] = limits[resource]
        if resource in guarantees:
            values["guarantee"] = guarantees[resource]
            changes[f"guarantee:{resource}"] = guarantees[resource]
        if scope == "*" and resource in BASE_RESOURCES:
            conn.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(
                **{f"{resource}_{'limit' if k == 'limit_value' else 'guarantee'}": v for k, v in values.items()}))
            continue
        where = (SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope, SCOPED.c.resource == resource)
        if values.get("limit_value", 0) is None:  # the limit cleared: its guarantee goes with it (checked above)
            conn.execute(SCOPED.delete().where(*where))
        elif conn.execute(select(SCOPED.c.id).where(*where)).first() is not None:
            conn.execute(SCOPED.update().where(*where).values(used=usage.get(resource, 0), **values))
        elif "limit_value" in values:  # (a guarantee cleared where no row is: nothing to do)
            conn.execute(SCOPED.insert().values(tenant_id=tenant_id, scope=scope, resource=resource,
                                                used=usage.get(resource, 0), **values))
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


def _borrowed(used: int, guarantee: int | None) -> int | None:
    return None if guarantee is None else max(0, used - guarantee)


def usage_report(conn: Connection, tenant_id: int) -> list[dict[str, Any]]:
    """Each limit of a tenant (and each base resource, limited or not) with its usage, its guaranteed part (None:
    none) and how much of the usage is borrowed (above the guarantee; None without one)."""
    t = conn.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping
    actual = allocated(conn, tenant_id)
    rows = [{"scope": "*", "resource": r, "used": t[f"{r}_used"], "limit": t[f"{r}_limit"],
             "guarantee": t[f"{r}_guarantee"], "borrowed": _borrowed(t[f"{r}_used"], t[f"{r}_guarantee"])}
            for r in BASE_RESOURCES]
    rows += [{"scope": "*", "resource": k, "used": v, "limit": None, "guarantee": None, "borrowed": None}
             for k, v in sorted(actual.items()) if k.startswith("profile:")]
    for r in conn.execute(select(SCOPED).where(SCOPED.c.tenant_id == tenant_id)
                          .order_by(SCOPED.c.scope, SCOPED.c.resource)).all():
        existing = next((x for x in rows if x["scope"] == r.scope and x["resource"] == r.resource), None)
        row = {"used": r.used, "limit": r.limit_value, "guarantee": r.guarantee,
               "borrowed": _borrowed(r.used, r.guarantee)}
        if existing is not None:
            existing.update(row)
        else:
            rows.append({"scope": r.scope, "resource": r.resource, **row})
    return rows
