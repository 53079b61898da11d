"""Tenant limits: setting them (with usage recomputed from allocations) and reading usage against them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vgpu_ctl.core.vm_state import HOLDS_CLAIM, HOLDS_HOST
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.allocation import GUARANTEED
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.requests import BASE_RESOURCES


def allocated(conn: Tx, tenant_id: int, scope: str = "*") -> dict[str, int]:
    """What a tenant's VMs hold, summed from the VMs and devices themselves (all pools, or one)."""
    return STORE.quotas.allocated(conn, tenant_id, scope, HOLDS_CLAIM)


def _field(resource: str) -> str:
    """The name of a guarantee's field in errors (the CLI option without its dashes)."""
    return f"guarantee_{resource}"


def check_guarantees(conn: Tx, tenant_id: int, scope: str, limits: Mapping[str, int | None],
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
    t = STORE.quotas.tenant_quota(conn, tenant_id)
    scoped = {r.resource: r for r in STORE.quotas.scoped_rows(conn, tenant_id, scope)}
    for resource in GUARANTEED:
        if resource not in limits and resource not in guarantees:
            continue
        if scope == "*":
            limit, guarantee = t.limits[resource], t.guarantees[resource]
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


def set_limits(conn: Tx, tenant_id: int, scope: str, limits: Mapping[str, int | None],
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
    STORE.quotas.lock_tenant(conn, tenant_id)
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
            STORE.quotas.set_tenant_columns(conn, tenant_id, {
                f"{resource}_{'limit' if k == 'limit_value' else 'guarantee'}": v for k, v in values.items()})
        elif values.get("limit_value", 0) is None:  # the limit cleared: its guarantee goes with it (checked above)
            STORE.quotas.drop_scoped(conn, tenant_id, scope, resource)
        else:
            STORE.quotas.put_scoped(conn, tenant_id, scope, resource, usage.get(resource, 0), values)
    STORE.quotas.refresh_has_scoped(conn, tenant_id)
    return changes


def repair_usage(conn: Tx) -> list[dict[str, Any]]:
    """Set every stored usage that differs from what allocations hold to what they hold (inside the caller's
    transaction): tenants' global usage, their per-pool and per-profile rows, hosts' vCPUs and memory; the
    changes, each with the object, resource, stored and allocated values. Each tenant and host row is locked
    (by a no-op update) before its allocations are summed, in the order claims lock them."""
    q = STORE.quotas
    changes: list[dict[str, Any]] = []
    for t_id, name in q.tenant_refs(conn):
        q.lock_tenant(conn, t_id)
        t = q.tenant_quota(conn, t_id)
        actual = allocated(conn, t_id)
        fixed = {r: actual[r] for r in BASE_RESOURCES if t.used[r] != actual[r]}
        changes += [{"object": f"tenant {name}", "resource": r, "stored": t.used[r], "allocated": v}
                    for r, v in fixed.items()]
        if fixed:
            q.set_tenant_columns(conn, t_id, {f"{r}_used": v for r, v in fixed.items()})
        for row in q.scoped_rows(conn, t_id, by_id=True):
            held = allocated(conn, t_id, row.scope).get(row.resource, 0)
            if row.used != held:
                where = "all pools" if row.scope == "*" else f"pool {row.scope}"
                changes.append({"object": f"tenant {name}", "resource": f"{row.resource} in {where}",
                                "stored": row.used, "allocated": held})
                q.set_scoped_used(conn, row.id, held)
    for h_id, name in q.host_refs(conn):
        stored = dict(zip(("used_vcpus", "used_memory_mib"), q.lock_host_usage(conn, h_id), strict=True))
        holds = dict(zip(("used_vcpus", "used_memory_mib"), q.host_allocated(conn, h_id, HOLDS_HOST), strict=True))
        fixed_host = {c: v for c, v in holds.items() if stored[c] != v}
        changes += [{"object": f"host {name}", "resource": k.removeprefix("used_"), "stored": stored[k],
                     "allocated": v} for k, v in fixed_host.items()]
        if fixed_host:
            q.set_host_used(conn, h_id, fixed_host)
    return changes


def _borrowed(used: int, guarantee: int | None) -> int | None:
    return None if guarantee is None else max(0, used - guarantee)


def usage_report(conn: Tx, tenant_id: int) -> list[dict[str, Any]]:
    """Each limit of a tenant (and each base resource, limited or not) with its usage, its guaranteed part (None:
    none) and how much of the usage is borrowed (above the guarantee; None without one)."""
    t = STORE.quotas.tenant_quota(conn, tenant_id)
    actual = allocated(conn, tenant_id)
    rows = [{"scope": "*", "resource": r, "used": t.used[r], "limit": t.limits[r], "guarantee": t.guarantees[r],
             "borrowed": _borrowed(t.used[r], t.guarantees[r])} for r in BASE_RESOURCES]
    rows += [{"scope": "*", "resource": k, "used": v, "limit": None, "guarantee": None, "borrowed": None}
             for k, v in sorted(actual.items()) if k.startswith("profile:")]
    for r in STORE.quotas.scoped_rows(conn, tenant_id):
        existing = next((x for x in rows if x["scope"] == r.scope and x["resource"] == r.resource), None)
        row = {"used": r.used, "limit": r.limit_value, "guarantee": r.guarantee,
               "borrowed": _borrowed(r.used, r.guarantee)}
        if existing is not None:
            existing.update(row)
        else:
            rows.append({"scope": r.scope, "resource": r.resource, **row})
    return rows
