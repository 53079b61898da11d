"""`vgpuctl db backup` / `db restore`: consistent copies while in use, refusals of foreign or newer files."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import time
from pathlib import Path

import pytest
from opsfixtures import Store, build_store, cli, clone, template_store

from vgpu_ctl import Controller, InvalidInput
from vgpu_ctl.ops.backup import Unsupported, backup, restore, store_path
from vgpu_ctl.ops.doctor import diagnose

CHILD_VMS = 16


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _vm_names(store: Store) -> list[str]:
    return sorted(r[0] for r in store.sql("SELECT name FROM vm"))


def test_backup_and_restore_round_trip(store: Store, tmp_path: Path) -> None:
    file = tmp_path / "b" / "backup.db"
    res = cli(store, "db", "backup", str(file))
    assert res.exit_code == 0, res.output
    assert file.read_bytes()[:16] == b"SQLite format 3\x00"
    before = _vm_names(store)
    ctl = store.ctl()
    try:
        ctl.release_vm("a1")
        ctl.create_tenant("initech")
    finally:
        ctl.close()
    assert _vm_names(store) != before
    res = cli(store, "db", "restore", str(file), "--yes")
    assert res.exit_code == 0, res.output
    assert _vm_names(store) == before
    assert "initech" not in {r[0] for r in store.sql("SELECT name FROM tenant")}


def test_restore_is_seen_by_an_open_controller(store: Store, tmp_path: Path) -> None:
    file = tmp_path / "backup.db"
    admin = store.ctl()
    try:
        backup(admin, file)
        admin.release_vm("g1")
        reader = store.ctl()
        assert "g1" not in {v.name for v in reader.list_vms()}
        restore(admin, file)
        assert "g1" in {v.name for v in reader.list_vms()}
        assert all(r.ok for r in diagnose(reader))
        reader.close()
    finally:
        admin.close()


def test_restore_refuses_what_is_not_a_store(store: Store, tmp_path: Path) -> None:
    before = _vm_names(store)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 100)
    res = cli(store, "db", "restore", str(text), "--yes")
    assert res.exit_code == 2 and "not a SQLite database" in res.output
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE things (x INTEGER)")
    conn.commit()
    conn.close()
    res = cli(store, "db", "restore", str(other), "--yes")
    assert res.exit_code == 2 and "not a vgpu-ctl store" in res.output and "alembic_version" in res.output
    res = cli(store, "db", "restore", str(tmp_path / "missing.db"), "--yes")
    assert res.exit_code == 2 and "does not exist" in res.output
    assert _vm_names(store) == before


def test_restore_refuses_a_newer_schema(store: Store, tmp_path: Path) -> None:
    file = tmp_path / "newer.db"
    assert cli(store, "db", "backup", str(file)).exit_code == 0
    conn = sqlite3.connect(file)
    conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    conn.commit()
    conn.close()
    ctl = store.ctl()
    try:
        ctl.release_vm("a1")
    finally:
        ctl.close()
    res = cli(store, "db", "restore", str(file), "--yes")
    assert res.exit_code == 2
    assert "9999_from_the_future" in res.output and "newer" in res.output
    assert "a1" not in _vm_names(store)


def test_restore_asks_for_confirmation(store: Store, tmp_path: Path) -> None:
    file = tmp_path / "b.db"
    assert cli(store, "db", "backup", str(file)).exit_code == 0
    ctl = store.ctl()
    try:
        ctl.release_vm("a1")
    finally:
        ctl.close()
    assert cli(store, "db", "restore", str(file), input="n\n").exit_code == 1
    assert "a1" not in _vm_names(store)


def test_backup_onto_the_store_itself_is_refused(store: Store) -> None:
    assert cli(store, "db", "backup", str(store.db)).exit_code == 2


def test_postgres_store_is_unsupported_with_a_pg_dump_hint() -> None:
    pytest.importorskip("psycopg")
    ctl = Controller("postgresql://nobody@127.0.0.1:1/none", init=False)
    with pytest.raises(Unsupported) as exc:
        store_path(ctl)
    assert "pg_dump" in exc.value.message and isinstance(exc.value, InvalidInput)


def _create_vms(url: str, state: str, started: mp.synchronize.Event) -> None:
    ctl = Controller(url, state_path=Path(state))
    try:
        for i in range(CHILD_VMS):
            ctl.request_vm("globex", f"bulk{i:02d}", "A100D-4C", vcpus=1, memory_mib=512, pool="training")
            started.set()
    finally:
        ctl.close()


@pytest.mark.slow
def test_backup_while_another_process_creates_vms_restores_consistent(tmp_path: Path) -> None:
    src = build_store(tmp_path / "live", vms=False)
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    child = ctx.Process(target=_create_vms, args=(src.url, str(src.state), started))
    child.start()
    backups: list[Path] = []
    admin = src.ctl()
    try:
        assert started.wait(60)
        while child.is_alive() and len(backups) < 40:
            f = tmp_path / f"b{len(backups):02d}.db"
            backup(admin, f)
            backups.append(f)
            time.sleep(0.05)
    finally:
        admin.close()
        child.join(120)
    assert child.exitcode == 0
    counts = []
    for i, f in enumerate(backups):
        target = build_store(tmp_path / f"restored{i}", vms=False)
        ctl = target.ctl()
        try:
            restore(ctl, f)
            results = diagnose(ctl)
            assert all(r.ok for r in results), [(r.name, r.problems) for r in results if not r.ok]
            counts.append(len(ctl.list_vms()))
        finally:
            ctl.close()
    assert any(0 < n < CHILD_VMS for n in counts), counts  # at least one copy was taken mid-way
