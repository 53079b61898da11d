"""Opening the state store: SQLite by default (WAL, busy timeout, foreign keys), PostgreSQL by URL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlmodel import create_engine

from vgpu_ctl.store.prepared import Prepared

DATABASE_URL_ENV = "VGPU_CTL_DATABASE_URL"
_BEGIN_IMMEDIATE = Prepared(text("BEGIN IMMEDIATE"))
STATE_DIR_ENV = "VGPU_CTL_STATE_DIR"


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
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None})
        _sqlite_pragmas(engine)
        return engine
    return create_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    # Writers take the lock when the transaction starts, so two claims never deadlock on an upgrade.
    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        _BEGIN_IMMEDIATE.run(conn)
