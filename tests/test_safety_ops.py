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
