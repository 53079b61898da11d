"""Every backing through the whole path: Controller -> host agent transport -> libvirt/NVML/sysfs drivers.

Two declared libvirt hosts run on libvirt's test driver, their NVIDIA side emulated: node devices shaped as
libvirt reports NVIDIA GPUs and VFs (mdev_types with name and availableInstances), node-device calls recorded
(libvirt's test driver cannot define mdevs), a fake NVML that follows NVIDIA's MIG rules, and a fake vendor-VFIO
sysfs tree. `inventory apply` discovers what each host calls each profile; each VM then gets exactly the device
asked for, and releasing it leaves the host as it was.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lxml import etree
from sqlalchemy import select

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from fake_pynvml import A100_80GB, H100_80GB, H200, L40S, FakeGpu, FakeNvml  # noqa: E402
from fake_sysfs import FakeVfioSysfs  # noqa: E402
from hostfixtures import RecordingNodeDevices, pci_device, running_vm, write_node_file  # noqa: E402

from vgpu_ctl import Controller  # noqa: E402
from vgpu_ctl.catalog import ProfileKind  # noqa: E402
from vgpu_ctl.errors import HostError, NoCapacity  # noqa: E402
from vgpu_ctl.hosts.agent import AgentHostSide, InProcessTransport  # noqa: E402
from vgpu_ctl.hosts.hostside import LocalHostSide  # noqa: E402
from vgpu_ctl.hosts.nodedev import parse_mdev_parent  # noqa: E402
from vgpu_ctl.service.hosts import HostFactory  # noqa: E402
from vgpu_ctl.store.tables import GPU, HOST  # noqa: E402

# kvm1 (mdev): A100 80GB legacy-style equal-size at 41 and mixed-size at 42, H100 in MIG mode at 43 whose VF
# 43:00.4 offers the MIG-backed type, L40S for passthrough at 44.
KVM1_DEVICES = [
    pci_device(0x41, "0x20b5", [("nvidia-558", "NVIDIA A100D-10C", 8), ("nvidia-560", "NVIDIA A100D-40C", 2)]),
    pci_device(0x42, "0x20b5", [("nvidia-559", "NVIDIA A100D-20C", 4), ("nvidia-558", "NVIDIA A100D-10C", 8)]),
    pci_device(0x43, "0x2330"),
    pci_device(0x43, "0x2330", [("nvidia-700", "NVIDIA H100-3-40C", 1)], function=4, physical_function=0x43),
    pci_device(0x43, "0x2330", [("nvidia-700", "NVIDIA H100-3-40C", 1)], function=5, physical_function=0x43),
    pci_device(0x44, "0x26b9"),
]
# kvm2 (vendor-specific VFIO): two H200 GPUs, time-sliced at 41, MIG at 42; no mdev types at all.
KVM2_DEVICES = [pci_device(0x41, "0x2335"), pci_device(0x42, "0x2335")]

INVENTORY = """\
pools:
  - {name: eq}
  - {name: mixed}
  - {name: mig}
  - {name: migmdev}
  - {name: pt}
  - {name: vf}
  - {name: migvf}
hosts:
  - name: kvm1
    uri: "%(kvm1)s"
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: eq}
      - {pci: "0000:42:00.0", model: A100-80GB, mode: vgpu-mixed, pool: mixed}
      - {pci: "0000:43:00.0", model: H100-80GB, mode: mig, pool: mig}
      - {pci: "0000:44:00.0", model: L40S, mode: passthrough, pool: pt}
  - name: kvm2
    uri: "%(kvm2)s"
    vgpu_backing: vfio
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:41:00.0", model: H200, mode: vgpu-equal, pool: vf}
      - {pci: "0000:42:00.0", model: H200, mode: mig, pool: migvf}
"""


class Fleet:
    """The two hosts' emulated NVIDIA side and a Controller whose HostFactory reaches them through the
    agent's protocol."""

    def __init__(self, tmp: Path, url: str | None = None) -> None:
        self.log: list[str] = []  # node-device, NVML and sysfs changes of both hosts, in order
        self.kvm1_uri = write_node_file(tmp / "kvm1.xml", KVM1_DEVICES)
        self.kvm2_uri = write_node_file(tmp / "kvm2.xml", KVM2_DEVICES)
        parents = [p for p in map(parse_mdev_parent, (d.strip() for d in KVM1_DEVICES)) if p is not None]
        self.nodedev = RecordingNodeDevices(parents, self.log)
        nodedevs = {"kvm1": self.nodedev, "kvm2": RecordingNodeDevices((), self.log)}  # kvm2 offers no mdevs
        self.nvml = {
            "kvm1": FakeNvml([FakeGpu(A100_80GB, "00000000:41:00.0", "GPU-a", 0, 0),
                              FakeGpu(A100_80GB, "00000000:42:00.0", "GPU-b", 0, 0),
                              FakeGpu(H100_80GB, "00000000:43:00.0", "GPU-c"),
                              FakeGpu(L40S, "00000000:44:00.0", "GPU-d")]),
            "kvm2": FakeNvml([FakeGpu(H200, "00000000:41:00.0", "GPU-e", 0, 0),
                              FakeGpu(H200, "00000000:42:00.0", "GPU-f")]),
        }
        for name, n in self.nvml.items():
            n.on_change.append(lambda call, name=name: self.log.append(f"nvml {name} {call}"))
        self.sysfs_root = tmp / "kvm2-sys"
        self.sysfs = {pf: FakeVfioSysfs(self.sysfs_root, pf, num_vfs=2, nvml=self.nvml["kvm2"])
                      for pf in ("0000:41:00.0", "0000:42:00.0")}
        self.sides = {
            "kvm1": LocalHostSide(tmp / "agent-kvm1", tmp / "kvm1-sys", self.nvml["kvm1"]),
            "kvm2": LocalHostSide(tmp / "agent-kvm2", self.sysfs_root, self.nvml["kvm2"]),
        }
        factory = HostFactory(tmp / "state", sides=lambda h: AgentHostSide(h.name, InProcessTransport(
            self.sides[h.name])), nodedevs=lambda h: nodedevs[h.name])
        self.ctl = Controller(url or f"sqlite:///{tmp / 'store.db'}", state_path=tmp / "state",
                              host_factory=factory)
        self.inventory = tmp / "inventory.yaml"
        self.inventory.write_text(INVENTORY % {"kvm1": self.kvm1_uri, "kvm2": self.kvm2_uri})

    def vf_types(self) -> dict[str, int]:
        """current_vgpu_type of every VF of kvm2."""
        out: dict[str, int] = {}
        for s in self.sysfs.values():
            out.update(s.current())
        return out


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    f.changes = f.ctl.apply_inventory(f.inventory)  # type: ignore[attr-defined]
    f.ctl.create_tenant("acme")
    f.log.clear()
    yield f
    f.ctl.close()


def _vm(fleet: Fleet, name: str, profile: str, pool: str) -> Any:
    return running_vm(fleet.ctl, name, profile, pool)


def _hostdevs(fleet: Fleet, vm: Any) -> list[str]:
    """The hostdev elements of the VM's domain as libvirt stored it, without whitespace."""
    doc = etree.fromstring(fleet.ctl.vm_xml(vm.id).encode())
    out = []
    for h in doc.iterfind("devices/hostdev"):
        for el in h.iter():
            el.tail = el.text = None if el.text is None or not el.text.strip() else el.text
        out.append(etree.tostring(h, encoding=str).replace("\n", ""))
    return out


def _mdev_xml(parent: str, type_id: str, uuid: str, attrs: str = "") -> str:
    return (f"<device>\n  <parent>{parent}</parent>\n  <capability type='mdev'>\n    <type id='{type_id}'/>\n"
            f"    <uuid>{uuid}</uuid>{attrs}\n  </capability>\n</device>\n")


# -- discovery feeds the store ---------------------------------------------------------------------------------

def test_apply_records_what_each_host_calls_each_profile(fleet: Fleet) -> None:
    from sqlalchemy import select

    from vgpu_ctl.service.host_types import stored_ids
    from vgpu_ctl.store.tables import GPU, HOST
    with fleet.ctl.engine.connect() as conn:
        rows = conn.execute(select(HOST.c.name, GPU.c.pci_address, GPU.c.id).join(HOST, HOST.c.id == GPU.c.host_id)
                            .order_by(HOST.c.name, GPU.c.pci_address)).all()
        ids = {f"{r.name}/{r.pci_address}": stored_ids(conn, r.id) for r in rows}
    assert ids["kvm1/0000:41:00.0"]["mdev"] == {"A100D-10C": "nvidia-558", "A100D-40C": "nvidia-560"}
    assert ids["kvm1/0000:42:00.0"]["mdev"] == {"A100D-20C": "nvidia-559", "A100D-10C": "nvidia-558"}
    # the VFs' MIG-backed type, and NVML's GPU-instance profiles of the H100 (all seven)
    assert ids["kvm1/0000:43:00.0"]["mdev"] == {"H100-3-40C": "nvidia-700"}
    assert ids["kvm1/0000:43:00.0"]["mig"]["3g.40gb"] == "9" and len(ids["kvm1/0000:43:00.0"]["mig"]) == 7
    # vendor VFIO: the host names the types H200X-..., the catalog H200-...; ids come from creatable_vgpu_types
    assert ids["kvm2/0000:41:00.0"]["vfio"] == {"H200-141C": "1428", "H200-70C": "1427", "H200-35C": "1425"}
    assert ids["kvm2/0000:42:00.0"]["vfio"] == {} and ids["kvm2/0000:42:00.0"]["mig"]["1g.18gb"] == "19"
    recorded = {c["name"] for c in fleet.changes if c["action"] == "record"}  # type: ignore[attr-defined]
    assert recorded == {"kvm1/0000:41:00.0", "kvm1/0000:42:00.0", "kvm1/0000:43:00.0", "kvm2/0000:41:00.0",
                        "kvm2/0000:42:00.0"}
    # applying again changes nothing it recorded
    again = fleet.ctl.apply_inventory(fleet.inventory)
    assert not [c for c in again if c["action"] == "record"]


def test_missing_types_are_findings_with_what_to_do(fleet: Fleet) -> None:
    findings = {(c["kind"], c["name"]): c["fields"] for c in fleet.changes  # type: ignore[attr-defined]
                if c["action"] == "report"}
    # the equal-size A100 lacks most time-sliced types: named, with the driver/mode advice
    eq = findings[("missing-mdev-types", "kvm1/0000:41:00.0")]
    assert "A100D-20C" in eq["detail"] and "A100D-10C" not in eq["detail"].split("for ", 1)[1]
    assert "driver (driver 550.90.05) offers other types" in eq["do"]
    # the MIG H100 offers only one of its MIG-backed types on its VFs
    mig = findings[("missing-mdev-types", "kvm1/0000:43:00.0")]
    assert "H100-1-10C" in mig["detail"] and "H100-3-40C" not in mig["detail"]
    # the MIG H200 on vendor VFIO: its VFs offer the MIG-backed types only once GPU instances exist
    assert ("missing-vfio-types", "kvm2/0000:42:00.0") in findings
    assert not any(k == "missing-mig-types" for k, _ in findings)


def test_wrong_mode_and_no_driver_are_findings(fleet: Fleet) -> None:
    fleet.nvml["kvm1"].gpus[2].mig_current = 0  # an admin turned MIG off on the H100
    changes = fleet.ctl.apply_inventory(fleet.inventory)
    wrong = [c for c in changes if c["kind"] == "wrong-mode"]
    assert [c["name"] for c in wrong] == ["kvm1/0000:43:00.0"]
    assert "nvidia-smi -i 0000:43:00.0 -mig 1" in wrong[0]["fields"]["do"]
    fleet.nvml["kvm2"].driver_loaded = False
    changes = fleet.ctl.apply_inventory(fleet.inventory)
    no_nvml = [c for c in changes if c["kind"] == "missing-mig-types" and c["name"] == "kvm2/0000:42:00.0"]
    assert no_nvml and "NVIDIA host driver is not loaded" in no_nvml[0]["fields"]["do"]


def test_a_type_the_host_lacks_is_kept_out_of_placement(fleet: Fleet) -> None:
    with pytest.raises(NoCapacity, match="1 GPU whose host has no type id for the profile"):
        fleet.ctl.request_vm("acme", "nope", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="eq")
    assert fleet.nodedev.calls == [] and fleet.ctl.list_vms() == []
    with fleet.ctl.engine.connect() as conn:
        lacked = dict(conn.execute(select(GPU.c.pci_address, GPU.c.lacked_types).join(HOST, HOST.c.id == GPU.c.host_id)
                                   .where(HOST.c.name == "kvm2")).all())
    # MIG-backed types show on a VF only once a GPU instance exists: never lacked for that
    mig_backed = {p.name for p in fleet.ctl.catalog.profiles("H200") if p.kind is ProfileKind.MIG_VGPU}
    assert mig_backed and not mig_backed & set(lacked["0000:42:00.0"] or {})
    _vm(fleet, "migvf", "H200-1-18C", "migvf")  # so placement offers their GPU for them


# -- each backing ------------------------------------------------------------------------------------------------

def test_mdev_equal_size(fleet: Fleet) -> None:
    vm = _vm(fleet, "eq1", "A100D-10C", "eq")
    (dev,) = vm.devices
    assert fleet.nodedev.calls[0] == ("define", _mdev_xml("pci_0000_41_00_0", "nvidia-558", dev.uuid))
    assert fleet.nodedev.names() == ["define", "start", "set_autostart"]
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"mdev\" managed=\"no\" model=\"vfio-pci\" display=\"off\">"
        f"<source><address uuid=\"{dev.uuid}\"/></source></hostdev>"]
    assert fleet.log == ["nodedev define", "nodedev start", "nodedev set_autostart"]
    fleet.ctl.release_vm(vm.id)
    assert fleet.nodedev.names()[3:] == ["destroy", "undefine"] and fleet.nodedev.mdevs == {}


def test_mdev_mixed_size_sends_the_placement_id(fleet: Fleet) -> None:
    vm = _vm(fleet, "mx1", "A100D-20C", "mixed")
    (dev,) = vm.devices
    assert dev.start in (0, 20, 40, 60)
    attr = f"\n    <attr name='vgpu-placement-id' value='{dev.start}'/>"
    assert fleet.nodedev.calls[0] == ("define", _mdev_xml("pci_0000_42_00_0", "nvidia-559", dev.uuid, attr))
    vm2 = _vm(fleet, "mx2", "A100D-10C", "mixed")  # another size on the same GPU, at its own placement
    (dev2,) = vm2.devices
    attr2 = f"\n    <attr name='vgpu-placement-id' value='{dev2.start}'/>"
    assert fleet.nodedev.calls[3] == ("define", _mdev_xml("pci_0000_42_00_0", "nvidia-558", dev2.uuid, attr2))
    assert not (dev.start <= dev2.start < dev.start + 20)


def test_mig_instance_on_kvm_is_the_instance_and_the_mig_backed_type_filling_it(fleet: Fleet) -> None:
    # a KVM guest can't take a bare GPU instance: it gets H100-3-40C (all 40 GB, one per instance) on a VF
    vm = _vm(fleet, "mig1", "3g.40gb", "mig")
    (dev,) = vm.devices
    assert dev.start in (0, 4)  # where placement put it: NVML gets exactly that placement
    assert fleet.log == [f"nvml kvm1 create_gi 00000000:43:00.0 3g.40gb@{dev.start}",
                         "nvml kvm1 create_ci 00000000:43:00.0 gi=1 slices=3",
                         "nodedev define", "nodedev start"]  # no autostart: the instance does not survive a boot
    assert fleet.nodedev.calls[0] == ("define", _mdev_xml("pci_0000_43_00_4", "nvidia-700", dev.uuid))
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"mdev\" managed=\"no\" model=\"vfio-pci\" display=\"off\">"
        f"<source><address uuid=\"{dev.uuid}\"/></source></hostdev>"]
    assert [f for f in fleet.ctl.reconcile().findings if f.kind != "foreign-domain"] == []
    fleet.log.clear()
    fleet.ctl.release_vm(vm.id)
    assert fleet.log == ["nodedev destroy", "nodedev undefine", "nvml kvm1 destroy_ci gi=1 ci=0",
                         "nvml kvm1 destroy_gi 00000000:43:00.0 1"]
    assert fleet.nvml["kvm1"].gpus[2].gis == {} and fleet.nodedev.mdevs == {}


def test_mig_instance_on_vendor_vfio_is_the_instance_and_the_vf_type_filling_it(fleet: Fleet) -> None:
    vm = _vm(fleet, "mig2", "1g.18gb", "migvf")
    (dev,) = vm.devices
    assert fleet.nvml["kvm2"].calls == [f"create_gi 00000000:42:00.0 1g.18gb@{dev.start}",
                                        "create_ci 00000000:42:00.0 gi=1 slices=1"]
    fleet.sysfs["0000:42:00.0"].refresh()
    assert fleet.vf_types() == {"0000:41:00.4": 0, "0000:41:00.5": 0, "0000:42:00.4": 1414, "0000:42:00.5": 0}
    assert fleet.sysfs["0000:42:00.0"].file("0000:42:00.4", "gpu_instance_id").read_text() == "1\n"
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"pci\" managed=\"no\"><source><address domain=\"0x0000\" "
        "bus=\"0x42\" slot=\"0x00\" function=\"0x4\"/></source></hostdev>"]
    assert fleet.nodedev.calls == []
    fleet.ctl.release_vm(vm.id)  # the VF's type first, then the instance (the fake refuses the other order)
    assert fleet.vf_types()["0000:42:00.4"] == 0 and fleet.nvml["kvm2"].gpus[1].gis == {}


def test_mig_instance_without_a_filling_type_is_refused_naming_what_to_use(fleet: Fleet, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.catalog.loader import CATALOG_PATH_ENV, DATA_DIR
    data = yaml.safe_load((DATA_DIR / "h100-80gb.yaml").read_text())
    data["mig"]["vgpu_types"] = [t for t in data["mig"]["vgpu_types"] if t["mig_profile"] != "3g.40gb"]
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "h100-80gb.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv(CATALOG_PATH_ENV, str(tmp_path / "cat"))
    fleet.ctl.catalog = load_catalog()
    assert fleet.ctl.catalog.profile("H100-80GB", "H100-3-40C") is None
    with pytest.raises(HostError) as err:
        fleet.ctl.request_vm("acme", "mig3", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="mig")
    assert ("MIG profile 3g.40gb on H100-80GB can't be given to a KVM guest: a VM takes a MIG instance only "
            "through the MIG-backed vGPU type that fills it, and the catalog has none for 3g.40gb on H100-80GB; "
            "ask for one of its MIG-backed vGPU types instead (H100-1-10C, ") in err.value.message
    assert "add a MIG-backed type with mig_profile: 3g.40gb to the catalog" in err.value.message
    assert fleet.log == [] and fleet.nvml["kvm1"].calls == []  # nothing was made on the host
    assert fleet.ctl.get_vm("mig3").state == "failed"


def test_mig_backed_vgpu_on_mdev_creates_the_gpu_instance_then_the_mdev_on_a_vf(fleet: Fleet) -> None:
    vm = _vm(fleet, "mb1", "H100-3-40C", "mig")
    (dev,) = vm.devices
    assert fleet.log == [f"nvml kvm1 create_gi 00000000:43:00.0 3g.40gb@{dev.start}",
                         "nvml kvm1 create_ci 00000000:43:00.0 gi=1 slices=3",
                         "nodedev define", "nodedev start"]  # no autostart: the GPU instance does not survive a boot
    assert fleet.nodedev.calls[0] == ("define", _mdev_xml("pci_0000_43_00_4", "nvidia-700", dev.uuid))
    vm2 = _vm(fleet, "mb2", "H100-3-40C", "mig")  # the first VF is used: the second one takes it
    assert fleet.nodedev.calls[2] == ("define", _mdev_xml("pci_0000_43_00_5", "nvidia-700", vm2.devices[0].uuid))
    assert sorted(g.start for g in fleet.nvml["kvm1"].gpus[2].gis.values()) == [0, 4]
    fleet.log.clear()
    fleet.ctl.release_vm(vm.id)
    assert fleet.log == ["nodedev destroy", "nodedev undefine", "nvml kvm1 destroy_ci gi=1 ci=0",
                         "nvml kvm1 destroy_gi 00000000:43:00.0 1"]


def test_vendor_vfio_vf(fleet: Fleet) -> None:
    vm = _vm(fleet, "vf1", "H200-35C", "vf")
    assert fleet.vf_types() == {"0000:41:00.4": 1425, "0000:41:00.5": 0, "0000:42:00.4": 0, "0000:42:00.5": 0}
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"pci\" managed=\"no\"><source><address domain=\"0x0000\" "
        "bus=\"0x41\" slot=\"0x00\" function=\"0x4\"/></source></hostdev>"]
    assert fleet.nodedev.calls == [] and fleet.nvml["kvm2"].calls == []
    fleet.ctl.release_vm(vm.id)
    fleet.sysfs["0000:41:00.0"].refresh()
    assert set(fleet.vf_types().values()) == {0}


def test_mig_backed_vgpu_on_vfio_creates_the_gpu_instance_then_writes_the_vf_type(fleet: Fleet) -> None:
    # the MIG-backed type only shows on the VFs once a GPU instance exists: its id is not in the store, so the
    # type is found by name on the VF, right after the GPU instance is made
    vm = _vm(fleet, "mv1", "H200-1-18C", "migvf")
    (dev,) = vm.devices
    assert fleet.nvml["kvm2"].calls == [f"create_gi 00000000:42:00.0 1g.18gb@{dev.start}",
                                        "create_ci 00000000:42:00.0 gi=1 slices=1"]
    fleet.sysfs["0000:42:00.0"].refresh()
    assert fleet.vf_types()["0000:42:00.4"] == 1414
    assert fleet.sysfs["0000:42:00.0"].file("0000:42:00.4", "gpu_instance_id").read_text() == "1\n"
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"pci\" managed=\"no\"><source><address domain=\"0x0000\" "
        "bus=\"0x42\" slot=\"0x00\" function=\"0x4\"/></source></hostdev>"]
    fleet.ctl.release_vm(vm.id)  # the VF first (the fake refuses destroying a GPU instance a VF holds)
    assert fleet.vf_types()["0000:42:00.4"] == 0 and fleet.nvml["kvm2"].gpus[1].gis == {}


def test_mig_backed_vgpu_on_vfio_is_undone_when_the_vf_refuses(fleet: Fleet) -> None:
    fleet.sysfs["0000:42:00.0"].mig_types.clear()  # a driver without MIG-backed vGPU support
    with pytest.raises(HostError, match=re.escape("vGPU type H200-1-18C is not creatable on GPU 0000:42:00.0")):
        fleet.ctl.request_vm("acme", "mv2", [("H200-1-18C", 1)], vcpus=2, memory_mib=4096, pool="migvf")
    assert fleet.nvml["kvm2"].calls[-1].startswith("destroy_gi") and fleet.nvml["kvm2"].gpus[1].gis == {}


def test_whole_gpu_passthrough(fleet: Fleet) -> None:
    vm = _vm(fleet, "pt1", "L40S", "pt")
    assert _hostdevs(fleet, vm) == [
        "<hostdev mode=\"subsystem\" type=\"pci\" managed=\"yes\"><source><address domain=\"0x0000\" "
        "bus=\"0x44\" slot=\"0x00\" function=\"0x0\"/></source></hostdev>"]
    assert fleet.log == []


def test_reconcile_sees_the_devices_of_every_backing(fleet: Fleet) -> None:
    for name, profile, pool in (("r1", "A100D-10C", "eq"), ("r2", "H200-35C", "vf"), ("r3", "L40S", "pt"),
                                ("r4", "3g.40gb", "mig"), ("r5", "H100-3-40C", "mig")):
        _vm(fleet, name, profile, pool)
    report = fleet.ctl.reconcile()
    assert [f for f in report.findings if f.kind != "foreign-domain"] == []


def test_vendor_vfio_uses_the_discovered_id(fleet: Fleet) -> None:
    from fake_sysfs import FakeVgpuType

    # a driver update renumbered H200X-35C after discovery: the stored id is no longer offered
    sysfs = fleet.sysfs["0000:41:00.0"]
    sysfs.types = {1500: FakeVgpuType(1500, "NVIDIA H200X-35C", 4)}
    sysfs.refresh()
    with pytest.raises(HostError, match=re.escape("vGPU type H200-35C (id 1425, as discovered) is not creatable "
                                                  "on GPU 0000:41:00.0 now; creatable: H200X-35C (1500); the host "
                                                  "driver now gives the type another id: discover the host again")):
        fleet.ctl.request_vm("acme", "vf2", [("H200-35C", 1)], vcpus=2, memory_mib=4096, pool="vf")
    assert set(fleet.vf_types().values()) == {0}
    fleet.ctl.apply_inventory(fleet.inventory)  # discovery again: the new id is recorded and used
    _vm(fleet, "vf3", "H200-35C", "vf")
    assert fleet.vf_types()["0000:41:00.4"] == 1500


def test_host_discover_write_fills_the_store(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from vgpu_ctl.cli.main import app
    from vgpu_ctl.service.ports import STORE
    with fleet.ctl.tx() as conn:  # no type id recorded on any GPU
        gpus = {h: [g.id for g in STORE.hosts.gpus_of_host(conn, h).values()] for h in ("kvm1", "kvm2")}
        for gpu_id in gpus["kvm1"] + gpus["kvm2"]:
            STORE.host_types.replace_type_ids(conn, gpu_id, {})
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "cli-state"))
    out = CliRunner().invoke(app, ["--db", str(fleet.ctl.engine.url), "host", "discover", fleet.kvm1_uri,
                                   "--name", "kvm1", "--write", str(tmp_path / "kvm1.yaml")])
    assert out.exit_code == 0, out.output
    assert "store: record type-ids kvm1/0000:41:00.0: mdev=2" in out.output
    with fleet.ctl.engine.connect() as conn:  # the discovery recorded kvm1's, and only kvm1's
        recorded = STORE.host_types.type_ids(conn, gpus["kvm1"] + gpus["kvm2"])
        assert any(recorded[g]["mdev"] for g in gpus["kvm1"])
        assert not any(ids for g in gpus["kvm2"] for ids in recorded[g].values())
    assert "model: A100-80GB" in (tmp_path / "kvm1.yaml").read_text()


def test_an_unreachable_declared_host_is_a_finding_not_a_failure(fleet: Fleet, tmp_path: Path) -> None:
    inv = tmp_path / "more.yaml"
    inv.write_text(fleet.inventory.read_text().replace(fleet.kvm2_uri, f"test://{tmp_path}/missing.xml"))
    changes = fleet.ctl.apply_inventory(inv)
    (f,) = [c for c in changes if c["kind"] == "host-unreachable"]
    assert f["name"] == "kvm2" and "connecting to test://" in f["fields"]["detail"]
    assert "type ids stay as recorded before" in f["fields"]["do"]


def _driver(fleet: Fleet, host: str) -> Any:
    from sqlalchemy import select

    from vgpu_ctl.store.tables import HOST
    with fleet.ctl.engine.connect() as conn:
        row = conn.execute(select(HOST).where(HOST.c.name == host)).one()
    return fleet.ctl.hosts.get(row)


def _active(fleet: Fleet) -> dict[str, bool]:
    return {d.name: d.active for h in ("kvm1", "kvm2") for d in _driver(fleet, h).list_domains()}


def _reboot(fleet: Fleet) -> None:
    """Both hosts boot: domains are off (none autostarts), GPU instances and VF types are gone, mdevs without
    autostart are defined but stopped."""
    for h in ("kvm1", "kvm2"):
        for d in _driver(fleet, h).list_domains():
            _driver(fleet, h).stop_domain(d.name, force=True)
    for n in fleet.nvml.values():
        for g in n.gpus:
            g.gis.clear()
    for sysfs in fleet.sysfs.values():
        for vf_addr in sysfs.vfs:
            sysfs.file(vf_addr, "current_vgpu_type").write_text("0\n")
        sysfs.refresh()
    fleet.nodedev.reboot()
    fleet.log.clear()


def test_after_a_host_reboot_reconcile_recreates_mig_instances_and_vf_types(fleet: Fleet) -> None:
    mig = _vm(fleet, "boot1", "3g.40gb", "mig")
    vf = _vm(fleet, "boot2", "H200-35C", "vf")
    eq = _vm(fleet, "boot3", "A100D-10C", "eq")  # a persistent mdev: back by itself after the boot
    _reboot(fleet)
    report = fleet.ctl.reconcile()
    lost = sorted(f.detail.split(" ")[1] for f in report.findings if f.kind == "lost-vm")
    assert lost == ["boot1", "boot2"]
    fleet.ctl.reconcile(fix=True)
    (dev,) = mig.devices
    assert [(g.profile.name, g.start) for g in fleet.nvml["kvm1"].gpus[2].gis.values()] == [("3g.40gb", dev.start)]
    # boot1's mdev (MIG-backed: never autostarted) is started again, not defined anew; boot3's is not touched
    assert fleet.log == [f"nvml kvm1 create_gi 00000000:43:00.0 3g.40gb@{dev.start}",
                         "nvml kvm1 create_ci 00000000:43:00.0 gi=1 slices=3", "nodedev start"]
    assert fleet.nodedev.calls[-1][1].startswith(f"mdev_{dev.uuid.replace('-', '_')}")
    assert fleet.vf_types()["0000:41:00.4"] == 1425
    assert {fleet.ctl.get_vm(v.id).state for v in (mig, vf, eq)} == {"running"}
    assert _active(fleet)[f"boot1-{mig.id[:8]}"] and _active(fleet)[f"boot2-{vf.id[:8]}"]
    assert [f for f in fleet.ctl.reconcile().findings if f.kind != "foreign-domain"] == []


def test_reconcile_never_touches_a_device_under_a_running_domain(fleet: Fleet) -> None:
    vf = _vm(fleet, "run1", "H200-35C", "vf")
    mig = _vm(fleet, "run2", "3g.40gb", "mig")
    fleet.sysfs["0000:41:00.0"].refresh()
    # behind the controller's back, with both guests still running: run1's VF type is reset, run2's mdev stops
    fleet.sysfs["0000:41:00.0"].set_type("0000:41:00.4", 0)
    (mdev,) = fleet.nodedev.mdevs
    fleet.nodedev.destroy(mdev)
    # a foreign guest runs on an mdev the controller never made
    foreign_uuid = "0b6d3c3e-7d8e-4c55-9a0e-3c1f1f2a6f00"
    fleet.nodedev.start(fleet.nodedev.define(_mdev_xml("pci_0000_41_00_0", "nvidia-558", foreign_uuid)))
    conn = _driver(fleet, "kvm1")._connection()
    conn.defineXML("<domain type='test'><name>foreign</name><memory unit='MiB'>64</memory><os><type>hvm</type>"
                   "</os><devices><hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
                   f"<address uuid='{foreign_uuid}'/></source></hostdev></devices></domain>").create()
    xml_before = {v.id: fleet.ctl.vm_xml(v.id) for v in (vf, mig)}
    fleet.log.clear()
    report = fleet.ctl.reconcile(fix=True)
    lost = {f.target: f for f in report.findings if f.kind == "lost-vm"}
    assert set(lost) == {f"vm:{vf.id}", f"vm:{mig.id}"}
    assert all(not f.fixed and f.action.startswith("none (domain running)") for f in lost.values())
    orphans = [f for f in report.findings if f.kind == "orphan-device"]
    assert len(orphans) == 1, [f.to_dict() for f in orphans]
    orphan = orphans[0]
    assert orphan.target == foreign_uuid and orphan.action == "none (in use)"
    assert fleet.log == [] and fleet.nvml["kvm1"].calls[-1].startswith("create_ci")  # nothing changed on a host
    assert fleet.vf_types()["0000:41:00.4"] == 0 and len(fleet.nvml["kvm1"].gpus[2].gis) == 1
    assert {fleet.ctl.get_vm(v.id).state for v in (vf, mig)} == {"running"}
    assert {v.id: fleet.ctl.vm_xml(v.id) for v in (vf, mig)} == xml_before
    assert all(_active(fleet).values())
    # stopped, run2 gets its mdev started again by the next reconcile, and stays stopped as its tenant left it
    fleet.ctl.stop_vm(mig.id, force=True)
    fleet.ctl.reconcile(fix=True)
    assert fleet.log == ["nodedev start"], fleet.log
    assert fleet.ctl.get_vm(mig.id).state == "stopped"
    assert not _driver(fleet, "kvm1")._connection().lookupByName(f"{mig.name}-{mig.id[:8]}").isActive()
    assert fleet.ctl.start_vm(mig.id).state == "running"


def test_a_vf_lost_to_a_reboot_and_taken_since_is_not_given_back(fleet: Fleet) -> None:
    old = _vm(fleet, "vfa", "H200-35C", "vf")
    _reboot(fleet)
    new = _vm(fleet, "vfb", "H200-35C", "vf")  # created before reconcile ran: takes the first free VF
    fleet.sysfs["0000:41:00.0"].refresh()
    assert fleet.vf_types()["0000:41:00.4"] == 1425
    assert "function=\"0x4\"" in _hostdevs(fleet, new)[0]
    fleet.ctl.reconcile(fix=True)
    fleet.sysfs["0000:41:00.0"].refresh()
    assert fleet.vf_types() == {"0000:41:00.4": 1425, "0000:41:00.5": 1425, "0000:42:00.4": 0, "0000:42:00.5": 0}
    assert "function=\"0x5\"" in _hostdevs(fleet, old)[0] and "function=\"0x4\"" in _hostdevs(fleet, new)[0]
    fleet.ctl.release_vm(old.id)
    fleet.sysfs["0000:41:00.0"].refresh()
    assert fleet.vf_types()["0000:41:00.4"] == 1425 and fleet.vf_types()["0000:41:00.5"] == 0


def test_vgpuctl_vm_create_gives_each_backing_exactly_its_device(fleet: Fleet, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI, on the same declared libvirt hosts: its controller's HostFactory reaches the emulated side."""
    import functools
    import json

    from typer.testing import CliRunner

    import vgpu_ctl.service.hosts as service_hosts
    from vgpu_ctl.cli.main import app
    factory = functools.partial(HostFactory, sides=fleet.ctl.hosts._side_of, nodedevs=fleet.ctl.hosts._nodedev_of)
    monkeypatch.setattr(service_hosts, "HostFactory", lambda state_path, *a, **k: factory(state_path))
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "cli-state"))
    runner, db = CliRunner(), str(fleet.ctl.engine.url)
    created = {}
    for name, profile, pool in (("c-eq", "A100D-10C", "eq"), ("c-mx", "A100D-20C", "mixed"),
                                ("c-mig", "3g.40gb", "mig"), ("c-mb", "H100-3-40C", "mig"),
                                ("c-vf", "H200-35C", "vf"), ("c-mv", "H200-1-18C", "migvf"), ("c-pt", "L40S", "pt")):
        out = runner.invoke(app, ["--db", db, "vm", "create", "--tenant", "acme", "--name", name, "--profile", profile,
                                  "--pool", pool, "--vcpus", "2", "--memory", "4GiB", "--json"])
        assert out.exit_code == 0, out.output
        created[name] = json.loads(out.output)
        for s in fleet.sysfs.values():
            s.refresh()
    uuids = {n: v["devices"][0]["uuid"] for n, v in created.items()}
    defined = {m.uuid: (m.parent, m.type_id) for m in fleet.nodedev.mdevs.values()}
    assert defined == {uuids["c-eq"]: ("pci_0000_41_00_0", "nvidia-558"),
                       uuids["c-mx"]: ("pci_0000_42_00_0", "nvidia-559"),
                       uuids["c-mig"]: ("pci_0000_43_00_4", "nvidia-700"),  # the bare MIG: its filling type
                       uuids["c-mb"]: ("pci_0000_43_00_5", "nvidia-700")}
    starts = {n: v["devices"][0]["start"] for n, v in created.items()}
    gis = sorted((g.profile.name, g.start) for g in fleet.nvml["kvm1"].gpus[2].gis.values())
    assert gis == sorted([("3g.40gb", starts["c-mig"]), ("3g.40gb", starts["c-mb"])])
    assert [(g.profile.name, g.start) for g in fleet.nvml["kvm2"].gpus[1].gis.values()] == [("1g.18gb", starts["c-mv"])]
    assert fleet.vf_types() == {"0000:41:00.4": 1425, "0000:41:00.5": 0, "0000:42:00.4": 1414, "0000:42:00.5": 0}
    placement = [c[1] for c in fleet.nodedev.calls if c[0] == "define" and uuids["c-mx"] in c[1]]
    assert f"<attr name='vgpu-placement-id' value='{starts['c-mx']}'/>" in placement[0]


@pytest.mark.postgres
def test_type_ids_and_backings_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    f = Fleet(tmp_path, pg_url)
    try:
        changes = f.ctl.apply_inventory(f.inventory)
        assert {c["name"] for c in changes if c["action"] == "record"} >= {"kvm1/0000:41:00.0", "kvm2/0000:41:00.0"}
        f.ctl.create_tenant("acme")
        vm = _vm(f, "pg1", "A100D-10C", "eq")
        vf = _vm(f, "pg2", "H200-35C", "vf")
        assert f.nodedev.calls[0][1].count("nvidia-558") == 1 and f.vf_types()["0000:41:00.4"] == 1425
        f.ctl.release_vm(vm.id)
        f.ctl.release_vm(vf.id)
        assert f.nodedev.mdevs == {}
        f.ctl.apply_inventory(f.inventory)  # recording again on PostgreSQL: no change, no error
    finally:
        f.ctl.close()
