"""Backing up and restoring a SQLite store with SQLite's online backup API (consistent while in use)."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.ops import require_admin
from vgpu_ctl.service.leases import pid_runs
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


def _clean_stale_temps(dest: Path) -> None:
    """Remove what earlier copies to `dest` that were killed left behind (their process no longer runs)."""
    for tmp in dest.parent.glob(f".{dest.name}.*.tmp"):
        pid = tmp.name[len(dest.name) + 2:-4]
        if pid.isdigit() and (int(pid) == os.getpid() or not pid_runs(int(pid))):
            tmp.unlink(missing_ok=True)


def _copy(src: sqlite3.Connection, dest: Path) -> None:
    """Copy `src` into a new private (0600) file next to `dest` and move it into place, so `dest` is whole or
    untouched; temp files of earlier copies that were killed are removed first."""
    _clean_stale_temps(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
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
    """Write a consistent copy of the store to `dest` (replacing it), readable by its owner only (0600, in a
    0700 folder if the folder is new); what was written (admin only)."""
    require_admin(ctl, "db backup")
    source = store_path(ctl)
    if dest.resolve() == source.resolve():
        raise InvalidInput(f"the backup file {dest} is the store itself; choose another path")
    if not dest.parent.exists():
        dest.parent.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            dest.parent.mkdir(mode=0o700)
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


_CHECK = re.compile(r"CONSTRAINT\s+(\w+)\s+CHECK\s*\(", re.IGNORECASE)


def _checks(sql: str) -> set[tuple[str, str]]:
    """The named CHECK constraints of a CREATE TABLE statement, each with its expression (spaces dropped)."""
    out = set()
    for m in _CHECK.finditer(sql):
        depth, i = 1, m.end()
        while i < len(sql) and depth:
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            i += 1
        out.add((m.group(1), re.sub(r"\s+", "", sql[m.end():i - 1])))
    return out


def schema_of(conn: sqlite3.Connection) -> dict[str, Any]:
    """What a store's schema is made of, in a form two stores can be compared by: per table its columns
    (name, type, not null, default, key), indexes (unique, columns), foreign keys and named CHECK constraints,
    and the triggers with their statements."""
    out: dict[str, Any] = {}
    for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' "
                                  "AND name NOT LIKE 'sqlite_%'"):
        q = name.replace('"', '""')
        cols = {(r[1], str(r[2]).upper(), r[3], r[4], r[5]) for r in conn.execute(f'PRAGMA table_info("{q}")')}
        idx = {(r[2], tuple(c[2] for c in conn.execute(f'PRAGMA index_info("{r[1]}")')))
               for r in conn.execute(f'PRAGMA index_list("{q}")')}
        fks = {(r[2], r[3], r[4]) for r in conn.execute(f'PRAGMA foreign_key_list("{q}")')}
        out[f"table {name}"] = {"columns": cols, "indexes": idx, "foreign keys": fks, "checks": _checks(sql or "")}
    for name, table, sql in conn.execute("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger'"):
        out[f"trigger {name}"] = {"table": table, "sql": re.sub(r"\s+", " ", sql or "").strip()}
    return out


@contextlib.contextmanager
def _reference(rev: str) -> Any:
    """A connection to an empty store built by this code's migrations up to `rev`."""
    from alembic import command

    from vgpu_ctl.store.engine import make_engine
    with tempfile.TemporaryDirectory(prefix="vgpu-ctl-schema-") as tmp:
        path = Path(tmp) / "reference.db"
        engine = make_engine(f"sqlite:///{path}")
        try:
            command.upgrade(migrate.alembic_config(engine), rev)
        finally:
            engine.dispose()
        conn = sqlite3.connect(path)
        try:
            yield conn
        finally:
            conn.close()


def verify_schema(path: Path, rev: str) -> None:
    """InvalidInput naming what differs unless the store file's schema is exactly what this code's
    migrations make at revision `rev` (columns, keys, indexes, constraints, the overlap triggers)."""
    with _reference(rev) as ref:
        want = schema_of(ref)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        have = schema_of(conn)
    finally:
        conn.close()
    diffs: list[dict[str, Any]] = []
    for obj in sorted(set(want) | set(have)):
        if obj not in have:
            diffs.append({"object": obj, "problem": "missing"})
        elif obj not in want:
            diffs.append({"object": obj, "problem": "not in this schema"})
        else:
            for part in want[obj]:
                if want[obj][part] != have[obj][part]:
                    if isinstance(want[obj][part], set):
                        lost = sorted(map(str, want[obj][part] - have[obj][part]))
                        extra = sorted(map(str, have[obj][part] - want[obj][part]))
                        diffs.append({"object": obj, "problem": f"{part} differ", "missing": lost, "extra": extra})
                    else:
                        diffs.append({"object": obj, "problem": f"{part} differs"})
    if diffs:
        shown = "; ".join(f"{d['object']}: {d['problem']}" + (f" (missing {', '.join(d['missing'][:3])})"
                                                               if d.get("missing") else "") for d in diffs[:5])
        raise InvalidInput(f"{path} does not have the schema of revision {rev}: {shown}"
                           f"{'; ...' if len(diffs) > 5 else ''}; nothing was restored",
                           reasons=[{"field": "file", "value": str(path), **d} for d in diffs])


def restore(ctl: Controller, src_path: Path) -> dict[str, Any]:
    """Replace the store with a backup file in one transaction (SQLite's backup API into the live store, so
    processes that have it open see the old or the new store, never a mix), then upgrade its schema if it is
    older. Refuses files that are not vgpu-ctl stores, are from a newer schema, or whose schema differs in
    any column, key, constraint or trigger from what its revision should be (admin only). Works on a broken
    store: open the controller with `init=False`."""
    require_admin(ctl, "db restore")
    target = store_path(ctl)
    rev = inspect_file(src_path)
    if src_path.resolve() == target.resolve():
        raise InvalidInput(f"{src_path} is the store itself; nothing to restore")
    verify_schema(src_path, rev)
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
    ctl.init()  # the schema and the GPUs' fit masks brought up to this code
    return {"store": str(target), "file": str(src_path), "restored_schema": rev,
            "schema": migrate.head_revision()}
