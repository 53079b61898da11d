"""Opening the state store: SQLite by default (WAL, busy timeout, foreign keys), PostgreSQL by URL."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DisconnectionError
from sqlmodel import create_engine

from vgpu_ctl.store.prepared import Prepared
from vgpu_ctl.store.writer_queue import holds_turn, lock_path, store_file

DATABASE_URL_ENV = "VGPU_CTL_DATABASE_URL"
_BEGIN_IMMEDIATE = Prepared(text("BEGIN IMMEDIATE"))
_BEGIN_DEFERRED = Prepared(text("BEGIN"))
READS = "vgpu_ctl_reads"  # execution option of a connection for reads (`Database.read`)
STATE_DIR_ENV = "VGPU_CTL_STATE_DIR"
PING_AFTER_IDLE_S = 1.0  # a pooled connection idle longer than this is pinged before it is handed out


def state_dir() -> Path:
    """The folder for local state: $VGPU_CTL_STATE_DIR, else $XDG_STATE_HOME/vgpu-ctl, else ~/.local/state/vgpu-ctl."""
    if env := os.environ.get(STATE_DIR_ENV):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vgpu-ctl"


def default_url() -> str:
    """The store URL: $VGPU_CTL_DATABASE_URL, else SQLite at `state_dir()/vgpu-ctl.db`."""
    return os.environ.get(DATABASE_URL_ENV) or f"sqlite:///{state_dir() / 'vgpu-ctl.db'}"


def is_sqlite(engine: Engine) -> bool:
    """True when the store is SQLite."""
    return engine.dialect.name == "sqlite"


def make_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: `default_url()`), with SQLite set up for several processes."""
    url = url or default_url()
    parsed = make_url(url)
    if parsed.drivername.startswith("postgresql") and parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    if parsed.drivername.startswith("sqlite"):
        if parsed.database and parsed.database != ":memory:":
            private_store_file(Path(parsed.database))
        engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None})
        _sqlite_pragmas(engine)
        return engine
    engine = create_engine(url)
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Hand out a pooled connection as it is when it was given back less than PING_AFTER_IDLE_S ago, and ping
    it first otherwise, replacing it when the ping fails. What kills a connection in a pool (a server restart,
    an idle timeout, a firewall) finds it idle; pinging on every checkout, as SQLAlchemy's pool_pre_ping does,
    costs a round trip per request on a busy store. A connection given back within the second that the server
    then dropped fails its first statement, as one in use at that moment does, and SQLAlchemy then discards
    the pool's connections of before."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["given_back"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        given_back = record.info.get("given_back")  # absent on a connection just made
        if given_back is None or time.monotonic() - given_back < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:  # the pool retries with a new connection
            raise DisconnectionError(f"connection idle {time.monotonic() - given_back:.0f} s failed its ping: "
                                     f"{exc}") from exc


def private_store_file(db: Path) -> None:
    """Make a SQLite store file only its owner can read: a new folder for it is created 0700, a new store
    file 0600 (SQLite gives its WAL and shared-memory files the store's mode), and an existing store, WAL or
    shared-memory file of ours that others could read is made 0600."""
    if not db.parent.exists():
        db.parent.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            db.parent.mkdir(mode=0o700)
    os.close(os.open(db, os.O_CREAT | os.O_RDWR, 0o600))
    for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        with contextlib.suppress(OSError):
            st = f.stat()
            if st.st_mode & 0o077 and st.st_uid == os.getuid():
                f.chmod(st.st_mode & 0o700 | 0o600)


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    db = store_file(engine)
    queue = None if db is None else lock_path(db)

    # Writers take the lock when the transaction starts, so two claims never deadlock on an upgrade. A
    # connection for reads (READS) outside this thread's writer turn begins a plain WAL read instead: BEGIN
    # IMMEDIATE would hold SQLite's write lock for as long as the read lasts (a `status` of 100k GPUs, a metrics
    # scrape), and every writer would wait for it.
    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if queue is not None and conn.get_execution_options().get(READS) and not holds_turn(queue):
            _BEGIN_DEFERRED.run(conn)
        else:
            _BEGIN_IMMEDIATE.run(conn)
