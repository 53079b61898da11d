"""Reads through the Controller take no SQLite lock: they run while another connection holds the store's write
lock (BEGIN IMMEDIATE), where a read on a plain `engine.connect()` began with BEGIN IMMEDIATE itself and waited
for it (up to the busy timeout, then "database is locked")."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from vgpu_ctl import Controller
from vgpu_ctl.service.requests import OperationInfo
from vgpu_ctl.store import migrate
from vgpu_ctl.store.engine import make_engine

DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"
BUSY_MS = 200  # the store connections' busy timeout here: a read that waits for the lock fails fast


@pytest.fixture
def queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Controller, Path, str]]:
    """A Controller on a SQLite store file with the demo inventory, tenant acme and one request of acme queued
    (its quota allows no VM), its connections made again with a short busy timeout; the store file and the
    queued operation's id."""
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    path = tmp_path / "s.db"
    ctl = Controller(f"sqlite:///{path}")
    try:
        ctl.apply_inventory(DEMO)
        ctl.create_tenant("acme")
        ctl.set_quota("acme", {"vms": 0})
        op = ctl.request_vm("acme", "waits", "1g.10gb", vcpus=1, memory_mib=1024, queue=True)
        assert isinstance(op, OperationInfo)

        @event.listens_for(ctl.engine, "connect")
        def _short_busy(dbapi_conn: Any, _record: Any) -> None:  # after the store's own PRAGMA busy_timeout
            dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_MS}")

        ctl.engine.dispose()  # the pooled connections, made with a 30 s busy timeout, go
        yield ctl, path, op.id
    finally:
        ctl.close()


@contextmanager
def write_lock_held(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection (not the controller's: no writer queue) holding SQLite's write lock on the store."""
    other = sqlite3.connect(path, timeout=0.05, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield other
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_queue_and_reconcile_read_while_another_connection_writes(
        queued: tuple[Controller, Path, str]) -> None:
    """The scheduling queue's listing and reconcile's read of the store (with the fleet's hosts) run while a
    writer holds the lock, and see the store as committed."""
    ctl, path, op_id = queued
    with write_lock_held(path) as other:
        t0 = time.perf_counter()
        assert [q["operation"] for q in ctl.scheduling.queue()] == [op_id]
        report = ctl.reconcile()
        assert report.hosts > 0 and not [f for f in report.findings if f.kind != "foreign-domain"]
        assert time.perf_counter() - t0 < 5
        with pytest.raises(sqlite3.OperationalError, match="locked"):  # the lock is still the other's
            sqlite3.connect(path, timeout=0, isolation_level=None).execute("BEGIN IMMEDIATE")
        other.execute("SELECT 1")


READS: dict[str, Callable[[Controller, str], object]] = {
    "get_operation": lambda c, op: c.get_operation(op),
    "list_operations": lambda c, op: c.list_operations(),
    "get_tenant": lambda c, op: c.get_tenant("acme"),
    "tenant_usage": lambda c, op: c.tenant_usage("acme"),
    "list_tenants": lambda c, op: c.list_tenants(),
    "list_vms": lambda c, op: c.list_vms("acme"),
    "inventory": lambda c, op: c.inventory(),
    "pools": lambda c, op: c.pools(),
    "events": lambda c, op: c.events(),
    "placement_candidates": lambda c, op: c.placement_candidates("acme", [("1g.10gb", 1)], vcpus=1,
                                                                  memory_mib=1024),
    "scheduling.settings": lambda c, op: c.scheduling.settings(),
    "scheduling.list_classes": lambda c, op: c.scheduling.list_classes(),
    "scheduling.share": lambda c, op: c.scheduling.share(),
    "rebalance_plan": lambda c, op: c.rebalance_plan(),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_controller_reads_while_another_connection_writes(queued: tuple[Controller, Path, str], name: str) -> None:
    """Each of these reads answers while a writer holds the lock (before, each waited for it, then failed)."""
    ctl, path, op_id = queued
    expected = READS[name](ctl, op_id)
    with write_lock_held(path):
        assert READS[name](ctl, op_id) == expected


def test_a_store_at_head_opens_while_another_connection_writes(queued: tuple[Controller, Path, str]) -> None:
    """Opening the store asks whether its schema is at head, as a read: a command starts while a claim writes
    (before, the question began with BEGIN IMMEDIATE and waited for the writer)."""
    _ctl, path, _op = queued
    engine = make_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _short_busy(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_MS}")

    try:
        with write_lock_held(path):
            assert migrate.at_head(engine)
    finally:
        engine.dispose()


def test_outside_the_store_a_bare_connection_is_opened_only_to_write() -> None:
    """A bare `engine.connect()` begins with BEGIN IMMEDIATE on SQLite and holds the write lock while it reads:
    outside vgpu_ctl/store/ it is opened only with the writer turn, to write; reads use `read()`."""
    root = Path(__file__).resolve().parent.parent / "vgpu_ctl"
    bare = [f"{p.relative_to(root)}:{n}: {line.strip()}"
            for p in sorted(root.rglob("*.py")) if "store" not in p.relative_to(root).parts
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\bengine\.connect\(\)", line) and "write_turn()" not in line and "READS" not in line]
    assert bare == []
