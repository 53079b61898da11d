"""What a process opens once and every call shares: the store's engine and its writer machinery, the catalog,
the host connections. A server makes one and answers each request with a Controller bound to the caller."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_ctl.catalog import Catalog, load_catalog
from vgpu_ctl.service.fit_masks import ensure_fit_masks
from vgpu_ctl.service.leases import forget_store
from vgpu_ctl.service.ports import Tx
from vgpu_ctl.store import migrate
from vgpu_ctl.store.database import Database
from vgpu_ctl.store.engine import default_url, state_dir
from vgpu_ctl.store.leader import Elector, elector_for
from vgpu_ctl.store.unit import StoreEngine, StoreError
from vgpu_ctl.store.urls import check_store_url, store_error

if TYPE_CHECKING:
    from vgpu_ctl.service.allocator import Allocator
    from vgpu_ctl.service.hosts import HostFactory


class ServiceContext:
    """The store, the catalog and the hosts of one process."""

    def __init__(self, url: str | None = None, *, engine: StoreEngine | None = None, catalog: Catalog | None = None,
                 host_factory: HostFactory | None = None, state_path: Path | None = None,
                 schema: str = "upgrade") -> None:
        """Open the store at `url` (or `engine`). `schema`: "upgrade" brings it to the newest revision (the
        admin's way), "require" refuses a store not at it, "as-is" opens it as it is (to repair it)."""
        try:
            self.db = Database(engine=engine) if engine is not None else Database(check_store_url(url))
            self.engine = self.db.engine
            self.catalog = catalog or load_catalog()
            self.state_path = state_path or state_dir()
            if schema == "upgrade":
                self.upgrade(refresh_fit_masks=False)
            elif schema == "require":
                migrate.require_head(self.engine)
        except (StoreError, OSError) as exc:
            raise store_error(url or default_url(), exc) from None
        self.allocator: Allocator | None = None  # a server's in-memory allocator (service/allocator.py), if any
        from vgpu_ctl.service.hosts import HostFactory, simulated_state_dir
        self.hosts = host_factory or HostFactory(  # simulated hosts live with their store
            self.state_path, simulated_dir=simulated_state_dir(self.engine.url, self.state_path))

    def upgrade(self, refresh_fit_masks: bool) -> str:
        """Bring the schema to the newest revision and the GPUs' fit masks up to date; the revision."""
        migrate.upgrade(self.engine)
        ensure_fit_masks(self.engine, self.catalog, force=refresh_fit_masks)
        return migrate.head_revision()

    def elector(self) -> Elector:
        """The election of the one server that leads this store (see store.leader)."""
        return elector_for(self.engine, self.state_path)

    def schema_revisions(self) -> tuple[str | None, str]:
        """The revision the store's schema is at (None: empty) and the newest this code knows."""
        return migrate.current_revision(self.engine), migrate.head_revision()

    def read(self) -> AbstractContextManager[Tx]:
        """A connection for reads (`Database.read`: on SQLite its transactions hold no lock)."""
        return self.db.read()

    def tx(self) -> AbstractContextManager[Tx]:
        """One transaction (SQLite: taken with BEGIN IMMEDIATE, in turn with this store's other processes)."""
        return self.db.write()

    def write_turn(self) -> AbstractContextManager[None]:
        """Wait for this process's turn to write (SQLite: the store's writer queue; PostgreSQL: no wait)."""
        return self.db.write_turn()

    def claim_turn(self) -> AbstractContextManager[Any]:
        """Wait for this process's turn to claim (`Database.claim_turn`)."""
        return self.db.claim_turn()

    def close(self) -> None:
        """Release database connections, host connections and the writer machinery (the allocator's claims
        queued by then are written first); the store's leases are renewed no more."""
        if self.allocator is not None:
            self.allocator.close()
        forget_store(self)
        self.hosts.close()
        self.db.close()


__all__ = ["ServiceContext"]
