"""Provisioning on a simulated host costs one fsync per VM: only what a real host keeps across a reboot (a
defined domain, a managed save image) is flushed to disk; devices and the running flag are written back with
the same atomic rename, and other processes see them at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO
from hostfixtures import MDEV_UUID, VM_UUID, domain_context, mdev_hostdev

from vgpu_ctl import Controller
from vgpu_ctl.hosts import simulated
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.render import TemplateRenderer


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every os.fsync the simulated host makes (the file descriptors)."""
    calls: list[int] = []
    real = simulated.os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(simulated.os, "fsync", counted)
    return calls


def test_a_vms_host_steps_cost_one_fsync(tmp_path: Path, fsyncs: list[int]) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    for i, uuid in enumerate((MDEV_UUID, "0b5b8c1e-2d3f-4e5a-8b6c-7d8e9f0a1b2c")):
        host.create_device(DeviceSpec(device_id=f"d{i}", gpu_pci="0000:41:00.0", backing=DeviceBacking.MDEV,
                                      profile="A100D-10C", start=10 * i, size=10, uuid=uuid, mdev_type="nvidia-558"))
    assert fsyncs == []
    xml = TemplateRenderer().render_domain("domain.xml.j2", domain_context([mdev_hostdev("d1")], name="vm-1",
                                                                           uuid=VM_UUID))
    host.define_domain(xml)
    host.start_domain("vm-1")
    assert len(fsyncs) == 1  # the definition
    # another instance (another process) sees everything, the undurable writes too
    other = SimulatedHost("sim-1", tmp_path)
    assert {d.uuid for d in other.list_devices()} == {MDEV_UUID, "0b5b8c1e-2d3f-4e5a-8b6c-7d8e9f0a1b2c"}
    assert [(d.name, d.active) for d in other.list_domains()] == [("vm-1", True)]
    other.stop_domain("vm-1")
    other.undefine_domain("vm-1")
    assert len(fsyncs) == 2  # the undefinition
    assert not list(tmp_path.glob(".sim-1.*.tmp"))
    # the first instance had the state parsed already: it sees the other's changes, not what it kept
    assert host.list_domains() == []
    host.remove_device(DeviceSpec(device_id="d0", gpu_pci="0000:41:00.0", backing=DeviceBacking.MDEV,
                                  profile="A100D-10C", start=0, size=10, uuid=MDEV_UUID, mdev_type="nvidia-558"))
    assert [d.uuid for d in other.list_devices()] == ["0b5b8c1e-2d3f-4e5a-8b6c-7d8e9f0a1b2c"]


def test_provisioned_vm_costs_one_fsync(state_dir: Path, sqlite_url: str, fsyncs: list[int]) -> None:
    c = Controller(sqlite_url)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        vm: Any = c.request_vm("acme", "web", [("L40S-12C", 2)], vcpus=2, memory_mib=2048,
                                pool="workstations")
        assert vm.state == "running"
        assert len(fsyncs) == 1
        assert vm == c.get_vm(vm.id)  # what provisioning answers from the rows it carried is what the store holds
        c.release_vm(vm.id)
        assert len(fsyncs) == 2
    finally:
        c.close()
