"""Hibernation, the `hibernate` victim mode: a preempted VM saved to its host's disk (libvirt managed save) and
resumed when its host has room again; and which victim modes a host supports for a VM's profiles.

A hibernated VM keeps its devices and quota (a vGPU's framebuffer is its own until the vGPU is destroyed, and its
saved state restores only onto that device), so hibernating frees its host's vCPUs and memory, not GPU room: it
helps a preemptor that is short of the host's CPU or memory, never one that needs the victim's GPU slots (the
victim search knows, see `core.preemption.without`). Resuming takes the vCPUs and memory back (NoCapacity when
the host has no room), then starts the domain, which restores the managed save image.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.priority import PreemptionMode
from vgpu_ctl.core.vm_state import VmState
from vgpu_ctl.errors import Conflict, NoCapacity, VgpuCtlError
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.allocation import ClaimConflict
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.leases import Renewal, advance, drop, new_holder, take
from vgpu_ctl.service.ports import STORE, Tx

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

DEFAULT_MODES = (PreemptionMode.REQUEUE, PreemptionMode.CANCEL)
"""What a host supports when its inventory declares nothing for a profile. Hibernation only where declared: it
needs a vGPU driver, guest driver and hypervisor that support suspend-resume (NVIDIA's feature chart)."""


def supported_modes(declared: Mapping[str, Collection[str]] | None, profiles: Collection[str],
                    backings: Collection[str], running: bool) -> tuple[frozenset[PreemptionMode], list[str]]:
    """The victim modes a VM with devices of `profiles` (and `backings`) supports on a host that declares
    `declared` (per profile, '*' for the rest; None: the defaults): what every one of its profiles allows (a VM
    without devices: what '*' allows), less hibernate for whole-GPU passthrough (NVIDIA: no managed save with
    passthrough) and for a VM that is not running (no memory to save); with why each mode was left out."""
    table = {k: {PreemptionMode(m) for m in v} for k, v in (declared or {}).items()}
    fallback = table.get("*", set(DEFAULT_MODES))
    modes = set(PreemptionMode)
    notes: list[str] = []
    for p in sorted(set(profiles)) or ["*"]:
        allowed = table.get(p, fallback)
        if modes - allowed:
            notes.append(f"{p}: {', '.join(sorted(allowed)) or 'none'}")
        modes &= allowed
    if PreemptionMode.HIBERNATE in modes and "pci" in backings:
        modes.discard(PreemptionMode.HIBERNATE)
        notes.append("no hibernate for a passthrough GPU")
    if PreemptionMode.HIBERNATE in modes and not running:
        modes.discard(PreemptionMode.HIBERNATE)
        notes.append("no hibernate for a VM that is not running")
    return frozenset(modes), notes


def _host_step(ctl: Controller, vm_id: str, holder: str, step: Callable[[], None],
               undo: Callable[[Tx], None]) -> None:
    """Run `step` on the VM's host while `holder`'s lease is renewed; if it fails, `undo` in a transaction and
    raise again."""
    try:
        with Renewal(ctl, vm_id, holder):
            step()
    except VgpuCtlError:
        with ctl.tx() as conn:
            undo(conn)
        raise


def hibernate(ctl: Controller, vm_id: str) -> None:
    """Hibernate a running VM: in the store first (state hibernated, its host's vCPUs and memory given back, so a
    crash after it leaves a VM the queue resumes), then the managed save on its host; a failed save puts it back
    running, charged again. Conflict when the VM is not running or another process works on it."""
    from vgpu_ctl.service.provision import domain_name, placed_host
    holder = new_holder()
    with ctl.tx() as conn:
        vm = take(conn, vm_id, holder, (VmState.RUNNING,), to_state=VmState.HIBERNATED, what="hibernate")
        if vm is None or vm.host_id is None:
            raise Conflict(f"VM {vm_id} is not running: only a running VM can be hibernated",
                           reasons=[{"vm": vm_id}])
        host_id = vm.host_id
        alloc.release_host(conn, host_id, vm.vcpus, vm.memory_mib)
        host = placed_host(conn, vm_id)
    def undo(conn: Tx) -> None:
        if advance(conn, vm_id, holder, (VmState.HIBERNATED,), VmState.RUNNING, keep_lease=False):
            alloc.release_host(conn, host_id, -vm.vcpus, -vm.memory_mib)  # it still runs: charged again

    _host_step(ctl, vm_id, holder, lambda: ctl.hosts.get(host).managed_save(domain_name(vm)), undo)
    with ctl.tx() as conn:
        drop(conn, vm_id, holder)


def resume(ctl: Controller, vm_id: str, history: Mapping[str, Any] | None = None) -> None:
    """Resume a hibernated VM: take its host's vCPUs and memory back and start its domain (libvirt restores the
    managed save image); a preempted one counts the preemption and gets its cool-down (`history`). NoCapacity
    when its host has no room now; Conflict when it is not hibernated; a failed start leaves it hibernated."""
    from vgpu_ctl.service.provision import domain_name, placed_host
    holder = new_holder()
    with ctl.tx() as conn:
        vm = take(conn, vm_id, holder, (VmState.HIBERNATED,), what="resume")
        if vm is None or vm.host_id is None:
            raise Conflict(f"VM {vm_id} is not hibernated", reasons=[{"vm": vm_id}])
        host_id = vm.host_id
        try:
            alloc.claim_host(conn, host_id, vm.vcpus, vm.memory_mib)
        except ClaimConflict:
            host_ref = STORE.vms.host_of(conn, host_id)
            host_name = host_ref[0] if host_ref is not None else None
            raise NoCapacity(f"hibernated VM {vm.name!r} resumes only on its host {host_name}, which has no room "
                             f"for its {vm.vcpus} vCPUs and {vm.memory_mib} MiB of memory now (or is not active)",
                             reasons=[{"kind": "host", "host": host_name, "vcpus": vm.vcpus,
                                       "memory_mib": vm.memory_mib}]) from None
        host = placed_host(conn, vm_id)
    def give_back(conn: Tx) -> None:
        alloc.release_host(conn, host_id, vm.vcpus, vm.memory_mib)
        drop(conn, vm_id, holder)

    _host_step(ctl, vm_id, holder, lambda: ctl.hosts.get(host).start_domain(domain_name(vm)), give_back)
    h = history or {}
    with ctl.tx() as conn:
        if not advance(conn, vm_id, holder, (VmState.HIBERNATED,), VmState.RUNNING, keep_lease=False):
            raise Conflict(f"VM {vm.name!r} changed while it was being resumed", reasons=[{"vm": vm.name}])
        if h:
            now = time.time()
            STORE.vm_sched.set_preemption_history(conn, vm_id, int(h.get("preemptions", 0)),
                                                  h.get("protected_below"), now + float(h.get("cooldown_s", 0.0)))
        record(conn, ctl.principal.actor, "vm.resume", f"vm:{vm_id}",
               tenant=STORE.tenants.tenant_name(conn, vm.tenant_id), params={"name": vm.name, "restored": True})
