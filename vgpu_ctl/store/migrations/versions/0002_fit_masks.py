"""fit masks: gpu.fits, a meta table; drop indexes that a unique constraint already covers

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 19:05:00

GPUs get the fit mask of their occupancy (which profiles could still be added). It is not in the candidate
index: the index's order (free_units, then id, the host order) is what lets a page query stop after a page;
the mask is tested on the rows the range walk reads. The masks are computed by
the controller when it opens the store (`service.fit_masks.ensure_fit_masks`), because they depend on the
catalog; the meta table records which catalog they were computed with.

Four single-column indexes repeat the first column of a unique constraint on the same table (vm.tenant_id,
device.gpu_id, gpu.host_id, scoped_quota.tenant_id); each cost a page write on every claim or release.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REDUNDANT = (('vm', 'tenant_id'), ('device', 'gpu_id'), ('gpu', 'host_id'), ('scoped_quota', 'tenant_id'))


def upgrade() -> None:
    op.create_table('meta',
                    sa.Column('key', sa.String(), nullable=False),
                    sa.Column('value', sa.String(), nullable=False),
                    sa.PrimaryKeyConstraint('key'))
    with op.batch_alter_table('gpu', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fits', sa.BigInteger(), server_default='0', nullable=False))
    for table, column in REDUNDANT:
        op.drop_index(f'ix_{table}_{column}', table_name=table)


def downgrade() -> None:
    for table, column in REDUNDANT:
        op.create_index(f'ix_{table}_{column}', table, [column], unique=False)
    # Not a batch (copy-and-drop) on SQLite: with foreign keys on, dropping gpu fails once devices exist.
    op.execute('ALTER TABLE gpu DROP COLUMN fits')
    op.drop_table('meta')
