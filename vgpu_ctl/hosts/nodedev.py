"""Seams of the libvirt host driver: the node-device API for mdevs, and the vendor-VFIO and MIG backends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import libvirt
from lxml import etree

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.protocol import DeviceHandle, DeviceSpec, HostDevice
from vgpu_ctl.inventory import check_uri


class MdevInfo(NamedTuple):
    """A mediated device known to libvirt (defined, started or both)."""

    name: str  # node-device name, e.g. mdev_<uuid>_0000_41_00_0
    uuid: str
    parent: str  # node-device name of the parent, e.g. pci_0000_41_00_0
    type_id: str  # e.g. nvidia-558
    active: bool


class MdevParent(NamedTuple):
    """A PCI device that offers mdev types: a GPU (legacy vGPU) or one of its SR-IOV virtual functions."""

    name: str  # node-device name, e.g. pci_0000_41_00_4
    gpu: str  # PCI address of the physical GPU ("0000:41:00.0"; its own address for a GPU)
    types: dict[str, int]  # mdev type id -> instances still creatable on this device


class NodeDeviceApi(Protocol):
    """The lifecycle of persistent mdevs, as libvirt's node-device API offers it."""

    def define(self, xml: str) -> str:
        """Define a persistent mdev from node-device XML; returns its node-device name."""
        ...

    def start(self, name: str) -> None:
        """Start (create) a defined mdev."""
        ...

    def set_autostart(self, name: str) -> None:
        """Have the mdev started at host boot."""
        ...

    def destroy(self, name: str) -> None:
        """Stop an active mdev (its definition stays)."""
        ...

    def undefine(self, name: str) -> None:
        """Remove an mdev's persistent definition."""
        ...

    def list_mdevs(self) -> list[MdevInfo]:
        """Every mdev libvirt knows, active or only defined."""
        ...

    def mdev_parents(self) -> list[MdevParent]:
        """Every device that offers mdev types, with what each can still create."""
        ...


class DeviceBackend(Protocol):
    """Creates and removes devices of one backing outside libvirt (vendor-VFIO sysfs, NVML MIG)."""

    def create(self, spec: DeviceSpec) -> DeviceHandle:
        """Make the device exist (idempotent)."""
        ...

    def remove(self, spec: DeviceSpec) -> None:
        """Remove the device (idempotent)."""
        ...

    def list_devices(self) -> list[HostDevice]:
        """Devices of this backing present on the host."""
        ...


def host_error(host: str, operation: str, exc: libvirt.libvirtError) -> HostError:
    """HostError naming the host, the operation and libvirt's message."""
    message = exc.get_error_message() or str(exc)
    return HostError(f"host {host}: {operation} failed: {message}",
                     reasons=[{"host": host, "operation": operation, "libvirt": message}])


@contextmanager
def libvirt_errors(host: str, operation: str) -> Iterator[None]:
    """Turn a libvirt error raised inside the block into HostError (see host_error)."""
    try:
        yield
    except libvirt.libvirtError as exc:
        raise host_error(host, operation, exc) from None


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt error handler that prints nothing: errors still arrive as exceptions."""


def open_libvirt(uri: str, host: str) -> Any:
    """A libvirt connection to `uri`; HostError naming the host when it cannot be opened, or when the URI is
    not one a controller may open (a store written before URIs were checked may hold such a one)."""
    try:
        check_uri("uri", uri)
    except InvalidInput as exc:
        raise HostError(f"host {host}: not opened: {exc.message}", reasons=exc.reasons) from None
    libvirt.registerErrorHandler(_quiet, None)
    with libvirt_errors(host, f"connecting to {uri}"):
        return libvirt.open(uri)


def parse_mdev(xml: str, active: bool) -> MdevInfo:
    """The MdevInfo of an mdev node device from its XML description."""
    doc = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False, no_network=True))
    name = doc.findtext("name", "")
    uuid = doc.findtext("capability[@type='mdev']/uuid") or name.removeprefix("mdev_")[:36].replace("_", "-")
    type_el = doc.find("capability[@type='mdev']/type")
    type_id = type_el.get("id", "") if type_el is not None else ""
    return MdevInfo(name, uuid, doc.findtext("parent", ""), type_id, active)


class LibvirtNodeDeviceApi:
    """NodeDeviceApi over a libvirt connection (needs libvirt >= 7.3 and mdevctl on the host)."""

    def __init__(self, conn: Any, host: str) -> None:
        self.conn = conn
        self.host = host

    def _device(self, name: str) -> Any:
        with libvirt_errors(self.host, f"looking up node device {name}"):
            return self.conn.nodeDeviceLookupByName(name)

    def define(self, xml: str) -> str:
        """Define a persistent mdev from node-device XML; returns its node-device name."""
        with libvirt_errors(self.host, "defining mdev"):
            return str(self.conn.nodeDeviceDefineXML(xml, 0).name())

    def start(self, name: str) -> None:
        """Start (create) a defined mdev."""
        dev = self._device(name)
        with libvirt_errors(self.host, f"starting mdev {name}"):
            dev.create()

    def set_autostart(self, name: str) -> None:
        """Have the mdev started at host boot."""
        dev = self._device(name)
        with libvirt_errors(self.host, f"setting autostart on mdev {name}"):
            dev.setAutostart(1)

    def destroy(self, name: str) -> None:
        """Stop an active mdev (its definition stays)."""
        dev = self._device(name)
        with libvirt_errors(self.host, f"destroying mdev {name}"):
            dev.destroy()

    def undefine(self, name: str) -> None:
        """Remove an mdev's persistent definition."""
        dev = self._device(name)
        with libvirt_errors(self.host, f"undefining mdev {name}"):
            dev.undefine()

    def list_mdevs(self) -> list[MdevInfo]:
        """Every mdev libvirt knows, active or only defined."""
        with libvirt_errors(self.host, "listing mdevs"):
            devices = self.conn.listAllDevices(libvirt.VIR_CONNECT_LIST_NODE_DEVICES_CAP_MDEV)
            return [parse_mdev(d.XMLDesc(0), _is_active(d)) for d in devices]

    def mdev_parents(self) -> list[MdevParent]:
        """Every PCI device that offers mdev types, as libvirt reports it now."""
        with libvirt_errors(self.host, "listing mdev parents"):
            devices = self.conn.listAllDevices(libvirt.VIR_CONNECT_LIST_NODE_DEVICES_CAP_MDEV_TYPES)
            found = (parse_mdev_parent(d.XMLDesc(0)) for d in devices)
            return sorted((p for p in found if p is not None), key=lambda p: p.name)


def _address(el: Any) -> str:
    """The PCI address "dddd:bb:ss.f" of an element holding domain/bus/slot/function (as children or attributes)."""
    def num(key: str) -> int:
        text = (el.get(key) if el.get(key) is not None else el.findtext(key)) or "0"
        text = text.strip()
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    return f"{num('domain'):04x}:{num('bus'):02x}:{num('slot'):02x}.{num('function'):x}"


def parse_mdev_parent(xml: str) -> MdevParent | None:
    """The MdevParent described by a PCI node device's XML (None if it offers no mdev types)."""
    doc = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False, no_network=True))
    cap = doc.find("capability[@type='pci']")
    if cap is None or cap.find("capability[@type='mdev_types']") is None:
        return None
    pf = cap.find("capability[@type='phys_function']/address")
    types = {t.get("id", ""): int((t.findtext("availableInstances") or "0").strip())
             for t in cap.iterfind("capability[@type='mdev_types']/type")}
    return MdevParent(doc.findtext("name", ""), _address(pf if pf is not None else cap), types)


def _is_active(dev: Any) -> bool:
    """Whether a node device is started (drivers without the call, like the test driver, list only those)."""
    try:
        return bool(dev.isActive())
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_SUPPORT:
            return True
        raise
