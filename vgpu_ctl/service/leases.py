"""Leases on VMs' in-flight operations: which process is provisioning, releasing or repairing a VM, and
until when. The holder renews its lease while it works; a lease whose time has passed, or whose holder is a
process of this machine that no longer runs, holds nothing, so reconcile can finish the VM at once."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.vm_state import check_move
from vgpu_ctl.errors import Conflict, PreconditionFailed
from vgpu_ctl.service.ports import STORE, Tx, utcnow
from vgpu_ctl.store.vms import VmRow

if TYPE_CHECKING:
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
    """While open, renews `holder`'s lease on the VM to `seconds` (default: this process's lease time) from
    now, every third of that (on a background thread)."""

    def __init__(self, ctl: Controller, vm_id: str, holder: str, seconds: float | None = None) -> None:
        self._ctl, self._vm_id, self._holder = ctl, vm_id, holder
        seconds = _lease_seconds if seconds is None else seconds
        self._seconds, self._every = seconds, seconds / 3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{vm_id[:8]}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                with self._ctl.tx() as conn:
                    kept = STORE.vms.set_vm_lease(conn, self._vm_id, self._holder, self._holder,
                                                  expiry(self._seconds))
                if not kept:
                    return  # the lease ended (or the VM is gone): nothing more to renew
            except Exception:  # a busy store: try again at the next tick, while the lease still runs
                continue

    def __enter__(self) -> Renewal:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
