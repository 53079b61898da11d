"""`?wait=` on an operation: woken when this process's worker ends it, the store polled only for an operation
that no worker here runs, and the wait bounded by its time (vgpu_ctl/server/waiting.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_server_runtime import held_runtime

from vgpu_ctl.server.waiting import RECHECK_S, OperationEnds, until_done
from vgpu_ctl.service.requests import OperationInfo

RUNNING = OperationInfo("op1", "vm.create", "running", "acme", None, {}, None, None, "t0", "t0", None)
SUCCEEDED = dataclasses.replace(RUNNING, state="succeeded", finished_at="t1")


class FakeOperation:
    """An operation that ends after `after` seconds, on a worker of this process (`here`) or elsewhere; counts
    the store reads a wait makes."""

    def __init__(self, ends: OperationEnds, after: float, here: bool) -> None:
        self.ends, self.here, self.reads, self.done = ends, here, 0, False
        self._timer = threading.Timer(after, self._end)

    def _end(self) -> None:
        self.done = True
        if self.here:
            self.here = False  # a worker stops running it here, then wakes its waiters
            self.ends.ended(RUNNING.id)

    def read(self, op_id: str) -> OperationInfo:
        assert op_id == RUNNING.id
        self.reads += 1
        return SUCCEEDED if self.done else RUNNING

    def wait(self, seconds: float) -> tuple[OperationInfo, float]:
        self._timer.start()
        start = time.monotonic()
        info = asyncio.run(until_done(self.ends, lambda _: self.here, self.read, RUNNING, seconds))
        took = time.monotonic() - start
        self._timer.join()
        return info, took


def test_a_wait_for_an_operation_run_here_is_woken_when_it_ends_not_by_polling() -> None:
    ends = OperationEnds()
    op = FakeOperation(ends, 0.4, here=True)
    info, took = op.wait(30)
    assert info.state == "succeeded"
    assert took < RECHECK_S, took  # woken by the end, not by the slow recheck
    assert op.reads == 1  # the store read once, after the wake (polling every 5-100 ms read it 8 times)
    assert ends.waiting() == 0  # the wait no longer registered


def test_a_wait_for_an_operation_elsewhere_polls_the_store() -> None:
    ends = OperationEnds()
    op = FakeOperation(ends, 0.3, here=False)  # another replica ends it: no wake, the store tells
    info, took = op.wait(30)
    assert info.state == "succeeded" and took < 0.3 + 0.2, took
    assert op.reads >= 5  # pauses of 5 ms growing to 100 ms


def test_a_wait_ends_after_its_time_with_the_operation_as_it_is() -> None:
    ends = OperationEnds()
    op = FakeOperation(ends, 0.8, here=True)
    info, took = op.wait(0.2)
    assert info.state == "running" and 0.2 <= took < 0.6, took
    assert ends.waiting() == 0


def test_a_wait_that_starts_done_or_without_time_reads_nothing() -> None:
    ends = OperationEnds()
    op = FakeOperation(ends, 0.0, here=True)
    assert asyncio.run(until_done(ends, lambda _: True, op.read, SUCCEEDED, 30)) is SUCCEEDED
    assert asyncio.run(until_done(ends, lambda _: True, op.read, RUNNING, 0)) is RUNNING
    assert op.reads == 0


def test_the_runtime_wakes_a_wait_when_its_worker_ends_the_operation(tmp_path: Path, state_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with held_runtime(tmp_path, monkeypatch, "define_domain", "w") as (rt, ctl, info, gate):
        assert rt.runs_here(info.id)
        reads: list[Any] = []

        def read(op_id: str) -> OperationInfo:
            found = ctl.get_operation(op_id)
            reads.append(found.state)
            return found

        threading.Timer(0.3, lambda: gate.unlink(missing_ok=True)).start()
        start = time.monotonic()
        done = asyncio.run(until_done(rt.ends, rt.runs_here, read, info, 30))
        took = time.monotonic() - start
        assert done.state == "succeeded", done
        assert ctl.get_vm("acme/w").state == "running"
        assert took < RECHECK_S and reads == ["succeeded"], (took, reads)
        assert not rt.runs_here(info.id) and rt.ends.waiting() == 0
