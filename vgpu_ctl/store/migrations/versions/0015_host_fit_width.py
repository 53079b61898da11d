"""host summaries know their host's width: `host_fit.gpus`, and whole-host pages for pack widest first

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 02:10:00

- `host_fit.gpus`: how many GPUs the host has in the row's pool with its model and mode, whether they can take the
  row's profile now or not (the host's width, `HostView.gpu_count` of a whole-host view). pack prices the room a
  placement takes by the typical tasks the host could ever run, and a wider host runs more of them (those asking
  for more GPUs), so of two hosts otherwise alike it fills the wider; its candidate pages read hosts widest first.
- Kept by triggers in the transaction of the write, recounted from the GPU rows: on a `host_fit` row's insert (a
  claim meets a new profile bit; a rebuild of the summaries), and on a GPU's insert, delete, or move to another
  host, pool, model or mode (inventory changes; claims and releases write none of those columns, so they pay
  nothing for it).
- `host_fit_by_width` (pool, model, mode, bit, gpus descending, mean free units of the GPUs that can take the
  profile, host; `n_fit > 0`): the order of pack's pages, read from the index as `host_fit_by_free` is for the
  other policies.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_GROUP = ("host_id = {r}.host_id AND pool_id = {r}.pool_id AND model = {r}.model AND mode = {r}.mode")


def _recount(r: str, row: str = "") -> str:
    """Set `gpus` of the host_fit rows of r's host, pool, model and mode (only the row `row` picks, if given) to
    the GPUs there; a statement for SQLite trigger bodies and PL/pgSQL alike."""
    where = _GROUP.format(r=r) + (f" AND {row}" if row else "")
    return (f"UPDATE host_fit SET gpus = (SELECT count(*) FROM gpu g WHERE g.host_id = {r}.host_id "
            f"AND g.pool_id = {r}.pool_id AND g.model = {r}.model AND g.mode = {r}.mode) WHERE {where}")


_NEW_ROW = _recount("NEW", "bitval = NEW.bitval")
_MOVED = ("OLD.host_id <> NEW.host_id OR OLD.model <> NEW.model OR OLD.mode <> NEW.mode "
          "OR OLD.pool_id IS NOT NEW.pool_id")

_SQLITE_TRIGGERS = [
    f"CREATE TRIGGER host_fit_width_insert AFTER INSERT ON host_fit FOR EACH ROW BEGIN {_NEW_ROW}; END",
    f"CREATE TRIGGER gpu_width_insert AFTER INSERT ON gpu FOR EACH ROW WHEN NEW.pool_id IS NOT NULL "
    f"BEGIN {_recount('NEW')}; END",
    f"CREATE TRIGGER gpu_width_delete AFTER DELETE ON gpu FOR EACH ROW WHEN OLD.pool_id IS NOT NULL "
    f"BEGIN {_recount('OLD')}; END",
    f"CREATE TRIGGER gpu_width_update AFTER UPDATE OF host_id, pool_id, model, mode ON gpu FOR EACH ROW "
    f"WHEN {_MOVED} BEGIN {_recount('OLD')}; {_recount('NEW')}; END",
]
_PG_STATEMENTS = [
    f"""CREATE FUNCTION vgpu_host_fit_width_row() RETURNS trigger AS $$
BEGIN
  {_NEW_ROW};
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER host_fit_width AFTER INSERT ON host_fit FOR EACH ROW EXECUTE FUNCTION
vgpu_host_fit_width_row()""",
    f"""CREATE FUNCTION vgpu_gpu_width() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF NOT ({_MOVED.replace('IS NOT NEW', 'IS DISTINCT FROM NEW')}) THEN
      RETURN NULL;
    END IF;
  END IF;
  IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.pool_id IS NOT NULL THEN
    {_recount('OLD')};
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.pool_id IS NOT NULL THEN
    {_recount('NEW')};
  END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER gpu_width AFTER INSERT OR DELETE OR UPDATE OF host_id, pool_id, model, mode ON gpu
FOR EACH ROW EXECUTE FUNCTION vgpu_gpu_width()""",
]
_FILL = ("UPDATE host_fit SET gpus = (SELECT count(*) FROM gpu g WHERE g.host_id = host_fit.host_id "
         "AND g.pool_id = host_fit.pool_id AND g.model = host_fit.model AND g.mode = host_fit.mode)")


def upgrade() -> None:
    op.add_column('host_fit', sa.Column('gpus', sa.Integer(), nullable=False, server_default='0'))
    op.create_index('host_fit_by_width', 'host_fit', ['pool_id', 'model', 'mode', 'bitval', sa.text('gpus DESC'),
                                                      sa.text('(CAST(free_units AS FLOAT) / n_fit)'), 'host_id'],
                    sqlite_where=sa.text('n_fit > 0'), postgresql_where=sa.text('n_fit > 0'))
    op.execute(_FILL)
    for statement in (_SQLITE_TRIGGERS if op.get_bind().dialect.name == 'sqlite' else _PG_STATEMENTS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for name in ('host_fit_width_insert', 'gpu_width_insert', 'gpu_width_delete', 'gpu_width_update'):
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
    else:
        op.execute('DROP TRIGGER IF EXISTS gpu_width ON gpu')
        op.execute('DROP TRIGGER IF EXISTS host_fit_width ON host_fit')
        op.execute('DROP FUNCTION IF EXISTS vgpu_gpu_width()')
        op.execute('DROP FUNCTION IF EXISTS vgpu_host_fit_width_row()')
    op.drop_index('host_fit_by_width', table_name='host_fit')
    # In place on both engines: a batch would recreate the table under the triggers of 0009 that write it.
    op.execute('ALTER TABLE host_fit DROP COLUMN gpus')
