"""gpu load: what each GPU was last measured doing, for the spread-load policy

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 16:20:00

The server's leader samples NVML on the GPU hosts on an interval (`utilization_interval_s`) and keeps each GPU's
measured load (0..1) here; a pool with policy `spread-load` places by it. Rows go with their GPU.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('gpu_load',
                    sa.Column('gpu_id', sa.Integer(), nullable=False),
                    sa.Column('busy', sa.Float(), nullable=False),
                    sa.Column('sampled_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint('busy >= 0 AND busy <= 1', name='gpu_load_ratio'),
                    sa.ForeignKeyConstraint(['gpu_id'], ['gpu.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('gpu_id'))


def downgrade() -> None:
    op.drop_table('gpu_load')
