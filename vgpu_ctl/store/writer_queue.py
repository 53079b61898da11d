"""A queue for SQLite's write lock between the controller processes on one store file.

SQLite lets one writer in at a time; a writer that finds the lock taken sleeps in its busy handler for 1, 2, 5,
10 ms and more between tries, so with several controller processes a claim could wait ten times as long as the
claim ahead of it took. Controllers instead take an exclusive `flock` on `<store>.lock` around each write
transaction: the kernel wakes the next waiter the moment the lock is released. This only orders writers;
correctness still rests on SQLite's own lock (a writer that does not use the queue, like the sqlite3 shell, is
still serialized by it, through the busy handler).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import Engine

_held = threading.local()  # .paths: the lock files of the turns this thread holds


def lock_path(store_path: str) -> str:
    """The queue's lock file of the SQLite store file at `store_path`."""
    return str(Path(store_path).resolve()) + ".lock"


def store_file(engine: Engine) -> str | None:
    """The file of a SQLite file store, whose writers queue; None for other stores (PostgreSQL queues writers
    itself, an in-memory SQLite store has one connection)."""
    db = engine.url.database
    return db if engine.dialect.name == "sqlite" and db and db != ":memory:" else None


def holds_turn(path: str) -> bool:
    """Whether this thread holds the turn of the queue whose lock file is `path`."""
    return path in getattr(_held, "paths", ())


class WriterQueue:
    """An exclusive file lock (and, within the process, a thread lock) taken around write transactions."""

    def __init__(self, store_path: str) -> None:
        self.path = lock_path(store_path)
        self._fd: int | None = None
        self._threads = threading.RLock()
        self._depth = 0  # turns this thread holds (a nested turn neither waits nor releases)

    @classmethod
    def for_engine(cls, engine: Engine) -> WriterQueue | None:
        """The queue of a SQLite file store (`store_file`); None for other stores."""
        db = store_file(engine)
        return None if db is None else cls(db)

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the queue's lock for the duration of the block."""
        with self._threads:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                _held.paths = getattr(_held, "paths", frozenset()) | {self.path}
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    _held.paths = _held.paths - {self.path}
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the lock file."""
        with self._threads:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
