"""VfioSysfs against a fake vendor-specific VFIO sysfs tree: exact writes, idempotency, clear refusals."""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from fake_sysfs import HEADER, FakeVfioSysfs, vf_address  # noqa: E402

from vgpu_ctl.errors import HostError, InvalidInput  # noqa: E402
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice  # noqa: E402
from vgpu_ctl.hosts.vfio import VfioSysfs  # noqa: E402

GPU = "0000:41:00.0"
VF0, VF1, VF2, VF3 = (vf_address(GPU, n) for n in range(4))


def raises(kind: type[Exception], text: str) -> Any:
    """pytest.raises matching `text` literally."""
    return pytest.raises(kind, match=re.escape(text))


def spec(n: int = 1, profile: str = "H200X-35C") -> DeviceSpec:
    return DeviceSpec(device_id=f"dev-{n}", gpu_pci=GPU, backing=DeviceBacking.VFIO_VF, profile=profile,
                      start=0, size=35, uuid=f"5b0a3f2e-9d1c-4c1e-8a4e-2f7f3c1d000{n}")


@pytest.fixture
def fake(tmp_path: Path) -> FakeVfioSysfs:
    return FakeVfioSysfs(tmp_path / "sys")


@pytest.fixture
def drv(tmp_path: Path, fake: FakeVfioSysfs) -> VfioSysfs:
    return VfioSysfs(fake.root, tmp_path / "state" / "vfio.json")


def test_vfs_are_listed_in_virtfn_order(tmp_path: Path) -> None:
    fake = FakeVfioSysfs(tmp_path / "sys", num_vfs=12)
    vfs = VfioSysfs(fake.root, tmp_path / "s.json").list_vfs(GPU)
    assert vfs[:5] == ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7", "0000:41:01.0"]
    assert vfs[10:] == ["0000:41:01.6", "0000:41:01.7"]  # virtfn10, virtfn11 after virtfn9


def test_creatable_types_and_current_type(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    assert fake.file(VF0, "creatable_vgpu_types").read_text().startswith(HEADER)
    assert drv.creatable_types(VF0) == {"H200X-141C": 1428, "H200X-70C": 1427, "H200X-35C": 1425}
    assert drv.current_type(VF0) == 0


def test_create_writes_the_type_id_on_the_first_free_vf(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    handle = drv.create(spec())
    assert handle == DeviceHandle(backing=DeviceBacking.VFIO_VF, uuid=spec().uuid, pci_address=VF0)
    assert fake.file(VF0, "current_vgpu_type").read_text() == "1425\n"
    assert [fake.file(vf, "current_vgpu_type").read_text() for vf in (VF1, VF2, VF3)] == ["0\n"] * 3
    fake.refresh()
    assert drv.creatable_types(VF0) == {}
    assert drv.creatable_types(VF1) == {"H200X-35C": 1425}
    assert drv.create(spec(2)).pci_address == VF1
    fake.refresh()
    assert fake.current() == {VF0: 1425, VF1: 1425, VF2: 0, VF3: 0}


def test_create_is_idempotent_across_instances(tmp_path: Path, drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    first = drv.create(spec())
    fake.refresh()
    assert drv.create(spec()) == first
    assert VfioSysfs(fake.root, drv.state_file).create(spec()) == first
    assert fake.current() == {VF0: 1425, VF1: 0, VF2: 0, VF3: 0}
    state = json.loads(drv.state_file.read_text())
    assert state["devices"][spec().uuid] == {"vf": VF0, "gpu": GPU, "type_id": 1425, "profile": "H200X-35C"}


def test_a_device_lost_to_a_reboot_gets_its_vf_back(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.create(spec(1))
    fake.refresh()
    assert drv.create(spec(2)).pci_address == VF1
    fake.refresh()
    fake.set_type(VF1, 0)  # the driver forgot it
    assert drv.create(spec(2)).pci_address == VF1
    fake.refresh()
    assert fake.current() == {VF0: 1425, VF1: 1425, VF2: 0, VF3: 0}


def test_no_free_vf(tmp_path: Path) -> None:
    fake = FakeVfioSysfs(tmp_path / "sys", num_vfs=2)
    drv = VfioSysfs(fake.root, tmp_path / "s.json")
    drv.create(spec(1))
    fake.refresh()
    drv.create(spec(2))
    fake.refresh()
    with raises(HostError, f"no free VF on GPU {GPU}: all 2 VFs hold a vGPU"):
        drv.create(spec(3))


def test_type_not_creatable_lists_what_is(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.create(spec(1))
    fake.refresh()
    with raises(HostError, f"vGPU type H200X-70C is not creatable on GPU {GPU} now; "
                           "creatable: H200X-35C (1425)"):
        drv.create(spec(2, "H200X-70C"))
    with raises(HostError, "vGPU type H200X-9C is not creatable"):
        drv.create(spec(3, "NVIDIA H200X-9C"))
    assert fake.current() == {VF0: 1425, VF1: 0, VF2: 0, VF3: 0}
    assert set(json.loads(drv.state_file.read_text())["devices"]) == {spec(1).uuid}


def test_full_gpu_lists_nothing_creatable(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.create(spec(1, "H200X-141C"))
    fake.refresh()
    with raises(HostError, f"vGPU type H200X-35C is not creatable on GPU {GPU} now; "
                           "creatable: none (the GPU is full)"):
        drv.create(spec(2))


def test_vfs_not_enabled(tmp_path: Path) -> None:
    fake = FakeVfioSysfs(tmp_path / "sys", num_vfs=0)
    drv = VfioSysfs(fake.root, tmp_path / "s.json")
    assert drv.list_vfs(GPU) == []
    with raises(HostError, f"no SR-IOV virtual functions are enabled on GPU {GPU}"):
        drv.create(spec())
    with raises(HostError, f"enable them with `/usr/lib/nvidia/sriov-manage -e {GPU}`"):
        drv.create(spec())


def test_unknown_gpu_and_bad_addresses(drv: VfioSysfs) -> None:
    with raises(HostError, "GPU 0000:99:00.0 not found"):
        drv.list_vfs("0000:99:00.0")
    with raises(InvalidInput, "not a PCI address: 'gpu0'"):
        drv.create(DeviceSpec(device_id="d", gpu_pci="gpu0", backing=DeviceBacking.VFIO_VF, profile="x",
                              start=0, size=1, uuid="u"))


def test_vf_without_vendor_vfio_files(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    shutil.rmtree(fake.devices / VF0 / "nvidia")
    with raises(HostError, f"VF {VF0}: {fake.file(VF0, 'current_vgpu_type')} does not exist"):
        drv.create(spec())
    with raises(HostError, "vendor-specific VFIO (vGPU 17+, kernel >= 6.8)"):
        drv.creatable_types(VF0)


def test_permission_denied_names_gpu_vf_and_file(
    drv: VfioSysfs, fake: FakeVfioSysfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = Path.write_text

    def deny(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if self.name == "current_vgpu_type":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", deny)
    path = fake.file(VF0, "current_vgpu_type")
    with raises(HostError, f"GPU {GPU}, VF {VF0}: permission denied writing {path}; "
                           "vgpu-ctl must run as root"):
        drv.create(spec())
    assert not drv.state_file.exists()


def test_driver_refusal_is_reported(drv: VfioSysfs, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(Path, "write_text", refuse)
    with raises(HostError, f"writing '1425' to {drv.root}/bus/pci/devices/{VF0}/nvidia/current_vgpu_type "
                           "failed: Invalid argument"):
        drv.create(spec())


def test_remove_writes_zero_and_is_idempotent(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.create(spec(1))
    fake.refresh()
    drv.create(spec(2))
    fake.refresh()
    drv.remove(spec(1))
    assert fake.file(VF0, "current_vgpu_type").read_text() == "0\n"
    fake.refresh()
    assert fake.current() == {VF0: 0, VF1: 1425, VF2: 0, VF3: 0}
    drv.remove(spec(1))
    drv.remove(spec(7))  # never created
    assert set(json.loads(drv.state_file.read_text())["devices"]) == {spec(2).uuid}


def test_remove_leaves_a_vf_that_someone_else_took(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.create(spec(1))
    fake.set_type(VF0, 0)
    fake.set_type(VF0, 1428)
    drv.remove(spec(1))
    assert fake.current()[VF0] == 1428


def test_list_devices(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    assert drv.list_devices() == []
    drv.create(spec(1))
    fake.refresh()
    fake.set_type(VF2, 1425)  # made by another tool
    assert drv.list_devices() == [
        HostDevice(backing=DeviceBacking.VFIO_VF, gpu_pci=GPU, uuid=spec(1).uuid, pci_address=VF0,
                   profile="H200X-35C"),
        HostDevice(backing=DeviceBacking.VFIO_VF, gpu_pci=GPU, pci_address=VF2, profile="H200X-35C"),
    ]


def test_list_devices_without_known_type_names(tmp_path: Path, fake: FakeVfioSysfs) -> None:
    fake.set_type(VF1, 1427)
    drv = VfioSysfs(fake.root, tmp_path / "fresh.json")
    assert drv.list_devices() == [HostDevice(backing=DeviceBacking.VFIO_VF, gpu_pci=GPU, pci_address=VF1)]


def test_write_vgpu_params(drv: VfioSysfs, fake: FakeVfioSysfs) -> None:
    drv.write_vgpu_params(VF0, {"frame_rate_limiter": 0, "disable_vnc": 1})
    assert fake.file(VF0, "vgpu_params").read_text() == "frame_rate_limiter=0, disable_vnc=1\n"
    drv.write_vgpu_params(VF0, {})
    assert fake.file(VF0, "vgpu_params").read_text() == " \n"
    with raises(InvalidInput, "vGPU parameter a='1, b=2'"):
        drv.write_vgpu_params(VF0, {"a": "1, b=2"})
