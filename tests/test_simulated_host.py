"""The simulated host: state in a JSON file shared by instances and processes; XML parsed by libvirt."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import libvirt
import pytest
from hostfixtures import MDEV_UUID, VM_UUID, domain_context, mdev_hostdev, run_simulated_writers

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.render import TemplateRenderer

OTHER_UUID = "0b5b8c1e-2d3f-4e5a-8b6c-7d8e9f0a1b2c"


def _spec(uuid: str, backing: DeviceBacking, profile: str = "A100D-10C") -> DeviceSpec:
    return DeviceSpec(device_id=f"dev-{uuid[:4]}", gpu_pci="0000:41:00.0", backing=backing, profile=profile,
                      start=0, size=10, uuid=uuid, mdev_type="nvidia-558")


def _domain_xml(name: str = "vm-1", uuid: str = VM_UUID) -> str:
    return TemplateRenderer().render_domain("domain.xml.j2", domain_context([mdev_hostdev("d1")], name=name,
                                                                            uuid=uuid))


def test_state_persists_across_instances(tmp_path: Path) -> None:
    first = SimulatedHost("sim-1", tmp_path)
    assert first.simulated
    handle = first.create_device(_spec(MDEV_UUID, DeviceBacking.MDEV))
    assert handle == DeviceHandle(DeviceBacking.MDEV, uuid=MDEV_UUID)
    assert first.define_domain(_domain_xml()) == VM_UUID
    first.start_domain("vm-1")
    first.close()

    second = SimulatedHost("sim-1", tmp_path)
    assert second.list_devices() == [HostDevice(DeviceBacking.MDEV, gpu_pci="0000:41:00.0", uuid=MDEV_UUID,
                                                profile="A100D-10C")]
    (dom,) = second.list_domains()
    assert (dom.name, dom.uuid, dom.active) == ("vm-1", VM_UUID, True)
    assert dom.metadata == {"tenant": "acme", "vm_id": "42", "devices": "d1"}
    assert b'"uuid": "%s"' % VM_UUID.encode() in (tmp_path / "sim-1.journal").read_bytes()  # on disk
    assert SimulatedHost("sim-2", tmp_path).list_domains() == []


def test_devices_of_every_backing(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    vf1 = host.create_device(_spec(MDEV_UUID, DeviceBacking.VFIO_VF, "L40S-12C"))
    vf2 = host.create_device(_spec(OTHER_UUID, DeviceBacking.VFIO_VF, "L40S-12C"))
    assert (vf1.pci_address, vf2.pci_address) == ("0000:41:00.4", "0000:41:00.5")
    assert host.create_device(_spec(MDEV_UUID, DeviceBacking.VFIO_VF, "L40S-12C")) == vf1
    gi = host.create_device(_spec("11111111-2222-4333-8444-555555555555", DeviceBacking.MIG, "3g.40gb"))
    assert gi.gpu_instance_id == 1
    whole = host.create_device(_spec("21111111-2222-4333-8444-555555555555", DeviceBacking.PCI, "A100-80GB"))
    assert whole.pci_address == "0000:41:00.0"
    assert len(host.list_devices()) == 4
    host.remove_device(_spec(MDEV_UUID, DeviceBacking.VFIO_VF))
    host.remove_device(_spec(MDEV_UUID, DeviceBacking.VFIO_VF))
    again = host.create_device(_spec(MDEV_UUID, DeviceBacking.VFIO_VF, "L40S-12C"))
    assert again.pci_address == "0000:41:00.4"


def test_domain_lifecycle(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.create_device(_spec(MDEV_UUID, DeviceBacking.MDEV))
    host.define_domain(_domain_xml())
    host.start_domain("vm-1")
    host.start_domain("vm-1")
    host.stop_domain("vm-1")
    host.stop_domain("vm-1", force=True)
    assert not host.list_domains()[0].active
    host.define_domain(_domain_xml())  # redefine keeps it
    host.undefine_domain("vm-1")
    host.undefine_domain("vm-1")
    host.stop_domain("vm-1")
    assert host.list_domains() == []
    with pytest.raises(HostError, match="domain vm-1 is not defined"):
        host.start_domain("vm-1")


@pytest.mark.parametrize("xml, message", [
    ("<domain type='kvm'><name>x</name></domain>", "an os <type> must be specified"),
    ("<domain", "Couldn't find end of Start Tag"),
    ("<domain type='kvm'><name>x</name><memory>1024</memory><os><type>hvm</type></os><devices>"
     "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='zz'/></source></hostdev>"
     "</devices></domain>", "Cannot parse uuid"),
])
def test_broken_domain_xml_is_refused_with_libvirts_message(tmp_path: Path, xml: str, message: str) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    with pytest.raises(HostError, match="host sim-1: defining domain failed") as err:
        host.define_domain(xml)
    assert message in err.value.message
    assert host.list_domains() == []


def test_start_needs_the_mdevs(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.define_domain(_domain_xml())
    with pytest.raises(HostError, match=f"mediated device {MDEV_UUID} not found"):
        host.start_domain("vm-1")


def test_name_and_uuid_clashes_are_refused(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.define_domain(_domain_xml())
    with pytest.raises(HostError, match="already exists with uuid"):
        host.define_domain(_domain_xml(uuid=OTHER_UUID))
    with pytest.raises(HostError, match="already defined with uuid"):
        host.define_domain(_domain_xml(name="vm-2"))
    assert [d.name for d in host.list_domains()] == ["vm-1"]


def test_domain_without_uuid_keeps_its_uuid(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    xml = "<domain type='kvm'><name>bare</name><memory>1024</memory><os><type>hvm</type></os></domain>"
    uuid = host.define_domain(xml)
    assert host.define_domain(xml) == uuid
    assert host.list_domains()[0].metadata == {}


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden"])
def test_unsafe_host_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidInput):
        SimulatedHost(name, tmp_path)


@pytest.mark.slow
def test_threads_define_domains_at_once_from_the_parsers_first_use(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's workers define domains at once, the first while the process's parser is still being set up:
    every definition lands, with one parser for the process. The parser used to be test:///default, emptied on
    first use and shared with the process's other connections to it, so a second setup could undefine a
    domain from under a definition ("Domain not found", one create in a few hundred in bench_allocator's HTTP
    phases)."""
    from vgpu_ctl.hosts import simulated
    real, opened = simulated.open_libvirt, []

    def slow_open(uri: str, who: str) -> Any:
        opened.append(uri)
        time.sleep(0.05)  # every thread reaches the setup before the first has finished it
        return real(uri, who)

    monkeypatch.setattr(simulated, "open_libvirt", slow_open)
    simulated._parser_connection.cache_clear()
    hosts = [SimulatedHost(f"sim-{i}", tmp_path) for i in range(8)]
    uuids = [str(uuid.uuid4()) for _ in hosts]
    start, errors = threading.Barrier(len(hosts)), []

    def define(i: int) -> None:
        start.wait()
        try:
            assert hosts[i].define_domain(_domain_xml(f"vm-{i}", uuids[i])) == uuids[i]
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=define, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(opened) == 1
    assert [[(d.name, d.uuid) for d in h.list_domains()] for h in hosts] == [[(f"vm-{i}", u)] for i, u in
                                                                            enumerate(uuids)]
    assert simulated._parser_connection().listAllDomains(0) == []  # the parser keeps no domain


def test_the_parser_leaves_test_default_alone(tmp_path: Path) -> None:
    """A test-driver host (test:///default) in the same process as simulated hosts keeps its domains, even one
    of the name a simulated host defines, and never sees the parser's."""
    from vgpu_ctl.hosts import simulated
    default = libvirt.open("test:///default")
    try:
        default.defineXML(_domain_xml("vm-same", OTHER_UUID))
        before = sorted(d.name() for d in default.listAllDomains(0))
        simulated._parser_connection.cache_clear()  # its first use, which once emptied test:///default
        assert SimulatedHost("sim-1", tmp_path).define_domain(_domain_xml("vm-same")) == VM_UUID
        assert sorted(d.name() for d in default.listAllDomains(0)) == before
        assert default.lookupByName("vm-same").UUIDString() == OTHER_UUID
    finally:
        default.lookupByName("vm-same").undefine()
        default.close()


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    run_simulated_writers(tmp_path, 2, 20, 120)
    host = SimulatedHost("sim-1", tmp_path)
    assert len(host.list_devices()) == 40
    assert len(host.list_domains()) == 40
