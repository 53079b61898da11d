"""host summaries' width is counted from the host's own GPUs, not by scanning its pool

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 12:50:00

0015's triggers count a host's GPUs with `gpu.host_id = ? AND gpu.pool_id = ? AND model = ? AND mode = ?`. Without
statistics (SQLite keeps none unless ANALYZE runs) SQLite read that through `gpu_candidates` (pool, mode, model):
every GPU of the pool for each GPU inserted, so `inventory apply` of 100k GPUs in three pools took 27 minutes
(988 s of CPU) instead of 19 s. The count now writes `pool_id + 0`, which no index serves, so both engines read
the host's GPUs through the unique (host_id, pci_address) index: eight rows, not a pool.
"""

import runpy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alembic import op

revision: str = '0018'
down_revision: str | None = '0017'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BY_POOL = "g.pool_id = "
_BY_HOST = "g.pool_id + 0 = "
_SQLITE_NAMES = ('host_fit_width_insert', 'gpu_width_insert', 'gpu_width_delete', 'gpu_width_update')


def _width() -> dict[str, Any]:
    """The names of migration 0015, whose trigger statements this one rewrites and a downgrade puts back."""
    return runpy.run_path(str(Path(__file__).with_name("0015_host_fit_width.py")))


def _statements(by_host: bool) -> list[str]:
    m = _width()
    sqlite = op.get_bind().dialect.name == 'sqlite'
    out = []
    for s in m["_SQLITE_TRIGGERS"] if sqlite else m["_PG_STATEMENTS"]:
        if not sqlite and not s.startswith("CREATE FUNCTION"):
            continue  # the PostgreSQL triggers call the functions, which are replaced in place
        assert _BY_POOL in s, "0015's statement as this migration knows it"
        out.append((s.replace(_BY_POOL, _BY_HOST) if by_host else s)
                   .replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    return out


def _replace(by_host: bool) -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for name in _SQLITE_NAMES:
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
    for statement in _statements(by_host):
        op.execute(statement)


def upgrade() -> None:
    _replace(by_host=True)


def downgrade() -> None:
    _replace(by_host=False)
