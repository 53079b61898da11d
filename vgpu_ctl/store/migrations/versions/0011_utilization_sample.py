"""utilization sample: each GPU host's last NVML sample as the server's leader took it

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 17:40:00

The leader samples NVML on the GPU hosts every `utilization_interval_s` and keeps, per host, the whole sample the
metrics need (`sample`: each GPU's utilization, framebuffer, power, temperature and XID errors; each vGPU's and
MIG instance's values with its mdev or VF, device (claim), VM, tenant and pool; each allocated vGPU's idle marks),
when it was taken (`sampled_at`), the last try (`attempted_at`, `error`) and the interval (`interval_s`), so that
every replica's /metrics reads the same numbers without calling a host. Rows go with their host.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('utilization_sample',
                    sa.Column('host_id', sa.Integer(), nullable=False),
                    sa.Column('attempted_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.Column('sampled_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
                    sa.Column('error', sa.String(), nullable=True),
                    sa.Column('interval_s', sa.Float(), nullable=False),
                    sa.Column('sample', sa.JSON(), nullable=True),
                    sa.CheckConstraint('interval_s > 0', name='utilization_sample_interval_pos'),
                    sa.ForeignKeyConstraint(['host_id'], ['host.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('host_id'))


def downgrade() -> None:
    op.drop_table('utilization_sample')
