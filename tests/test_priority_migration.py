"""Migration 0006 (scheduling) on SQLite and PostgreSQL: down to 0005 and up again with VMs in the store; the
VMs that existed get a priority row without a class, charged their framebuffer; the triggers work after it."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from conftest import DEMO, check_store_invariants
from sqlalchemy import inspect, text

from vgpu_ctl import Controller
from vgpu_ctl.store import migrate


def test_migration_0006_down_and_up_with_vms(store_url: str, state_dir: Path) -> None:
    with Controller(store_url) as c:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        c.scheduling.create_class("std", 100, default=True)
        c.request_vm("acme", "a", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="inference")
        command.downgrade(migrate.alembic_config(c.engine), "0005")
        tables = set(inspect(c.engine).get_table_names())
        assert not tables & {"priority_class", "vm_sched", "usage_interval", "usage_ledger", "tenant_sched"}
    with Controller(store_url) as c:  # opening the store upgrades it again
        with c.engine.connect() as conn:
            row = conn.execute(text("SELECT class_name, priority, preemptible, fb_gib, compute_slices "
                                    "FROM vm_sched")).one()
        assert (row.class_name, row.priority, bool(row.preemptible), row.fb_gib, row.compute_slices) == \
            (None, 0, False, 40.0, 0.0)
        c.release_vm("acme/a")  # the trigger closes its interval
        with c.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM usage_interval")).scalar() == 1
            assert conn.execute(text("SELECT count(*) FROM vm_sched")).scalar() == 0
        check_store_invariants(c.engine)
