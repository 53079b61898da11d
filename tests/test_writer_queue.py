"""The SQLite writer queue: controllers take turns on a file lock before SQLite's write lock."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from vgpu_ctl import Controller
from vgpu_ctl.store import migrate
from vgpu_ctl.store.database import Database
from vgpu_ctl.store.engine import make_engine
from vgpu_ctl.store.tables import TENANT
from vgpu_ctl.store.writer_queue import WriterQueue


def _hold(path: str, ready: object, release: object) -> None:
    q = WriterQueue(path)
    with q.turn():
        ready.set()  # type: ignore[attr-defined]
        release.wait(10)  # type: ignore[attr-defined]
    q.close()


def test_a_second_process_waits_for_the_turn(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(db, ready, release))
    p.start()
    try:
        assert ready.wait(10)
        q = WriterQueue(db)
        t0 = time.perf_counter()
        timer = ctx.Process(target=lambda: (time.sleep(0.3), release.set()))
        timer.start()
        with q.turn():
            waited = time.perf_counter() - t0
        timer.join()
        q.close()
        assert waited >= 0.25  # it got its turn only when the other released it
    finally:
        release.set()
        p.join(10)


def test_nested_turns_in_one_thread_do_not_wait(tmp_path: Path) -> None:
    q = WriterQueue(str(tmp_path / "s.db"))
    with q.turn(), q.turn():
        pass
    with q.turn():  # released by the outer turn only: taken again at once
        pass
    q.close()
    assert Path(q.path).exists() and q.path.endswith("s.db.lock")


def test_only_sqlite_file_stores_have_a_queue(tmp_path: Path) -> None:
    assert WriterQueue.for_engine(make_engine(f"sqlite:///{tmp_path / 'a.db'}")) is not None
    assert WriterQueue.for_engine(make_engine("sqlite://")) is None


@pytest.mark.postgres
def test_postgres_has_no_queue(pg_url: str) -> None:
    assert WriterQueue.for_engine(make_engine(pg_url)) is None


def test_controller_writes_take_the_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    ctl = Controller(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        turns: list[int] = []
        queue = ctl.ctx.db._writers
        assert queue is not None
        real = queue.turn

        def counted():  # type: ignore[no-untyped-def]
            turns.append(1)
            return real()

        monkeypatch.setattr(queue, "turn", counted)
        ctl.create_tenant("acme")
        assert turns  # an admin write went through the queue
    finally:
        ctl.close()


def test_a_write_waits_for_a_connection_before_it_takes_the_turn(tmp_path: Path) -> None:
    """Claims hold every connection of the pool and wait for the turn while a write starts: the write waits
    for a connection without holding the turn, so the claims go first and then the write. Taking the turn
    first, the write held it while it waited for a connection they held: all stalled until the pool's
    timeout."""
    db = Database(f"sqlite:///{tmp_path / 's.db'}")
    migrate.upgrade(db.engine)
    pool = db.engine.pool
    held = pool.size() + pool._max_overflow  # type: ignore[attr-defined]  # every connection the pool gives
    have_connection, go = threading.Barrier(held + 1), threading.Event()
    done: list[str] = []

    def claim(i: int) -> None:
        with db.engine.connect():
            have_connection.wait(10)
            go.wait(10)
            with db.write_turn():
                done.append(f"claim {i}")

    def write() -> None:
        with db.write() as tx:
            tx.execute(TENANT.insert().values(name="acme"))
        done.append("write")

    claims = [threading.Thread(target=claim, args=(i,)) for i in range(held)]
    for t in claims:
        t.start()
    have_connection.wait(10)
    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.3)  # the write is waiting by now (if not yet, it comes after the claims all the same)
    go.set()
    for t in [*claims, writer]:
        t.join(20)
    try:
        assert not any(t.is_alive() for t in [*claims, writer]), "stalled: the turn and the pool wait on each other"
        assert sorted(done) == sorted([*(f"claim {i}" for i in range(held)), "write"])
        with db.read() as conn:
            assert conn.execute(select(TENANT.c.name)).scalars().all() == ["acme"]
    finally:
        db.close()


def test_a_read_holds_no_lock_and_reads_one_snapshot(tmp_path: Path) -> None:
    """A transaction of a connection for reads (`Database.read`) takes no SQLite lock: writers go on while it
    lasts, and it goes on reading the store as it was when it began. In the writer turn the same connection
    begins with BEGIN IMMEDIATE (a claim reads, then writes in its turn), and other writers wait."""
    path = tmp_path / "s.db"
    db = Database(f"sqlite:///{path}")
    migrate.upgrade(db.engine)
    names = select(TENANT.c.name)
    try:
        with db.read() as conn:
            assert conn.execute(names).all() == [] and conn.in_transaction()
            with db.write() as tx:
                tx.execute(TENANT.insert().values(name="acme"))
            other = sqlite3.connect(path, timeout=0, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")  # no wait allowed: the lock is free
            other.execute("ROLLBACK")
            assert conn.execute(names).all() == []  # still the store as it was
        with db.read() as conn, db.write_turn():
            assert conn.execute(names).scalars().all() == ["acme"]
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.close()
    finally:
        db.close()
