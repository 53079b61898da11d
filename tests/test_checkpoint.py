"""The background WAL checkpointer of a SQLite store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import DEMO

from vgpu_ctl import Controller
from vgpu_ctl.store.checkpoint import WalCheckpointer
from vgpu_ctl.store.engine import make_engine


def test_controller_connections_leave_checkpoints_to_the_thread(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    db = tmp_path / "s.db"
    ctl = Controller(f"sqlite:///{db}")
    try:
        with ctl.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
        checkpointer = ctl.ctx.db.checkpointer
        assert checkpointer is not None
        before = checkpointer.checkpoints
        ctl.apply_inventory(DEMO)  # writes pages to the log
        deadline = time.monotonic() + 10
        while checkpointer.checkpoints < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checkpointer.checkpoints >= before + 2  # the thread runs on its own
        busy, log, done = checkpointer.checkpoint()
        assert busy == 0 and log == done  # nothing left behind in the log
    finally:
        ctl.close()
    assert not ctl.ctx.db.checkpointer._thread.is_alive()  # type: ignore[union-attr]


def test_other_engines_keep_sqlite_automatic_checkpoints(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 's.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 1000
    finally:
        engine.dispose()
    assert WalCheckpointer.for_engine(make_engine("sqlite://")) is None


def test_a_removed_store_is_not_created_again(tmp_path: Path) -> None:
    db = tmp_path / "gone.db"
    engine = make_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x)")
    engine.dispose()
    checkpointer = WalCheckpointer(engine, interval_s=0.05)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    time.sleep(0.3)
    checkpointer.stop()
    assert not db.exists()  # the thread found nothing to checkpoint and stopped; it made no empty store


def test_a_log_past_its_limit_is_restarted(tmp_path: Path) -> None:
    db = tmp_path / "big.db"
    engine = make_engine(f"sqlite:///{db}")
    checkpointer = WalCheckpointer(engine, interval_s=60, restart_frames=4)  # the test runs it by hand
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (x)")
            for i in range(200):
                conn.exec_driver_sql(f"INSERT INTO t VALUES ('{'x' * 500}{i}')")
        busy, log, done = checkpointer.checkpoint()  # past 4 frames: the PASSIVE pass, then RESTART
        assert busy == 0 and log > 4 and log == done
    finally:
        checkpointer.stop()
        engine.dispose()


def test_a_restart_does_not_hold_writers_behind_a_long_read(tmp_path: Path) -> None:
    """A read on an old snapshot (a `status` of a large fleet) keeps the log from being restarted. The RESTART
    that finds it gives up within RESTART_WAIT_MS instead of holding the write lock until the read ends: a
    writer that starts meanwhile commits at once, and the log is restarted once the read is gone."""
    import sqlite3
    import threading

    db = tmp_path / "read.db"
    engine = make_engine(f"sqlite:///{db}")
    checkpointer = WalCheckpointer(engine, interval_s=60, restart_frames=4)
    reader = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (x)")
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM t").fetchone()  # the read's snapshot: before the rows below
        with engine.begin() as conn:
            for i in range(200):
                conn.exec_driver_sql(f"INSERT INTO t VALUES ('{'x' * 500}{i}')")
        committed: list[float] = []

        def write() -> None:
            time.sleep(0.01)  # while the checkpoint runs
            start = time.monotonic()
            with engine.begin() as conn:
                conn.exec_driver_sql("INSERT INTO t VALUES ('late')")
            committed.append(time.monotonic() - start)

        writer = threading.Thread(target=write)
        threading.Timer(2.0, lambda: reader.execute("COMMIT")).start()  # the long read ends after 2 s
        start = time.monotonic()
        writer.start()
        busy, log, done = checkpointer.checkpoint()  # past 4 frames: PASSIVE, then a RESTART the read blocks
        took = time.monotonic() - start
        writer.join(10)
        assert busy == 1 and done < log  # the frames after the read's snapshot stay in the log
        assert took < 1.0, took  # the RESTART waited RESTART_WAIT_MS, not for the read (2 s)
        assert committed and committed[0] < 1.0, committed  # the writer was not held behind the read
        time.sleep(2.2)
        busy, log, done = checkpointer.checkpoint()  # the read is gone: restarted
        assert busy == 0 and log == done
    finally:
        reader.close()
        checkpointer.stop()
        engine.dispose()


def test_a_controller_dropped_without_close_stops_its_thread(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    ctl = Controller(f"sqlite:///{tmp_path / 'd.db'}")
    checkpointer = ctl.ctx.db.checkpointer
    assert checkpointer is not None and checkpointer._thread.is_alive()
    del ctl
    gc.collect()
    checkpointer._thread.join(5)
    assert not checkpointer._thread.is_alive()
