"""Shared fixtures of the host tests: a libvirt test-driver node file with NVIDIA GPUs, a recording
NodeDeviceApi, and sample domain contexts."""

from __future__ import annotations

import multiprocessing
import uuid as uuidlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lxml import etree

from vgpu_ctl.errors import HostError
from vgpu_ctl.hosts import simulated
from vgpu_ctl.hosts.nodedev import MdevInfo, MdevParent
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.render import DomainContext, HostdevContext, PciAddress, TemplateRenderer

VM_UUID = "c2177883-f1bb-47f0-914d-32a22e3a8804"
MDEV_UUID = "aa618089-8b16-4d01-a136-25a0f3c73123"

NODE_CPU = """
  <cpu><nodes>1</nodes><sockets>1</sockets><cores>4</cores><threads>2</threads><active>8</active>
       <mhz>3000</mhz><model>x86_64</model></cpu>
  <memory>67108864</memory>"""


def _mdev_types(types: Sequence[tuple[str, str, int]]) -> str:
    if not types:
        return ""
    body = "".join(f"<type id='{tid}'><name>{name}</name><deviceAPI>vfio-pci</deviceAPI>"
                   f"<availableInstances>{avail}</availableInstances></type>" for tid, name, avail in types)
    return f"<capability type='mdev_types'>{body}</capability>"


def pci_device(bus: int, product: str, types: Sequence[tuple[str, str, int]] = (),
               vendor: str = "0x10de", klass: str = "0x030200", function: int = 0,
               physical_function: int | None = None) -> str:
    """A <device> of the test driver's node file: a PCI device at 0000:<bus>:00.<function>."""
    pf = "" if physical_function is None else (
        f"<capability type='phys_function'><address domain='0x0000' bus='{physical_function:#04x}' "
        "slot='0x00' function='0x0'/></capability>")
    return f"""
  <device>
    <name>pci_0000_{bus:02x}_00_{function}</name>
    <parent>computer</parent>
    <capability type='pci'>
      <class>{klass}</class>
      <domain>0</domain><bus>{bus}</bus><slot>0</slot><function>{function}</function>
      <product id='{product}'>GPU</product>
      <vendor id='{vendor}'>Vendor</vendor>
      {pf}{_mdev_types(types)}
    </capability>
  </device>"""


def mdev_device(uuid: str, parent: str, type_id: str) -> str:
    """A <device> of the test driver's node file: an mdev under `parent`."""
    return f"""
  <device>
    <name>mdev_{uuid.replace('-', '_')}</name>
    <parent>{parent}</parent>
    <capability type='mdev'><type id='{type_id}'/><uuid>{uuid}</uuid><iommuGroup number='12'/></capability>
  </device>"""


def write_node_file(path: Path, devices: list[str]) -> str:
    """Write a test-driver node file holding `devices`; returns its test:/// URI."""
    path.write_text(f"<node>{NODE_CPU}{''.join(devices)}\n</node>\n")
    return f"test://{path.resolve()}"


# A host with: an A100 80GB offering matched, alternative-prefix, unknown and miscounted types; a GPU the
# catalog does not know; an L40S in passthrough; an A100 40GB that already holds an mdev (so no count check);
# an A100 80GB whose types come from an SR-IOV VF; a NIC that is not NVIDIA's.
FLEET_DEVICES = [
    pci_device(0x41, "0x20b5", [("nvidia-558", "NVIDIA A100D-10C", 8), ("nvidia-559", "NVIDIA A100DX-20C", 4),
                                ("nvidia-777", "NVIDIA A100D-7C", 11), ("nvidia-560", "GRID A100D-40C", 3)]),
    pci_device(0x42, "0x1234", [("nvidia-1", "NVIDIA X1-1C", 4)]),
    pci_device(0x43, "0x26b9"),
    pci_device(0x44, "0x20f1", [("nvidia-468", "GRID A100-4C", 7)]),
    mdev_device(MDEV_UUID, "pci_0000_44_00_0", "nvidia-468"),
    pci_device(0x45, "0x20b5"),
    pci_device(0x45, "0x20b5", [("nvidia-558", "NVIDIA A100D-10C", 1)], function=4, physical_function=0x45),
    pci_device(0x46, "0x1521", vendor="0x8086", klass="0x020000"),
]


class RecordingNodeDevices:
    """A NodeDeviceApi that records every call and keeps mdevs in memory, as mdevctl would. With `parents`
    (as libvirt lists the GPUs and VFs offering mdev types), it counts instances as the driver does: a
    started mdev takes one instance of its type on a GPU, and a whole VF (one vGPU per VF)."""

    def __init__(self, parents: Sequence[MdevParent] = (), log: list[str] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.mdevs: dict[str, MdevInfo] = {}
        self.autostart: set[str] = set()
        self.fail_start = False
        self.parents = {p.name: MdevParent(p.name, p.gpu, dict(p.types)) for p in parents}
        self._initial = {p.name: dict(p.types) for p in parents}
        self.log = log if log is not None else []  # shared with other fakes to check the order across them

    def _call(self, name: str, arg: str) -> None:
        self.calls.append((name, arg))
        self.log.append(f"nodedev {name}")

    def define(self, xml: str) -> str:
        """Record the XML and define the mdev it describes."""
        self._call("define", xml)
        doc = etree.fromstring(xml.encode())
        uuid = doc.findtext("capability/uuid") or ""
        parent = doc.findtext("parent") or ""
        type_el = doc.find("capability/type")
        type_id = type_el.get("id", "") if type_el is not None else ""
        name = f"mdev_{uuid.replace('-', '_')}_{parent.removeprefix('pci_')}"
        self.mdevs[name] = MdevInfo(name, uuid, parent, type_id, False)
        return name

    def start(self, name: str) -> None:
        """Record and start, taking an instance of the type from its parent."""
        self._call("start", name)
        if self.fail_start:
            raise HostError("start failed")
        m = self.mdevs[name]
        p = self.parents.get(m.parent)
        if p is not None:
            assert p.types.get(m.type_id, 0) > 0, f"driver would refuse: no {m.type_id} left on {m.parent}"
            if p.name != PciAddress.parse(p.gpu).nodedev_name:
                p.types.update(dict.fromkeys(p.types, 0))
            else:
                p.types[m.type_id] -= 1
        self.mdevs[name] = m._replace(active=True)

    def set_autostart(self, name: str) -> None:
        """Record; the mdev is started again by `reboot`."""
        self._call("set_autostart", name)
        self.autostart.add(name)

    def destroy(self, name: str) -> None:
        """Record and stop, giving the instance back."""
        self._call("destroy", name)
        m = self.mdevs[name]
        p = self.parents.get(m.parent)
        if p is not None and m.active:
            if p.name != PciAddress.parse(p.gpu).nodedev_name:
                p.types.update(self._initial[p.name])
            else:
                p.types[m.type_id] += 1
        self.mdevs[name] = m._replace(active=False)

    def undefine(self, name: str) -> None:
        """Record and forget."""
        self._call("undefine", name)
        del self.mdevs[name]
        self.autostart.discard(name)

    def reboot(self) -> None:
        """A host boot, not recorded: every mdev stops, those with autostart start again."""
        for p in self.parents.values():
            p.types.update(self._initial[p.name])
        self.mdevs = {n: m._replace(active=False) for n, m in self.mdevs.items()}
        for name in sorted(self.autostart):
            self.start(name)
            self.calls.pop()
            self.log.pop()

    def list_mdevs(self) -> list[MdevInfo]:
        """The mdevs defined so far (not recorded: it changes nothing)."""
        return list(self.mdevs.values())

    def mdev_parents(self) -> list[MdevParent]:
        """The parents with what each can still create (not recorded: it changes nothing)."""
        return [MdevParent(p.name, p.gpu, dict(p.types)) for p in sorted(self.parents.values())]

    def names(self) -> list[str]:
        """The recorded call names, in order."""
        return [c[0] for c in self.calls]


def mdev_hostdev(device_id: str = "dev-1", display: bool = False, ramfb: bool = False) -> HostdevContext:
    """An mdev vGPU hostdev."""
    return HostdevContext(device_id, "A100D-10C", DeviceBacking.MDEV, MDEV_UUID, None, display, ramfb)


def vf_hostdev(device_id: str = "dev-2") -> HostdevContext:
    """A vendor-VFIO VF hostdev."""
    vf = PciAddress.parse("0000:41:00.4")
    return HostdevContext(device_id, "L40S-12C", DeviceBacking.VFIO_VF, None, vf)


def pci_hostdev(device_id: str = "dev-3") -> HostdevContext:
    """A whole-GPU passthrough hostdev."""
    return HostdevContext(device_id, "A100-80GB", DeviceBacking.PCI, None, PciAddress.parse("0000:42:00.0"))


def domain_context(hostdevs: list[HostdevContext] | None = None, **changes: object) -> DomainContext:
    """A valid DomainContext, with `changes` applied."""
    values: dict[str, object] = {
        "name": "vm-1", "uuid": VM_UUID, "tenant": "acme", "vm_id": "42", "vcpus": 4, "memory_mib": 8192,
        "disk_base_image": "/var/lib/vgpu-ctl/images/ubuntu-24.04.qcow2",
        "disk_overlay": "/var/lib/vgpu-ctl/disks/vm-1.qcow2", "network": "default", "network_type": "network",
        "hostdevs": [mdev_hostdev()] if hostdevs is None else hostdevs, "compute_only": True,
    }
    values.update(changes)
    return DomainContext(**values)  # type: ignore[arg-type]


def simulated_writer(state_dir: str, worker: int, count: int, start: bool = False,
                     fold_bytes: int | None = None) -> None:
    """One of several processes each adding `count` devices and domains to simulated host sim-1 (started with
    `start`; with `fold_bytes`, the journal folded into the state file once it is that long)."""
    if fold_bytes is not None:
        simulated._FOLD_BYTES = fold_bytes
    host = SimulatedHost("sim-1", Path(state_dir))
    renderer = TemplateRenderer()
    for i in range(count):
        uuid = str(uuidlib.UUID(int=(worker + 1) << 64 | i))
        host.create_device(DeviceSpec(f"dev-{worker}-{i}", "0000:41:00.0", DeviceBacking.MDEV, "A100D-4C",
                                      start=0, size=4, uuid=uuid, mdev_type="nvidia-555"))
        hostdev = HostdevContext(f"dev-{worker}-{i}", "A100D-4C", DeviceBacking.MDEV, uuid, None)
        host.define_domain(renderer.render_domain(
            "domain.xml.j2", domain_context([hostdev], name=f"vm-{worker}-{i}", uuid=uuid)))
        if start:
            host.start_domain(f"vm-{worker}-{i}")


def run_simulated_writers(state_dir: Path, workers: int, count: int, timeout_s: float, **kw: Any) -> None:
    """`simulated_writer` in `workers` processes at once, spawned (a forked child would share this process's
    libvirt state); each must end well within `timeout_s`."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=simulated_writer, args=(str(state_dir), w, count), kwargs=kw)
             for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
        assert p.exitcode == 0


def running_vm(ctl: Any, name: str, profile: str, pool: str) -> Any:
    """Tenant acme's VM `name` with one vGPU of `profile` in `pool` (2 vCPUs, 4 GiB), asserted running."""
    vm = ctl.request_vm("acme", name, [(profile, 1)], vcpus=2, memory_mib=4096, pool=pool)
    assert vm.state == "running", vm.error
    return vm
