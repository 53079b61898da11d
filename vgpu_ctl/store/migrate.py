"""Schema migrations (Alembic), run in-process by `vgpuctl init` and on open."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic config of the migrations folder, bound to `engine` when one is given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    """The newest schema revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> set[str]:
    """Every revision this code can read."""
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def upgrade(engine: Engine) -> None:
    """Bring the store's schema to the newest revision."""
    command.upgrade(alembic_config(engine), "head")


def current_revision(engine: Engine) -> str | None:
    """The revision the store's schema is at (None for an empty store)."""
    from alembic.runtime.migration import MigrationContext
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def require_head(engine: Engine) -> None:
    """PermissionDenied unless the store's schema is at this code's newest revision (only the admin
    upgrades it, with `vgpuctl init`)."""
    from vgpu_ctl.errors import PermissionDenied
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise PermissionDenied(f"the store's schema is at revision {current or 'none'}, this vgpu-ctl needs {head}; "
                               "the admin must run `vgpuctl init` first",
                               reasons=[{"field": "schema", "value": current}])
