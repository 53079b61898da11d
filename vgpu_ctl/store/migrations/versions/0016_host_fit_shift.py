"""host summaries: a GPU write that keeps its host, pool, model and mode touches each of its summary rows once

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 02:30:00

A claim or release changes a GPU's free units and fit mask, never its host, pool, model or mode. The trigger of
0009 then took the GPU off every `host_fit` row of its old mask and put it on every row of its new one: two
writes of each row the masks share (and of the row's indexes, three since 0015) and an upsert per new bit. Such a
write now shifts the rows in place: one UPDATE of each row of the old mask (free units moved to the new value,
`n_fit` less one where the new mask lost the bit) and an upsert only for bits the new mask gained. A GPU that
moves to another host, pool, model or mode, an insert and a delete keep 0009's off-and-on. On SQLite this is a
trigger of its own beside 0009's update trigger (which now skips such writes); on PostgreSQL, 0009's function
with the same branch.
"""

import runpy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SAME = "OLD.host_id = NEW.host_id AND OLD.model = NEW.model AND OLD.mode = NEW.mode AND OLD.pool_id IS NEW.pool_id"
_SHIFTED = "OLD.fits <> NEW.fits OR OLD.free_units <> NEW.free_units"
# The GPU's rows in place (OLD and NEW share host, pool, model and mode); SQLite trigger bodies and PL/pgSQL alike.
_SHIFT = ("UPDATE host_fit SET n_fit = n_fit - CASE WHEN (bitval & NEW.fits) = 0 THEN 1 ELSE 0 END, "
          "free_units = free_units - OLD.free_units "
          "+ CASE WHEN (bitval & NEW.fits) <> 0 THEN NEW.free_units ELSE 0 END "
          "WHERE host_id = OLD.host_id AND pool_id = OLD.pool_id AND model = OLD.model AND mode = OLD.mode "
          "AND (bitval & OLD.fits) <> 0")
_GAINED = ("INSERT INTO host_fit (host_id, pool_id, model, mode, bitval, n_fit, free_units) SELECT NEW.host_id, "
           "NEW.pool_id, NEW.model, NEW.mode, b.bitval, 1, NEW.free_units FROM fit_bit b "
           "WHERE (NEW.fits & b.bitval) <> 0 AND (OLD.fits & b.bitval) = 0 AND NEW.pool_id IS NOT NULL "
           "ON CONFLICT (host_id, pool_id, model, mode, bitval) DO UPDATE SET n_fit = host_fit.n_fit + 1, "
           "free_units = host_fit.free_units + excluded.free_units")


def _host_fit() -> dict[str, Any]:
    """The names of migration 0009, whose trigger statements this one adapts and a downgrade puts back."""
    return runpy.run_path(str(Path(__file__).with_name("0009_host_fit.py")))


def upgrade() -> None:
    m = _host_fit()
    if op.get_bind().dialect.name == 'sqlite':
        op.execute('DROP TRIGGER IF EXISTS gpu_host_fit_update')
        op.execute(f"""CREATE TRIGGER gpu_host_fit_update AFTER UPDATE OF fits, free_units, pool_id, host_id, model,
mode ON gpu FOR EACH ROW WHEN ({m["_CHANGED"]}) AND NOT ({_SAME})
BEGIN {m["_off"]('OLD')}; {m["_on"]('NEW')}; END""")
        op.execute(f"""CREATE TRIGGER gpu_host_fit_shift AFTER UPDATE OF fits, free_units ON gpu FOR EACH ROW
WHEN ({_SHIFTED}) AND {_SAME}
BEGIN {_SHIFT}; {_GAINED}; END""")
        return
    old = m["_PG_STATEMENTS"][0]
    moved = "  IF TG_OP IN ('UPDATE', 'DELETE')"
    assert old.count(moved) == 1, "0009's function as this migration knows it"
    same = _SAME.replace("IS NEW", "IS NOT DISTINCT FROM NEW")
    shift = (f"  IF TG_OP = 'UPDATE' AND {same} THEN\n"
             f"    IF OLD.pool_id IS NOT NULL THEN\n      {_SHIFT};\n      {_GAINED};\n    END IF;\n"
             f"    RETURN NULL;\n  END IF;\n")
    op.execute(old.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").replace(moved, shift + moved))


def downgrade() -> None:
    m = _host_fit()
    if op.get_bind().dialect.name == 'sqlite':
        op.execute('DROP TRIGGER IF EXISTS gpu_host_fit_shift')
        op.execute('DROP TRIGGER IF EXISTS gpu_host_fit_update')
        op.execute(m["_SQLITE_TRIGGERS"][2])
    else:
        op.execute(m["_PG_STATEMENTS"][0].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
