"""Tenants in the store: lookups by id and name."""

from __future__ import annotations

from sqlalchemy import select

from vgpu_ctl.store.tables import TENANT
from vgpu_ctl.store.unit import Tx


def tenant_name(tx: Tx, tenant_id: int) -> str | None:
    """The name of the tenant `tenant_id`, if there is one."""
    name = tx.execute(select(TENANT.c.name).where(TENANT.c.id == tenant_id)).scalar()
    return None if name is None else str(name)
