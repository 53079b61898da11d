"""VMs' scheduling rows in the store (`vm_sched`): priority, fair-share charge and preemption history."""

from __future__ import annotations

from sqlalchemy import update

from vgpu_ctl.store.tables import VM_SCHED
from vgpu_ctl.store.unit import Tx


def set_preemption_history(tx: Tx, vm_id: str, preemptions: int, protected_below: int | None,
                           protected_until: float) -> None:
    """Set the VM's preemption count and the protection (below a priority, until epoch seconds) it has."""
    tx.execute(update(VM_SCHED).where(VM_SCHED.c.vm_id == vm_id).values(
        preemptions=preemptions, protected_below=protected_below, protected_until=protected_until))
