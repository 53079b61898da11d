"""Reconcile: compare the store with what the hosts really have, report drift, and with fix repair it.

It never removes a device that a defined domain uses, and never touches a domain it did not write. A VM in
the middle of an operation (a rebalance move included) is reported in progress while a live process holds its
lease, and finished (or rolled back) at once when none does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.vm_state import BEFORE_DOMAIN, IN_FLIGHT, LIVE, VmState
from vgpu_ctl.hosts.protocol import DeviceSpec
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.leases import is_held, new_holder, take
from vgpu_ctl.service.ports import STORE
from vgpu_ctl.service.provision import domain_name, provision_vm, release_vm, undo
from vgpu_ctl.service.requests import Finding as Finding  # their home, re-exported
from vgpu_ctl.service.requests import ReconcileReport as ReconcileReport

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller



def reconcile(ctl: Controller, fix: bool = False, progress: Any = None,
              confirm_undefine: Callable[[Finding], bool] | None = None,
              confirm_adopt: Callable[[Finding], bool] | None = None) -> ReconcileReport:
    """Compare every host with the store; with `fix`, repair what is safe to repair. A domain of a VM the store
    does not know is adopted (claimed again as its metadata records it) when `confirm_adopt(finding)` says
    yes; else a running one is undefined only if `confirm_undefine(finding)` says yes (never without it)."""
    report = ReconcileReport()
    moving = _moves(ctl, report, fix)
    with ctl.read() as conn:
        hosts = STORE.hosts.host_rows(conn)
        vms = STORE.vms.vm_statuses(conn)
        devices = STORE.vms.device_refs(conn)
    store_uuids = {d.uuid: d.vm_id for d in devices}  # every claimed device: none of them is an orphan
    uuids_of: dict[str, set[str]] = {}  # per VM, the devices a host must show (grouped once, not per VM)
    for dev in devices:
        if dev.backing != "pci":  # a passthrough GPU is not a device a host makes: it cannot go missing
            uuids_of.setdefault(dev.vm_id, set()).add(dev.uuid)
    vm_ids = {v.id for v in vms}
    vms_on: dict[int | None, list[Any]] = {}  # by host: one pass over the VMs, not one per host
    for v in vms:
        vms_on.setdefault(v.host_id, []).append(v)
    for host in hosts:
        report.hosts += 1
        if progress is not None:
            progress(host.name)
        driver = ctl.hosts.get(host)
        try:
            host_devices = driver.list_devices()
            domains = driver.list_domains()
        except Exception as exc:
            report.findings.append(Finding("host-unreachable", host.name, host.uri, str(exc)))
            continue
        domain_names = {d.name for d in domains}
        used_by_domain = {dev for d in domains for dev in (*d.metadata.get("devices", "").split(","), *d.hostdevs)
                          if dev}  # the controller's device ids, and what each domain's XML takes (foreign too)
        for d in domains:
            vm_id = d.metadata.get("vm_id")
            if not vm_id:
                report.findings.append(Finding("foreign-domain", host.name, d.name,
                                               "domain not written by vgpu-ctl; left alone"))
                report.findings[-1].fixed = True  # nothing to repair: informational
            elif vm_id not in vm_ids:
                f = Finding("unknown-domain", host.name, d.name, f"vgpu-ctl domain of VM {vm_id} the store "
                                                                 "does not know", action="undefine domain")
                if fix and d.claim is not None and confirm_adopt is not None and confirm_adopt(f):
                    f.action = "adopt VM"
                    try:
                        adopted = ctl.adopt_domain(host.name, d)
                        store_uuids.update({dev.uuid: adopted.id for dev in adopted.devices})
                        f.fixed = True
                    except Exception as exc:  # refused (quota, a position taken...): reported, nothing changed
                        f.error = str(exc)
                elif fix and d.active and (confirm_undefine is None or not confirm_undefine(f)):
                    f.action = "left running (not confirmed)"
                elif fix:
                    _try(f, partial(driver.undefine_domain, d.name))
                    used_by_domain -= set(d.metadata.get("devices", "").split(","))
                report.findings.append(f)
        host_uuids = {hd.uuid for hd in host_devices if hd.uuid and hd.active}
        held = {hd.uuid for hd in host_devices if hd.uuid in used_by_domain or hd.pci_address in used_by_domain}
        for hd in host_devices:
            if hd.uuid is None or hd.uuid in store_uuids:
                continue
            if hd.uuid in held:
                report.findings.append(Finding("orphan-device", host.name, hd.uuid,
                                               f"{hd.profile} on {hd.gpu_pci} has no claim but a defined domain "
                                               "uses it; not removed", action="none (in use)"))
                continue
            f = Finding("orphan-device", host.name, hd.uuid, f"{hd.profile} on {hd.gpu_pci} has no claim",
                        action="remove device")
            if fix:
                spec = DeviceSpec(device_id=hd.uuid, gpu_pci=hd.gpu_pci, backing=hd.backing,
                                  profile=hd.profile or "", start=0, size=0, uuid=hd.uuid)
                _try(f, partial(driver.remove_device, spec))
            report.findings.append(f)
        running = {d.name for d in domains if d.active}
        for vm in vms_on.get(host.id, ()):
            if vm.id in moving:  # devices on two hosts until its move is settled: reported above
                continue
            report.findings.extend(_check_vm(ctl, vm, host, domain_names, host_uuids, uuids_of.get(vm.id, set()),
                                             fix, running))
    if fix and report.findings:
        with ctl.tx() as conn:
            record(conn, ctl.principal.actor, "reconcile.fix", "fleet",
                   params={"findings": len(report.findings), "fixed": sum(f.fixed for f in report.findings)})
    return report


def _moves(ctl: Controller, report: ReconcileReport, fix: bool) -> set[str]:
    """Rebalance moves under way or interrupted (service.rebalance): one a live process holds is in progress;
    one no process holds is `interrupted-move`, which fix finishes (from step done) or rolls back (before). The
    VMs whose move is not settled, which the other checks leave alone."""
    from vgpu_ctl.service.rebalance import pending_moves, resume_move

    with ctl.read() as conn:
        pending = pending_moves(conn)
    moving = set()
    for mv in pending:
        where = f"{mv.from_host} -> {mv.to_host or '(not claimed yet)'}"
        if is_held(mv.lease_holder, mv.lease_expires):
            report.findings.append(Finding("in-progress", mv.from_host, f"vm:{mv.vm_id}",
                                           f"VM {mv.name} is being moved ({where}, step {mv.step}) by process "
                                           f"{mv.lease_holder}", action="wait"))
            moving.add(mv.vm_id)
            continue
        forward = mv.step == "done"
        f = Finding("interrupted-move", mv.from_host, f"vm:{mv.vm_id}",
                    f"VM {mv.name}: its rebalance move ({where}) stopped at step {mv.step} (no process holds it)",
                    action="finish move" if forward else "roll back move")
        if fix:
            _try(f, partial(resume_move, ctl, mv.vm_id))
        if not f.fixed:
            moving.add(mv.vm_id)
        report.findings.append(f)
    return moving


def _roll_back(ctl: Controller, vm: Any) -> None:
    holder = new_holder()
    with ctl.tx() as conn:
        if take(conn, vm.id, holder, BEFORE_DOMAIN, what="roll back") is None:
            raise RuntimeError(f"VM {vm.name} is no longer {vm.state}")
    undo(ctl, vm.id, f"rolled back by reconcile: left {vm.state} by a process that stopped", holder)


def _check_vm(ctl: Controller, vm: Any, host: Any, domain_names: set[str], host_uuids: set[str],
              mine: set[str], fix: bool, running: set[str] | None = None) -> list[Finding]:
    name = domain_name(vm)
    def finding(kind: str, detail: str, action: str, repair: Callable[[], object]) -> list[Finding]:
        f = Finding(kind, host.name, f"vm:{vm.id}", detail, action=action)
        if fix:
            _try(f, repair)
        return [f]

    if vm.state in IN_FLIGHT and is_held(vm.lease_holder, vm.lease_expires):
        return [Finding("in-progress", host.name, f"vm:{vm.id}",
                        f"VM {vm.name} is {vm.state}: process {vm.lease_holder} is working on it (lease until "
                        f"{vm.lease_expires:%Y-%m-%d %H:%M:%S}Z, renewed while it works)", action="wait")]
    if vm.state in BEFORE_DOMAIN:
        return finding("stuck-claim", f"VM {vm.name} left {vm.state} (no process holds it)", "roll back",
                       lambda: _roll_back(ctl, vm))
    if vm.state == VmState.RELEASING:
        return finding("stuck-release", f"VM {vm.name} left releasing (no process holds it)", "finish release",
                       lambda: release_vm(ctl, vm.id))
    if vm.state not in (VmState.DEFINED, *LIVE):
        return []
    missing_devices = sorted(mine - host_uuids)
    if name in domain_names and not missing_devices:
        if vm.state == VmState.DEFINED:
            return finding("stuck-start", f"VM {vm.name} defined but never started (no process holds it)",
                           "start domain", lambda: provision_vm(ctl, vm.id))
        return []
    what = []
    if name not in domain_names:
        what.append(f"domain {name} vanished")
    if missing_devices:
        what.append(f"devices missing on host: {', '.join(missing_devices)}")
    if name in (running or set()):  # never recreate (or undo) devices under a running guest
        return [Finding("lost-vm", host.name, f"vm:{vm.id}", f"VM {vm.name} ({vm.state}): {'; '.join(what)}; "
                        "its domain is running, so nothing is touched", action="none (domain running): stop "
                        "the VM, then `vgpuctl reconcile --fix` recreates its devices")]

    def recreate() -> None:
        holder = new_holder()
        with ctl.tx() as conn:
            if take(conn, vm.id, holder, (VmState.DEFINED, *LIVE), to_state=VmState.PLACED, what="recreate") is None:
                raise RuntimeError(f"VM {vm.name} is no longer {vm.state}")
            STORE.vms.reclaim_devices(conn, vm.id)
        provision_vm(ctl, vm.id, holder, start=vm.state != VmState.STOPPED)  # a stopped VM stays stopped

    return finding("lost-vm", f"VM {vm.name} ({vm.state}): {'; '.join(what)}", "recreate devices and domain",
                   recreate)


def _try(f: Finding, action: Callable[[], object]) -> None:
    try:
        action()
        f.fixed = True
    except Exception as exc:
        f.error = str(exc)
