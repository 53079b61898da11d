"""device overlap guard: checked when a device's position changes, on both backends, not on every update

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 03:20:00

On PostgreSQL the guard of 0001 ran before every UPDATE of a device and locked its GPU row, so marking a VM's
devices ready (one transaction since provisioning reads once) locked their GPUs in device-id order: two VMs
provisioned at once with devices on the same two GPUs could deadlock, and one of them failed. A device's state,
handle, id or UUID does not move it; the guard now fires only when its GPU, start or size changes. SQLite's guard
checked inserts only; it now also checks such an update, so the invariant holds the same on both.
"""

from collections.abc import Sequence

from alembic import op

revision: str = '0017'
down_revision: str | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_UPDATE_GUARD = """
CREATE TRIGGER device_no_overlap_update BEFORE UPDATE OF gpu_id, start, size ON device
WHEN EXISTS (SELECT 1 FROM device d WHERE d.gpu_id = NEW.gpu_id AND d.id <> OLD.id
             AND d.start < NEW.start + NEW.size AND NEW.start < d.start + d.size)
BEGIN SELECT RAISE(ABORT, 'device position overlaps another device on this GPU'); END
"""


def _pg_trigger(columns: str) -> None:
    op.execute("DROP TRIGGER IF EXISTS device_no_overlap ON device")
    op.execute(f"CREATE TRIGGER device_no_overlap BEFORE INSERT OR UPDATE{columns} ON device "
               "FOR EACH ROW EXECUTE FUNCTION device_no_overlap()")


def upgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        op.execute(_SQLITE_UPDATE_GUARD)
    else:
        _pg_trigger(" OF gpu_id, start, size")


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        op.execute("DROP TRIGGER IF EXISTS device_no_overlap_update")
    else:
        _pg_trigger("")
