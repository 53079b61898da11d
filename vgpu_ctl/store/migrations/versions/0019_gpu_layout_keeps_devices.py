"""a GPU's layout keeps every device it holds when a write adds to it, on both backends

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 15:50:00

The GPU's compare-and-set (its version) guards a write against any other since the state it was planned on was
read, and the overlap guard keeps two devices from one position. Neither caught a write planned on a state that
another writer had also reached by the same version number: the in-memory allocator once wrote such a layout
(fixed in the allocator; see docs/design-service.md), and it dropped another VM's device, which `doctor` then
reported as gpu-occupancy drift. A write that leaves the GPU's device count as it was or adds to it (a claim, a
move's new positions) now fails unless every device row of the GPU is in its new layout. A release writes the
layout without the device first and deletes the device row after, in that order for its locks, so a write
that lowers the count is not checked; the reverse (a slot in the layout with no device) is left to `doctor`.
"""

from collections.abc import Sequence

from alembic import op

revision: str = '0019'
down_revision: str | None = '0018'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A device is in a layout when `profile@start+size` is one of its `;`-separated slots (core.geometry.Slot.encode).
_DROPS_A_DEVICE = """EXISTS (SELECT 1 FROM device d WHERE d.gpu_id = NEW.id
  AND {find}(';' || NEW.layout || ';', ';' || d.profile || '@' || d.start || '+' || d.size || ';') = 0)"""

_SQLITE = f"""
CREATE TRIGGER gpu_layout_keeps_devices AFTER UPDATE OF layout ON gpu
WHEN NEW.device_count >= OLD.device_count AND {_DROPS_A_DEVICE.format(find="instr")}
BEGIN SELECT RAISE(ABORT, 'GPU layout drops a device the GPU holds'); END
"""

_PG = f"""
CREATE FUNCTION gpu_layout_keeps_devices() RETURNS trigger AS $$
BEGIN
  IF {_DROPS_A_DEVICE.format(find="strpos")} THEN
    RAISE EXCEPTION 'GPU layout drops a device the GPU holds' USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER gpu_layout_keeps_devices AFTER UPDATE OF layout ON gpu
FOR EACH ROW WHEN (NEW.device_count >= OLD.device_count) EXECUTE FUNCTION gpu_layout_keeps_devices();
"""


def upgrade() -> None:
    op.execute(_SQLITE if op.get_bind().dialect.name == 'sqlite' else _PG)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        op.execute("DROP TRIGGER IF EXISTS gpu_layout_keeps_devices")
    else:
        op.execute("DROP TRIGGER IF EXISTS gpu_layout_keeps_devices ON gpu")
        op.execute("DROP FUNCTION IF EXISTS gpu_layout_keeps_devices()")
