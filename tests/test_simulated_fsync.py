"""Provisioning on a simulated host costs one fsync per VM: every change is a line appended to the host's
journal, which other processes see at once; only what a real host keeps across a reboot (a defined domain, a
managed save image) is flushed to disk with it, and a long journal is folded into a new state file by the next
such change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO
from hostfixtures import MDEV_UUID, VM_UUID, domain_context, mdev_hostdev, run_simulated_writers

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


def _define(host: SimulatedHost, name: str = "vm-1") -> None:
    xml = TemplateRenderer().render_domain("domain.xml.j2", domain_context([mdev_hostdev("d1")], name=name,
                                                                           uuid=VM_UUID))
    host.define_domain(xml)


def _mdev(uuid: str = MDEV_UUID) -> DeviceSpec:
    return DeviceSpec(device_id="d1", gpu_pci="0000:41:00.0", backing=DeviceBacking.MDEV, profile="A100D-10C",
                      start=0, size=10, uuid=uuid, mdev_type="nvidia-558")


def test_steps_append_to_the_journal_without_rewriting_the_state_file(tmp_path: Path, fsyncs: list[int]) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.create_device(_mdev())
    _define(host)
    host.start_domain("vm-1")
    host.stop_domain("vm-1")
    host.start_domain("vm-1")
    assert not (tmp_path / "sim-1.json").exists()  # a short journal is the whole state
    assert len(fsyncs) == 1
    assert [(d.name, d.active) for d in SimulatedHost("sim-1", tmp_path).list_domains()] == [("vm-1", True)]
    host.undefine_domain("vm-1")
    assert len(fsyncs) == 2
    assert SimulatedHost("sim-1", tmp_path).list_domains() == []


def test_a_long_journal_is_folded_into_the_state_file(tmp_path: Path, fsyncs: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.create_device(_mdev())
    monkeypatch.setattr(simulated, "_FOLD_BYTES", 1)
    _define(host)  # durable, with a journal past the limit: the whole state in a new file, the journal emptied
    assert len(fsyncs) == 1
    assert (tmp_path / "sim-1.journal").read_bytes() == b""
    state = json.loads((tmp_path / "sim-1.json").read_text())
    assert list(state["domains"]) == ["vm-1"] and list(state["devices"]) == [MDEV_UUID]
    host.start_domain("vm-1")  # undurable: a line, never a fold
    assert (tmp_path / "sim-1.journal").read_bytes() != b""
    assert [(d.name, d.active) for d in SimulatedHost("sim-1", tmp_path).list_domains()] == [("vm-1", True)]


def test_a_torn_journal_line_loses_only_its_own_change(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    _define(host)
    with open(tmp_path / "sim-1.journal", "ab") as f:  # a writer that died in the middle of its line
        f.write(b'{"device": "0b5b8c1e-2d3f-4e5a')
    host.create_device(_mdev())  # lands after the torn line, on a line of its own
    fresh = SimulatedHost("sim-1", tmp_path)
    assert [d.uuid for d in fresh.list_devices()] == [MDEV_UUID]
    assert [d.name for d in fresh.list_domains()] == ["vm-1"]


def test_a_torn_line_that_joins_the_next_into_valid_json_still_loses_only_itself(tmp_path: Path) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.create_device(_mdev())
    with open(tmp_path / "sim-1.journal", "ab") as f:  # torn inside a string; with the next line and a comma
        f.write(b'{"g": 0, "device": "%s", "is": null, "t": "\n"}\n' % MDEV_UUID.encode())  # ... it parses
    _define(host)
    fresh = SimulatedHost("sim-1", tmp_path)
    assert [d.uuid for d in fresh.list_devices()] == [MDEV_UUID]  # not removed by the merged line
    assert [d.name for d in fresh.list_domains()] == ["vm-1"]


def test_journal_lines_of_an_older_state_file_are_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = SimulatedHost("sim-1", tmp_path)
    host.create_device(_mdev())
    _define(host)
    host.start_domain("vm-1")
    old = (tmp_path / "sim-1.journal").read_bytes()
    monkeypatch.setattr(simulated, "_FOLD_BYTES", 1)
    host.managed_save("vm-1")  # folded into a new state file: saved, not running
    with open(tmp_path / "sim-1.journal", "ab") as f:  # as if the journal had not been emptied before a crash
        f.write(old)
    (dom,) = SimulatedHost("sim-1", tmp_path).list_domains()
    assert (dom.active, dom.saved) == (False, True)


def test_a_step_reads_only_the_journal_lines_it_has_not_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = SimulatedHost("sim-1", tmp_path)  # a new host: no state file, and no writer has left a token yet
    host.create_device(_mdev())
    _define(host)
    reads: list[int] = []
    real_open = open

    def counted_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        if str(path).endswith("sim-1.journal") and "r" in mode:
            real_read = f.read
            f.read = lambda *a: (data := real_read(*a), reads.append(len(data)))[0]
        return f

    monkeypatch.setattr("builtins.open", counted_open)
    host.start_domain("vm-1")
    host.stop_domain("vm-1")
    assert reads == [0, 0]  # its own lines are kept, not read back, let alone the whole journal again
    SimulatedHost("sim-1", tmp_path).start_domain("vm-1")  # another process's line ...
    host.list_domains()
    assert reads[-1] == len((tmp_path / "sim-1.journal").read_bytes().splitlines(keepends=True)[-1])  # ... alone
    assert [(d.name, d.active) for d in host.list_domains()] == [("vm-1", True)]


def test_processes_defining_on_one_host_while_its_journal_is_folded_lose_nothing(tmp_path: Path) -> None:
    run_simulated_writers(tmp_path, 3, 12, 60, start=True, fold_bytes=4096)  # a fold every few definitions
    assert (tmp_path / "sim-1.json").exists()  # folded at least once
    host = SimulatedHost("sim-1", tmp_path)
    domains = host.list_domains()
    assert sorted(d.name for d in domains) == sorted(f"vm-{w}-{i}" for w in range(3) for i in range(12))
    assert all(d.active for d in domains)
    assert {d.uuid for d in host.list_devices()} == {h for d in domains for h in d.hostdevs}
