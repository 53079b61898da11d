"""The store of one process: its engine and the machinery that makes writing fast on SQLite (the writer queue
between processes, the WAL checkpointer thread), opened once and owned here. A write unit of work is opened one
way, `write()`; reads use `read()`."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy.engine import Engine

from vgpu_ctl.store.checkpoint import WalCheckpointer
from vgpu_ctl.store.engine import READS, make_engine
from vgpu_ctl.store.unit import Tx
from vgpu_ctl.store.writer_queue import WriterQueue


class Database:
    """The engine of a store with its writer queue and checkpointer (SQLite files; PostgreSQL needs neither)."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None) -> None:
        """Open the store at `url` (default: the default store), or wrap `engine`."""
        self.engine = engine or make_engine(url)
        self.checkpointer = WalCheckpointer.for_engine(self.engine)
        if self.checkpointer is not None:  # a store dropped without close() leaves no thread behind
            weakref.finalize(self, self.checkpointer.stop_soon)
        self._writers = WriterQueue.for_engine(self.engine)
        self._claimers = threading.RLock()

    @contextmanager
    def write(self) -> Iterator[Tx]:
        """One write transaction, committed at the end of the block (rolled back on an error); on SQLite taken
        with BEGIN IMMEDIATE, in turn with this store's other processes."""
        with self.engine.connect() as conn, self.write_turn(), conn.begin():
            yield conn

    def read(self) -> AbstractContextManager[Tx]:
        """A connection for reads (each statement sees the store as committed; on SQLite a transaction of it
        holds no lock, unless this thread holds the writer turn: a claim reads, then writes in its turn, on one
        connection)."""
        return self.engine.connect().execution_options(**{READS: True})

    def write_turn(self) -> AbstractContextManager[None]:
        """Wait for this process's turn to write (SQLite: the writer queue; PostgreSQL: no wait). Take it with a
        connection in hand, never ask the pool for one while holding it: a claim holds its read's connection
        while it waits for the turn, so a turn holder waiting for a connection would wait for them, and they
        for it, once they hold all of the pool's connections."""
        return self._writers.turn() if self._writers is not None else nullcontext()

    def claim_turn(self) -> AbstractContextManager[Any]:
        """Wait for this process's turn to claim: on SQLite the writer queue (a turn among the store's
        processes), elsewhere a lock among this store's threads in the process. A claim writes in its turn; one
        that keeps losing races to other claims holds it from its read on, so none of theirs lands between.
        Taken, as `write_turn`, with a connection in hand."""
        return self._writers.turn() if self._writers is not None else self._claimers

    def close(self) -> None:
        """Release the connections, stop the checkpointer and close the writer queue."""
        self.engine.dispose()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        if self._writers is not None:
            self._writers.close()


__all__ = ["Database"]
