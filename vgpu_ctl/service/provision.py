"""The provisioning state machine: placed -> devices-ready -> defined -> running, and back on release.

The intent is committed before each side effect and each step is idempotent, so a crash anywhere leaves a
state that `reconcile` can finish or roll back. A failed step undoes what the request did.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from vgpu_ctl.catalog import ProfileKind
from vgpu_ctl.core.backings import vgpu_backing
from vgpu_ctl.core.vm_state import BEFORE_DOMAIN, HOLDS_CLAIM, LIVE, PROVISIONING, VmState
from vgpu_ctl.errors import Conflict, HostError, NotFound, VgpuCtlError
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDriver
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.leases import Renewal, advance, check_generation, drop, new_holder, take
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
    devs = conn.execute(select(alloc.DEVICE, alloc.GPU.c.pci_address, alloc.GPU.c.model,
                               alloc.GPU.c.mode.label("gpu_mode"))
                        .join(alloc.GPU, alloc.GPU.c.id == alloc.DEVICE.c.gpu_id)
                        .where(alloc.DEVICE.c.vm_id == vm_id).order_by(alloc.DEVICE.c.id)).all()
    return vm, host, list(devs)


def kvm_mig_type(catalog: Any, model: str, mig_profile: str) -> Any | None:
    """The MIG-backed vGPU type that fills a GPU instance of `mig_profile` on `model` (one vGPU per instance,
    the instance's whole framebuffer; a C-series type first), or None when the catalog has none. A KVM guest
    gets a bare MIG instance only through such a type."""
    fitting = [p for p in catalog.profiles(model)
               if p.kind is ProfileKind.MIG_VGPU and p.mig_profile == mig_profile]
    fitting.sort(key=lambda p: (not p.name.endswith("C"), -p.framebuffer_mib, p.name))
    return fitting[0] if fitting else None


def _host_of_gpu(conn: Connection, gpu_id: int) -> Any:
    return conn.execute(select(alloc.HOST.c.name, alloc.HOST.c.driver, alloc.HOST.c.vgpu_backing)
                        .join(alloc.GPU, alloc.GPU.c.host_id == alloc.HOST.c.id)
                        .where(alloc.GPU.c.id == gpu_id)).one()


def device_spec(ctl: Controller, dev: Any) -> DeviceSpec:
    """What the host needs to create a claimed device, with the ids the host's discovery recorded for its GPU
    (mdev type, vendor-VFIO type, MIG profile; the catalog's MIG profile id where none was recorded). On a
    libvirt host a bare MIG instance is the instance plus the MIG-backed vGPU type filling it (`kvm_mig_type`),
    on an mdev or on a VF as the host's vGPU backing says; without such a type it stays a bare MIG spec, which
    `_provision` refuses to create there."""
    from vgpu_ctl.service.host_types import stored_ids

    with ctl.engine.connect() as conn:
        ids = stored_ids(conn, dev.gpu_id)
        host = _host_of_gpu(conn, dev.gpu_id)
    profile = ctl.catalog.profile(dev.model, dev.profile)
    kind = profile.kind if profile is not None else None
    mig_id = None
    if profile is not None and kind in (ProfileKind.MIG, ProfileKind.MIG_VGPU):
        gi_name = profile.name if kind is ProfileKind.MIG else profile.mig_profile
        found = ids["mig"].get(gi_name or "")
        mig_id = int(found) if found is not None else profile.profile_id
    backing, type_name = DeviceBacking(dev.backing), dev.profile
    if kind is ProfileKind.MIG and host.driver != "simulated":
        vgpu = kvm_mig_type(ctl.catalog, dev.model, dev.profile)
        if vgpu is not None:
            backing = vgpu_backing(host.vgpu_backing)
            type_name = vgpu.name
    mixed = profile is not None and kind is ProfileKind.VGPU and dev.start in (profile.mixed_placement_ids or ()) \
        and dev.gpu_mode == "vgpu-mixed"
    vfio = ids["vfio"].get(type_name)
    return DeviceSpec(device_id=dev.id, gpu_pci=dev.pci_address, backing=backing,
                      profile=type_name, start=dev.start, size=dev.size, uuid=dev.uuid,
                      mdev_type=ids["mdev"].get(type_name), vfio_type_id=int(vfio) if vfio is not None else None,
                      mig_profile_id=mig_id, placement_id=dev.start if mixed else None)


def _refuse_bare_mig(ctl: Controller, dev: Any, host: Any) -> HostError:
    """Why a bare MIG instance can't go to a KVM guest on `host`: the catalog has no MIG-backed vGPU type for
    its GPU instance; with what to ask for instead."""
    others = sorted(p.name for p in ctl.catalog.profiles(dev.model) if p.kind is ProfileKind.MIG_VGPU)
    instead = (f"ask for one of its MIG-backed vGPU types instead ({', '.join(others)})" if others else
               "ask for whole-GPU passthrough or a time-sliced vGPU instead")
    return HostError(f"host {host.name}: MIG profile {dev.profile} on {dev.model} can't be given to a KVM "
                     "guest: a VM takes a MIG instance only through the MIG-backed vGPU type that fills it, "
                     f"and the catalog has none for {dev.profile} on {dev.model}; {instead}, or add a "
                     f"MIG-backed type with mig_profile: {dev.profile} to the catalog",
                     reasons=[{"host": host.name, "profile": dev.profile, "model": dev.model,
                               "instead": others}])


def provision_vm(ctl: Controller, vm_id: str, holder: str | None = None, start: bool = True) -> None:
    """Drive a placed (or part-provisioned) VM to running (to stopped, its domain defined, without `start`)
    under a lease on it: `holder`'s (the claim's), else one taken here; nothing when the VM is not being
    provisioned. On failure undo everything and raise HostError; Conflict when another live process is working
    on the VM."""
    if holder is None:
        holder = new_holder()
        with ctl.tx() as conn:
            if take(conn, vm_id, holder, PROVISIONING, what="provision") is None:
                return
    try:
        with Renewal(ctl, vm_id, holder):
            _provision(ctl, vm_id, holder, start)
    except VgpuCtlError as exc:
        undo(ctl, vm_id, exc.message, holder)
        if isinstance(exc, HostError | Conflict):
            raise
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {exc.message}") from exc
    except Exception as exc:
        undo(ctl, vm_id, f"{type(exc).__name__}: {exc}", holder)
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {type(exc).__name__}: {exc}") from exc


def _step(conn: Connection, vm: Any, holder: str, from_state: str, to_state: str, **values: Any) -> None:
    """One step of provisioning, taken only while `holder` holds the VM's lease (a compare-and-set)."""
    if not advance(conn, vm.id, holder, (from_state,), to_state, keep_lease=to_state not in LIVE, **values):
        raise Conflict(f"VM {vm.name!r} changed while it was being provisioned (another process took it over)",
                       reasons=[{"vm": vm.name, "step": to_state}])


def _provision(ctl: Controller, vm_id: str, holder: str, start: bool = True) -> None:
    with ctl.engine.connect() as conn:
        vm, host, devs = _load(ctl, conn, vm_id)
    driver = ctl.hosts.get(host)
    if vm.state == VmState.PLACED:
        for dev in devs:
            if dev.state == "ready":
                continue
            spec = device_spec(ctl, dev)
            if spec.backing is DeviceBacking.MIG and host.driver != "simulated":
                raise _refuse_bare_mig(ctl, dev, host)
            handle = driver.create_device(spec)
            with ctl.tx() as conn:
                conn.execute(update(alloc.DEVICE).where(alloc.DEVICE.c.id == dev.id)
                             .values(state="ready", handle=_handle_json(handle)))
        with ctl.tx() as conn:
            _step(conn, vm, holder, VmState.PLACED, VmState.DEVICES_READY)
    if vm.state in BEFORE_DOMAIN:
        with ctl.engine.connect() as conn:
            xml = render_vm(ctl, conn, vm_id)
        dom_uuid = driver.define_domain(xml)
        with ctl.tx() as conn:
            _step(conn, vm, holder, VmState.DEVICES_READY, VmState.DEFINED, domain_uuid=dom_uuid)
    if not start:
        with ctl.tx() as conn:
            _step(conn, vm, holder, VmState.DEFINED, VmState.STOPPED, error=None)
        return
    driver.start_domain(domain_name(vm))
    with ctl.tx() as conn:
        _step(conn, vm, holder, VmState.DEFINED, VmState.RUNNING, error=None)
        record(conn, ctl.principal.actor, "vm.start", f"vm:{vm_id}", tenant=_tenant_name(conn, vm),
               params={"name": vm.name})


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
    return errors + remove_devices(ctl, driver, devs)


def remove_devices(ctl: Controller, driver: HostDriver, devs: Sequence[Any], on: str | None = None) -> list[str]:
    """Remove each device from its host (each tried whatever the others do); the errors met, in words (`on`
    names the host in them)."""
    errors = []
    where = f" on {on}" if on else ""
    for dev in devs:
        try:
            driver.remove_device(device_spec(ctl, dev))
        except Exception as exc:
            errors.append(f"remove device {dev.uuid}{where}: {exc}")
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


def _free_once(ctl: Controller, conn: Connection, vm_id: str, holder: str, from_states: tuple[str, ...],
               to_state: str, **values: Any) -> Any | None:
    """Move the VM to `to_state` and give back its claim, if `holder` holds its lease and it is in one of
    `from_states` (a compare-and-set, so a claim is given back exactly once); the VM row, or None."""
    if not advance(conn, vm_id, holder, from_states, to_state, keep_lease=False, **values):
        return None
    vm, _host, devs = _load(ctl, conn, vm_id)
    _free_claim(ctl, conn, vm, devs)
    return vm


def undo(ctl: Controller, vm_id: str, error: str, holder: str) -> None:
    """Roll a failed request back while `holder` holds its lease: host side first, then claim and quota; the
    VM is kept as failed. Nothing when the lease is no longer `holder`'s."""
    with ctl.engine.connect() as conn:
        vm, host, devs = _load(ctl, conn, vm_id)
    if vm.state not in (*PROVISIONING, VmState.RUNNING) or vm.lease_holder != holder:
        return
    errors = _teardown(ctl, ctl.hosts.get(host), vm, devs)
    with ctl.tx() as conn:
        freed = _free_once(ctl, conn, vm_id, holder, (*PROVISIONING, VmState.RUNNING), VmState.FAILED,
                           error=error + ("; cleanup: " + "; ".join(errors) if errors else ""))
        if freed is not None:
            record(conn, ctl.principal.actor, "vm.create", f"vm:{vm_id}", result="failed", error=error,
                   tenant=_tenant_name(conn, vm), params={"name": vm.name})


def release_vm(ctl: Controller, vm_id: str, holder: str | None = None, generation: int | None = None) -> None:
    """Delete a VM: take its lease and persist 'releasing', remove domain and devices, then free claim and
    quota, exactly once. Conflict while another live process works on the VM; NotFound once it is gone;
    PreconditionFailed when `generation` is given and the VM is at another."""
    holder = holder or new_holder()
    with ctl.tx() as conn:
        vm = take(conn, vm_id, holder, HOLDS_CLAIM, to_state=VmState.RELEASING, what="delete", generation=generation)
        if vm is not None and vm.state == VmState.HIBERNATED and vm.host_id is not None:  # it gave back its
            alloc.release_host(conn, vm.host_id, -vm.vcpus, -vm.memory_mib)  # host's share: the release frees it
        if vm is None:  # failed (it holds nothing), or deleted meanwhile
            gone = conn.execute(select(VM.c.name, VM.c.tenant_id).where(VM.c.id == vm_id)).first()
            failed = VM.delete().where(VM.c.id == vm_id, VM.c.state == VmState.FAILED.value)
            if gone is None or conn.execute(failed).rowcount != 1:
                raise NotFound(f"VM {vm_id} not found (deleted meanwhile?)", reasons=[{"field": "vm", "value": vm_id}])
            record(conn, ctl.principal.actor, "vm.delete", f"vm:{vm_id}", tenant=_tenant_name(conn, gone),
                   params={"name": gone.name})
            return
    with Renewal(ctl, vm_id, holder):
        with ctl.engine.connect() as conn:
            vm, host, devs = _load(ctl, conn, vm_id)
        errors = _teardown(ctl, ctl.hosts.get(host), vm, devs)
        with ctl.tx() as conn:
            if errors:
                conn.execute(update(VM).where(VM.c.id == vm_id).values(error="; ".join(errors)))
                drop(conn, vm_id, holder)
            elif _free_once(ctl, conn, vm_id, holder, (VmState.RELEASING,), VmState.RELEASING) is None:
                raise Conflict(f"VM {vm.name!r} changed while it was being deleted (another process took it over)",
                               reasons=[{"vm": vm.name}])
            else:
                conn.execute(alloc.DEVICE.delete().where(alloc.DEVICE.c.vm_id == vm_id))
                conn.execute(VM.delete().where(VM.c.id == vm_id))
                record(conn, ctl.principal.actor, "vm.delete", f"vm:{vm_id}", tenant=_tenant_name(conn, vm),
                       params={"name": vm.name})
    if errors:
        raise HostError(f"deleting VM {vm.name!r} left work on host {host.name}: {'; '.join(errors)}; "
                        "the VM stays 'releasing' and `vgpuctl reconcile --fix` or a new delete finishes it")


def set_power(ctl: Controller, vm_id: str, on: bool, force: bool = False, generation: int | None = None) -> None:
    """Start or stop a VM's domain and record the state (PreconditionFailed when `generation` is given and
    the VM is at another)."""
    with ctl.engine.connect() as conn:
        vm, host, _ = _load(ctl, conn, vm_id)
    check_generation(vm, generation, "VM", vm.name)
    want_from = (VmState.STOPPED,) if on else (VmState.RUNNING,)
    if vm.state not in want_from:
        raise Conflict(f"VM {vm.name!r} is {vm.state}; it must be {' or '.join(want_from)} to "
                       f"{'start' if on else 'stop'}", reasons=[{"vm": vm.name, "state": vm.state}])
    driver = ctl.hosts.get(host)
    if on:
        driver.start_domain(domain_name(vm))
    else:
        driver.stop_domain(domain_name(vm), force=force)
    with ctl.tx() as conn:
        changed = conn.execute(update(VM).where(VM.c.id == vm_id, VM.c.state == vm.state, VM.c.lease_holder.is_(None),
                                                VM.c.generation == vm.generation)
                               .values(state=(VmState.RUNNING if on else VmState.STOPPED).value, updated_at=utcnow()))
        if changed.rowcount != 1:  # deleted or taken over meanwhile: its state is the other operation's
            raise Conflict(f"VM {vm.name!r} changed while it was being {'started' if on else 'stopped'}",
                           reasons=[{"vm": vm.name}])
        tenant = _tenant_name(conn, vm)
        record(conn, ctl.principal.actor, "vm.start" if on else "vm.stop", f"vm:{vm_id}", tenant=tenant,
               params={"name": vm.name, "force": force})


def render_vm(ctl: Controller, conn: Connection, vm_id: str, only: Collection[str] | None = None) -> str:
    """The validated domain XML of a VM (with `only`, with those of its devices only: a VM being moved holds its
    old devices and its new ones)."""
    from vgpu_ctl.render import DomainContext, HostdevContext, PciAddress

    vm, _host, devs = _load(ctl, conn, vm_id)
    if only is not None:
        devs = [d for d in devs if d.id in only]
    tenant = _tenant_name(conn, vm)
    hostdevs = []
    for d in devs:
        handle = d.handle if isinstance(d.handle, dict) else {}
        pci = handle.get("pci_address") or (d.pci_address if d.backing == "pci" else None)
        backing = DeviceBacking(handle.get("backing") or d.backing)  # a bare MIG: the vGPU type filling it
        if backing is DeviceBacking.MIG:
            backing = DeviceBacking.MDEV  # simulated host: the MIG slice stands for the vGPU on it
        hostdevs.append(HostdevContext(device_id=d.id, profile=d.profile, backing=backing,
                                       uuid=handle.get("uuid") or d.uuid,
                                       pci=PciAddress.parse(pci) if pci and backing is not DeviceBacking.MDEV
                                       else None, gpu_pci=d.pci_address, start=d.start, size=d.size))
    spec = vm.spec if isinstance(vm.spec, dict) else {}
    images = ctl.state_path / "images"
    ctx = DomainContext(name=domain_name(vm), uuid=vm.id, tenant=str(tenant), vm_id=vm.id, vcpus=vm.vcpus,
                        memory_mib=vm.memory_mib, disk_base_image=str(images / "base.qcow2"),
                        disk_overlay=str(images / f"{vm.id}.qcow2"), network=spec.get("network", "default"),
                        network_type="network", hostdevs=hostdevs, compute_only=True)
    return ctl.hosts.renderer.render_domain(vm.template, ctx)
