"""Charges of a claim in the store: tenants' global and pool-scoped usage, hosts' used capacity, and the
anti-affinity reads a claim makes under the host's lock.

Every charge is a conditional UPDATE, so concurrent claims by several processes can never pass a limit or a
host's capacity. The statements a claim runs are `Prepared` (compiled once per process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Integer, bindparam, or_, select, update

from vgpu_ctl.store.prepared import Prepared
from vgpu_ctl.store.tables import HOST, SCOPED, TENANT, VM
from vgpu_ctl.store.unit import Tx


class ScopedUse(NamedTuple):
    """A pool-scoped limit row's limit and usage."""

    limit_value: int
    used: int


def charge_tenant(tx: Tx, tenant_id: int, delta: Mapping[str, int]) -> bool | None:
    """Add `delta` to the tenant's global usage if no limit is passed: None if one would pass, else whether
    the tenant has scoped limits (read under the row lock this update takes)."""
    return charge_tenant_sent(tx, tenant_id, delta)()


def charge_tenant_sent(tx: Tx, tenant_id: int, delta: Mapping[str, int]) -> Callable[[], bool | None]:
    """`charge_tenant` sent; its answer is read by the callable it returns (after `sent_together` ends)."""
    stmt = _charge_tenant_stmt(tuple(delta), tuple(r for r, n in delta.items() if n > 0))
    cur = stmt.run(tx, {"t_id": tenant_id, **{f"d_{r}": n for r, n in delta.items()}})

    def answer() -> bool | None:
        row = cur.fetchone()
        return None if row is None else bool(row[0])
    return answer


@lru_cache(maxsize=256)
def _charge_tenant_stmt(resources: tuple[str, ...], limited: tuple[str, ...]) -> Prepared:
    d = {r: bindparam(f"d_{r}", type_=BigInteger) for r in resources}
    values = {f"{r}_used": TENANT.c[f"{r}_used"] + d[r] for r in resources}
    conds = [or_(TENANT.c[f"{r}_limit"].is_(None), TENANT.c[f"{r}_used"] + d[r] <= TENANT.c[f"{r}_limit"])
             for r in limited]
    return Prepared(update(TENANT).where(TENANT.c.id == bindparam("t_id", type_=Integer), *conds)
                    .values(**values).returning(TENANT.c.has_scoped_limits))


_SCOPED_ROWS = Prepared(select(SCOPED.c.scope, SCOPED.c.resource)
                        .where(SCOPED.c.tenant_id == bindparam("t_id", type_=Integer)))
_SCOPED_CHARGE = Prepared(update(SCOPED).where(
    SCOPED.c.tenant_id == bindparam("t_id", type_=Integer), SCOPED.c.scope == bindparam("s_scope"),
    SCOPED.c.resource == bindparam("s_resource"),
    SCOPED.c.used + bindparam("s_n", type_=BigInteger) <= SCOPED.c.limit_value,
).values(used=SCOPED.c.used + bindparam("s_n", type_=BigInteger)))


def scoped_keys(tx: Tx, tenant_id: int) -> list[tuple[str, str]]:
    """The (scope, resource) of each of the tenant's scoped limit rows."""
    return [(scope, resource) for scope, resource in _SCOPED_ROWS.run(tx, {"t_id": tenant_id})]


def charge_scoped_row(tx: Tx, tenant_id: int, scope: str, resource: str, n: int) -> bool:
    """Add `n` to one scoped limit row if its limit is not passed; whether it did."""
    res = _SCOPED_CHARGE.run(tx, {"t_id": tenant_id, "s_scope": scope, "s_resource": resource, "s_n": n})
    return bool(res.rowcount == 1)


def uncharge(tx: Tx, tenant_id: int, delta: Mapping[str, int], scoped: Mapping[tuple[str, str], int]) -> None:
    """Take `delta` off the tenant's global usage and each amount off its scoped row, where one exists."""
    if delta:
        tx.execute(update(TENANT).where(TENANT.c.id == tenant_id)
                   .values(**{f"{r}_used": TENANT.c[f"{r}_used"] - n for r, n in delta.items()}))
    for (scope, resource), n in scoped.items():
        tx.execute(update(SCOPED).where(SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope,
                                        SCOPED.c.resource == resource).values(used=SCOPED.c.used - n))


def tenant_usage(tx: Tx, tenant_id: int) -> dict[str, Any]:
    """The tenant's row, by column name (each resource's `_used` and `_limit`)."""
    return dict(tx.execute(select(TENANT).where(TENANT.c.id == tenant_id)).one()._mapping)


def scoped_use(tx: Tx, tenant_id: int, scope: str, resource: str) -> ScopedUse:
    """One scoped limit row's limit and usage."""
    row = tx.execute(select(SCOPED.c.limit_value, SCOPED.c.used).where(
        SCOPED.c.tenant_id == tenant_id, SCOPED.c.scope == scope, SCOPED.c.resource == resource)).one()
    return ScopedUse(*row)


_CLAIM_HOST = Prepared(update(HOST).where(
    HOST.c.id == bindparam("h_id", type_=Integer), HOST.c.state == "active",
    HOST.c.used_vcpus + bindparam("d_vcpus", type_=BigInteger) <= HOST.c.vcpus * HOST.c.cpu_overcommit,
    HOST.c.used_memory_mib + bindparam("d_memory_mib", type_=BigInteger)
    <= HOST.c.memory_mib * HOST.c.memory_overcommit,
).values(used_vcpus=HOST.c.used_vcpus + bindparam("d_vcpus", type_=BigInteger),
         used_memory_mib=HOST.c.used_memory_mib + bindparam("d_memory_mib", type_=BigInteger)))


def claim_host(tx: Tx, host_id: int, vcpus: int, memory_mib: int) -> bool:
    """Take vCPUs and memory on the host if it is active and has room (overcommit applied); whether it did."""
    return claim_host_sent(tx, host_id, vcpus, memory_mib)()


def claim_host_sent(tx: Tx, host_id: int, vcpus: int, memory_mib: int) -> Callable[[], bool]:
    """`claim_host` sent; its answer is read by the callable it returns (after `sent_together` ends)."""
    res = _CLAIM_HOST.run(tx, {"h_id": host_id, "d_vcpus": vcpus, "d_memory_mib": memory_mib})
    return lambda: bool(res.rowcount == 1)


def release_host(tx: Tx, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Give back a VM's vCPUs and memory."""
    tx.execute(update(HOST).where(HOST.c.id == host_id).values(
        used_vcpus=HOST.c.used_vcpus - vcpus, used_memory_mib=HOST.c.used_memory_mib - memory_mib))


_GROUP_HOSTS = Prepared(select(VM.c.host_id).where(VM.c.anti_affinity == bindparam("group")).distinct())
_GROUP_ON_HOST = Prepared(select(VM.c.id).where(VM.c.anti_affinity == bindparam("group"),
                                               VM.c.host_id == bindparam("h_id", type_=Integer)).limit(1))


def hosts_of_group(tx: Tx, group: str) -> set[int]:
    """The hosts a VM of anti-affinity `group` is on (a prepared read: a claim's read takes no write lock)."""
    return {hid for hid, in _GROUP_HOSTS.run(tx, {"group": group}) if hid is not None}


def group_on_host(tx: Tx, group: str, host_id: int) -> bool:
    """Whether a VM of anti-affinity `group` is on the host."""
    return group_on_host_sent(tx, group, host_id)()


def group_on_host_sent(tx: Tx, group: str, host_id: int) -> Callable[[], bool]:
    """`group_on_host` sent; its answer is read by the callable it returns (after `sent_together` ends)."""
    cur = _GROUP_ON_HOST.run(tx, {"group": group, "h_id": host_id})
    return lambda: cur.fetchone() is not None


__all__ = ["ScopedUse", "charge_scoped_row", "charge_tenant", "charge_tenant_sent", "claim_host", "claim_host_sent",
           "group_on_host", "group_on_host_sent", "hosts_of_group", "release_host", "scoped_keys", "scoped_use",
           "tenant_usage", "uncharge"]
