"""The libvirt host driver and discovery, against libvirt's test driver and a recording node-device seam."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hostfixtures import (
    FLEET_DEVICES,
    MDEV_UUID,
    VM_UUID,
    RecordingNodeDevices,
    domain_context,
    mdev_hostdev,
    write_node_file,
)

from vgpu_ctl.catalog import Catalog, load_catalog
from vgpu_ctl.errors import HostError
from vgpu_ctl.hosts.discovery import discover_host, match_type
from vgpu_ctl.hosts.libvirt_host import LibvirtHost
from vgpu_ctl.hosts.nodedev import LibvirtNodeDeviceApi, MdevInfo, open_libvirt
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice
from vgpu_ctl.render import TemplateRenderer

FOREIGN = "<domain type='test'><name>legacy</name><memory>1024</memory><os><type>hvm</type></os></domain>"
NEW_UUID = "0b5b8c1e-2d3f-4e5a-8b6c-7d8e9f0a1b2c"


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


@pytest.fixture()
def node_uri(tmp_path: Path) -> str:
    return write_node_file(tmp_path / "node.xml", [*FLEET_DEVICES, FOREIGN])


@pytest.fixture()
def host(node_uri: str) -> Iterator[LibvirtHost]:
    h = LibvirtHost("kvm-test", node_uri)
    yield h
    h.close()


def _spec(uuid: str = NEW_UUID, backing: DeviceBacking = DeviceBacking.MDEV, **changes: object) -> DeviceSpec:
    values: dict[str, object] = {
        "device_id": "dev-1", "gpu_pci": "0000:41:00.0", "backing": backing, "profile": "A100D-10C",
        "start": 10, "size": 10, "uuid": uuid, "mdev_type": "nvidia-558",
    }
    values.update(changes)
    return DeviceSpec(**values)  # type: ignore[arg-type]


# --- discovery ----------------------------------------------------------------------------------------------

def test_discovery_matches_models_and_types(node_uri: str, catalog: Catalog) -> None:
    found = discover_host(node_uri, catalog, name="kvm-test")
    assert (found.name, found.vcpus, found.memory_mib) == ("kvm-test", 8, 65536)
    gpus = {g.pci: g for g in found.gpus}
    assert sorted(gpus) == ["0000:41:00.0", "0000:42:00.0", "0000:43:00.0", "0000:44:00.0", "0000:45:00.0"]
    a100 = gpus["0000:41:00.0"]
    assert (a100.model, a100.product_id, a100.mode) == ("A100-80GB", "0x20b5", "vgpu-equal")
    assert a100.types == {"A100D-10C": "nvidia-558", "A100D-20C": "nvidia-559", "A100D-40C": "nvidia-560",
                          "A100D-7C": "nvidia-777"}
    assert (gpus["0000:43:00.0"].model, gpus["0000:43:00.0"].mode) == ("L40S", "passthrough")
    assert gpus["0000:44:00.0"].types == {"A100-4C": "nvidia-468"}
    assert gpus["0000:45:00.0"].types == {"A100D-10C": "nvidia-558"}  # offered by its VF 0000:45:00.4
    assert gpus["0000:42:00.0"].model is None


def test_discovery_reports_mismatches(node_uri: str, catalog: Catalog) -> None:
    found = discover_host(node_uri, catalog, name="kvm-test")
    kinds = sorted((m["gpu"], m["kind"]) for m in found.mismatches)
    assert kinds == [("0000:41:00.0", "max-count"), ("0000:41:00.0", "unknown-type"),
                     ("0000:42:00.0", "unknown-model")]
    detail = {m["kind"]: m["detail"] for m in found.mismatches}
    assert "0x1234" in detail["unknown-model"]
    assert "A100D-7C" in detail["unknown-type"] and "nvidia-777" in detail["unknown-type"]
    assert "A100D-40C" in detail["max-count"] and "3" in detail["max-count"] and "2" in detail["max-count"]


def test_discovery_inventory(node_uri: str, catalog: Catalog) -> None:
    found = discover_host(node_uri, catalog, name="kvm-test")
    inventory = found.to_inventory()
    (host,) = inventory["hosts"]
    assert (host["name"], host["uri"], host["driver"], host["vcpus"]) == ("kvm-test", node_uri, "libvirt", 8)
    assert [g["pci"] for g in host["gpus"]] == [f"0000:4{i}:00.0" for i in (1, 3, 4, 5)]
    text = found.to_yaml()
    assert yaml.safe_load(text) == inventory
    assert text.count("# mismatch on GPU") == 3


def test_discovery_names_the_host_by_default(node_uri: str, catalog: Catalog) -> None:
    conn = open_libvirt(node_uri, "x")
    try:
        assert discover_host(node_uri, catalog).name == conn.getHostname()
    finally:
        conn.close()


def test_discovery_of_an_unreachable_host(tmp_path: Path, catalog: Catalog) -> None:
    with pytest.raises(HostError, match="host far: connecting to"):
        discover_host(f"test://{tmp_path}/missing.xml", catalog, name="far")


def test_type_matching_across_board_prefixes(catalog: Catalog) -> None:
    a100 = catalog.model("A100-80GB")
    assert match_type("A100D-10C", a100, catalog) == "A100D-10C"
    assert match_type("A100DX-10C", a100, catalog) == "A100D-10C"
    assert match_type("A100X-10C", a100, catalog) is None
    assert match_type("A100D-3-40C", a100, catalog) == "A100D-3-40C"
    assert match_type("3g.40gb", a100, catalog) is None


# --- domains ------------------------------------------------------------------------------------------------

def test_domain_lifecycle(host: LibvirtHost) -> None:
    xml = TemplateRenderer().render_domain("domain.xml.j2", domain_context([mdev_hostdev("d1")]))
    assert host.define_domain(xml) == VM_UUID
    assert host.define_domain(xml) == VM_UUID  # redefine
    domains = {d.name: d for d in host.list_domains()}
    assert domains["vm-1"].uuid == VM_UUID and not domains["vm-1"].active
    assert domains["vm-1"].metadata == {"tenant": "acme", "vm_id": "42", "devices": "d1"}
    assert domains["legacy"].metadata == {} and domains["legacy"].active
    host.start_domain("vm-1")
    host.start_domain("vm-1")
    assert {d.name: d.active for d in host.list_domains()}["vm-1"]
    host.stop_domain("vm-1")
    host.stop_domain("vm-1")
    assert not {d.name: d.active for d in host.list_domains()}["vm-1"]
    host.start_domain("vm-1")
    host.stop_domain("vm-1", force=True)
    assert not {d.name: d.active for d in host.list_domains()}["vm-1"]
    host.start_domain("vm-1")
    host.undefine_domain("vm-1")  # running: destroyed first
    host.undefine_domain("vm-1")
    host.stop_domain("vm-1")
    assert [d.name for d in host.list_domains()] == ["legacy"]


def test_domain_errors_carry_host_and_libvirt_message(host: LibvirtHost) -> None:
    with pytest.raises(HostError, match=r"host kvm-test: defining domain failed: .*os <type> must be"):
        host.define_domain("<domain type='kvm'><name>x</name></domain>")
    with pytest.raises(HostError, match="domain nope is not defined"):
        host.start_domain("nope")


def test_close_and_reopen(node_uri: str) -> None:
    h = LibvirtHost("kvm-test", node_uri)
    assert [d.name for d in h.list_domains()] == ["legacy"]
    h.close()
    h.close()
    assert [d.name for d in h.list_domains()] == ["legacy"]
    h.close()


# --- mdevs through the node-device seam ---------------------------------------------------------------------

EXPECTED_MDEV_XML = f"""<device>
  <parent>pci_0000_41_00_0</parent>
  <capability type='mdev'>
    <type id='nvidia-558'/>
    <uuid>{NEW_UUID}</uuid>
    <attr name='vgpu-placement-id' value='10'/>
  </capability>
</device>
"""


def test_mdev_create_sends_exact_xml_in_order() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    handle = h.create_device(_spec(placement_id=10))
    assert handle == DeviceHandle(DeviceBacking.MDEV, uuid=NEW_UUID)
    name = f"mdev_{NEW_UUID.replace('-', '_')}_0000_41_00_0"
    assert api.calls == [("define", EXPECTED_MDEV_XML), ("start", name), ("set_autostart", name)]


def test_mdev_without_placement_has_no_attr() -> None:
    api = RecordingNodeDevices()
    LibvirtHost("kvm-test", "test:///default", nodedev=api).create_device(_spec())
    assert "<attr" not in api.calls[0][1]


def test_mdev_create_is_idempotent() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    first = h.create_device(_spec())
    api.calls.clear()
    assert h.create_device(_spec()) == first
    assert api.calls == []
    name = next(iter(api.mdevs))
    api.destroy(name)  # e.g. the host rebooted without autostart
    api.calls.clear()
    assert h.create_device(_spec()) == first
    assert api.names() == ["start"]


def test_mdev_remove_in_order_and_idempotent() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    h.create_device(_spec())
    api.calls.clear()
    h.remove_device(_spec())
    assert api.names() == ["destroy", "undefine"]
    api.calls.clear()
    h.remove_device(_spec())
    assert api.calls == []


def test_mdev_remove_of_an_inactive_one_only_undefines() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    h.create_device(_spec())
    api.destroy(next(iter(api.mdevs)))
    api.calls.clear()
    h.remove_device(_spec())
    assert api.names() == ["undefine"]


def test_mdev_unknown_type_is_refused() -> None:
    api = RecordingNodeDevices()
    with pytest.raises(HostError, match=r"type id of A100D-10C on GPU 0000:41:00\.0 is unknown on this host"):
        LibvirtHost("kvm-test", "test:///default", nodedev=api).create_device(_spec(mdev_type=None))
    assert api.calls == []


def test_mdev_existing_with_another_type_is_refused() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    h.create_device(_spec())
    with pytest.raises(HostError, match="exists with type nvidia-558"):
        h.create_device(_spec(mdev_type="nvidia-559"))


def test_mdev_failed_start_is_undone() -> None:
    api = RecordingNodeDevices()
    api.fail_start = True
    with pytest.raises(HostError, match="start failed"):
        LibvirtHost("kvm-test", "test:///default", nodedev=api).create_device(_spec())
    assert api.names() == ["define", "start", "undefine"]
    assert api.mdevs == {}


def test_libvirt_node_device_api_on_the_test_driver(node_uri: str) -> None:
    conn = open_libvirt(node_uri, "kvm-test")
    try:
        api = LibvirtNodeDeviceApi(conn, "kvm-test")
        name = f"mdev_{MDEV_UUID.replace('-', '_')}"
        assert api.list_mdevs() == [MdevInfo(name, MDEV_UUID, "pci_0000_44_00_0", "nvidia-468", True)]
        with pytest.raises(HostError, match=r"host kvm-test: defining mdev failed: .*not supported"):
            api.define(EXPECTED_MDEV_XML)
        with pytest.raises(HostError, match="host kvm-test: looking up node device nope failed"):
            api.start("nope")
    finally:
        conn.close()


def test_list_devices_over_libvirt(host: LibvirtHost) -> None:
    assert host.list_devices() == [HostDevice(DeviceBacking.MDEV, gpu_pci="0000:44:00.0", uuid=MDEV_UUID)]


# --- other backings -----------------------------------------------------------------------------------------

class FakeBackend:
    """A DeviceBackend recording what it is asked."""

    def __init__(self, backing: DeviceBacking) -> None:
        self.backing = backing
        self.calls: list[tuple[str, str]] = []

    def create(self, spec: DeviceSpec) -> DeviceHandle:
        self.calls.append(("create", spec.uuid))
        return DeviceHandle(self.backing, uuid=spec.uuid, pci_address="0000:41:00.4")

    def remove(self, spec: DeviceSpec) -> None:
        self.calls.append(("remove", spec.uuid))

    def list_devices(self) -> list[HostDevice]:
        return [HostDevice(self.backing, gpu_pci="0000:41:00.0", pci_address="0000:41:00.4")]


def test_vfio_and_mig_are_delegated() -> None:
    vfio, mig = FakeBackend(DeviceBacking.VFIO_VF), FakeBackend(DeviceBacking.MIG)
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api, vfio=vfio, mig=mig)
    assert h.create_device(_spec(backing=DeviceBacking.VFIO_VF)).pci_address == "0000:41:00.4"
    h.remove_device(_spec(backing=DeviceBacking.VFIO_VF))
    h.create_device(_spec(backing=DeviceBacking.MIG))
    assert vfio.calls == [("create", NEW_UUID), ("remove", NEW_UUID)]
    assert mig.calls == [("create", NEW_UUID)]
    assert api.calls == []
    assert [d.backing for d in h.list_devices()] == [DeviceBacking.VFIO_VF, DeviceBacking.MIG]


@pytest.mark.parametrize("backing", [DeviceBacking.VFIO_VF, DeviceBacking.MIG])
def test_missing_backend_is_a_host_error(backing: DeviceBacking) -> None:
    h = LibvirtHost("kvm-test", "test:///default", nodedev=RecordingNodeDevices())
    with pytest.raises(HostError, match=f"no {backing} backend"):
        h.create_device(_spec(backing=backing))


def test_passthrough_needs_nothing_on_the_host() -> None:
    api = RecordingNodeDevices()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api)
    spec = _spec(backing=DeviceBacking.PCI, profile="A100-80GB", mdev_type=None)
    assert h.create_device(spec) == DeviceHandle(DeviceBacking.PCI, pci_address="0000:41:00.0")
    h.remove_device(spec)
    assert api.calls == []


def test_domains_say_which_host_devices_their_xml_takes(host: LibvirtHost) -> None:
    from hostfixtures import pci_hostdev, vf_hostdev

    xml = TemplateRenderer().render_domain("domain.xml.j2", domain_context([mdev_hostdev(), vf_hostdev(),
                                                                            pci_hostdev()]))
    host.define_domain(xml)
    taken = {d.name: d.hostdevs for d in host.list_domains()}
    assert taken == {"legacy": (), "vm-1": (MDEV_UUID, "0000:41:00.4", "0000:42:00.0")}


def test_a_stopped_mdev_makes_every_part_of_its_device_inactive() -> None:
    api = RecordingNodeDevices()
    mig = _FakeMig()
    h = LibvirtHost("kvm-test", "test:///default", nodedev=api, mig=mig)
    h.create_device(_spec(mig_profile_id=9))
    other = h.create_device(_spec(uuid=MDEV_UUID, mig_profile_id=9))
    assert other.gpu_instance_id == 2
    (name,) = [n for n, m in api.mdevs.items() if m.uuid == NEW_UUID]
    api.destroy(name)
    state = {(d.backing, d.uuid): d.active for d in h.list_devices()}
    assert state == {(DeviceBacking.MDEV, NEW_UUID): False, (DeviceBacking.MIG, NEW_UUID): False,
                     (DeviceBacking.MDEV, MDEV_UUID): True, (DeviceBacking.MIG, MDEV_UUID): True}


class _FakeMig:
    """A MIG backend keeping one GPU instance per device uuid."""

    def __init__(self) -> None:
        self.gis: dict[str, int] = {}

    def create(self, spec: DeviceSpec) -> DeviceHandle:
        gi = self.gis.setdefault(spec.uuid, len(self.gis) + 1)
        return DeviceHandle(DeviceBacking.MIG, gpu_instance_id=gi)

    def remove(self, spec: DeviceSpec) -> None:
        self.gis.pop(spec.uuid, None)

    def list_devices(self) -> list[HostDevice]:
        return [HostDevice(DeviceBacking.MIG, "0000:41:00.0", uuid=u, gpu_instance_id=gi)
                for u, gi in self.gis.items()]
