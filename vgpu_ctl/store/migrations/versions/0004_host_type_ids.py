"""host type ids: what each host calls each profile on each GPU

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 12:20:00

Discovery (`inventory apply` of a libvirt host, `host discover --write`) records per GPU the mdev type id
(`nvidia-558`), the vendor-VFIO type id and the NVML GPU-instance profile id of each catalog profile it found;
provisioning takes the ids from here. Rows go with their GPU (ON DELETE CASCADE).
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('gpu_type_id',
                    sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('gpu_id', sa.Integer(), nullable=False),
                    sa.Column('kind', sa.String(), nullable=False),
                    sa.Column('profile', sa.String(), nullable=False),
                    sa.Column('type_id', sa.String(), nullable=False),
                    sa.Column('seen_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint("kind IN ('mdev', 'vfio', 'mig')", name='gpu_type_id_kind_known'),
                    sa.ForeignKeyConstraint(['gpu_id'], ['gpu.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('id'),
                    sa.UniqueConstraint('gpu_id', 'kind', 'profile', name='gpu_type_id_unique'))


def downgrade() -> None:
    op.drop_table('gpu_type_id')
