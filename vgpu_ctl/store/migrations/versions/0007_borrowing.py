"""borrowing: a guaranteed part of each quota limit, and VMs claimed above it marked borrowed

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 16:00:00

- `tenant.{vms,vgpus,framebuffer_mib,vcpus,memory_mib}_guarantee`: the guaranteed part of each global limit
  (NULL: none), with a CHECK that it is >= 0 and no more than the limit when one is set.
- `scoped_quota.guarantee`: the same within one pool (a base resource's row only, never a profile's), at most
  the row's limit.
- `vm_sched.borrowed`: the VM was claimed while its tenant's usage, after the claim's charge, was above one of
  its guarantees (globally, or in the VM's pool). A trigger refuses a row whose flag disagrees with the tenant's
  rows at that moment (the claim holds their lock), and any later change of the flag.
Existing VMs are not borrowed (no guarantee existed before). On SQLite a downgrade empties the columns rather than
dropping them (see `downgrade`).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RESOURCES = ('vms', 'vgpus', 'framebuffer_mib', 'vcpus', 'memory_mib')


def _guarantee_check(r: str) -> str:
    return f"{r}_guarantee IS NULL OR ({r}_guarantee >= 0 AND ({r}_limit IS NULL OR {r}_guarantee <= {r}_limit))"


_SCOPED_CHECK = ("guarantee IS NULL OR (guarantee >= 0 AND guarantee <= limit_value "
                 "AND resource NOT LIKE 'profile:%')")

# Whether the tenant of the vm_sched row NEW is above a guarantee now: globally, or in the pool of NEW's VM.
_OVER = ("((SELECT " + " OR ".join(f"({r}_guarantee IS NOT NULL AND {r}_used > {r}_guarantee)" for r in _RESOURCES)
         + " FROM tenant WHERE id = NEW.tenant_id) OR EXISTS (SELECT 1 FROM scoped_quota q "
           "JOIN pool p ON p.name = q.scope JOIN vm v ON v.pool_id = p.id WHERE v.id = NEW.vm_id "
           "AND q.tenant_id = NEW.tenant_id AND q.guarantee IS NOT NULL AND q.used > q.guarantee))")

_SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER vm_sched_borrowed_insert BEFORE INSERT ON vm_sched FOR EACH ROW
WHEN NEW.borrowed <> {_OVER}
BEGIN SELECT RAISE(ABORT, 'vm_sched_borrowed_mismatch: borrowed must say whether the tenant is above a guarantee');
END""",
    """CREATE TRIGGER vm_sched_borrowed_fixed BEFORE UPDATE OF borrowed ON vm_sched FOR EACH ROW
WHEN NEW.borrowed <> OLD.borrowed
BEGIN SELECT RAISE(ABORT, 'vm_sched_borrowed_fixed: a VM is borrowed or not as it was claimed'); END""",
    """CREATE TRIGGER scoped_quota_guarantee_generation AFTER UPDATE OF guarantee ON scoped_quota FOR EACH ROW
BEGIN UPDATE tenant SET generation = generation + 1 WHERE id = NEW.tenant_id; END""",
]
_PG_STATEMENTS = [
    f"""CREATE FUNCTION vgpu_check_borrowed() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF NEW.borrowed <> OLD.borrowed THEN
      RAISE EXCEPTION 'vm_sched_borrowed_fixed: a VM is borrowed or not as it was claimed';
    END IF;
  ELSIF NEW.borrowed <> {_OVER} THEN
    RAISE EXCEPTION 'vm_sched_borrowed_mismatch: borrowed must say whether the tenant is above a guarantee';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER vm_sched_borrowed BEFORE INSERT OR UPDATE OF borrowed ON vm_sched FOR EACH ROW
EXECUTE FUNCTION vgpu_check_borrowed()""",
    "DROP TRIGGER IF EXISTS scoped_quota_generation ON scoped_quota",
    """CREATE TRIGGER scoped_quota_generation AFTER INSERT OR DELETE OR UPDATE OF limit_value, guarantee
ON scoped_quota FOR EACH ROW EXECUTE FUNCTION vgpu_bump_tenant_generation()""",
]

def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == 'sqlite'
    if sqlite:  # SQLite adds a column with its CHECK in one statement (no ALTER TABLE ADD CONSTRAINT)
        have = {t: {r[1] for r in op.get_bind().exec_driver_sql(f"PRAGMA table_info({t})")}
                for t in ('tenant', 'scoped_quota', 'vm_sched')}  # kept by an earlier downgrade (see there)
        for r in _RESOURCES:
            if f'{r}_guarantee' not in have['tenant']:
                op.execute(f"ALTER TABLE tenant ADD COLUMN {r}_guarantee BIGINT "
                           f"CONSTRAINT tenant_{r}_guarantee_valid CHECK ({_guarantee_check(r)})")
        if 'guarantee' not in have['scoped_quota']:
            op.execute("ALTER TABLE scoped_quota ADD COLUMN guarantee BIGINT "
                       f"CONSTRAINT scoped_quota_guarantee_valid CHECK ({_SCOPED_CHECK})")
        if 'borrowed' not in have['vm_sched']:
            op.add_column('vm_sched', sa.Column('borrowed', sa.Boolean(), nullable=False, server_default=sa.false()))
    else:
        for r in _RESOURCES:
            op.add_column('tenant', sa.Column(f'{r}_guarantee', sa.BigInteger(), nullable=True))
            op.create_check_constraint(f'tenant_{r}_guarantee_valid', 'tenant', _guarantee_check(r))
        op.add_column('scoped_quota', sa.Column('guarantee', sa.BigInteger(), nullable=True))
        op.create_check_constraint('scoped_quota_guarantee_valid', 'scoped_quota', _SCOPED_CHECK)
        op.add_column('vm_sched', sa.Column('borrowed', sa.Boolean(), nullable=False, server_default=sa.false()))
    for statement in (_SQLITE_TRIGGERS if sqlite else _PG_STATEMENTS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        # SQLite can't drop a column a CHECK names without rebuilding the table, and tenant can't be rebuilt
        # while other tables reference it (foreign keys are on, and can't be turned off in a transaction): the
        # columns stay, emptied (no guarantee, nothing borrowed), unused by revision 0006, and upgrade keeps them.
        for name in ('vm_sched_borrowed_insert', 'vm_sched_borrowed_fixed', 'scoped_quota_guarantee_generation'):
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
        op.execute('UPDATE vm_sched SET borrowed = false')
        op.execute('UPDATE scoped_quota SET guarantee = NULL')
        op.execute('UPDATE tenant SET ' + ', '.join(f'{r}_guarantee = NULL' for r in _RESOURCES))
        return
    op.execute('DROP TRIGGER IF EXISTS vm_sched_borrowed ON vm_sched')
    op.execute('DROP FUNCTION IF EXISTS vgpu_check_borrowed()')
    op.execute('DROP TRIGGER IF EXISTS scoped_quota_generation ON scoped_quota')
    op.execute("""CREATE TRIGGER scoped_quota_generation AFTER INSERT OR DELETE OR UPDATE OF limit_value
ON scoped_quota FOR EACH ROW EXECUTE FUNCTION vgpu_bump_tenant_generation()""")
    op.drop_column('vm_sched', 'borrowed')
    op.drop_constraint('scoped_quota_guarantee_valid', 'scoped_quota', type_='check')
    op.drop_column('scoped_quota', 'guarantee')
    for r in _RESOURCES:
        op.drop_constraint(f'tenant_{r}_guarantee_valid', 'tenant', type_='check')
        op.drop_column('tenant', f'{r}_guarantee')
