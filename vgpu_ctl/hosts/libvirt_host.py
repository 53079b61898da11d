"""A host driven through libvirt (any URI): persistent mdevs, domains, and the VFIO/MIG backends given."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import libvirt

from vgpu_ctl.errors import HostError
from vgpu_ctl.hosts.disks import delete_overlays, ensure_overlays
from vgpu_ctl.hosts.nodedev import (
    DeviceBackend,
    LibvirtNodeDeviceApi,
    MdevInfo,
    NodeDeviceApi,
    host_error,
    libvirt_errors,
    open_libvirt,
)
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, DomainInfo, HostDevice
from vgpu_ctl.render import PciAddress, TemplateRenderer, parse_xml, read_domain, read_metadata

PLACEMENT_ATTR = "vgpu-placement-id"


class LibvirtHost:
    """HostDriver over a libvirt connection, opened on first use."""

    simulated = False

    def __init__(
        self,
        name: str,
        uri: str,
        nodedev: NodeDeviceApi | None = None,
        vfio: DeviceBackend | None = None,
        renderer: TemplateRenderer | None = None,
        mig: DeviceBackend | None = None,
    ) -> None:
        self.name = name
        self.uri = uri
        self._nodedev = nodedev
        self._backends = {DeviceBacking.VFIO_VF: vfio, DeviceBacking.MIG: mig}
        self._renderer = renderer or TemplateRenderer()
        self._conn: Any = None

    def _connection(self) -> Any:
        if self._conn is None:
            self._conn = open_libvirt(self.uri, self.name)
        return self._conn

    def _mdevs(self) -> NodeDeviceApi:
        if self._nodedev is None:
            self._nodedev = LibvirtNodeDeviceApi(self._connection(), self.name)
        return self._nodedev

    def _backend(self, backing: DeviceBacking) -> DeviceBackend:
        backend = self._backends[backing]
        if backend is None:
            raise HostError(f"host {self.name}: no {backing} backend is configured for this host",
                            reasons=[{"host": self.name, "backing": str(backing)}])
        return backend

    def _find_mdev(self, uuid: str) -> MdevInfo | None:
        return next((m for m in self._mdevs().list_mdevs() if m.uuid == uuid), None)

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        """Make the device exist (idempotent: an existing one with this uuid is returned). A MIG-backed vGPU
        gets its GPU instance first, then its mdev or VF type on it."""
        if spec.backing is DeviceBacking.PCI:
            return DeviceHandle(DeviceBacking.PCI, pci_address=spec.gpu_pci)
        if spec.backing is DeviceBacking.MIG:
            return self._backend(DeviceBacking.MIG).create(spec)
        gi = None
        if spec.mig_backed:
            gi = self._backend(DeviceBacking.MIG).create(replace(spec, backing=DeviceBacking.MIG)).gpu_instance_id
        try:
            if spec.backing is DeviceBacking.VFIO_VF:
                handle = self._backend(DeviceBacking.VFIO_VF).create(spec)
            else:
                handle = self._create_mdev(spec)
        except Exception:
            if spec.mig_backed:
                self._backend(DeviceBacking.MIG).remove(replace(spec, backing=DeviceBacking.MIG))
            raise
        return handle if gi is None else replace(handle, gpu_instance_id=gi)

    def _parent(self, spec: DeviceSpec, type_id: str) -> str:
        """The node device to create the mdev under: the GPU itself, or a VF of it that can still take the
        type (SR-IOV GPUs)."""
        gpu = PciAddress.parse(spec.gpu_pci)
        parents = [p for p in self._mdevs().mdev_parents() if p.gpu == str(gpu)]
        if not parents:
            return gpu.nodedev_name
        free = [p for p in parents if p.types.get(type_id, 0) > 0]
        if not free:
            offered = sorted({t for p in parents for t in p.types})
            raise HostError(f"host {self.name}: no device of GPU {gpu} can take an mdev of type {type_id} "
                            f"({spec.profile}) now: {len(parents)} offer mdev types, none has an instance "
                            f"of it left (types offered: {', '.join(offered) or 'none'})",
                            reasons=[{"host": self.name, "gpu": str(gpu), "mdev_type": type_id}])
        return free[0].name

    def _create_mdev(self, spec: DeviceSpec) -> DeviceHandle:
        api = self._mdevs()
        existing = self._find_mdev(spec.uuid)
        if existing is not None:
            if spec.mdev_type is not None and existing.type_id != spec.mdev_type:
                raise HostError(f"host {self.name}: mdev {spec.uuid} exists with type {existing.type_id}, "
                                f"not {spec.mdev_type}", reasons=[{"host": self.name, "uuid": spec.uuid}])
            if not existing.active:
                api.start(existing.name)
            return DeviceHandle(DeviceBacking.MDEV, uuid=spec.uuid)
        if spec.mdev_type is None:
            raise HostError(f"host {self.name}: the mdev type id of {spec.profile} on GPU {spec.gpu_pci} "
                            "is unknown on this host: discovery did not find the type there (see the "
                            "findings of `vgpuctl inventory apply` or `vgpuctl host discover`)",
                            reasons=[{"host": self.name, "profile": spec.profile}])
        attrs = [] if spec.placement_id is None else [(PLACEMENT_ATTR, str(spec.placement_id))]
        xml = self._renderer.render_mdev(self._parent(spec, spec.mdev_type), spec.mdev_type, spec.uuid, attrs)
        name = api.define(xml)
        try:
            api.start(name)
        except HostError:
            api.undefine(name)
            raise
        if not spec.mig_backed:  # NVIDIA: the mdev of a MIG-backed vGPU can't be made persistent
            api.set_autostart(name)
        return DeviceHandle(DeviceBacking.MDEV, uuid=spec.uuid)

    def remove_device(self, spec: DeviceSpec) -> None:
        """Remove the device (idempotent: absent is fine); a MIG-backed vGPU's GPU instance after it."""
        if spec.backing is DeviceBacking.PCI:
            return
        if spec.backing is DeviceBacking.MIG:
            self._backend(DeviceBacking.MIG).remove(spec)
            return
        if spec.backing is DeviceBacking.VFIO_VF:
            self._backend(DeviceBacking.VFIO_VF).remove(spec)
        else:
            existing = self._find_mdev(spec.uuid)
            if existing is not None:
                if existing.active:
                    self._mdevs().destroy(existing.name)
                self._mdevs().undefine(existing.name)
        if spec.mig_backed:
            self._backend(DeviceBacking.MIG).remove(replace(spec, backing=DeviceBacking.MIG))

    def list_devices(self) -> list[HostDevice]:
        """Mdevs libvirt knows, then the devices of each configured backend; every part of a device whose mdev
        is stopped (a MIG-backed vGPU's GPU instance too) is inactive."""
        found = [HostDevice(DeviceBacking.MDEV, gpu_pci=_pci_of(m.parent), uuid=m.uuid, active=m.active)
                 for m in self._mdevs().list_mdevs()]
        for backend in self._backends.values():
            if backend is not None:
                found.extend(backend.list_devices())
        stopped = {d.uuid for d in found if d.uuid is not None and not d.active}
        return [replace(d, active=False) if d.uuid in stopped else d for d in found]

    def _lookup(self, name: str) -> Any | None:
        try:
            return self._connection().lookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise host_error(self.name, f"looking up domain {name}", exc) from None

    def _runs_guests(self) -> bool:
        """Whether the connection runs real guests with real disks (libvirt's test driver does not)."""
        with libvirt_errors(self.name, "reading the hypervisor type"):
            return str(self._connection().getType()).upper() != "TEST"

    def define_domain(self, xml: str) -> str:
        """Define (or redefine) a persistent domain, after creating its overlay disk on the host if it lacks
        one; returns its UUID."""
        made = ensure_overlays(self._connection(), self.name, xml) if self._runs_guests() else []
        try:
            with libvirt_errors(self.name, "defining domain"):
                return str(self._connection().defineXML(xml).UUIDString())
        except HostError:
            if made:
                delete_overlays(self._connection(), self.name, xml)
            raise

    def start_domain(self, name: str) -> None:
        """Start a defined domain (idempotent)."""
        dom = self._lookup(name)
        if dom is None:
            raise HostError(f"host {self.name}: domain {name} is not defined",
                            reasons=[{"host": self.name, "domain": name}])
        with libvirt_errors(self.name, f"starting domain {name}"):
            if not dom.isActive():
                dom.create()

    def stop_domain(self, name: str, force: bool = False) -> None:
        """Ask the guest to shut down, or with force destroy it (idempotent: stopped or absent is fine)."""
        dom = self._lookup(name)
        if dom is None:
            return
        with libvirt_errors(self.name, f"stopping domain {name}"):
            if not dom.isActive():
                return
            if force:
                dom.destroy()
            else:
                dom.shutdown()

    def managed_save(self, name: str) -> None:
        """Save the running domain's memory to its managed save file and stop it (`virDomainManagedSave`); the
        next `start_domain` restores it (idempotent: already saved is fine)."""
        dom = self._lookup(name)
        if dom is None:
            raise HostError(f"host {self.name}: domain {name} is not defined",
                            reasons=[{"host": self.name, "domain": name}])
        with libvirt_errors(self.name, f"saving domain {name}"):
            if dom.isActive():
                dom.managedSave(0)
            elif not dom.hasManagedSaveImage(0):
                raise HostError(f"host {self.name}: domain {name} is not running and has no managed save image, "
                                "so there is nothing to save", reasons=[{"host": self.name, "domain": name}])

    def undefine_domain(self, name: str) -> None:
        """Stop if needed and undefine; a controller's domain also loses its overlay disks (idempotent: absent
        is fine)."""
        dom = self._lookup(name)
        if dom is None:
            return
        with libvirt_errors(self.name, f"undefining domain {name}"):
            if dom.isActive():
                dom.destroy()
            flags = libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
            xml = dom.XMLDesc(0)
            if parse_xml(xml).find("os/nvram") is not None:
                flags |= libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
            dom.undefineFlags(flags)
        if read_metadata(xml) and self._runs_guests():  # only the controller's own domains' overlays
            delete_overlays(self._connection(), self.name, xml)

    def list_domains(self) -> list[DomainInfo]:
        """Every domain on the host, with the controller's metadata where it wrote one."""
        out: list[DomainInfo] = []
        with libvirt_errors(self.name, "listing domains"):
            for dom in self._connection().listAllDomains(0):
                try:
                    xml = dom.XMLDesc(0)
                    active = bool(dom.isActive())
                    saved = not active and bool(dom.hasManagedSaveImage(0))
                except libvirt.libvirtError:
                    continue  # undefined while we were listing
                out.append(DomainInfo(dom.name(), dom.UUIDString(), active, *read_domain(xml), saved=saved))
        return out

    def close(self) -> None:
        """Close the libvirt connection (a later call opens a new one)."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            if isinstance(self._nodedev, LibvirtNodeDeviceApi):
                self._nodedev = None
            with libvirt_errors(self.name, "closing the connection"):
                conn.close()


def _pci_of(nodedev_name: str) -> str:
    """PCI address of a pci_dddd_bb_ss_f node-device name ("" if it is not one)."""
    parts = nodedev_name.split("_")
    if len(parts) != 5 or parts[0] != "pci":
        return ""
    return f"{parts[1]}:{parts[2]}:{parts[3]}.{parts[4]}"
