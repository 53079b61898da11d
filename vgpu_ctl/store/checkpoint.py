"""Checkpointing a SQLite store's write-ahead log on a background thread.

SQLite's automatic checkpoint runs inside the commit that crosses its threshold (1,000 pages) and ends with an
fsync of the database: on the benchmark machine about 13 ms, paid by every fiftieth claim. A controller instead
turns automatic checkpoints off on its connections and checkpoints here: PASSIVE checkpoints never block a
writer, and a commit then only appends to the log. A log that outgrows `restart_frames` (writes arriving faster
than a checkpoint completes, or a long read keeping an old snapshot) is restarted. A RESTART holds the write lock
while it waits for readers to leave old snapshots, so it waits at most `RESTART_WAIT_MS` and otherwise gives up
until the next round: a `status` or `doctor` reading for seconds would have stopped every claim for as long.
When the controller closes, a last checkpoint runs; when the last connection to a store closes, SQLite also
checkpoints it itself.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

RESTART_WAIT_MS = 20  # the longest a RESTART keeps writers waiting for readers or a writer (then: next round)


class WalCheckpointer:
    """Background WAL checkpoints for one SQLite store file (see the module docstring)."""

    def __init__(self, engine: Engine, interval_s: float = 0.25, restart_frames: int = 16384) -> None:
        path = engine.url.database
        assert engine.dialect.name == "sqlite" and path and path != ":memory:", "a SQLite store file"
        self.path = path
        self._uri = Path(path).resolve().as_uri() + "?mode=rw"  # never creates a store that was removed
        self.interval_s = interval_s
        self.restart_frames = restart_frames
        self.checkpoints = 0
        self._stop = threading.Event()

        @event.listens_for(engine, "connect")
        def _no_auto_checkpoint(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

        self._thread = threading.Thread(target=self._run, name=f"wal-checkpoint {path}", daemon=True)
        self._thread.start()

    @classmethod
    def for_engine(cls, engine: Engine) -> WalCheckpointer | None:
        """A checkpointer for a SQLite file store, None for other stores."""
        db = engine.url.database
        if engine.dialect.name != "sqlite" or not db or db == ":memory:":
            return None
        return cls(engine)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.checkpoint()
        self.checkpoint()

    def checkpoint(self) -> tuple[int, int, int]:
        """One checkpoint now: (busy, frames in the log, frames checkpointed), as SQLite reports it."""
        try:
            conn = sqlite3.connect(self._uri, uri=True, timeout=30, isolation_level=None)
        except sqlite3.OperationalError:  # the store was removed: nothing left to checkpoint
            self._stop.set()
            return (0, 0, 0)
        try:
            busy, log, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if log > self.restart_frames:
                conn.execute(f"PRAGMA busy_timeout={RESTART_WAIT_MS}")
                busy, log, done = conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
        except sqlite3.OperationalError:  # the store is being replaced (restore): try again later
            return (1, 0, 0)
        finally:
            conn.close()
        self.checkpoints += 1
        return int(busy), int(log), int(done)

    def stop(self) -> None:
        """Run a last checkpoint and stop the thread."""
        self._stop.set()
        self._thread.join(timeout=30)

    def stop_soon(self) -> None:
        """Let the thread run its last checkpoint and end, without waiting for it (an owner being collected)."""
        self._stop.set()
