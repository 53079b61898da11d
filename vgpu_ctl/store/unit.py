"""The store's unit of work as the service sees it: an opaque handle, opened by the store (`Database.write`
for a write transaction, `Database.read` for reads) and passed to the store's functions. The service never
runs a statement on it; only the modules of this package do."""

from __future__ import annotations

from typing import TypeAlias

from sqlalchemy.engine import Connection

from vgpu_ctl.store.models import utcnow as utcnow  # the store's clock (aware UTC), for times the service sets

Tx: TypeAlias = Connection

__all__ = ["Tx", "utcnow"]
