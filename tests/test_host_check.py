"""`vgpuctl host check`: the preflight explains a host without IOMMU or NVIDIA driver (this machine, and a fake
sysfs tree), and names what to do on a GPU host that is half set up."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from fake_pynvml import H100_80GB, FakeGpu, FakeNvml  # noqa: E402

from vgpu_ctl.cli.main import app  # noqa: E402
from vgpu_ctl.hosts.agent import AgentHostSide, InProcessTransport  # noqa: E402
from vgpu_ctl.hosts.hostside import LocalHostSide  # noqa: E402
from vgpu_ctl.hosts.preflight import Check, Report, check_host  # noqa: E402

URI = "test:///default"  # libvirt answers; the host side is the fake tree


def _tree(root: Path, *, iommu: bool, driver: bool, vfs: int | None) -> tuple[Path, Path, Path]:
    sys_, proc, dev = root / "sys", root / "proc", root / "dev"
    (sys_ / "kernel" / "iommu_groups").mkdir(parents=True)
    dev.mkdir()
    (dev / "kvm").write_text("")
    if iommu:
        for i in range(3):
            (sys_ / "kernel" / "iommu_groups" / str(i)).mkdir()
        for m in ("vfio", "vfio_pci", "vfio_iommu_type1", "kvm"):
            (sys_ / "module" / m).mkdir(parents=True)
    if driver:
        (proc / "driver" / "nvidia").mkdir(parents=True)
        (proc / "driver" / "nvidia" / "version").write_text(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.05  Thu Jun  6 2024\n")
        (sys_ / "module" / "nvidia").mkdir(parents=True)
    if vfs is not None:
        gpu = sys_ / "bus" / "pci" / "devices" / "0000:41:00.0"
        gpu.mkdir(parents=True)
        for f, v in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200"),
                     ("sriov_totalvfs", "16"), ("sriov_numvfs", str(vfs))):
            (gpu / f).write_text(v + "\n")
    return sys_, proc, dev


def _side(root: Path, nvml: FakeNvml, **tree: object) -> AgentHostSide:
    sys_, proc, dev = _tree(root, **tree)  # type: ignore[arg-type]
    return AgentHostSide("h", InProcessTransport(LocalHostSide(root / "state", sys_, nvml, proc_root=proc,
                                                               dev_root=dev)))


def _by_check(report: Report) -> dict[str, Check]:
    return {c.check: c for c in report.checks}


def test_a_host_without_iommu_or_nvidia_driver_is_explained(tmp_path: Path) -> None:
    nvml = FakeNvml([])
    nvml.driver_loaded = False
    report = check_host("h", URI, _side(tmp_path, nvml, iommu=False, driver=False, vfs=None))
    checks = _by_check(report)
    assert not report.ok
    assert checks["iommu"].status == "fail" and "intel_iommu=on" in checks["iommu"].do
    assert checks["vfio"].status == "fail" and "modprobe vfio-pci" in checks["vfio"].do
    nv = checks["nvidia driver"]
    assert nv.status == "fail" and "vGPU Manager" in nv.do
    assert "NVIDIA driver not loaded" in checks["nvml"].detail
    assert checks["libvirt"].status == "ok"


def test_a_gpu_host_with_vfs_off_and_no_mdevctl_says_what_to_do(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    nvml = FakeNvml([FakeGpu(H100_80GB, "00000000:41:00.0", "GPU-1", 0, 0)])
    report = check_host("h", URI, _side(tmp_path, nvml, iommu=True, driver=True, vfs=0))
    checks = _by_check(report)
    assert [checks[k].status for k in ("iommu", "vfio", "nvidia driver")] == ["ok"] * 3
    assert checks["nvidia driver"].detail == "NVIDIA host driver 550.90.05"
    gpu = checks["gpu 0000:41:00.0"]
    assert gpu.status == "fail" and "/usr/lib/nvidia/sriov-manage -e 0000:41:00.0" in gpu.do
    assert checks["mdevctl"].status == "fail"
    mig = checks["mig 0000:41:00.0"]
    assert mig.detail == "0000:41:00.0: MIG mode off" and "-mig 1" in mig.do


def test_vfs_on_for_vendor_vfio_pass(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(H100_80GB, "00000000:41:00.0", "GPU-1")])
    report = check_host("h", URI, _side(tmp_path, nvml, iommu=True, driver=True, vfs=16), backing="vfio")
    # all is well but the URI: libvirt's test driver is no KVM host
    assert [(c.check, c.status) for c in report.checks if c.status != "ok"] == [("hypervisor", "fail")]
    assert _by_check(report)["gpu 0000:41:00.0"].detail.endswith("16 VFs for vendor-specific VFIO vGPUs")


@pytest.mark.skipif(os.path.isdir("/sys/kernel/iommu_groups") and bool(os.listdir("/sys/kernel/iommu_groups")),
                    reason="this machine has an IOMMU: the case is covered by the fake tree above")
def test_the_cli_explains_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    inv = tmp_path / "inv.yaml"
    inv.write_text(f'hosts:\n  - {{name: here, uri: "{URI}", vcpus: 8, memory_mib: 8192}}\n')
    db = f"sqlite:///{tmp_path / 's.db'}"
    runner = CliRunner()
    assert runner.invoke(app, ["--db", db, "inventory", "apply", str(inv)]).exit_code == 0
    for target in ("here", URI):  # by name in the store, and by URI
        out = runner.invoke(app, ["--db", db, "host", "check", target, "--json"])
        assert out.exit_code == 1, out.output
        data = json.loads(out.output)
        checks = {c["check"]: c for c in data["checks"]}
        assert checks["iommu"]["detail"].startswith("IOMMU is off")
        if not os.path.exists("/proc/driver/nvidia/version"):
            assert checks["nvidia driver"]["status"] == "fail"
    as_yaml = runner.invoke(app, ["--db", db, "host", "check", "here", "-o", "yaml"])
    assert as_yaml.exit_code == 1 and yaml.safe_load(as_yaml.output)["host"] == "here"
    missing_json = runner.invoke(app, ["--db", db, "host", "check", "nowhere", "-o", "json"])
    assert missing_json.exit_code == 4 and json.loads(missing_json.output)["error"]["code"] == "not_found"
    text = runner.invoke(app, ["--db", db, "host", "check", "here"]).output
    assert "fail iommu: IOMMU is off" in text and "do: enable VT-d / AMD-Vi" in text
    missing = runner.invoke(app, ["--db", db, "host", "check", "nowhere"])
    assert missing.exit_code == 4 and "known: here" in missing.output
