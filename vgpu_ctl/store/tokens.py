"""Credentials in the store: tenants' token hashes and API tokens (name, role, hash)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.store.models import utcnow
from vgpu_ctl.store.tables import API_TOKEN, TENANT
from vgpu_ctl.store.unit import Tx


class TenantRef(NamedTuple):
    """A tenant by id and name."""

    id: int
    name: str


class ApiTokenRow(NamedTuple):
    """An API token as listed (never the token, nor its hash)."""

    name: str
    role: str
    created_at: datetime


def tenant_by_token_hash(tx: Tx, digest: str) -> TenantRef | None:
    """The tenant whose token hashes to `digest`, if any."""
    row = tx.execute(select(TENANT.c.id, TENANT.c.name).where(TENANT.c.token_hash == digest)).first()
    return TenantRef(row.id, row.name) if row is not None else None


def api_token_by_hash(tx: Tx, digest: str) -> ApiTokenRow | None:
    """The API token that hashes to `digest`, if any."""
    row = tx.execute(select(API_TOKEN.c.name, API_TOKEN.c.role, API_TOKEN.c.created_at)
                     .where(API_TOKEN.c.token_hash == digest)).first()
    return ApiTokenRow(row.name, row.role, row.created_at) if row is not None else None


def add_api_token(tx: Tx, name: str, role: str, digest: str) -> bool:
    """Store an API token; False (and nothing stored) when one named `name` exists."""
    try:
        with tx.begin_nested():
            tx.execute(API_TOKEN.insert().values(name=name, role=role, token_hash=digest, created_at=utcnow()))
    except IntegrityError:
        return False
    return True


def api_tokens(tx: Tx) -> list[ApiTokenRow]:
    """Every API token, by name."""
    return [ApiTokenRow(r.name, r.role, r.created_at)
            for r in tx.execute(select(API_TOKEN.c.name, API_TOKEN.c.role, API_TOKEN.c.created_at)
                                .order_by(API_TOKEN.c.name))]


def remove_api_token(tx: Tx, name: str) -> bool:
    """Delete the API token `name`; whether there was one."""
    return bool(tx.execute(API_TOKEN.delete().where(API_TOKEN.c.name == name)).rowcount == 1)
