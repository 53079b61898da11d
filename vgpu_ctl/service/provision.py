"""The provisioning state machine: placed -> devices-ready -> defined -> running, and back on release.

The intent is committed before each side effect and each step is idempotent, so a crash anywhere leaves a
state that `reconcile` can finish or roll back. A failed step undoes what the request did.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vgpu_ctl.catalog import ProfileKind
from vgpu_ctl.core.backings import vgpu_backing
from vgpu_ctl.core.vm_state import BEFORE_DOMAIN, HOLDS_CLAIM, LIVE, PROVISIONING, VmState
from vgpu_ctl.errors import Conflict, HostError, NotFound, VgpuCtlError
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDriver
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.leases import Renewal, advance, check_generation, drop, new_holder, take
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.requests import DeviceInfo, VmInfo
from vgpu_ctl.store.host_types import TypeIds
from vgpu_ctl.store.moves import HeldDevice
from vgpu_ctl.store.vms import VmHost, VmPlace, VmRow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

log = logging.getLogger(__name__)


def domain_name(vm: Any) -> str:
    """The libvirt domain name of a VM: its name and the start of its id (unique on every host)."""
    return f"{vm.name}-{vm.id[:8]}"


def _place(conn: Tx, vm_id: str) -> VmPlace:
    """The VM with its host, pool and devices, read once; NotFound when it is gone (or on no host)."""
    place = STORE.vms.vm_place(conn, vm_id)
    if place is None or place.host is None:
        raise NotFound(f"VM {vm_id} not found (deleted meanwhile?)", reasons=[{"field": "vm", "value": vm_id}])
    return place


def _load(ctl: Controller, conn: Tx, vm_id: str) -> tuple[VmRow, VmHost, list[HeldDevice]]:
    """The VM (with its tenant's name), its host and its devices by id."""
    place = _place(conn, vm_id)
    assert place.host is not None  # _place refuses a VM on no host
    return place.vm, place.host, place.devices


def placed_host(conn: Tx, vm_id: str) -> VmHost:
    """The host a placed VM is on, as its driver needs it (what hibernating or resuming the VM's domain talks
    to); NotFound when the VM is gone or on no host."""
    host = _place(conn, vm_id).host
    assert host is not None  # _place refuses a VM on no host
    return host


def kvm_mig_type(catalog: Any, model: str, mig_profile: str) -> Any | None:
    """The MIG-backed vGPU type that fills a GPU instance of `mig_profile` on `model` (one vGPU per instance,
    the instance's whole framebuffer; a C-series type first), or None when the catalog has none. A KVM guest
    gets a bare MIG instance only through such a type."""
    fitting = [p for p in catalog.profiles(model)
               if p.kind is ProfileKind.MIG_VGPU and p.mig_profile == mig_profile]
    fitting.sort(key=lambda p: (not p.name.endswith("C"), -p.framebuffer_mib, p.name))
    return fitting[0] if fitting else None


def device_spec(ctl: Controller, dev: Any, host: Any | None = None, ids: TypeIds | None = None) -> DeviceSpec:
    """What the host needs to create a claimed device, with the ids the host's discovery recorded for its GPU
    (mdev type, vendor-VFIO type, MIG profile; the catalog's MIG profile id where none was recorded). On a
    libvirt host a bare MIG instance is the instance plus the MIG-backed vGPU type filling it (`kvm_mig_type`),
    on an mdev or on a VF as the host's vGPU backing says; without such a type it stays a bare MIG spec, which
    `_provision` refuses to create there. `host` (its driver and vGPU backing) and `ids` are read from the
    store when not given."""
    if host is None or ids is None:
        with ctl.read() as conn:
            host = host or STORE.hosts.host_of_gpu(conn, dev.gpu_id)
            ids = ids or STORE.host_types.type_ids(conn, (dev.gpu_id,))[dev.gpu_id]
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


def provision_vm(ctl: Controller, vm_id: str, holder: str | None = None, start: bool = True) -> VmInfo | None:
    """Drive a placed (or part-provisioned) VM to running (to stopped, its domain defined, without `start`)
    under a lease on it: `holder`'s (the claim's), else one taken here; the VM as provisioned, or None when the
    VM is not being provisioned. On failure undo everything and raise HostError; Conflict when another live
    process is working on the VM."""
    if holder is None:
        holder = new_holder()
        with ctl.tx() as conn:
            if take(conn, vm_id, holder, PROVISIONING, what="provision") is None:
                return None
    try:
        with Renewal(ctl, vm_id, holder):
            return _provision(ctl, vm_id, holder, start)
    except VgpuCtlError as exc:
        undo(ctl, vm_id, exc.message, holder)
        if isinstance(exc, HostError | Conflict):
            raise
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {exc.message}") from exc
    except Exception as exc:
        undo(ctl, vm_id, f"{type(exc).__name__}: {exc}", holder)
        raise HostError(f"provisioning VM {vm_id} failed and was undone: {type(exc).__name__}: {exc}") from exc


def _step(conn: Tx, vm: Any, holder: str, from_state: str, to_state: str, **values: Any) -> None:
    """One step of provisioning, taken only while `holder` holds the VM's lease (a compare-and-set)."""
    if not advance(conn, vm.id, holder, (from_state,), to_state, keep_lease=to_state not in LIVE, **values):
        raise Conflict(f"VM {vm.name!r} changed while it was being provisioned (another process took it over)",
                       reasons=[{"vm": vm.name, "step": to_state}])


def _provision(ctl: Controller, vm_id: str, holder: str, start: bool = True) -> VmInfo:
    """The steps of the state machine from where the VM is, each host call followed by the one transaction
    that records it (devices ready, defined, running or stopped). The VM, its host, devices and type ids are
    read once, and what each step changes is carried on, not read again."""
    with ctl.read() as conn:
        place = _place(conn, vm_id)
        ids = STORE.host_types.type_ids(conn, {d.gpu_id for d in place.devices})
    vm, host, devs = place.vm, place.host, place.devices
    assert host is not None  # _place refuses a VM on no host
    driver = ctl.hosts.get(host)
    if vm.state == VmState.PLACED:
        made: dict[str, dict[str, Any]] = {}
        for dev in devs:
            if dev.state == "ready":
                continue
            spec = device_spec(ctl, dev, host, ids[dev.gpu_id])
            if spec.backing is DeviceBacking.MIG and host.driver != "simulated":
                raise _refuse_bare_mig(ctl, dev, host)
            made[dev.id] = _handle_json(driver.create_device(spec))
        with ctl.tx() as conn:  # every device and the step at once: each creation is idempotent (by UUID)
            STORE.vms.set_devices_ready(conn, made)
            _step(conn, vm, holder, VmState.PLACED, VmState.DEVICES_READY)
        devs = [d._replace(state="ready", handle=made[d.id]) if d.id in made else d for d in devs]
    dom_uuid = vm.domain_uuid
    if vm.state in BEFORE_DOMAIN:
        dom_uuid = driver.define_domain(_render(ctl, vm, devs))
        with ctl.tx() as conn:
            _step(conn, vm, holder, VmState.DEVICES_READY, VmState.DEFINED, domain_uuid=dom_uuid)
    if not start:
        with ctl.tx() as conn:
            _step(conn, vm, holder, VmState.DEFINED, VmState.STOPPED, error=None)
            generation = STORE.vms.vm_generation(conn, vm_id)
        return _info(place, devs, VmState.STOPPED, dom_uuid, generation)
    driver.start_domain(domain_name(vm))
    with ctl.tx() as conn:
        _step(conn, vm, holder, VmState.DEFINED, VmState.RUNNING, error=None)
        record(conn, ctl.principal.actor, "vm.start", f"vm:{vm_id}", tenant=vm.tenant_name,
               params={"name": vm.name})
        generation = STORE.vms.vm_generation(conn, vm_id)
    return _info(place, devs, VmState.RUNNING, dom_uuid, generation)


def _info(place: VmPlace, devs: Sequence[HeldDevice], state: str, dom_uuid: str | None,
          generation: int | None) -> VmInfo:
    """The VM as provisioning left it, from the rows it read and what it changed."""
    vm, host = place.vm, place.host
    assert host is not None
    devices = tuple(DeviceInfo(d.id, f"{host.name}/{d.pci_address}", d.gpu_id, d.profile, d.kind, d.start, d.size,
                               d.uuid, d.backing, d.state) for d in sorted(devs, key=lambda d: (d.gpu_id, d.start)))
    return VmInfo(vm.id, vm.name, str(vm.tenant_name), host.name, place.pool_name, str(state), vm.vcpus,
                  vm.memory_mib, vm.framebuffer_mib, devices, None, dom_uuid, host.driver == "simulated",
                  generation or 0)


def _tenant_name(conn: Tx, vm: Any) -> str | None:
    """The name of the VM's tenant."""
    return STORE.tenants.tenant_name(conn, vm.tenant_id)


def _handle_json(h: DeviceHandle) -> dict[str, Any]:
    return {"backing": h.backing.value, "uuid": h.uuid, "pci_address": h.pci_address,
            "gpu_instance_id": h.gpu_instance_id}


def _teardown(ctl: Controller, driver: HostDriver, vm: Any, devs: Sequence[Any], host: Any) -> list[str]:
    """Remove the domain, then each device; the errors met (each step still tried)."""
    errors = []
    try:
        driver.undefine_domain(domain_name(vm))
    except Exception as exc:
        errors.append(f"undefine domain: {exc}")
    return errors + remove_devices(ctl, driver, devs, host=host)


def remove_devices(ctl: Controller, driver: HostDriver, devs: Sequence[Any], on: str | None = None,
                   host: Any | None = None) -> list[str]:
    """Remove each device from its host (each tried whatever the others do); the errors met, in words (`on`
    names the host in them). `host`: the devices' host row, read from the store when not given."""
    errors = []
    where = f" on {on}" if on else ""
    ids: Mapping[int, TypeIds] = {}
    if devs:
        with ctl.read() as conn:
            ids = STORE.host_types.type_ids(conn, {d.gpu_id for d in devs})
    for dev in devs:
        try:
            driver.remove_device(device_spec(ctl, dev, host, ids[dev.gpu_id]))
        except Exception as exc:
            errors.append(f"remove device {dev.uuid}{where}: {exc}")
    return errors


def _free_claim(ctl: Controller, conn: Tx, vm: VmRow, devs: Sequence[HeldDevice]) -> None:
    """Give back quota, host capacity and devices of a VM (inside the caller's transaction). Rows are locked
    in the order a claim locks them (tenant, scoped limits, host, GPUs by id), so a release and a claim
    running at once can't deadlock."""
    spec = vm.spec if isinstance(vm.spec, dict) else {}
    scoped = {(s, r): n for s, r, n in spec.get("charges", [])}
    alloc.uncharge(conn, vm.tenant_id, spec.get("delta", {}), {})  # takes the tenant row's lock first
    if STORE.vms.tenant_has_scoped(conn, vm.tenant_id):
        alloc.uncharge(conn, vm.tenant_id, {}, scoped)
    assert vm.host_id is not None
    alloc.release_host(conn, vm.host_id, vm.vcpus, vm.memory_mib)
    alloc.free_devices(conn, ctl.catalog, [d._asdict() for d in devs])


def _free_once(ctl: Controller, conn: Tx, vm_id: str, holder: str, from_states: tuple[str, ...],
               to_state: str, **values: Any) -> VmRow | None:
    """Move the VM to `to_state` and give back its claim, if `holder` holds its lease and it is in one of
    `from_states` (a compare-and-set, so a claim is given back exactly once, from the rows as they are after
    it); the VM row, or None."""
    if not advance(conn, vm_id, holder, from_states, to_state, keep_lease=False, **values):
        return None
    vm, _host, devs = _load(ctl, conn, vm_id)
    _free_claim(ctl, conn, vm, devs)
    return vm


def undo(ctl: Controller, vm_id: str, error: str, holder: str) -> None:
    """Roll a failed request back while `holder` holds its lease: host side first, then claim and quota; the
    VM is kept as failed. Nothing when the lease is no longer `holder`'s."""
    with ctl.read() as conn:
        vm, host, devs = _load(ctl, conn, vm_id)
    if vm.state not in (*PROVISIONING, VmState.RUNNING) or vm.lease_holder != holder:
        return
    errors = _teardown(ctl, ctl.hosts.get(host), vm, devs, host)
    with ctl.tx() as conn:
        freed = _free_once(ctl, conn, vm_id, holder, (*PROVISIONING, VmState.RUNNING), VmState.FAILED,
                           error=error + ("; cleanup: " + "; ".join(errors) if errors else ""))
        if freed is not None:
            record(conn, ctl.principal.actor, "vm.create", f"vm:{vm_id}", result="failed", error=error,
                   tenant=vm.tenant_name, params={"name": vm.name})


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
            gone = STORE.vms.vm_row(conn, vm_id)
            if gone is None or not STORE.vms.remove_failed_vm(conn, vm_id):
                raise NotFound(f"VM {vm_id} not found (deleted meanwhile?)", reasons=[{"field": "vm", "value": vm_id}])
            record(conn, ctl.principal.actor, "vm.delete", f"vm:{vm_id}", tenant=_tenant_name(conn, gone),
                   params={"name": gone.name})
            return
    with Renewal(ctl, vm_id, holder):
        with ctl.read() as conn:
            vm, host, devs = _load(ctl, conn, vm_id)
        errors = _teardown(ctl, ctl.hosts.get(host), vm, devs, host)
        with ctl.tx() as conn:
            if errors:
                STORE.vms.set_vm_error(conn, vm_id, "; ".join(errors))
                drop(conn, vm_id, holder)
            elif _free_once(ctl, conn, vm_id, holder, (VmState.RELEASING,), VmState.RELEASING) is None:
                raise Conflict(f"VM {vm.name!r} changed while it was being deleted (another process took it over)",
                               reasons=[{"vm": vm.name}])
            else:
                STORE.vms.remove_vm(conn, vm_id)
                record(conn, ctl.principal.actor, "vm.delete", f"vm:{vm_id}", tenant=vm.tenant_name,
                       params={"name": vm.name})
    if errors:
        raise HostError(f"deleting VM {vm.name!r} left work on host {host.name}: {'; '.join(errors)}; "
                        "the VM stays 'releasing' and `vgpuctl reconcile --fix` or a new delete finishes it")


def set_power(ctl: Controller, vm_id: str, on: bool, force: bool = False, generation: int | None = None) -> None:
    """Start or stop a VM's domain and record the state (PreconditionFailed when `generation` is given and
    the VM is at another)."""
    with ctl.read() as conn:
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
        if not STORE.vms.set_power_state(conn, vm, (VmState.RUNNING if on else VmState.STOPPED).value):
            # deleted or taken over meanwhile: its state is the other operation's
            raise Conflict(f"VM {vm.name!r} changed while it was being {'started' if on else 'stopped'}",
                           reasons=[{"vm": vm.name}])
        record(conn, ctl.principal.actor, "vm.start" if on else "vm.stop", f"vm:{vm_id}", tenant=vm.tenant_name,
               params={"name": vm.name, "force": force})


def render_vm(ctl: Controller, conn: Tx, vm_id: str, only: Collection[str] | None = None) -> str:
    """The validated domain XML of a VM (with `only`, with those of its devices only: a VM being moved holds its
    old devices and its new ones)."""
    vm, _host, devs = _load(ctl, conn, vm_id)
    return _render(ctl, vm, [d for d in devs if d.id in only] if only is not None else devs)


def _render(ctl: Controller, vm: VmRow, devs: Sequence[HeldDevice]) -> str:
    """The validated domain XML of a VM (its row with its tenant's name) with these devices."""
    from vgpu_ctl.render import DomainContext, HostdevContext, PciAddress

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
    ctx = DomainContext(name=domain_name(vm), uuid=vm.id, tenant=str(vm.tenant_name), vm_id=vm.id, vcpus=vm.vcpus,
                        memory_mib=vm.memory_mib, disk_base_image=str(images / "base.qcow2"),
                        disk_overlay=str(images / f"{vm.id}.qcow2"), network=spec.get("network", "default"),
                        network_type="network", hostdevs=hostdevs, compute_only=True)
    return ctl.hosts.renderer.render_domain(vm.template, ctx)
