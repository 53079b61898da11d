"""Issue 9, defects 4, 5 and 10: `db restore` verifies the whole schema and works on a broken store; a
usage repair recomputes usage from allocations; the store, its WAL files and backups are private."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from opsfixtures import Store, cli, clone, template_store

from vgpu_ctl import InvalidInput
from vgpu_ctl.ops.backup import restore


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _backup(store: Store, path: Path) -> Path:
    res = cli(store, "db", "backup", str(path))
    assert res.exit_code == 0, res.output
    return path


def _tamper(path: Path, *sql: str) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA foreign_keys=OFF")
        for s in sql:
            conn.execute(s)
        conn.commit()
    finally:
        conn.close()


HOLLOW = [  # the table names and a schema version, not the columns
    "ALTER TABLE tenant RENAME TO tenant_old", "CREATE TABLE tenant (id INTEGER PRIMARY KEY, name TEXT)",
    "ALTER TABLE gpu RENAME TO gpu_old", "CREATE TABLE gpu (id INTEGER PRIMARY KEY, host_id INTEGER)",
    "DROP TABLE meta",
]
TAMPERED = {
    "a missing column": HOLLOW,
    "a dropped check": ["DROP TABLE device", "CREATE TABLE device (id VARCHAR PRIMARY KEY, gpu_id INTEGER, "
                        "vm_id VARCHAR, profile VARCHAR, kind VARCHAR, start INTEGER, size INTEGER, "
                        "framebuffer_mib BIGINT, uuid VARCHAR, backing VARCHAR, handle JSON, state VARCHAR)"],
    "no overlap trigger": ["DROP TRIGGER device_no_overlap"],
    "no layout guard": ["DROP TRIGGER gpu_layout_keeps_devices"],
    "a dropped unique constraint": ["DROP TABLE scoped_quota", "CREATE TABLE scoped_quota (id INTEGER NOT NULL "
                                    "PRIMARY KEY, tenant_id INTEGER NOT NULL, scope VARCHAR NOT NULL, resource "
                                    "VARCHAR NOT NULL, limit_value BIGINT NOT NULL, used BIGINT NOT NULL)"],
}


@pytest.mark.parametrize("what", sorted(TAMPERED))
def test_restore_verifies_the_whole_schema(store: Store, tmp_path: Path, what: str) -> None:
    bad = _backup(store, tmp_path / "bad.db")
    _tamper(bad, *TAMPERED[what])
    before = store.sql("SELECT name FROM vm ORDER BY name")
    ctl = store.ctl()
    try:
        with pytest.raises(InvalidInput, match="schema") as err:
            restore(ctl, bad)
        assert err.value.reasons
    finally:
        ctl.close()
    res = cli(store, "db", "restore", str(bad), "--yes")
    assert res.exit_code == 2, res.output
    assert store.sql("SELECT name FROM vm ORDER BY name") == before  # not swapped


def test_restore_works_on_a_broken_store(store: Store, tmp_path: Path) -> None:
    good = _backup(store, tmp_path / "good.db")
    names = store.sql("SELECT name FROM vm ORDER BY name")
    _tamper(Path(store.url.removeprefix("sqlite:///")), *HOLLOW)  # the store itself is now broken
    with pytest.raises(Exception, match=r"no such (column|table)"):  # every command fails
        broken = store.ctl()
        broken.list_tenants()
    res = cli(store, "db", "restore", str(good), "--yes")
    assert res.exit_code == 0, res.output
    assert store.sql("SELECT name FROM vm ORDER BY name") == names
    assert cli(store, "tenant", "list").exit_code == 0


# -- 10: private files -------------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture
def umask_022() -> object:
    import os
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_store_wal_and_backup_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_022: object) -> None:
    from conftest import DEMO

    from vgpu_ctl import Controller
    from vgpu_ctl.ops.backup import backup
    state = tmp_path / "fresh" / "state"
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(state))
    c = Controller()  # the default store in a state folder that does not exist yet
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        db = state / "vgpu-ctl.db"
        assert _mode(state) == 0o700
        for f in (db, db.with_name("vgpu-ctl.db-wal"), db.with_name("vgpu-ctl.db-shm")):
            assert f.exists() and _mode(f) == 0o600, (f, oct(_mode(f)))
        out = tmp_path / "backups" / "b.db"
        backup(c, out)
        assert _mode(out) == 0o600 and _mode(out.parent) == 0o700
    finally:
        c.close()


def test_an_existing_world_readable_store_is_made_private(tmp_path: Path, umask_022: object) -> None:
    from vgpu_ctl import Controller
    url = f"sqlite:///{tmp_path / 'old.db'}"
    Controller(url).close()
    (tmp_path / "old.db").chmod(0o644)
    Controller(url).close()
    assert _mode(tmp_path / "old.db") == 0o600


def test_a_killed_backup_leaves_no_temp_file_after_the_next_run(store: Store, tmp_path: Path) -> None:
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()
    dest = tmp_path / "b" / "backup.db"
    dest.parent.mkdir()
    stale = dest.with_name(f".{dest.name}.{dead.pid}.tmp")  # what `db backup` killed mid-copy left
    stale.write_bytes(b"\0" * 65536)
    _backup(store, dest)
    assert not stale.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["backup.db"]


# -- 5: usage repair ---------------------------------------------------------------------------------------


def _drift(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("acme", {"vgpus": 5}, pool="inference")
    finally:
        ctl.close()
    store.sql("UPDATE tenant SET vms_used = vms_used + 1, vgpus_used = vgpus_used + 3 WHERE name = 'acme'")
    store.sql("UPDATE scoped_quota SET used = used + 2")
    store.sql("UPDATE host SET used_vcpus = used_vcpus + 4")


def _failing(store: Store) -> dict[str, list[str]]:
    from vgpu_ctl.ops.doctor import diagnose
    ctl = store.ctl()
    try:
        return {r.name: [p.fix for p in r.problems] for r in diagnose(ctl) if r.problems}
    finally:
        ctl.close()


def test_usage_repair_recomputes_usage_from_allocations(store: Store) -> None:
    from conftest import check_store_invariants

    from vgpu_ctl import PermissionDenied
    _drift(store)
    failing = _failing(store)
    assert set(failing) == {"tenant-usage", "scoped-quota", "host-usage"}
    assert all("vgpuctl db repair-usage" in fix for fixes in failing.values() for fix in fixes), failing
    tenant = store.as_tenant("acme")
    try:
        with pytest.raises(PermissionDenied):
            tenant.repair_usage(dry_run=False)
    finally:
        tenant.close()
    ctl = store.ctl()
    try:
        before = store.sql("SELECT * FROM tenant ORDER BY id"), store.sql("SELECT * FROM host ORDER BY id")
        events = len(ctl.events(limit=100000))
        plan = ctl.repair_usage()  # a dry run by default
        assert {(c["object"], c["resource"]) for c in plan} >= {
            ("tenant acme", "vms"), ("tenant acme", "vgpus"), ("tenant acme", "vgpus in pool inference")}
        assert all(c["stored"] != c["allocated"] for c in plan)
        assert (store.sql("SELECT * FROM tenant ORDER BY id"), store.sql("SELECT * FROM host ORDER BY id")) == before
        assert len(ctl.events(limit=100000)) == events
        done = ctl.repair_usage(dry_run=False)
        assert done == plan
        check_store_invariants(ctl.engine)
        last = ctl.events(limit=100000)[-1]
        assert last["action"] == "usage.repair" and last["params"]["changes"] == len(plan)
        assert ctl.repair_usage() == []
    finally:
        ctl.close()
    assert _failing(store) == {}


def test_cli_usage_repair_is_a_dry_run_without_apply(store: Store) -> None:
    _drift(store)
    res = cli(store, "db", "repair-usage")
    assert res.exit_code == 0 and "vms" in res.output and "dry run" in res.output, res.output
    assert "tenant-usage" in _failing(store)
    res = cli(store, "db", "repair-usage", "--apply")
    assert res.exit_code == 0, res.output
    assert _failing(store) == {}
