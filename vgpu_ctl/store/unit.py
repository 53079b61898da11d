"""The store's unit of work as the service sees it: an opaque handle, opened by the store (`Database.write`
for a write transaction, `Database.read` for reads) and passed to the store's functions. The service never
runs a statement on it; only the modules of this package do."""

from __future__ import annotations

from typing import TypeAlias

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from vgpu_ctl.store.models import utcnow as utcnow  # the store's clock (aware UTC), for times the service sets

Tx: TypeAlias = Connection
StoreEngine: TypeAlias = Engine  # an opened store, for the callers that hand one in (tests, tools)
StoreError: TypeAlias = SQLAlchemyError  # what the store raises when it can't be read or written


__all__ = ["StoreEngine", "StoreError", "Tx", "utcnow"]
