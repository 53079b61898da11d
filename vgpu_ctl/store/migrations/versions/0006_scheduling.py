"""scheduling: priority classes, tenants' classes and shares, the fair-share tree and usage ledger, VMs' priority

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 16:00:00

- `priority_class`: name, value (0..1e9), preemptible, preemption policy and mode; at most one global default
  (a unique partial index on `is_default`).
- `tenant_sched`, `tenant_priority_class`: a tenant's shares, account, default class and the classes it may use.
- `share_account`: the accounts of the fair-share tree (Fair Tree).
- `vm_sched`: a VM's class and value as admitted, whether preemptible, what it is charged for fair share and its
  preemption history (cool-down). Deleting it closes the VM's usage interval into `usage_interval` (a trigger on
  both engines, so no path that deletes a VM can forget it); a VM that fails has it deleted (a trigger on vm).
- `usage_ledger`: per tenant the folded, decayed past usage.
VMs that exist already get a `vm_sched` row without a class, charged their framebuffer from the upgrade on.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
_SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER vm_sched_close AFTER DELETE ON vm_sched FOR EACH ROW
BEGIN INSERT INTO usage_interval (tenant_id, vm_id, started, ended, fb_gib, compute_slices)
VALUES (OLD.tenant_id, OLD.vm_id, OLD.admitted_at, MAX(OLD.admitted_at, {_SQLITE_NOW}), OLD.fb_gib,
        OLD.compute_slices); END""",
    """CREATE TRIGGER vm_failed_closes_sched AFTER UPDATE OF state ON vm FOR EACH ROW WHEN NEW.state = 'failed'
BEGIN DELETE FROM vm_sched WHERE vm_id = NEW.id; END""",
]
_PG_STATEMENTS = [
    """CREATE FUNCTION vgpu_close_usage() RETURNS trigger AS $$
BEGIN
  INSERT INTO usage_interval (tenant_id, vm_id, started, ended, fb_gib, compute_slices)
  VALUES (OLD.tenant_id, OLD.vm_id, OLD.admitted_at, GREATEST(OLD.admitted_at, extract(epoch FROM now())),
          OLD.fb_gib, OLD.compute_slices);
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    """CREATE FUNCTION vgpu_failed_closes_sched() RETURNS trigger AS $$
BEGIN
  IF NEW.state = 'failed' AND OLD.state <> 'failed' THEN DELETE FROM vm_sched WHERE vm_id = NEW.id; END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    "CREATE TRIGGER vm_sched_close AFTER DELETE ON vm_sched FOR EACH ROW EXECUTE FUNCTION vgpu_close_usage()",
    """CREATE TRIGGER vm_failed_closes_sched AFTER UPDATE OF state ON vm FOR EACH ROW
EXECUTE FUNCTION vgpu_failed_closes_sched()""",
]


def upgrade() -> None:
    op.create_table('priority_class',
                    sa.Column('name', sa.String(), nullable=False),
                    sa.Column('value', sa.BigInteger(), nullable=False),
                    sa.Column('preemptible', sa.Boolean(), nullable=False),
                    sa.Column('preemption_policy', sa.String(), nullable=False),
                    sa.Column('preemption_mode', sa.String(), nullable=False),
                    sa.Column('is_default', sa.Boolean(), nullable=False),
                    sa.Column('description', sa.String(), nullable=False),
                    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint('value >= 0 AND value <= 1000000000', name='priority_class_value_range'),
                    sa.CheckConstraint("preemption_policy IN ('never', 'lower-priority')",
                                       name='priority_class_policy_known'),
                    sa.CheckConstraint("preemption_mode IN ('requeue', 'cancel')", name='priority_class_mode_known'),
                    sa.PrimaryKeyConstraint('name'))
    op.create_index('priority_class_one_default', 'priority_class', ['is_default'], unique=True,
                    sqlite_where=sa.text('is_default'), postgresql_where=sa.text('is_default'))
    op.create_table('share_account',
                    sa.Column('name', sa.String(), nullable=False),
                    sa.Column('parent', sa.String(), nullable=True),
                    sa.Column('shares', sa.BigInteger(), nullable=False),
                    sa.CheckConstraint('shares > 0', name='share_account_shares_pos'),
                    sa.CheckConstraint('parent IS NULL OR parent <> name', name='share_account_not_own_parent'),
                    sa.ForeignKeyConstraint(['parent'], ['share_account.name']),
                    sa.PrimaryKeyConstraint('name'))
    op.create_table('tenant_sched',
                    sa.Column('tenant_id', sa.Integer(), nullable=False),
                    sa.Column('shares', sa.BigInteger(), nullable=False),
                    sa.Column('account', sa.String(), nullable=True),
                    sa.Column('default_class', sa.String(), nullable=True),
                    sa.CheckConstraint('shares > 0', name='tenant_sched_shares_pos'),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.ForeignKeyConstraint(['account'], ['share_account.name']),
                    sa.ForeignKeyConstraint(['default_class'], ['priority_class.name']),
                    sa.PrimaryKeyConstraint('tenant_id'))
    op.create_table('tenant_priority_class',
                    sa.Column('tenant_id', sa.Integer(), nullable=False),
                    sa.Column('class_name', sa.String(), nullable=False),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.ForeignKeyConstraint(['class_name'], ['priority_class.name']),
                    sa.PrimaryKeyConstraint('tenant_id', 'class_name'))
    op.create_table('vm_sched',
                    sa.Column('vm_id', sa.String(), nullable=False),
                    sa.Column('tenant_id', sa.Integer(), nullable=False),
                    sa.Column('class_name', sa.String(), nullable=True),
                    sa.Column('priority', sa.BigInteger(), nullable=False),
                    sa.Column('preemptible', sa.Boolean(), nullable=False),
                    sa.Column('admitted_at', sa.Float(), nullable=False),
                    sa.Column('fb_gib', sa.Float(), nullable=False),
                    sa.Column('compute_slices', sa.Float(), nullable=False),
                    sa.Column('preemptions', sa.Integer(), nullable=False),
                    sa.Column('protected_below', sa.BigInteger(), nullable=True),
                    sa.Column('protected_until', sa.Float(), nullable=True),
                    sa.CheckConstraint('priority >= 0 AND priority <= 1000000000', name='vm_sched_priority_range'),
                    sa.CheckConstraint('fb_gib >= 0 AND compute_slices >= 0', name='vm_sched_charge_nonneg'),
                    sa.CheckConstraint('preemptions >= 0', name='vm_sched_preemptions_nonneg'),
                    sa.ForeignKeyConstraint(['vm_id'], ['vm.id'], ondelete='CASCADE'),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.ForeignKeyConstraint(['class_name'], ['priority_class.name']),
                    sa.PrimaryKeyConstraint('vm_id'))
    op.create_index('ix_vm_sched_tenant_id', 'vm_sched', ['tenant_id'])
    op.create_table('usage_interval',
                    sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('tenant_id', sa.Integer(), nullable=False),
                    sa.Column('vm_id', sa.String(), nullable=False),
                    sa.Column('started', sa.Float(), nullable=False),
                    sa.Column('ended', sa.Float(), nullable=False),
                    sa.Column('fb_gib', sa.Float(), nullable=False),
                    sa.Column('compute_slices', sa.Float(), nullable=False),
                    sa.CheckConstraint('ended >= started', name='usage_interval_ordered'),
                    sa.CheckConstraint('fb_gib >= 0 AND compute_slices >= 0', name='usage_interval_nonneg'),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('id'))
    op.create_index('ix_usage_interval_tenant_id', 'usage_interval', ['tenant_id'])
    op.create_table('usage_ledger',
                    sa.Column('tenant_id', sa.Integer(), nullable=False),
                    sa.Column('fb_gib_h', sa.Float(), nullable=False),
                    sa.Column('compute_h', sa.Float(), nullable=False),
                    sa.Column('as_of', sa.Float(), nullable=False),
                    sa.CheckConstraint('fb_gib_h >= 0 AND compute_h >= 0', name='usage_ledger_nonneg'),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('tenant_id'))
    sqlite = op.get_bind().dialect.name == 'sqlite'
    # VMs made before this revision: no class (value 0, not preemptible), charged their framebuffer from now on
    # (their compute slices need the catalog, which a migration does not read).
    now = _SQLITE_NOW if sqlite else 'extract(epoch FROM now())'
    op.execute("INSERT INTO vm_sched (vm_id, tenant_id, class_name, priority, preemptible, admitted_at, fb_gib, "
               f"compute_slices, preemptions) SELECT id, tenant_id, NULL, 0, false, {now}, framebuffer_mib / 1024.0, "
               "0, 0 FROM vm WHERE state <> 'failed'")
    for statement in (_SQLITE_TRIGGERS if sqlite else _PG_STATEMENTS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        op.execute('DROP TRIGGER IF EXISTS vm_failed_closes_sched')
        op.execute('DROP TRIGGER IF EXISTS vm_sched_close')
    else:
        op.execute('DROP TRIGGER IF EXISTS vm_failed_closes_sched ON vm')
        op.execute('DROP TRIGGER IF EXISTS vm_sched_close ON vm_sched')
        op.execute('DROP FUNCTION IF EXISTS vgpu_failed_closes_sched()')
        op.execute('DROP FUNCTION IF EXISTS vgpu_close_usage()')
    op.drop_table('usage_ledger')
    op.drop_index('ix_usage_interval_tenant_id', 'usage_interval')
    op.drop_table('usage_interval')
    op.drop_index('ix_vm_sched_tenant_id', 'vm_sched')
    op.drop_table('vm_sched')
    op.drop_table('tenant_priority_class')
    op.drop_table('tenant_sched')
    op.drop_table('share_account')
    op.drop_index('priority_class_one_default', 'priority_class')
    op.drop_table('priority_class')
