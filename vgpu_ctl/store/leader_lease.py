"""The leader's lease in the store (`server_lease`): who leads the servers of this store, at which address,
until when."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import delete, select, update

from vgpu_ctl.store.tables import SERVER_LEASE
from vgpu_ctl.store.unit import Tx


class LeaderLease(NamedTuple):
    """The leader's lease as stored (`expires_at` as the driver returns it: naive on SQLite)."""

    holder: str
    address: str
    expires_at: datetime


def write_leader(tx: Tx, holder: str, address: str, until: datetime) -> None:
    """Record `holder` (at `address`) as the leader until `until`."""
    if tx.execute(update(SERVER_LEASE).where(SERVER_LEASE.c.name == "leader")
                  .values(holder=holder, address=address, expires_at=until)).rowcount == 0:
        tx.execute(SERVER_LEASE.insert().values(name="leader", holder=holder, address=address, expires_at=until))


def clear_leader(tx: Tx, holder: str) -> None:
    """Delete the leader's lease if `holder` has it."""
    tx.execute(delete(SERVER_LEASE).where(SERVER_LEASE.c.name == "leader", SERVER_LEASE.c.holder == holder))


def leader(tx: Tx) -> LeaderLease | None:
    """The leader's lease, run out or not, if there is one."""
    row = tx.execute(select(SERVER_LEASE.c.holder, SERVER_LEASE.c.address, SERVER_LEASE.c.expires_at)
                     .where(SERVER_LEASE.c.name == "leader")).first()
    return LeaderLease(*row) if row is not None else None
