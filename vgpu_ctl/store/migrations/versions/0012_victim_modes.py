"""victim modes and reclaim by current usage: hibernation (libvirt managed save) as a way to free a preempted
VM, per host which modes it supports for which profile, and no borrowed flag frozen at a VM's claim

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 17:50:00

- `vm.state` may be `hibernated`: the VM's memory is in the host's managed save file and QEMU has ended, so it
  holds its devices and quota but not its host's vCPUs and memory (`host.used_*` no longer count it).
- `priority_class.preemption_mode` may be `hibernate`.
- `host.victim_modes` (JSON, NULL: the defaults): per profile name, or `*` for every profile, the modes a
  preempted VM on the host may be freed by (`requeue`, `hibernate`, `cancel`), as the inventory declares them.
- `vm_sched.borrowed` and the triggers of 0007 that fixed it at the claim go: whether a VM is borrowed is decided
  from its tenant's usage as it stands (`service.scheduling.borrowed_vms`), so work claimed above a guarantee
  becomes guaranteed once older VMs of its tenant are released.

Both CHECKs only widen: on PostgreSQL they are dropped and added again; on SQLite, whose ALTER TABLE cannot change
a CHECK and whose table copy would cascade the foreign keys that point at `vm`, the table's stored definition is
rewritten in place (SQLite's documented procedure for changing a CHECK constraint: writable_schema, then a new
schema_version), which is safe because every stored row satisfies the wider CHECK.
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATES = "'requested', 'placed', 'devices-ready', 'defined', 'running', 'stopped', 'releasing', 'failed'"
_MODES = "'requeue', 'cancel'"
CHECKS = (  # (table, constraint, column, values before, values after)
    ('vm', 'vm_state_known', 'state', _STATES, _STATES + ", 'hibernated'"),
    ('priority_class', 'priority_class_mode_known', 'preemption_mode', _MODES, _MODES + ", 'hibernate'"),
)


def _sqlite_check(table: str, column: str, old: str, new: str) -> None:
    bind = op.get_bind()
    sql = bind.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).scalar()
    before, after = f"{column} IN ({old})", f"{column} IN ({new})"
    if sql is None or sql.count(before) != 1:
        raise RuntimeError(f"table {table}: its CHECK on {column} is not {before!r}; not rewriting it")
    version = int(bind.exec_driver_sql("PRAGMA schema_version").scalar() or 0)
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        bind.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?",
                             (sql.replace(before, after), table))
        bind.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema = OFF")


def _set_checks(forward: bool) -> None:
    for table, name, column, old, new in CHECKS:
        frm, to = (old, new) if forward else (new, old)
        if op.get_bind().dialect.name == 'sqlite':
            _sqlite_check(table, column, frm, to)
        else:
            op.execute(f'ALTER TABLE {table} DROP CONSTRAINT {name}')
            op.execute(f'ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({column} IN ({to}))')


def _borrowing() -> Any:
    """Migration 0007, whose triggers a downgrade puts back."""
    spec = importlib.util.spec_from_file_location("borrowing_0007", Path(__file__).with_name("0007_borrowing.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    _set_checks(True)
    op.add_column('host', sa.Column('victim_modes', sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == 'sqlite':
        for name in ('vm_sched_borrowed_insert', 'vm_sched_borrowed_fixed'):
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
        op.execute('ALTER TABLE vm_sched DROP COLUMN borrowed')
    else:
        op.execute('DROP TRIGGER IF EXISTS vm_sched_borrowed ON vm_sched')
        op.execute('DROP FUNCTION IF EXISTS vgpu_check_borrowed()')
        op.drop_column('vm_sched', 'borrowed')


def downgrade() -> None:
    # Hibernated VMs must be gone first (the narrower CHECK would not hold); hibernate classes requeue instead.
    # Existing VMs count as not borrowed, as 0007 left them; new claims get the flag from 0007's triggers.
    hibernated = [r[0] for r in op.get_bind().exec_driver_sql("SELECT name FROM vm WHERE state = 'hibernated'")]
    if hibernated:
        raise RuntimeError(f"revision 0011 has no hibernated VMs: resume or delete {', '.join(sorted(hibernated))} "
                           "first")
    op.execute("UPDATE priority_class SET preemption_mode = 'requeue' WHERE preemption_mode = 'hibernate'")
    sqlite = op.get_bind().dialect.name == 'sqlite'
    op.add_column('vm_sched', sa.Column('borrowed', sa.Boolean(), nullable=False, server_default=sa.false()))
    b = _borrowing()
    for statement in (b._SQLITE_TRIGGERS[:2] if sqlite else b._PG_STATEMENTS[:2]):
        op.execute(statement)
    if sqlite:
        op.execute('ALTER TABLE host DROP COLUMN victim_modes')
    else:
        op.drop_column('host', 'victim_modes')
    _set_checks(False)
