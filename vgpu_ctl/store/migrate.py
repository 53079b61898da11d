"""Schema migrations (Alembic), run in-process by `vgpuctl init` and on open."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    """An Alembic config bound to `engine`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    """The newest schema revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config_dummy()).get_current_head()
    assert head is not None
    return head


def alembic_config_dummy() -> Config:
    """An Alembic config without an engine, for reading the script folder."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def current_revision(engine: Engine) -> str | None:
    """The schema revision of the store, or None when it was never initialised."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def known_revisions() -> set[str]:
    """Every revision this code can read."""
    return {s.revision for s in ScriptDirectory.from_config(alembic_config_dummy()).walk_revisions()}


def upgrade(engine: Engine) -> None:
    """Bring the store's schema to the newest revision."""
    command.upgrade(alembic_config(engine), "head")
