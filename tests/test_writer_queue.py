"""The SQLite writer queue: controllers take turns on a file lock before SQLite's write lock."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from vgpu_ctl import Controller
from vgpu_ctl.store.engine import make_engine
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
