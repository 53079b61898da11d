"""service: API tokens with roles, operations, idempotent requests, the leader's lease, generations

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 15:00:00

What `vgpuctl serve` needs in the store, so that any replica can answer for any other:
- `api_token`: tokens the admin issued for a role (`admin`, `reader`); only hashes.
- `operation`: long work (create or delete a VM) with its state, request, result or error and the lease of the
  worker running it; the leader takes over an operation whose lease ran out.
- `idempotent_request`: per caller and `Idempotency-Key`, the request's fingerprint and the response a retry gets.
- `server_lease`: who leads, until when (the election itself is a PostgreSQL advisory lock or a file lock).
- `generation` on `vm` and `tenant`, bumped by a trigger on every change (also a change of the tenant's scoped
  quotas), so an ETag read earlier can be checked with If-Match in the write's own transaction.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_TRIGGERS = [
    """CREATE TRIGGER vm_generation AFTER UPDATE ON vm FOR EACH ROW WHEN NEW.generation = OLD.generation
BEGIN UPDATE vm SET generation = OLD.generation + 1 WHERE id = NEW.id; END""",
    """CREATE TRIGGER tenant_generation AFTER UPDATE ON tenant FOR EACH ROW WHEN NEW.generation = OLD.generation
BEGIN UPDATE tenant SET generation = OLD.generation + 1 WHERE id = NEW.id; END""",
    """CREATE TRIGGER scoped_quota_insert_generation AFTER INSERT ON scoped_quota FOR EACH ROW
BEGIN UPDATE tenant SET generation = generation + 1 WHERE id = NEW.tenant_id; END""",
    """CREATE TRIGGER scoped_quota_update_generation AFTER UPDATE OF limit_value ON scoped_quota FOR EACH ROW
BEGIN UPDATE tenant SET generation = generation + 1 WHERE id = NEW.tenant_id; END""",
    """CREATE TRIGGER scoped_quota_delete_generation AFTER DELETE ON scoped_quota FOR EACH ROW
BEGIN UPDATE tenant SET generation = generation + 1 WHERE id = OLD.tenant_id; END""",
]
_PG_STATEMENTS = [
    """CREATE FUNCTION vgpu_bump_generation() RETURNS trigger AS $$
BEGIN
  IF NEW.generation = OLD.generation THEN NEW.generation := OLD.generation + 1; END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql""",
    """CREATE FUNCTION vgpu_bump_tenant_generation() RETURNS trigger AS $$
BEGIN
  UPDATE tenant SET generation = generation + 1 WHERE id = COALESCE(NEW.tenant_id, OLD.tenant_id);
  RETURN NULL;
END $$ LANGUAGE plpgsql""",
    "CREATE TRIGGER vm_generation BEFORE UPDATE ON vm FOR EACH ROW EXECUTE FUNCTION vgpu_bump_generation()",
    "CREATE TRIGGER tenant_generation BEFORE UPDATE ON tenant FOR EACH ROW EXECUTE FUNCTION vgpu_bump_generation()",
    """CREATE TRIGGER scoped_quota_generation AFTER INSERT OR DELETE OR UPDATE OF limit_value ON scoped_quota
FOR EACH ROW EXECUTE FUNCTION vgpu_bump_tenant_generation()""",
]


def upgrade() -> None:
    op.add_column('vm', sa.Column('generation', sa.BigInteger(), nullable=False, server_default='1'))
    op.add_column('tenant', sa.Column('generation', sa.BigInteger(), nullable=False, server_default='1'))
    op.create_table('api_token',
                    sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('name', sa.String(), nullable=False),
                    sa.Column('role', sa.String(), nullable=False),
                    sa.Column('token_hash', sa.String(), nullable=False),
                    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint("role IN ('admin', 'reader')", name='api_token_role_known'),
                    sa.PrimaryKeyConstraint('id'),
                    sa.UniqueConstraint('name'),
                    sa.UniqueConstraint('token_hash'))
    op.create_table('operation',
                    sa.Column('id', sa.String(), nullable=False),
                    sa.Column('kind', sa.String(), nullable=False),
                    sa.Column('state', sa.String(), nullable=False),
                    sa.Column('actor', sa.String(), nullable=False),
                    sa.Column('role', sa.String(), nullable=False),
                    sa.Column('tenant_id', sa.Integer(), nullable=True),
                    sa.Column('vm_id', sa.String(), nullable=True),
                    sa.Column('request', sa.JSON(), nullable=False),
                    sa.Column('result', sa.JSON(), nullable=True),
                    sa.Column('error', sa.JSON(), nullable=True),
                    sa.Column('lease_holder', sa.String(), nullable=True),
                    sa.Column('lease_expires', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
                    sa.Column('attempts', sa.Integer(), nullable=False),
                    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.Column('updated_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.Column('finished_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
                    sa.CheckConstraint("state IN ('pending', 'running', 'succeeded', 'failed')",
                                       name='operation_state_known'),
                    sa.CheckConstraint("kind IN ('vm.create', 'vm.delete')", name='operation_kind_known'),
                    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], ondelete='CASCADE'),
                    sa.PrimaryKeyConstraint('id'))
    op.create_index('operation_unfinished', 'operation', ['state', 'lease_expires'])
    op.create_table('idempotent_request',
                    sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('scope', sa.String(), nullable=False),
                    sa.Column('key', sa.String(), nullable=False),
                    sa.Column('fingerprint', sa.String(), nullable=False),
                    sa.Column('state', sa.String(), nullable=False),
                    sa.Column('status_code', sa.Integer(), nullable=True),
                    sa.Column('response', sa.JSON(), nullable=True),
                    sa.Column('headers', sa.JSON(), nullable=False),
                    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.Column('expires_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.CheckConstraint("state IN ('in-flight', 'done')", name='idempotent_request_state_known'),
                    sa.PrimaryKeyConstraint('id'),
                    sa.UniqueConstraint('scope', 'key', name='idempotent_request_unique'))
    op.create_index('idempotent_request_expiry', 'idempotent_request', ['expires_at'])
    op.create_table('server_lease',
                    sa.Column('name', sa.String(), nullable=False),
                    sa.Column('holder', sa.String(), nullable=False),
                    sa.Column('address', sa.String(), nullable=False),
                    sa.Column('expires_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
                    sa.PrimaryKeyConstraint('name'))
    for statement in (_SQLITE_TRIGGERS if op.get_bind().dialect.name == 'sqlite' else _PG_STATEMENTS):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        for name in ('vm_generation', 'tenant_generation', 'scoped_quota_insert_generation',
                     'scoped_quota_update_generation', 'scoped_quota_delete_generation'):
            op.execute(f'DROP TRIGGER IF EXISTS {name}')
    else:
        for name, table in (('vm_generation', 'vm'), ('tenant_generation', 'tenant'),
                            ('scoped_quota_generation', 'scoped_quota')):
            op.execute(f'DROP TRIGGER IF EXISTS {name} ON {table}')
        op.execute('DROP FUNCTION IF EXISTS vgpu_bump_tenant_generation()')
        op.execute('DROP FUNCTION IF EXISTS vgpu_bump_generation()')
    op.drop_table('server_lease')
    op.drop_index('idempotent_request_expiry', 'idempotent_request')
    op.drop_table('idempotent_request')
    op.drop_index('operation_unfinished', 'operation')
    op.drop_table('operation')
    op.drop_table('api_token')
    op.execute('ALTER TABLE tenant DROP COLUMN generation')
    op.execute('ALTER TABLE vm DROP COLUMN generation')
