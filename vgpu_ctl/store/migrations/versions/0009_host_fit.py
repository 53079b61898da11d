"""host fit summaries: per host, pool, model, mode and profile bit, how many GPUs can take it and their free units

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 17:30:00

- `fit_bit`: the 63 bits of a fit mask (`core.geometry.FIT_BITS`), one row each, so that SQL can split a mask.
- `host_fit`: per host, pool, GPU model, mode and fit-mask bit (a profile of that geometry), `n_fit` (how many of
  the host's GPUs in the pool can take the profile now) and `free_units` (their free units together). Triggers on
  `gpu` keep it in the same transaction as any write of a GPU's fit mask, free units, pool, host, model or mode
  (claims, releases, re-carving, inventory apply, fit-mask refreshes), so no writer can forget it. A request for
  k GPUs, or a policy that scores whole hosts, then reads one row per candidate host from the partial indexes
  (`n_fit > 0`) in the policy's order instead of grouping all of the pool's GPUs.
Rows whose `n_fit` fell to 0 stay (out of the indexes) until their host's GPUs are deleted.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FIT_BITS = 63  # core.geometry.FIT_BITS at this revision
_KEY = "host_id, pool_id, model, mode, bitval"

# Take a GPU row's contribution off (r = OLD) or put it on (r = NEW); SQLite trigger bodies and PL/pgSQL alike.
def _off(r: str) -> str:
    return (f"UPDATE host_fit SET n_fit = n_fit - 1, free_units = free_units - {r}.free_units "
            f"WHERE host_id = {r}.host_id AND pool_id = {r}.pool_id AND model = {r}.model AND mode = {r}.mode "
            f"AND (bitval & {r}.fits) <> 0")


def _on(r: str) -> str:
    return (f"INSERT INTO host_fit ({_KEY}, n_fit, free_units) SELECT {r}.host_id, {r}.pool_id, {r}.model, "
            f"{r}.mode, b.bitval, 1, {r}.free_units FROM fit_bit b WHERE ({r}.fits & b.bitval) <> 0 "
            f"AND {r}.pool_id IS NOT NULL ON CONFLICT ({_KEY}) DO UPDATE SET n_fit = host_fit.n_fit + 1, "
            f"free_units = host_fit.free_units + excluded.free_units")


_COUNTED = ("{r}.pool_id IS NOT NULL AND {r}.fits <> 0")
_CHANGED = ("OLD.fits <> NEW.fits OR OLD.free_units <> NEW.free_units OR OLD.host_id <> NEW.host_id "
            "OR OLD.model <> NEW.model OR OLD.mode <> NEW.mode OR OLD.pool_id IS NOT NEW.pool_id")
_DROP_EMPTY = "DELETE FROM host_fit WHERE host_id = OLD.host_id AND n_fit = 0"

_SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER gpu_host_fit_insert AFTER INSERT ON gpu FOR EACH ROW WHEN {_COUNTED.format(r='NEW')}
BEGIN {_on('NEW')}; END""",
    f"""CREATE TRIGGER gpu_host_fit_delete AFTER DELETE ON gpu FOR EACH ROW
BEGIN {_off('OLD')}; {_DROP_EMPTY}; END""",
    f"""CREATE TRIGGER gpu_host_fit_update AFTER UPDATE OF fits, free_units, pool_id, host_id, model, mode ON gpu
FOR EACH ROW WHEN {_CHANGED}
BEGIN {_off('OLD')}; {_on('NEW')}; END""",
]
_PG_STATEMENTS = [
    f"""CREATE FUNCTION vgpu_host_fit() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF NOT ({_CHANGED.replace('IS NOT NEW', 'IS DISTINCT FROM NEW')}) THEN
      RETURN NULL;
    END IF;
  END IF;
  IF TG_OP IN ('UPDATE', 'DELETE') AND {_COUNTED.format(r='OLD')} THEN
    {_off('OLD')};
  END IF;
  IF TG_OP = 'DELETE' THEN
    {_DROP_EMPTY};
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') AND {_COUNTED.format(r='NEW')} THEN
    {_on('NEW')};
  END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER gpu_host_fit AFTER INSERT OR DELETE OR UPDATE OF fits, free_units, pool_id, host_id, model,
mode ON gpu FOR EACH ROW EXECUTE FUNCTION vgpu_host_fit()""",
]

REBUILD = (f"INSERT INTO host_fit ({_KEY}, n_fit, free_units) SELECT g.host_id, g.pool_id, g.model, g.mode, "
           "b.bitval, count(*), sum(g.free_units) FROM gpu g JOIN fit_bit b ON (g.fits & b.bitval) <> 0 "
           "WHERE g.pool_id IS NOT NULL GROUP BY g.host_id, g.pool_id, g.model, g.mode, b.bitval")


def upgrade() -> None:
    op.create_table('fit_bit',
                    sa.Column('bit', sa.Integer(), nullable=False),
                    sa.Column('bitval', sa.BigInteger(), nullable=False),
                    sa.PrimaryKeyConstraint('bit'),
                    sa.UniqueConstraint('bitval', name='fit_bit_value_unique'))
    op.bulk_insert(sa.table('fit_bit', sa.column('bit', sa.Integer()), sa.column('bitval', sa.BigInteger())),
                   [{'bit': b, 'bitval': 1 << b} for b in range(FIT_BITS)])
    op.create_table('host_fit',
                    sa.Column('host_id', sa.Integer(), nullable=False),
                    sa.Column('pool_id', sa.Integer(), nullable=False),
                    sa.Column('model', sa.String(), nullable=False),
                    sa.Column('mode', sa.String(), nullable=False),
                    sa.Column('bitval', sa.BigInteger(), nullable=False),
                    sa.Column('n_fit', sa.Integer(), nullable=False),
                    sa.Column('free_units', sa.BigInteger(), nullable=False),
                    sa.CheckConstraint('n_fit >= 0 AND free_units >= 0', name='host_fit_nonneg'),
                    sa.PrimaryKeyConstraint('host_id', 'pool_id', 'model', 'mode', 'bitval'))
    with op.batch_alter_table('host_fit') as batch_op:
        batch_op.create_index('host_fit_by_free', ['pool_id', 'model', 'mode', 'bitval', 'free_units', 'host_id'],
                              sqlite_where=sa.text('n_fit > 0'), postgresql_where=sa.text('n_fit > 0'))
        batch_op.create_index('host_fit_by_host', ['pool_id', 'model', 'mode', 'bitval', 'host_id'],
                              sqlite_where=sa.text('n_fit > 0'), postgresql_where=sa.text('n_fit > 0'))
    op.execute(REBUILD)
    for statement in (_SQLITE_TRIGGERS if op.get_bind().dialect.name == 'sqlite' else _PG_STATEMENTS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for name in ('gpu_host_fit_insert', 'gpu_host_fit_delete', 'gpu_host_fit_update'):
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
    else:
        op.execute('DROP TRIGGER IF EXISTS gpu_host_fit ON gpu')
        op.execute('DROP FUNCTION IF EXISTS vgpu_host_fit()')
    op.drop_table('host_fit')
    op.drop_table('fit_bit')
