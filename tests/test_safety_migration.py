"""Migration 0003 (issue 9): 64-bit quota and capacity columns, upgraded from 0002 and downgraded again on
SQLite and PostgreSQL; a framebuffer limit of 10**12 MiB is stored and charged on both."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from conftest import DEMO, check_store_invariants
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from vgpu_ctl import Controller
from vgpu_ctl.store import migrate
from vgpu_ctl.store.engine import make_engine

HUGE = 10**12


def _revision(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one())


def _type(engine: Engine, table: str, column: str) -> str:
    return str(next(c["type"] for c in inspect(engine).get_columns(table) if c["name"] == column)).upper()


def test_huge_framebuffer_limit_is_stored_and_charged(store_url: str, state_dir: Path) -> None:
    c = Controller(store_url)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        c.set_quota("acme", {"framebuffer_mib": HUGE, "memory_mib": HUGE, "vcpus": HUGE, "vgpus": HUGE})
        c.set_quota("acme", {"framebuffer_mib": HUGE}, pool="inference")
        c.request_vm("acme", "a", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="inference")
        use = {(r["scope"], r["resource"]): (r["used"], r["limit"]) for r in c.tenant_usage("acme")}
        assert use[("*", "framebuffer_mib")] == (40960, HUGE)
        assert use[("inference", "framebuffer_mib")] == (40960, HUGE)
        check_store_invariants(c.engine)
    finally:
        c.close()


def test_migration_0003_upgrades_from_0002_and_downgrades(store_url: str, state_dir: Path) -> None:
    engine = make_engine(store_url)
    try:
        command.upgrade(migrate.alembic_config(engine), "0002")
    finally:
        engine.dispose()
    c = Controller(store_url)  # opening the store runs the rest
    try:
        assert _revision(c.engine) >= "0003"
        if c.engine.dialect.name == "postgresql":
            assert _type(c.engine, "tenant", "framebuffer_mib_limit") == "BIGINT"
            assert _type(c.engine, "scoped_quota", "limit_value") == "BIGINT"
            assert _type(c.engine, "host", "memory_mib") == "BIGINT"
            assert _type(c.engine, "vm", "memory_mib") == "BIGINT"
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        c.set_quota("acme", {"framebuffer_mib": 100 * 1024})
        c.request_vm("acme", "a", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="inference")
        command.downgrade(migrate.alembic_config(c.engine), "0002")
        assert _revision(c.engine) == "0002"
        if c.engine.dialect.name == "postgresql":
            assert _type(c.engine, "tenant", "framebuffer_mib_limit") == "INTEGER"
    finally:
        c.close()
    c = Controller(store_url)
    try:
        assert _revision(c.engine) == migrate.head_revision()
        c.set_quota("acme", {"framebuffer_mib": HUGE})
        c.request_vm("acme", "b", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="inference")
        check_store_invariants(c.engine)
    finally:
        c.close()
