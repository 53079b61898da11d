"""Schema migrations (Alembic), run in-process by `vgpuctl init` and on open.

Opening a store whose schema is already at head costs one SELECT: the head revision is read from the
migration files' `revision` / `down_revision` lines (no Alembic import), and Alembic runs only when the stored
revision differs from it.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from vgpu_ctl.store.engine import READS

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"
_ASSIGN = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic config of the migrations folder, bound to `engine` when one is given."""
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        cfg.attributes["engine"] = engine
    return cfg


@lru_cache(maxsize=1)
def _file_head() -> str | None:
    """The head revision read from the migration files' `revision = ...` and `down_revision = ...` lines, or
    None when the files do not say it plainly (several heads, a computed value): Alembic then decides."""
    revisions: set[str] = set()
    downs: set[str] = set()
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        found = dict(_ASSIGN.findall(path.read_text()))
        try:
            rev = ast.literal_eval(found["revision"])
            down = ast.literal_eval(found.get("down_revision", "None"))
        except (KeyError, ValueError, SyntaxError):
            return None
        if not isinstance(rev, str):
            return None
        revisions.add(rev)
        downs.update([down] if isinstance(down, str) else down or ())
    heads = revisions - downs
    return heads.pop() if len(heads) == 1 else None


def head_revision() -> str:
    """The newest schema revision this code knows."""
    if (head := _file_head()) is not None:
        return head
    from alembic.script import ScriptDirectory
    found = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert found is not None
    return found


def known_revisions() -> set[str]:
    """Every revision this code can read."""
    from alembic.script import ScriptDirectory
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def _stored_revisions(engine: Engine) -> list[str] | None:
    """The revisions in the store's `alembic_version` table; None when it has none (a new store)."""
    try:  # a read: on SQLite it must not take the write lock (every store open asks this)
        with engine.connect().execution_options(**{READS: True}) as conn:
            return [str(r[0]) for r in conn.execute(text("SELECT version_num FROM alembic_version"))]
    except DBAPIError:  # no such table: a store that was never migrated
        return None


def at_head(engine: Engine) -> bool:
    """True when the store's schema is at this code's head revision (one SELECT, no Alembic)."""
    head = _file_head()
    return head is not None and _stored_revisions(engine) == [head]


def upgrade(engine: Engine) -> None:
    """Bring the store's schema to the newest revision (at once, without Alembic, when it is there already)."""
    if at_head(engine):
        return
    from alembic import command
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
    if at_head(engine):
        return
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise PermissionDenied(f"the store's schema is at revision {current or 'none'}, this vgpu-ctl needs {head}; "
                               "the admin must run `vgpuctl init` first",
                               reasons=[{"field": "schema", "value": current}])
