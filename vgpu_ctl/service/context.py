"""What a process opens once and every call shares: the store's engine and its writer machinery, the catalog,
the host connections. A server makes one and answers each request with a Controller bound to the caller."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from vgpu_ctl.catalog import Catalog, load_catalog
from vgpu_ctl.service.fit_masks import ensure_fit_masks
from vgpu_ctl.store import migrate
from vgpu_ctl.store.checkpoint import WalCheckpointer
from vgpu_ctl.store.engine import default_url, make_engine, state_dir
from vgpu_ctl.store.leader import Elector, elector_for
from vgpu_ctl.store.urls import check_store_url, store_error
from vgpu_ctl.store.writer_queue import WriterQueue

if TYPE_CHECKING:
    from vgpu_ctl.service.hosts import HostFactory


class ServiceContext:
    """The store, the catalog and the hosts of one process."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None, catalog: Catalog | None = None,
                 host_factory: HostFactory | None = None, state_path: Path | None = None,
                 schema: str = "upgrade") -> None:
        """Open the store at `url` (or `engine`). `schema`: "upgrade" brings it to the newest revision (the
        admin's way), "require" refuses a store not at it, "as-is" opens it as it is (to repair it)."""
        try:
            self.engine = engine or make_engine(check_store_url(url))
            self._checkpointer = WalCheckpointer.for_engine(self.engine)
            if self._checkpointer is not None:  # a context dropped without close() leaves no thread behind
                weakref.finalize(self, self._checkpointer.stop_soon)
            self._writers = WriterQueue.for_engine(self.engine)
            self.catalog = catalog or load_catalog()
            self.state_path = state_path or state_dir()
            if schema == "upgrade":
                self.upgrade(refresh_fit_masks=False)
            elif schema == "require":
                migrate.require_head(self.engine)
        except (SQLAlchemyError, OSError) as exc:
            raise store_error(url or default_url(), exc) from None
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

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """One transaction (SQLite: taken with BEGIN IMMEDIATE, in turn with this store's other processes)."""
        with self.write_turn(), self.engine.begin() as conn:
            yield conn

    def write_turn(self) -> AbstractContextManager[None]:
        """Wait for this process's turn to write (SQLite: the store's writer queue; PostgreSQL: no wait)."""
        return self._writers.turn() if self._writers is not None else nullcontext()

    def close(self) -> None:
        """Release database connections, host connections and the writer machinery."""
        self.hosts.close()
        self.engine.dispose()
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if self._writers is not None:
            self._writers.close()


__all__ = ["ServiceContext"]
