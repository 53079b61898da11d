"""Electing the one server that runs the loops: on PostgreSQL a session advisory lock (held while the
leader's connection lives, so a killed leader loses it at once), on SQLite a file lock beside the store (one
machine; the kernel drops it when the process dies)."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
from typing import Protocol

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

LOCK_KEY = 0x76677075  # "vgpu": the advisory lock's key space, the same for every replica of a store


def lock_key(schema: str) -> int:
    """The advisory lock's key for the store in `schema`: advisory locks are per database, and two stores in
    two schemas of one database (two deployments, or parallel tests) must not share a leader."""
    digest = hashlib.blake2b(f"{LOCK_KEY}:{schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)  # a bigint, as pg_try_advisory_lock takes


class Elector(Protocol):
    """A lock only one server of a store holds at a time."""

    def try_lead(self) -> bool:
        """Take the lock if free (or keep it); whether this process holds it now."""
        ...

    def resign(self) -> None:
        """Let the lock go."""
        ...


class AdvisoryLockElector:
    """PostgreSQL: `pg_try_advisory_lock` on a connection kept open for as long as this process leads."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Connection | None = None
        self._key: int | None = None

    def try_lead(self) -> bool:
        """Take the lock if free (or check it is still held); whether this process holds it."""
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                self._conn.commit()  # never left idle in a transaction (a server may time those out)
                return True
            except Exception:  # the connection died: the server released the lock with it
                self.resign()
        conn = self._engine.connect()
        try:
            if self._key is None:
                self._key = lock_key(str(conn.execute(text("SELECT current_schema()")).scalar()))
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self._key}).scalar())
            conn.commit()
        except Exception:
            conn.close()
            raise
        if got:
            self._conn = conn
        else:
            conn.close()
        return got

    def resign(self) -> None:
        """Unlock and close the connection (closing it alone would unlock too)."""
        if self._conn is None:
            return
        try:
            self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
            self._conn.commit()
        except Exception:
            pass
        finally:
            self._conn.close()
            self._conn = None


class FileLockElector:
    """SQLite: an exclusive `flock` on a file beside the store."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def try_lead(self) -> bool:
        """Take the lock if free (or keep it); whether this process holds it."""
        if self._fd is not None:
            return True
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def resign(self) -> None:
        """Unlock and close the file."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def elector_for(engine: Engine, state_dir: Path) -> Elector:
    """The election that suits the store: an advisory lock on PostgreSQL, else a file lock."""
    if engine.dialect.name == "postgresql":
        return AdvisoryLockElector(engine)
    db = engine.url.database
    path = Path(f"{db}.leader") if db and db != ":memory:" else state_dir / "server.leader"
    return FileLockElector(path)
