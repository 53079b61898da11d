"""The host agent over SSH: the controller runs `vgpuctl agent call` with the qemu+ssh URI's own login, user,
port and keyfile; the agent does the vendor-VFIO sysfs writes on "the host" (here: a fake `ssh` that runs the
command locally and a fake sysfs tree), and its errors come back as the same errors."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from fake_sysfs import FakeVfioSysfs  # noqa: E402

from vgpu_ctl.errors import HostError, InvalidInput  # noqa: E402
from vgpu_ctl.hosts.agent import AGENT_COMMAND_ENV, PROTOCOL, AgentHostSide, SshTransport, handle, ssh_argv  # noqa: E402
from vgpu_ctl.hosts.hostside import LocalHostSide  # noqa: E402
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceSpec  # noqa: E402

URI = "qemu+ssh://ops@gpu1.example:2222/system?keyfile=/etc/vgpu-ctl/id_ed25519&no_verify=1"
UUID = "5b0a3f2e-9d1c-4c1e-8a4e-2f7f3c1d0001"


def test_ssh_argv_uses_the_uri_login() -> None:
    assert ssh_argv(URI, "vgpuctl agent call") == [
        "ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/etc/vgpu-ctl/id_ed25519",
        "-o", "StrictHostKeyChecking=no", "ops@gpu1.example", "--", "vgpuctl", "agent", "call"]
    with pytest.raises(HostError, match="reached over SSH only"):
        ssh_argv("qemu+tls://gpu1/system", "vgpuctl agent call")


@pytest.fixture
def remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[AgentHostSide, FakeVfioSysfs, Path]:
    """An AgentHostSide over SSH whose `ssh` logs its arguments and runs the remote command here."""
    log = tmp_path / "ssh.log"
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n'
                        'while [ "$1" != "--" ]; do shift; done; shift\nexec "$@"\n')
    fake_ssh.chmod(0o755)
    sysfs = FakeVfioSysfs(tmp_path / "sys", num_vfs=2)
    monkeypatch.setenv(AGENT_COMMAND_ENV, f"{shlex.quote(sys.executable)} -m vgpu_ctl.cli.main agent call "
                                          f"--state-dir {tmp_path / 'agent'} --sysfs-root {tmp_path / 'sys'}")
    side = AgentHostSide("gpu1", SshTransport("gpu1", URI, ssh=str(fake_ssh)))
    return side, sysfs, log


def test_vfio_through_the_agent_over_ssh(remote: tuple[AgentHostSide, FakeVfioSysfs, Path]) -> None:
    side, sysfs, log = remote
    facts = side.facts(["0000:41:00.0"])
    assert facts.gpus["0000:41:00.0"].vfio_types == {"H200X-141C": 1428, "H200X-70C": 1427, "H200X-35C": 1425}
    spec = DeviceSpec("dev-1", "0000:41:00.0", DeviceBacking.VFIO_VF, "H200-35C", 0, 35, UUID, vfio_type_id=1425)
    handle_ = side.vfio().create(spec)
    assert (handle_.backing, handle_.pci_address, handle_.uuid) == (DeviceBacking.VFIO_VF, "0000:41:00.4", UUID)
    sysfs.refresh()
    assert sysfs.current() == {"0000:41:00.4": 1425, "0000:41:00.5": 0}
    assert [d.uuid for d in side.vfio().list_devices()] == [UUID]
    side.vfio().remove(spec)
    sysfs.refresh()
    assert sysfs.current() == {"0000:41:00.4": 0, "0000:41:00.5": 0}
    assert log.read_text().splitlines()[0].startswith("-o BatchMode=yes -p 2222 -i /etc/vgpu-ctl/id_ed25519 ")
    assert len(log.read_text().splitlines()) == 4  # one SSH session per request: facts, create, list, remove


def test_agent_errors_come_back_as_the_same_errors(remote: tuple[AgentHostSide, FakeVfioSysfs, Path]) -> None:
    side, _sysfs, _log = remote
    with pytest.raises(HostError, match=r"GPU 0000:99:00\.0 not found"):
        side.vfio().create(DeviceSpec("d", "0000:99:00.0", DeviceBacking.VFIO_VF, "H200-35C", 0, 35, UUID))
    with pytest.raises(InvalidInput, match="not a PCI address"):
        side.vfio().create(DeviceSpec("d", "gpu0", DeviceBacking.VFIO_VF, "H200-35C", 0, 35, UUID))


def test_an_unreachable_agent_is_a_host_error(tmp_path: Path) -> None:
    side = AgentHostSide("gpu1", SshTransport("gpu1", URI, ssh=str(tmp_path / "no-ssh-here")))
    with pytest.raises(HostError, match="host gpu1: cannot run the host agent"):
        side.facts([])


def test_the_agent_refuses_other_protocols(tmp_path: Path) -> None:
    answer = json.loads(handle(LocalHostSide(tmp_path), json.dumps({"protocol": 99, "op": "facts"})))
    assert answer["protocol"] == PROTOCOL and answer["error"]["type"] == "InvalidInput"


def test_a_host_without_ssh_has_no_agent_but_still_opens(tmp_path: Path) -> None:
    from vgpu_ctl.hosts.hostside import open_host_side

    side = open_host_side(type("H", (), {"name": "tls1", "uri": "qemu+tls://tls1/system"})(), tmp_path)
    with pytest.raises(HostError, match="reached over SSH only"):
        side.facts([])
