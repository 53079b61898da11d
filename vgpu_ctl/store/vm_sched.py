"""VMs' scheduling rows in the store (`vm_sched`): priority, fair-share charge and preemption history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import func, select, update

from vgpu_ctl.store.prepared import insert_all
from vgpu_ctl.store.tables import VM_SCHED
from vgpu_ctl.store.unit import Tx


class VmSchedRow(NamedTuple):
    """A VM's scheduling row: its class and priority as admitted, whether it may be preempted, its fair-share
    charge (framebuffer GiB and compute slices from `admitted_at`, epoch seconds), its preemption history."""

    vm_id: str
    tenant_id: int
    class_name: str | None
    priority: int
    preemptible: bool
    admitted_at: float
    fb_gib: float
    compute_slices: float
    preemptions: int
    protected_below: int | None
    protected_until: float | None


class Holding(NamedTuple):
    """What a VM holding now is charged for fair share, since when (epoch seconds)."""

    tenant_id: int
    admitted_at: float
    fb_gib: float
    compute_slices: float


_INSERT = insert_all(VM_SCHED)  # in every claim's transaction


def add_vm_scheds(tx: Tx, rows: Sequence[VmSchedRow]) -> None:
    """Insert just-claimed VMs' scheduling rows."""
    _INSERT.run_many(tx, [r._asdict() for r in rows])


def set_preemption_history(tx: Tx, vm_id: str, preemptions: int, protected_below: int | None,
                           protected_until: float) -> None:
    """Set the VM's preemption count and the protection (below a priority, until epoch seconds) it has."""
    tx.execute(update(VM_SCHED).where(VM_SCHED.c.vm_id == vm_id).values(
        preemptions=preemptions, protected_below=protected_below, protected_until=protected_until))


def preemptions(tx: Tx, vm_id: str) -> int:
    """How often the VM was preempted (0 without a scheduling row)."""
    n = tx.execute(select(VM_SCHED.c.preemptions).where(VM_SCHED.c.vm_id == vm_id)).scalar()
    return int(n or 0)


def holdings(tx: Tx) -> list[Holding]:
    """What every VM with a scheduling row is charged now."""
    return [Holding(*r) for r in tx.execute(select(VM_SCHED.c.tenant_id, VM_SCHED.c.admitted_at, VM_SCHED.c.fb_gib,
                                                   VM_SCHED.c.compute_slices))]


def class_vm_counts(tx: Tx) -> dict[str | None, int]:
    """How many VMs hold each priority class (None: no class)."""
    return {name: int(n) for name, n in tx.execute(
        select(VM_SCHED.c.class_name, func.count()).group_by(VM_SCHED.c.class_name))}
