"""vm move: how far each rebalance move has come, so a move a crash interrupted is finished or rolled back

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 18:05:00

`rebalance --apply` moves a VM by stop, re-place, start. Its row is written in the transaction that takes the VM's
lease (step `stopping`) and advanced in the transactions of its steps: `claimed` (the new positions and host room
taken beside the old ones: `to_host_id`, `new_devices`), `defined` (the domain defined at the new place,
`domain_uuid`), `done` (it runs there, or is defined there for a stopped VM); the transaction that frees the old
claim deletes it. `reconcile --fix` (and the server's leader) finds a row whose VM no live process holds and
finishes the move from `done`, or rolls it back before. Rows go with their VM.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('vm_move',
                    sa.Column('vm_id', sa.String(), nullable=False),
                    sa.Column('step', sa.String(), nullable=False),
                    sa.Column('from_host_id', sa.Integer(), nullable=False),
                    sa.Column('to_host_id', sa.Integer(), nullable=True),
                    sa.Column('old_devices', sa.JSON(), nullable=False),
                    sa.Column('new_devices', sa.JSON(), nullable=False),
                    sa.Column('was_running', sa.Boolean(), nullable=False),
                    sa.Column('domain_uuid', sa.String(), nullable=True),
                    sa.Column('params', sa.JSON(), nullable=False),
                    sa.Column('started_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.Column('updated_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint("step IN ('stopping', 'claimed', 'defined', 'done')", name='vm_move_step_known'),
                    sa.ForeignKeyConstraint(['vm_id'], ['vm.id'], ondelete='CASCADE'),
                    sa.ForeignKeyConstraint(['from_host_id'], ['host.id']),
                    sa.ForeignKeyConstraint(['to_host_id'], ['host.id']),
                    sa.PrimaryKeyConstraint('vm_id'))


def downgrade() -> None:
    op.drop_table('vm_move')
