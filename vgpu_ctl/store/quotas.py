"""Quotas in the store: tenants' limits, guarantees and usage (global on the tenant row, per pool and per
profile in `scoped_quota`), hosts' used capacity, and what allocations actually hold."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from sqlalchemy import func, select

from vgpu_ctl.store.tables import DEVICE, HOST, POOL, SCOPED, TENANT, VM
from vgpu_ctl.store.unit import Tx

# the resources kept on the tenant row, each as <resource>_used, _limit and _guarantee
RESOURCES = tuple(c.name.removesuffix("_used") for c in TENANT.columns if c.name.endswith("_used"))


class TenantQuota(NamedTuple):
    """A tenant's global usage, limits (None: none) and guarantees (None: none), by resource."""

    id: int
    name: str
    used: dict[str, int]
    limits: dict[str, int | None]
    guarantees: dict[str, int | None]


class ScopedRow(NamedTuple):
    """A limit of a tenant in a scope ('*' for a profile's across pools, or a pool's name)."""

    id: int
    scope: str
    resource: str
    limit_value: int
    used: int
    guarantee: int | None


def allocated(tx: Tx, tenant_id: int, scope: str, states: Collection[str]) -> dict[str, int]:
    """What the tenant's VMs in `states` hold (all pools, or the pool named `scope`), summed from the VMs and
    devices themselves: vms, vcpus, memory_mib, vgpus, framebuffer_mib and profile:NAME counts."""
    vm_where = [VM.c.tenant_id == tenant_id, VM.c.state.in_([str(s) for s in states])]
    if scope != "*":
        vm_where.append(VM.c.pool_id == select(POOL.c.id).where(POOL.c.name == scope).scalar_subquery())
    vms, vcpus, mem = tx.execute(select(func.count(), func.coalesce(func.sum(VM.c.vcpus), 0),
                                        func.coalesce(func.sum(VM.c.memory_mib), 0)).where(*vm_where)).one()
    dev_rows = tx.execute(select(DEVICE.c.profile, func.count(), func.coalesce(func.sum(DEVICE.c.framebuffer_mib), 0))
                          .join(VM, VM.c.id == DEVICE.c.vm_id).where(*vm_where)
                          .group_by(DEVICE.c.profile)).all()
    out = {"vms": vms, "vcpus": vcpus, "memory_mib": mem,
           "vgpus": sum(r[1] for r in dev_rows), "framebuffer_mib": sum(r[2] for r in dev_rows)}
    for profile, n, _fb in dev_rows:
        out[f"profile:{profile}"] = n
    return {k: int(v) for k, v in out.items()}


def tenant_quota(tx: Tx, tenant_id: int) -> TenantQuota:
    """The tenant's global usage, limits and guarantees (the tenant must exist)."""
    t = tx.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping
    return TenantQuota(int(t["id"]), str(t["name"]), {r: int(t[f"{r}_used"]) for r in RESOURCES},
                       {r: t[f"{r}_limit"] for r in RESOURCES}, {r: t[f"{r}_guarantee"] for r in RESOURCES})


def tenant_refs(tx: Tx) -> list[tuple[int, str]]:
    """Every tenant's (id, name), by id."""
    return [(int(i), str(n)) for i, n in tx.execute(select(TENANT.c.id, TENANT.c.name).order_by(TENANT.c.id))]


def lock_tenant(tx: Tx, tenant_id: int) -> None:
    """Lock the tenant's row for the rest of the transaction (a no-op update: claims of this tenant wait)."""
    tx.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(vms_used=TENANT.c.vms_used))


def set_tenant_columns(tx: Tx, tenant_id: int, values: dict[str, Any]) -> None:
    """Set columns of the tenant row (<resource>_used, _limit, _guarantee)."""
    tx.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(**values))


def scoped_rows(tx: Tx, tenant_id: int, scope: str | None = None, *, by_id: bool = False) -> list[ScopedRow]:
    """The tenant's scoped limits (only `scope`'s when given), by scope and resource (or by id)."""
    q = select(SCOPED.c.id, SCOPED.c.scope, SCOPED.c.resource, SCOPED.c.limit_value, SCOPED.c.used,
               SCOPED.c.guarantee).where(SCOPED.c.tenant_id == tenant_id)
    if scope is not None:
        q = q.where(SCOPED.c.scope == scope)
    q = q.order_by(SCOPED.c.id) if by_id else q.order_by(SCOPED.c.scope, SCOPED.c.resource)
    return [ScopedRow(*r) for r in tx.execute(q)]


def put_scoped(tx: Tx, tenant_id: int, scope: str, resource: str, used: int, values: dict[str, Any]) -> None:
    """Set `values` (limit_value, guarantee) and `used` on the tenant's limit of `resource` in `scope`,
    inserting the row when there is none (which needs a limit_value)."""
    where = (SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope, SCOPED.c.resource == resource)
    if tx.execute(select(SCOPED.c.id).where(*where)).first() is not None:
        tx.execute(SCOPED.update().where(*where).values(used=used, **values))
    elif "limit_value" in values:  # (a guarantee cleared where no row is: nothing to do)
        tx.execute(SCOPED.insert().values(tenant_id=tenant_id, scope=scope, resource=resource, used=used,
                                          **values))


def drop_scoped(tx: Tx, tenant_id: int, scope: str, resource: str) -> None:
    """Delete the tenant's limit of `resource` in `scope`."""
    tx.execute(SCOPED.delete().where(SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope,
                                     SCOPED.c.resource == resource))


def set_scoped_used(tx: Tx, row_id: int, used: int) -> None:
    """Set the usage of one scoped limit."""
    tx.execute(SCOPED.update().where(SCOPED.c.id == row_id).values(used=used))


def refresh_has_scoped(tx: Tx, tenant_id: int) -> None:
    """Record on the tenant row whether it has any scoped limit (claims skip the scoped rows otherwise)."""
    n = tx.execute(select(func.count()).select_from(SCOPED).where(SCOPED.c.tenant_id == tenant_id)).scalar()
    tx.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(has_scoped_limits=bool(n)))


def host_refs(tx: Tx) -> list[tuple[int, str]]:
    """Every host's (id, name), by id."""
    return [(int(i), str(n)) for i, n in tx.execute(select(HOST.c.id, HOST.c.name).order_by(HOST.c.id))]


def lock_host_usage(tx: Tx, host_id: int) -> tuple[int, int]:
    """Lock the host's row (a no-op update) and read its used vCPUs and memory."""
    tx.execute(HOST.update().where(HOST.c.id == host_id).values(used_vcpus=HOST.c.used_vcpus))
    h = tx.execute(select(HOST.c.used_vcpus, HOST.c.used_memory_mib).where(HOST.c.id == host_id)).one()
    return int(h.used_vcpus), int(h.used_memory_mib)


def host_allocated(tx: Tx, host_id: int, states: Collection[str]) -> tuple[int, int]:
    """The vCPUs and memory the host's VMs in `states` hold."""
    vcpus, mem = tx.execute(select(func.coalesce(func.sum(VM.c.vcpus), 0), func.coalesce(func.sum(VM.c.memory_mib), 0))
                            .where(VM.c.host_id == host_id, VM.c.state.in_([str(s) for s in states]))).one()
    return int(vcpus), int(mem)


def set_host_used(tx: Tx, host_id: int, values: dict[str, int]) -> None:
    """Set the host's used_vcpus and/or used_memory_mib."""
    tx.execute(HOST.update().where(HOST.c.id == host_id).values(**values))
