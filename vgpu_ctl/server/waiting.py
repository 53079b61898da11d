"""Waiting for an operation to end (`?wait=`): a waiter is woken the moment a worker of this process ends the
operation, and reads the store on a short, growing cadence only for an operation no worker here runs (one
another replica holds, or one not yet dispatched)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from starlette.concurrency import run_in_threadpool

from vgpu_ctl.service.operations import OperationInfo

FIRST_PAUSE_S = 0.005  # most operations another replica runs end within milliseconds
LONGEST_PAUSE_S = 0.1
RECHECK_S = 1.0  # an operation a worker here runs: read again this often all the same, in case a wake is missed


class OperationEnds:
    """Who waits for which operation of this process; a worker calls `ended` once the operation's outcome is
    committed, from its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._woken: dict[str, list[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def watching(self, op_id: str, woken: Callable[[], None]) -> Iterator[None]:
        """Call `woken` (from the worker's thread) each time operation `op_id` ends here while the block runs."""
        with self._lock:
            self._woken.setdefault(op_id, []).append(woken)
        try:
            yield
        finally:
            with self._lock:
                calls = self._woken[op_id]
                calls.remove(woken)
                if not calls:
                    del self._woken[op_id]

    def ended(self, op_id: str) -> None:
        """Operation `op_id` ended on this process: wake whoever waits for it."""
        with self._lock:
            calls = list(self._woken.get(op_id, ()))
        for call in calls:
            call()

    def waiting(self) -> int:
        """How many waits are registered now."""
        with self._lock:
            return sum(len(c) for c in self._woken.values())


async def until_done(ends: OperationEnds, runs_here: Callable[[str], bool], read: Callable[[str], OperationInfo],
                     info: OperationInfo, seconds: float) -> OperationInfo:
    """The operation once it is done, or as `read` gives it after `seconds`. No thread is held while it waits,
    so any number of callers may wait at once without keeping others from being answered."""
    if info.done or seconds <= 0:
        return info
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:  # on the worker's thread
        with contextlib.suppress(RuntimeError):  # the loop closed as the wait ended: no one to wake
            loop.call_soon_threadsafe(woken.set)

    deadline = time.monotonic() + seconds
    pause = FIRST_PAUSE_S
    # No end is missed: a worker stops running an operation here before it wakes the operation's waiters, and
    # a waiter registers before it asks whether the operation runs here.
    with ends.watching(info.id, wake):
        while not info.done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait = RECHECK_S if runs_here(info.id) else pause
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(left, wait))
            woken.clear()
            pause = min(pause * 1.5, LONGEST_PAUSE_S)
            info = await run_in_threadpool(read, info.id)
    return info


__all__ = ["OperationEnds", "until_done"]
