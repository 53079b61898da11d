"""Leases on VMs' in-flight operations: which process is provisioning, releasing or repairing a VM, and
until when. The holder renews its lease while it works; a lease whose time has passed, or whose holder is a
process of this machine that no longer runs, holds nothing, so reconcile can finish the VM at once."""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import threading
import time
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.vm_state import check_move
from vgpu_ctl.errors import Conflict, PreconditionFailed
from vgpu_ctl.service.ports import STORE, Tx, utcnow
from vgpu_ctl.store.vms import VmRow

if TYPE_CHECKING:
    from vgpu_ctl.service.context import ServiceContext
    from vgpu_ctl.service.controller import Controller

LEASE_SECONDS = 30.0
_HOST = socket.gethostname()


def new_holder() -> str:
    """A holder name for one operation: this machine, this process, and a random part."""
    return f"{_HOST}:{os.getpid()}:{secrets.token_hex(6)}"


_lease_seconds = LEASE_SECONDS


def set_lease_seconds(seconds: float) -> float:
    """Set how long this process's leases on VMs last from each renewal (a server sets its --operation-lease,
    so a VM it was provisioning when it died is taken over as soon as its operation); the time before."""
    global _lease_seconds
    if not seconds > 0:
        raise ValueError(f"a lease must last more than 0 seconds, not {seconds!r}")
    before, _lease_seconds = _lease_seconds, float(seconds)
    return before


def expiry(seconds: float | None = None) -> datetime:
    """When a lease taken or renewed now runs out (this process's lease time unless `seconds`)."""
    return utcnow() + timedelta(seconds=_lease_seconds if seconds is None else seconds)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def pid_runs(pid: int) -> bool:
    """Whether a process with this id runs on this machine (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_held(holder: str | None, expires: datetime | None, now: datetime | None = None) -> bool:
    """True while a lease holds its VM: its time has not passed and, for a holder on this machine, the
    holder's process still runs."""
    if holder is None or expires is None:
        return False
    if _aware(expires) <= _aware(now or utcnow()):
        return False
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host == _HOST and pid.isdigit():
        return pid_runs(int(pid))
    return True


def take(conn: Tx, vm_id: str, holder: str, states: Collection[str], to_state: str | None = None,
         what: str = "change", generation: int | None = None) -> VmRow | None:
    """Take the VM's lease for `holder` (inside the caller's transaction) if the VM is in one of `states` and
    no live process holds it, moving it to `to_state` if given; the VM row as it was, or None when the VM is
    gone or in another state. Conflict when another live process holds it; PreconditionFailed when
    `generation` is given and the VM is at another. A compare-and-set on the lease as read, so two callers
    never both take it."""
    if to_state is not None:
        check_move(states, to_state)
    vm = STORE.vms.vm_row(conn, vm_id)
    check_generation(vm, generation, "VM", vm_id)
    if vm is None or vm.state not in states:
        return None
    if vm.lease_holder not in (None, holder) and is_held(vm.lease_holder, vm.lease_expires):
        raise Conflict(f"VM {vm.name!r} is {vm.state}: another process ({vm.lease_holder}) is working on it "
                       f"until {vm.lease_expires:%Y-%m-%d %H:%M:%S}Z at the latest; try to {what} it later",
                       reasons=[{"vm": vm.name, "state": vm.state, "lease_holder": vm.lease_holder}])
    values: dict[str, Any] = {"lease_holder": holder, "lease_expires": expiry()}
    if to_state is not None:
        values.update(state=str(to_state), updated_at=utcnow())
    if not STORE.vms.retake_vm(conn, vm, values):  # changed since read: someone else took it
        raise Conflict(f"VM {vm.name!r} changed while taking it to {what}; try again",
                       reasons=[{"vm": vm.name, "state": vm.state}])
    return vm


def check_generation(row: Any | None, generation: int | None, kind: str, ref: str) -> None:
    """PreconditionFailed when `generation` is given and the row (a VM's or a tenant's) is at another one."""
    if generation is not None and row is not None and row.generation != generation:
        raise PreconditionFailed(f"{kind} {ref!r} changed since it was read (generation {row.generation}, "
                                 f"not {generation}); read it again and retry",
                                 reasons=[{"field": "generation", "value": generation,
                                           "current": row.generation}])


def advance(conn: Tx, vm_id: str, holder: str, from_states: Collection[str], to_state: str,
            *, keep_lease: bool = True, **values: Any) -> bool:
    """Move the VM from one of `from_states` to `to_state` if `holder` still holds its lease (and, without
    `keep_lease`, end the lease); whether it did."""
    check_move(from_states, to_state)
    lease: dict[str, Any] = {"lease_expires": expiry()} if keep_lease else {"lease_holder": None,
                                                                             "lease_expires": None}
    return STORE.vms.move_vm(conn, vm_id, holder, [str(s) for s in from_states],
                             {"state": str(to_state), "updated_at": utcnow(), **lease, **values})


def drop(conn: Tx, vm_id: str, holder: str) -> None:
    """End `holder`'s lease on the VM, if it still has it."""
    STORE.vms.set_vm_lease(conn, vm_id, holder, None, None)


class Renewal:
    """While open, `holder`'s lease on the VM is renewed to `seconds` (default: this process's lease time)
    from now, every third of that, by this process's one renewer thread (shared by every open Renewal):
    entering registers the lease, leaving unregisters it without waiting for anything. A renewal already
    under way when it leaves may land once more; the compare-and-set on the holder stays the arbiter."""

    def __init__(self, ctl: Controller, vm_id: str, holder: str, seconds: float | None = None) -> None:
        self.ctx, self.vm_id, self.holder = ctl.ctx, vm_id, holder
        self.seconds = _lease_seconds if seconds is None else seconds
        self.every = self.seconds / 3

    def __enter__(self) -> Renewal:
        _RENEWER.add(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _RENEWER.remove(self)


class _Renewer:
    """This process's one lease renewer: a daemon thread, started with the first open Renewal, that extends
    every due lease of a store with one statement (per lease time) and then sleeps until the next is due (a
    lease due no sooner than that does not wake it, so opening a Renewal costs no thread switch)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Start afresh: no leases, no thread (also a child after fork, whose parent's thread does not run in
        it and whose parent's leases are not its own)."""
        self._cond = threading.Condition()
        self._due: dict[Renewal, float] = {}  # open Renewal -> when it is next due (monotonic)
        self._busy: dict[ServiceContext, int] = {}  # stores a renewal is being written to right now
        self._thread: threading.Thread | None = None
        self._wake = float("inf")  # when the waiting thread wakes by itself (inf: it is not waiting)

    def add(self, r: Renewal) -> None:
        """Renew `r`'s lease from now on."""
        with self._cond:
            due = self._due[r] = time.monotonic() + r.every
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
                self._thread.start()
            elif due < self._wake:  # else the thread, woken by then, finds it due: no switch to it now
                self._cond.notify()

    def remove(self, r: Renewal) -> None:
        """Renew `r`'s lease no more."""
        with self._cond:
            self._due.pop(r, None)

    def forget(self, ctx: ServiceContext) -> None:
        """Drop the leases of a store that is closing, once no renewal is being written to it; the thread
        ends when it holds no lease left."""
        with self._cond:
            for r in [r for r in self._due if r.ctx is ctx]:
                del self._due[r]
            self._cond.wait_for(lambda: ctx not in self._busy)
            thread = self._end() if not self._due else None
        self._join(thread)

    def stop(self) -> None:
        """End the thread and drop every lease it holds (at interpreter exit)."""
        with self._cond:
            self._due.clear()
            thread = self._end()
        self._join(thread)

    def _end(self) -> threading.Thread | None:
        """Tell the thread to end (with the lock held); the thread."""
        thread, self._thread = self._thread, None
        self._cond.notify_all()
        return thread

    @staticmethod
    def _join(thread: threading.Thread | None) -> None:
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)  # a daemon: one stuck in a busy store does not hold the exit up

    def _run(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._thread is me:
                now = time.monotonic()
                batch = [r for r, due in self._due.items() if due <= now + r.every / 2]
                if not batch:  # idle, it wakes every third of this process's lease time
                    self._wake = min(self._due.values(), default=now + _lease_seconds / 3)
                    self._cond.wait(self._wake - now)
                    self._wake = float("inf")
                    continue
                groups: dict[tuple[ServiceContext, float], list[Renewal]] = {}
                for r in batch:
                    self._due[r] = now + r.every
                    groups.setdefault((r.ctx, r.seconds), []).append(r)
                for (ctx, seconds), grouped in groups.items():
                    rs = [r for r in grouped if r in self._due]  # not those left or forgotten meanwhile
                    if not rs:
                        continue
                    self._busy[ctx] = self._busy.get(ctx, 0) + 1
                    self._cond.release()
                    try:
                        kept = _renew(ctx, rs, seconds)
                    finally:
                        self._cond.acquire()
                        self._busy[ctx] -= 1
                        if not self._busy[ctx]:
                            del self._busy[ctx]
                        self._cond.notify_all()
                    for r in rs:
                        if kept is not None and r.vm_id not in kept:  # the lease ended (or the VM is gone):
                            self._due.pop(r, None)  # nothing more to renew


def _renew(ctx: ServiceContext, rs: Collection[Renewal], seconds: float) -> set[str] | None:
    """Extend the leases of `rs` (all on `ctx`'s store) to `seconds` from now; the VMs' ids whose lease was
    extended, or None when the store was busy (tried again at the next tick, while the leases still run)."""
    try:
        with ctx.tx() as conn:
            return STORE.vms.renew_vm_leases(conn, [(r.vm_id, r.holder) for r in rs], expiry(seconds))
    except Exception:
        return None


def forget_store(ctx: ServiceContext) -> None:
    """Stop renewing the leases of a store that is closing (its Renewals renew nothing from now on)."""
    _RENEWER.forget(ctx)


_RENEWER = _Renewer()
os.register_at_fork(after_in_child=_RENEWER._reset)
atexit.register(_RENEWER.stop)
