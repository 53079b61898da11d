"""safety: 64-bit quota and capacity columns; a lease on each VM's in-flight operation

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 12:00:00

Quota limits and usage, host capacity and VM sizes become BIGINT: a framebuffer limit of 10**12 MiB no
longer overflows PostgreSQL's 32-bit INTEGER. SQLite's INTEGER is already 64-bit, so there the columns
keep their declared type (a table copy would break the foreign keys of a store with VMs).

A VM gets `lease_holder` and `lease_expires`: the process running an operation on it (provisioning,
release, a reconcile repair) and until when, renewed while it works; reconcile finishes an in-flight VM at
once when no live process holds it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESOURCES = ('vms', 'vgpus', 'framebuffer_mib', 'vcpus', 'memory_mib')
WIDE: dict[str, tuple[str, ...]] = {
    'tenant': tuple(f'{r}_{k}' for r in RESOURCES for k in ('used', 'limit')),
    'scoped_quota': ('limit_value', 'used'),
    'host': ('vcpus', 'memory_mib', 'used_vcpus', 'used_memory_mib'),
    'vm': ('vcpus', 'memory_mib', 'framebuffer_mib'),
    'device': ('framebuffer_mib',),
}


def _retype(to: str) -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    for table, columns in WIDE.items():
        op.execute(f'ALTER TABLE {table} ' + ', '.join(f'ALTER COLUMN {c} TYPE {to}' for c in columns))


def upgrade() -> None:
    _retype('BIGINT')
    op.add_column('vm', sa.Column('lease_holder', sa.String(), nullable=True))
    op.add_column('vm', sa.Column('lease_expires', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    # Not a batch (copy-and-drop) on SQLite: with foreign keys on, dropping vm fails once devices exist.
    op.execute('ALTER TABLE vm DROP COLUMN lease_expires')
    op.execute('ALTER TABLE vm DROP COLUMN lease_holder')
    _retype('INTEGER')  # fails (and changes nothing) while a value does not fit in 32 bits
