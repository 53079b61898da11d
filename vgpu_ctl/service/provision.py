"""The provisioning state machine: placed -> devices-ready -> defined -> running, and back on release.

The intent is committed before each side effect and each step is idempotent, so a crash anywhere leaves a
state that `reconcile` can finish or roll back. A failed step undoes what the request did.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from vgpu_ctl.catalog import ProfileKind
from vgpu_ctl.errors import Conflict, HostError, VgpuCtlError
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDriver
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.quotas import VM
from vgpu_ctl.store.models import utcnow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

log = logging.getLogger(__name__)


def domain_name(vm: Any) -> str:
    """The libvirt domain name of a VM: its name and the start of its id (unique on every host)."""
    return f"{vm.name}-{vm.id[:8]}"


def _set_state(conn: Connection, vm_id: str, state: str, **values: Any) -> None:
    conn.execute(update(VM).where(VM.c.id == vm_id).values(state=state, updated_at=utcnow(), **values))


def _load(ctl: Controller, conn: Connection, vm_id: str) -> tuple[Any, Any, list[Any]]:
    vm = conn.execute(select(VM).where(VM.c.id == vm_id)).one()
    host = conn.execute(select(alloc.HOST).where(alloc.HOST.c.id == vm.host_id)).one()
    devs = conn.execute(select(alloc.DEVICE, alloc.GPU.c.pci_address, alloc.GPU.c.model)
                        .join(alloc.GPU, alloc.GPU.c.id == alloc.DEVICE.c.gpu_id)
                        .where(alloc.DEVICE.c.vm_id == vm_id).order_by(alloc.DEVICE.c.id)).all()
    return vm, host, list(devs)


def device_spec(ctl: Controller, dev: Any) -> DeviceSpec:
    """What the host needs to create a claimed device."""
    profile = ctl.catalog.profile(dev.model, dev.profile)
    mig_id = profile.profile_id if profile is not None and profile.kind in (ProfileKind.MIG,
                                                                             ProfileKind.MIG_VGPU) else None
    mixed = profile is not None and profile.mixed_placement_ids is not None and dev.start in \
        (profile.mixed_placement_ids or ()) and profile.kind is ProfileKind.VGPU
    return DeviceSpec(device_id=dev.id, gpu_pci=dev.pci_address, backing=DeviceBacking(dev.backing),
                      profile=dev.profile, start=dev.start, size=dev.size, uuid=dev.uuid,
                      mig_profile_id=mig_id, placement_id=dev.start if mixed else None)


def provision_vm(ctl: Controller, vm_id: str) -> None:
    """Drive a placed VM to running; on failure undo everything and raise HostError."""
    try:
        with ctl.engine.connect() as conn:
            vm, host, devs = _load(ctl, conn, vm_id)
        driver = ctl.hosts.get(host)
        if vm.state == "placed":
            for dev in devs:
                if dev.state == "ready":
                    continue
                handle = driver.create_device(device_spec(ctl, dev))
                with ctl.tx() as conn:
                    conn.execute(update(alloc.DEVICE).where(alloc.DEVICE.c.id == dev.id)
                                 .values(state="ready", handle=_handle_json(handle)))
            with ctl.tx() as conn:
                _set_state(conn, vm_id, "devices-ready")
        if vm.state in ("placed", "devices-ready"):
            with ctl.engine.connect() as conn:
                xml = render_vm(ctl, conn, vm_id)
            dom_uuid = driver.define_domain(xml)
            with ctl.tx() as conn:
                _set_state(conn, vm_id, "defined", domain_uuid=dom_uuid)
        driver.start_domain(domain_name(vm))
        with ctl.tx() as conn:
            _set_state(conn, vm_id, "running", error=None)
            record(conn, ctl.principal.actor, "vm.start", f"vm:{vm_id}", tenant=_tenant_name(conn, vm),
                   params={"name": vm.name})
    except VgpuCtlError as exc:
        undo(ctl, vm_id, exc.message)
        if isinstance(exc, HostError):
            raise
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {exc.message}") from exc
    except Exception as exc:
        undo(ctl, vm_id, f"{type(exc).__name__}: {exc}")
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {type(exc).__name__}: {exc}") from exc


def _tenant_name(conn: Connection, vm: Any) -> str | None:
    return conn.execute(select(alloc.TENANT.c.name).where(alloc.TENANT.c.id == vm.tenant_id)).scalar()


def _handle_json(h: DeviceHandle) -> dict[str, Any]:
    return {"backing": h.backing.value, "uuid": h.uuid, "pci_address": h.pci_address,
            "gpu_instance_id": h.gpu_instance_id}


def _teardown(ctl: Controller, driver: HostDriver, vm: Any, devs: list[Any]) -> list[str]:
    """Remove the domain, then each device; the errors met (each step still tried)."""
    errors = []
    try:
        driver.undefine_domain(domain_name(vm))
    except Exception as exc:
        errors.append(f"undefine domain: {exc}")
    for dev in devs:
        try:
            driver.remove_device(device_spec(ctl, dev))
        except Exception as exc:
            errors.append(f"remove device {dev.uuid}: {exc}")
    return errors


def _free_claim(ctl: Controller, conn: Connection, vm: Any, devs: list[Any]) -> None:
    """Give back quota, host capacity and devices of a VM (inside the caller's transaction). Rows are locked
    in the order a claim locks them (tenant, scoped limits, host, GPUs by id), so a release and a claim
    running at once can't deadlock."""
    spec = vm.spec if isinstance(vm.spec, dict) else {}
    scoped = {(s, r): n for s, r, n in spec.get("charges", [])}
    alloc.uncharge(conn, vm.tenant_id, spec.get("delta", {}), {})  # takes the tenant row's lock first
    has_scoped = conn.execute(select(alloc.TENANT.c.has_scoped_limits)
                              .where(alloc.TENANT.c.id == vm.tenant_id)).scalar()
    if has_scoped:
        alloc.uncharge(conn, vm.tenant_id, {}, scoped)
    alloc.release_host(conn, vm.host_id, vm.vcpus, vm.memory_mib)
    alloc.free_devices(conn, ctl.catalog, [d._mapping for d in devs])


def undo(ctl: Controller, vm_id: str, error: str) -> None:
    """Roll a failed request back: host side first, then claim and quota; the VM is kept as failed."""
    with ctl.engine.connect() as conn:
        vm, host, devs = _load(ctl, conn, vm_id)
    if vm.state == "failed":
        return
    errors = _teardown(ctl, ctl.hosts.get(host), vm, devs)
    with ctl.tx() as conn:
        _free_claim(ctl, conn, vm, devs)
        _set_state(conn, vm_id, "failed", error=error + ("; cleanup: " + "; ".join(errors) if errors else ""))
        record(conn, ctl.principal.actor, "vm.create", f"vm:{vm_id}", result="failed", error=error,
               tenant=_tenant_name(conn, vm), params={"name": vm.name})


def release_vm(ctl: Controller, vm_id: str) -> None:
    """Delete a VM: persist 'releasing', remove domain and devices, then free claim and quota."""
    with ctl.tx() as conn:
        vm = conn.execute(select(VM).where(VM.c.id == vm_id)).one()
        if vm.state != "failed":
            _set_state(conn, vm_id, "releasing")
    with ctl.engine.connect() as conn:
        vm, host, devs = _load(ctl, conn, vm_id)
    if vm.state == "releasing":
        errors = _teardown(ctl, ctl.hosts.get(host), vm, devs)
        if errors:
            with ctl.tx() as conn:
                conn.execute(update(VM).where(VM.c.id == vm_id).values(error="; ".join(errors)))
            raise HostError(f"deleting VM {vm.name!r} left work on host {host.name}: {'; '.join(errors)}; "
                            "the VM stays 'releasing' and `vgpuctl reconcile --fix` or a new delete finishes it")
    with ctl.tx() as conn:
        if vm.state == "releasing":
            _free_claim(ctl, conn, vm, devs)
        conn.execute(alloc.DEVICE.delete().where(alloc.DEVICE.c.vm_id == vm_id))
        conn.execute(VM.delete().where(VM.c.id == vm_id))
        tenant = _tenant_name(conn, vm)
        record(conn, ctl.principal.actor, "vm.delete", f"vm:{vm_id}", tenant=tenant, params={"name": vm.name})


def set_power(ctl: Controller, vm_id: str, on: bool, force: bool = False) -> None:
    """Start or stop a VM's domain and record the state."""
    with ctl.engine.connect() as conn:
        vm, host, _ = _load(ctl, conn, vm_id)
    want_from = ("stopped",) if on else ("running",)
    if vm.state not in want_from:
        raise Conflict(f"VM {vm.name!r} is {vm.state}; it must be {' or '.join(want_from)} to "
                       f"{'start' if on else 'stop'}", reasons=[{"vm": vm.name, "state": vm.state}])
    driver = ctl.hosts.get(host)
    if on:
        driver.start_domain(domain_name(vm))
    else:
        driver.stop_domain(domain_name(vm), force=force)
    with ctl.tx() as conn:
        _set_state(conn, vm_id, "running" if on else "stopped")
        tenant = _tenant_name(conn, vm)
        record(conn, ctl.principal.actor, "vm.start" if on else "vm.stop", f"vm:{vm_id}", tenant=tenant,
               params={"name": vm.name, "force": force})


def render_vm(ctl: Controller, conn: Connection, vm_id: str) -> str:
    """The validated domain XML of a VM."""
    from vgpu_ctl.render import DomainContext, HostdevContext, PciAddress

    vm, _host, devs = _load(ctl, conn, vm_id)
    tenant = _tenant_name(conn, vm)
    hostdevs = []
    for d in devs:
        handle = d.handle if isinstance(d.handle, dict) else {}
        pci = handle.get("pci_address") or (d.pci_address if d.backing == "pci" else None)
        backing = DeviceBacking(d.backing)
        if backing is DeviceBacking.MIG:
            backing = DeviceBacking.MDEV  # a VM gets a MIG slice through the vGPU on that GPU instance
        hostdevs.append(HostdevContext(device_id=d.id, profile=d.profile, backing=backing,
                                       uuid=handle.get("uuid") or d.uuid,
                                       pci=PciAddress.parse(pci) if pci and backing is not DeviceBacking.MDEV
                                       else None))
    spec = vm.spec if isinstance(vm.spec, dict) else {}
    images = ctl.state_path / "images"
    ctx = DomainContext(name=domain_name(vm), uuid=vm.id, tenant=str(tenant), vm_id=vm.id, vcpus=vm.vcpus,
                        memory_mib=vm.memory_mib, disk_base_image=str(images / "base.qcow2"),
                        disk_overlay=str(images / f"{vm.id}.qcow2"), network=spec.get("network", "default"),
                        network_type="network", hostdevs=hostdevs, compute_only=True)
    return ctl.hosts.renderer.render_domain(vm.template, ctx)
