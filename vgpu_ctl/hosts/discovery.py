"""Discovering a libvirt host's NVIDIA GPUs and vGPU types, matched against the catalog, as inventory YAML."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import libvirt
import yaml

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.catalog.schema import GpuModelSpec
from vgpu_ctl.errors import VgpuCtlError
from vgpu_ctl.hosts.hostside import HostFacts, HostSide
from vgpu_ctl.hosts.nodedev import libvirt_errors, open_libvirt, parse_mdev
from vgpu_ctl.render import PciAddress, parse_xml

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03  # PCI base class of display controllers (VGA 0x0300, 3D 0x0302)
_NAME_PREFIXES = ("NVIDIA ", "GRID ")
_VGPU_KINDS = (ProfileKind.VGPU, ProfileKind.MIG_VGPU)
CAP_PCI = libvirt.VIR_CONNECT_LIST_NODE_DEVICES_CAP_PCI_DEV
CAP_MDEV = libvirt.VIR_CONNECT_LIST_NODE_DEVICES_CAP_MDEV


@dataclass(frozen=True)
class MdevType:
    """One mdev type a PCI device offers, as libvirt reports it."""

    type_id: str
    name: str  # without the "NVIDIA "/"GRID " prefix
    available: int
    on_vf: bool  # offered by an SR-IOV virtual function: `available` then counts for that VF only


@dataclass(frozen=True)
class DiscoveredGpu:
    """A physical NVIDIA GPU found on the host."""

    pci: str
    model: str | None
    product_id: str
    mode: str  # guess: vgpu-equal when it offers mdev types, else passthrough
    types: dict[str, str] = field(default_factory=dict)  # type name (catalog's if matched) -> mdev type id
    vfio_types: dict[str, int] = field(default_factory=dict)  # catalog vGPU type -> vendor-VFIO type id
    mig_profiles: dict[str, int] = field(default_factory=dict)  # catalog MIG profile -> NVML profile id
    mig_current: bool | None = None  # MIG mode from NVML (None: no MIG, or NVML not reachable)
    nvml_seen: bool = False  # the host side (NVML) was asked and saw this GPU


@dataclass
class Discovery:
    """What a host has, and where it disagrees with the catalog."""

    name: str
    uri: str
    vcpus: int
    memory_mib: int
    gpus: list[DiscoveredGpu] = field(default_factory=list)
    mismatches: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the host side could not read (NVML, sysfs)
    driver_version: str | None = None  # NVIDIA host driver, when NVML answered

    def to_inventory(self) -> dict[str, Any]:
        """The host as an inventory document (GPUs of unknown models are left out; see mismatches)."""
        gpus = [{"pci": g.pci, "model": g.model, "mode": g.mode} for g in self.gpus if g.model is not None]
        host = {"name": self.name, "uri": self.uri, "driver": "libvirt", "vgpu_backing": "mdev",
                "vcpus": self.vcpus, "memory_mib": self.memory_mib, "gpus": gpus}
        return {"hosts": [host]}

    def to_yaml(self) -> str:
        """The inventory document as YAML, headed by one comment line per mismatch."""
        notes = [" ".join(f"# mismatch on GPU {m['gpu']}: {m['kind']}: {m['detail']}".split())
                 for m in self.mismatches]
        body = yaml.safe_dump(self.to_inventory(), sort_keys=False)
        return "\n".join([*notes, body]) if notes else body


def _number(text: str | None) -> int:
    text = (text or "0").strip()
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def _strip_vendor(name: str) -> str:
    for prefix in _NAME_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


@dataclass
class _PciDevice:
    pci: str
    product_id: str
    physical_function: str | None
    types: list[MdevType]


def _parse_pci(xml: str) -> _PciDevice | None:
    """The NVIDIA display-class PCI device described by node-device XML, or None for any other device."""
    cap = parse_xml(xml).find("capability[@type='pci']")
    if cap is None:
        return None
    vendor, product = cap.find("vendor"), cap.find("product")
    if vendor is None or product is None or _number(vendor.get("id")) != NVIDIA_VENDOR:
        return None
    if (_number(cap.findtext("class")) >> 16) != DISPLAY_CLASS:
        return None
    pci = PciAddress(*(_number(cap.findtext(k)) for k in ("domain", "bus", "slot", "function")))
    pf = cap.find("capability[@type='phys_function']/address")
    on_vf = pf is not None
    types = [MdevType(t.get("id", ""), _strip_vendor(t.findtext("name", "")),
                      _number(t.findtext("availableInstances")), on_vf)
             for t in cap.iterfind("capability[@type='mdev_types']/type")]
    physical = None if pf is None else str(PciAddress(*(_number(pf.get(k)) for k in
                                                          ("domain", "bus", "slot", "function"))))
    return _PciDevice(str(pci), f"0x{_number(product.get('id')):04x}", physical, types)


def match_type(name: str, model: GpuModelSpec, catalog: Catalog) -> str | None:
    """The catalog's vGPU type of `model` that the host's type `name` is, also across board prefixes."""
    names = {p.name for p in catalog.profiles(model.model) if p.kind in _VGPU_KINDS}
    if name in names:
        return name
    board, sep, rest = name.partition("-")
    if sep and board in model.vgpu_prefixes:
        return next((f"{p}-{rest}" for p in model.vgpu_prefixes if f"{p}-{rest}" in names), None)
    return None


def _check_gpu(dev: _PciDevice, catalog: Catalog, has_mdevs: bool,
               mismatches: list[dict[str, str]]) -> DiscoveredGpu:
    model = catalog.by_pci_id(dev.product_id)
    mode = "vgpu-equal" if dev.types else "passthrough"

    def report(kind: str, detail: str) -> None:
        mismatches.append({"gpu": dev.pci, "kind": kind, "detail": detail})

    if model is None:
        report("unknown-model", f"PCI device id {dev.product_id} is not in the catalog")
        return DiscoveredGpu(dev.pci, None, dev.product_id, mode, {t.name: t.type_id for t in dev.types})
    types: dict[str, str] = {}
    for t in dev.types:
        profile_name = match_type(t.name, model, catalog)
        if profile_name is None:
            report("unknown-type", f"{model.model} has no vGPU type {t.name} ({t.type_id}) in the catalog")
            types[t.name] = t.type_id
            continue
        types[profile_name] = t.type_id
        profile = catalog.profile(model.model, profile_name)
        if profile is not None and not has_mdevs and not t.on_vf and t.available != profile.max_instances:
            report("max-count", f"{profile_name} ({t.type_id}): the host offers {t.available} on an empty "
                                f"GPU, the catalog says {profile.max_instances}")
    return DiscoveredGpu(dev.pci, model.model, dev.product_id, mode, types)


def discover_host(uri: str, catalog: Catalog, name: str | None = None, side: HostSide | None = None) -> Discovery:
    """Connect to `uri` and describe its NVIDIA GPUs and vGPU types against the catalog; with the host's `side`,
    also the vendor-VFIO type ids and NVML's MIG profile ids and MIG mode. InvalidInput for a URI outside
    what a controller may open (see inventory.check_uri)."""
    from vgpu_ctl.inventory import check_uri
    check_uri("uri", uri)
    conn = open_libvirt(uri, name or uri)
    try:
        with libvirt_errors(name or uri, "discovering devices"):
            host_name = name or str(conn.getHostname())
            info = conn.getInfo()
            pci_xml = [d.XMLDesc(0) for d in conn.listAllDevices(CAP_PCI)]
            mdev_xml = [d.XMLDesc(0) for d in conn.listAllDevices(CAP_MDEV)]
    finally:
        conn.close()
    devices = [d for d in map(_parse_pci, pci_xml) if d is not None]
    physical = {d.pci: d for d in devices if d.physical_function is None}
    for vf in devices:
        pf = physical.get(vf.physical_function or "")
        if pf is not None:
            known = {t.type_id for t in pf.types}
            pf.types.extend(t for t in vf.types if t.type_id not in known)
    parents = {parse_mdev(x, True).parent for x in mdev_xml}
    discovery = Discovery(host_name, uri, vcpus=int(info[2]), memory_mib=int(info[1]))
    for dev in sorted(physical.values(), key=lambda d: d.pci):
        has_mdevs = PciAddress.parse(dev.pci).nodedev_name in parents
        discovery.gpus.append(_check_gpu(dev, catalog, has_mdevs, discovery.mismatches))
    if side is not None:
        try:
            facts = side.facts([g.pci for g in discovery.gpus])
        except VgpuCtlError as exc:
            discovery.notes.append(f"host side: {exc.message}")
        else:
            _add_facts(discovery, catalog, facts)
    return discovery


def _add_facts(discovery: Discovery, catalog: Catalog, facts: HostFacts) -> None:
    """Fill the GPUs' vendor-VFIO and MIG ids from the host side's facts, named as the catalog names them."""
    discovery.notes.extend(facts.notes)
    discovery.driver_version = facts.driver_version
    for i, g in enumerate(discovery.gpus):
        f = facts.gpus.get(g.pci)
        if f is None or g.model is None:
            continue
        model = catalog.models[g.model]
        vfio = {}
        for type_name, type_id in f.vfio_types.items():
            profile = match_type(type_name, model, catalog)
            vfio[profile or type_name] = type_id
        mig_names = {p.name for p in catalog.profiles(g.model) if p.kind is ProfileKind.MIG}
        mig = {n: i for n, i in f.mig_profiles.items() if n in mig_names}
        for n in sorted(set(f.mig_profiles) - mig_names):
            discovery.mismatches.append({"gpu": g.pci, "kind": "unknown-mig-profile",
                                         "detail": f"{g.model} has no MIG profile {n} in the catalog"})
        mode = "mig" if f.mig_current else g.mode
        discovery.gpus[i] = replace(g, vfio_types=vfio, mig_profiles=mig, mig_current=f.mig_current,
                                    nvml_seen=f.nvml_seen, mode=mode)
