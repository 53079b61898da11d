"""Backing up and restoring a SQLite store with SQLite's online backup API (consistent while in use)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.ops import require_admin
from vgpu_ctl.store import migrate

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

SQLITE_MAGIC = b"SQLite format 3\x00"
TABLES = frozenset({"alembic_version", "pool", "host", "gpu", "tenant", "scoped_quota", "vm", "device",
                    "event"})


@dataclass
class Unsupported(InvalidInput):
    """The store's backend can't do this; the message says what to use instead."""

    code: str = "unsupported"


def store_path(ctl: Controller) -> Path:
    """The file of a SQLite store; Unsupported (naming pg_dump / pg_restore) for any other store."""
    url = ctl.engine.url
    if url.get_backend_name() != "sqlite":
        raise Unsupported(f"db backup/restore supports SQLite stores only; this store is "
                          f"{url.get_backend_name()}. Use pg_dump (backup) and pg_restore or psql (restore) "
                          "for PostgreSQL.")
    if not url.database or url.database == ":memory:":
        raise Unsupported("the store is an in-memory SQLite database; there is no file to back up or restore")
    return Path(url.database)


def _copy(src: sqlite3.Connection, dest: Path) -> None:
    """Copy `src` into a new file next to `dest` and move it into place, so `dest` is whole or untouched."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        out = sqlite3.connect(tmp)
        try:
            src.backup(out)  # one step: a consistent snapshot, even while other processes write
            out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
        finally:
            out.close()
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def backup(ctl: Controller, dest: Path) -> dict[str, Any]:
    """Write a consistent copy of the store to `dest` (replacing it); what was written (admin only)."""
    require_admin(ctl, "db backup")
    source = store_path(ctl)
    if dest.resolve() == source.resolve():
        raise InvalidInput(f"the backup file {dest} is the store itself; choose another path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    try:
        _copy(src, dest)
    finally:
        src.close()
    return {"store": str(source), "file": str(dest), "bytes": dest.stat().st_size,
            "schema": inspect_file(dest)}


def inspect_file(path: Path) -> str:
    """The schema revision of a vgpu-ctl store file; InvalidInput saying why if we can't restore it."""
    if not path.is_file():
        raise InvalidInput(f"{path} does not exist or is not a file",
                           reasons=[{"field": "file", "value": str(path)}])
    with path.open("rb") as f:
        if f.read(16) != SQLITE_MAGIC:
            raise InvalidInput(f"{path} is not a SQLite database, so not a vgpu-ctl store",
                               reasons=[{"field": "file", "value": str(path)}])
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        try:
            if conn.execute("PRAGMA quick_check").fetchone() != ("ok",):
                raise InvalidInput(f"{path} is a damaged SQLite database (quick_check failed)")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            missing = sorted(TABLES - tables)
            if missing:
                raise InvalidInput(f"{path} is a SQLite database but not a vgpu-ctl store (missing tables: "
                                   f"{', '.join(missing)})", reasons=[{"field": "file", "missing": missing}])
            rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        except sqlite3.DatabaseError as exc:
            raise InvalidInput(f"{path} can't be read as a SQLite database: {exc}") from None
    finally:
        conn.close()
    if len(rows) != 1:
        raise InvalidInput(f"{path} has no schema revision (alembic_version holds {len(rows)} rows)")
    rev = str(rows[0][0])
    if rev not in migrate.known_revisions():
        raise InvalidInput(f"{path} has schema revision {rev!r}, which this vgpu-ctl does not know (it "
                           f"knows up to {migrate.head_revision()!r}); it was written by a newer vgpu-ctl: "
                           "upgrade vgpu-ctl to restore it", reasons=[{"field": "schema", "value": rev}])
    return rev


def restore(ctl: Controller, src_path: Path) -> dict[str, Any]:
    """Replace the store with a backup file in one transaction (SQLite's backup API into the live store, so
    processes that have it open see the old or the new store, never a mix), then upgrade its schema if it is
    older. Refuses files that are not vgpu-ctl stores or are from a newer schema (admin only)."""
    require_admin(ctl, "db restore")
    target = store_path(ctl)
    rev = inspect_file(src_path)
    if src_path.resolve() == target.resolve():
        raise InvalidInput(f"{src_path} is the store itself; nothing to restore")
    ctl.engine.dispose()
    src = sqlite3.connect(f"file:{src_path}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(target, timeout=30)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
    with contextlib.suppress(Exception):
        ctl.engine.dispose()
    migrate.upgrade(ctl.engine)
    return {"store": str(target), "file": str(src_path), "restored_schema": rev,
            "schema": migrate.head_revision()}
