"""gpu lacks: the profiles a GPU's host has no type id for, kept out of its fit mask

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 17:30:00

`inventory apply` and `host discover --write` record what a libvirt host calls each profile; a profile the
GPU's declared mode needs but the host lacks (driver, mode, VFs) can't be provisioned there. `lacked_types`
keeps those profiles with what the admin can do (the finding of the apply), `lacks` their bits in the GPU's
fit mask (`core.geometry.profile_bit`); every write of `fits` leaves those bits out, so placement never picks
such a GPU for them. Both are empty on simulated hosts and until a discovery reads the host.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('gpu', sa.Column('lacks', sa.BigInteger(), nullable=False, server_default='0'))
    op.add_column('gpu', sa.Column('lacked_types', sa.JSON(), nullable=True))


def downgrade() -> None:
    # Not a batch (copy-and-drop) on SQLite: that would drop gpu's triggers and fail once devices exist.
    op.execute('ALTER TABLE gpu DROP COLUMN lacked_types')
    op.execute('ALTER TABLE gpu DROP COLUMN lacks')
