"""Tenants in the store: lookups by id and name, the tenant rows, adding and removing them, their tokens."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.store.prepared import Prepared
from vgpu_ctl.store.tables import SCOPED, TENANT, VM
from vgpu_ctl.store.unit import Tx


class TenantRow(NamedTuple):
    """A tenant with its token's presence, its generation (ETag) and its main usage."""

    id: int
    name: str
    token_hash: str | None
    created_at: datetime
    generation: int
    vms_used: int
    vgpus_used: int
    framebuffer_mib_used: int


_COLUMNS = [TENANT.c[name] for name in TenantRow._fields]
_BY_NAME = Prepared(select(*_COLUMNS).where(TENANT.c.name == bindparam("name")))
_ID = Prepared(select(TENANT.c.id).where(TENANT.c.name == bindparam("name")))


def tenant_name(tx: Tx, tenant_id: int) -> str | None:
    """The name of the tenant `tenant_id`, if there is one."""
    name = tx.execute(select(TENANT.c.name).where(TENANT.c.id == tenant_id)).scalar()
    return None if name is None else str(name)


def tenant_id(tx: Tx, name: str) -> int | None:
    """The id of the tenant named `name`, if there is one."""
    return tenant_id_sent(tx, name)()


def tenant_id_sent(tx: Tx, name: str) -> Callable[[], int | None]:
    """`tenant_id` sent (inside `sent_together`); its answer is read by the callable it returns."""
    cur = _ID.run(tx, {"name": name})

    def answer() -> int | None:
        row = cur.fetchone()
        return int(row[0]) if row else None
    return answer


def tenant_by_name(tx: Tx, name: str) -> TenantRow | None:
    """The tenant named `name`, if there is one."""
    rows = _BY_NAME.rows(tx, {"name": name})
    return TenantRow(*rows[0]) if rows else None


def tenant_rows(tx: Tx, only_id: int | None = None) -> list[TenantRow]:
    """Every tenant (only `only_id` when given), by name."""
    q = select(*_COLUMNS).order_by(TENANT.c.name)
    if only_id is not None:
        q = q.where(TENANT.c.id == only_id)
    return [TenantRow(*r) for r in tx.execute(q)]


def add_tenant(tx: Tx, name: str) -> bool:
    """Insert a tenant; False (nothing stored) when the name is taken."""
    try:
        with tx.begin_nested():
            tx.execute(TENANT.insert().values(name=name))
    except IntegrityError:
        return False
    return True


def tenant_vm_names(tx: Tx, tenant_id: int) -> list[str]:
    """The names of the tenant's VMs, sorted."""
    return sorted(str(r[0]) for r in tx.execute(select(VM.c.name).where(VM.c.tenant_id == tenant_id)))


def remove_tenant(tx: Tx, tenant_id: int) -> None:
    """Delete the tenant and its scoped limits."""
    tx.execute(SCOPED.delete().where(SCOPED.c.tenant_id == tenant_id))
    tx.execute(TENANT.delete().where(TENANT.c.id == tenant_id))


def set_token_hash(tx: Tx, tenant_id: int, digest: str | None) -> None:
    """Set (or, None, clear) the hash of the tenant's token."""
    tx.execute(TENANT.update().where(TENANT.c.id == tenant_id).values(token_hash=digest))
