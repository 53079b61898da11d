"""A host's preflight: what vGPUs need there (libvirt and QEMU, IOMMU, vfio, the NVIDIA host driver, an mdev
bus or SR-IOV VFs, MIG mode, mdevctl), each finding with what to do. The host-side facts come from the
host's agent (`probe`); the judgement is made here."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu_ctl.errors import VgpuCtlError

NVIDIA = "0x10de"
MDEVCTL_MIN_LIBVIRT = 7_003_000  # persistent mdevs through nodeDeviceDefineXML (libvirt >= 7.3, mdevctl)


@dataclass(frozen=True)
class Check:
    """One finding: ok, warn (vGPUs of some kind will not work) or fail (none will), and what to do."""

    check: str
    status: str
    detail: str
    do: str = ""

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass
class Report:
    """The findings of one host."""

    host: str
    uri: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed."""
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"host": self.host, "uri": self.uri, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def probe(sysfs: Path = Path("/sys"), proc: Path = Path("/proc"), dev: Path = Path("/dev")) -> dict[str, Any]:
    """The raw host-side facts, read from sysfs, procfs and PATH on the host itself."""
    groups = sysfs / "kernel" / "iommu_groups"
    modules = sorted(m for m in ("vfio", "vfio_pci", "vfio_iommu_type1", "mdev", "nvidia", "nvidia_vgpu_vfio",
                                 "kvm") if (sysfs / "module" / m).exists())
    version_text = _read(proc / "driver" / "nvidia" / "version") or ""
    m = re.search(r"Kernel Module\s+(\d+\.\d+(?:\.\d+)?)", version_text)
    driver = m.group(1) if m else _read(sysfs / "module" / "nvidia" / "version")
    mdev_parents = sorted(p.name for p in (sysfs / "class" / "mdev_bus").iterdir()) \
        if (sysfs / "class" / "mdev_bus").is_dir() else []
    gpus = []
    pci = sysfs / "bus" / "pci" / "devices"
    for d in sorted(pci.iterdir()) if pci.is_dir() else []:
        if _read(d / "vendor") != NVIDIA or not (_read(d / "class") or "").startswith("0x03"):
            continue
        if (d / "physfn").exists():
            continue  # a VF: counted with its GPU
        drv = d / "driver"
        gpus.append({"pci": d.name, "device": _read(d / "device"),
                     "driver": os.path.basename(os.readlink(drv)) if drv.is_symlink() else None,
                     "sriov_totalvfs": int(_read(d / "sriov_totalvfs") or 0),
                     "sriov_numvfs": int(_read(d / "sriov_numvfs") or 0)})
    return {"iommu_groups": len(list(groups.iterdir())) if groups.is_dir() else 0, "modules": modules,
            "nvidia_driver": driver, "mdev_parents": mdev_parents, "gpus": gpus,
            "mdevctl": shutil.which("mdevctl"), "kvm": (dev / "kvm").exists()}


def _version(n: int) -> str:
    return f"{n // 1_000_000}.{n // 1000 % 1000}.{n % 1000}"


def _libvirt(report: Report) -> int | None:
    from vgpu_ctl.hosts.nodedev import open_libvirt
    try:
        conn = open_libvirt(report.uri, report.host)
    except VgpuCtlError as exc:
        report.checks.append(Check("libvirt", "fail", exc.message,
                                   "start libvirtd on the host and check the URI (and SSH access for qemu+ssh://)"))
        return None
    try:
        lib, hv, kind = int(conn.getLibVersion()), int(conn.getVersion()), str(conn.getType())
    finally:
        conn.close()
    report.checks.append(Check("libvirt", "ok", f"libvirt {_version(lib)}, {kind} {_version(hv)}"))
    if kind.upper() != "QEMU":
        report.checks.append(Check("hypervisor", "fail", f"the URI's driver is {kind}, not QEMU/KVM",
                                   "use a qemu:// or qemu+ssh:// URI"))
    return lib


def check_host(name: str, uri: str, side: Any, backing: str = "mdev") -> Report:
    """Preflight of one host: libvirt over its URI, everything else from its agent (`side.probe()`)."""
    report = Report(name, uri)
    lib = _libvirt(report)
    add = report.checks.append
    try:
        facts = side.probe()
    except VgpuCtlError as exc:
        add(Check("host agent", "fail", exc.message, "install vgpu-ctl on the host, reachable as the libvirt URI's "
                                                       "SSH login (`vgpuctl agent call` on its PATH)"))
        return report
    if not facts["kvm"]:
        add(Check("kvm", "fail", "/dev/kvm is missing: KVM guests cannot run",
                  "enable virtualization (VT-x/AMD-V) in the firmware and load kvm_intel or kvm_amd"))
    if facts["iommu_groups"]:
        add(Check("iommu", "ok", f"IOMMU on: {facts['iommu_groups']} groups in /sys/kernel/iommu_groups"))
    else:
        add(Check("iommu", "fail", "IOMMU is off: /sys/kernel/iommu_groups is empty, so no device can be given "
                  "to a guest (vGPU, VF or whole GPU)", "enable VT-d / AMD-Vi in the firmware and boot with "
                  "intel_iommu=on iommu=pt (AMD: amd_iommu=on iommu=pt), then reboot"))
    vfio = {"vfio", "vfio_pci"} & set(facts["modules"])
    if vfio == {"vfio", "vfio_pci"}:
        add(Check("vfio", "ok", "vfio and vfio_pci are loaded"))
    else:
        add(Check("vfio", "fail", f"vfio modules missing: {', '.join(sorted({'vfio', 'vfio_pci'} - vfio))}",
                  "modprobe vfio-pci (and list it in /etc/modules-load.d/vfio.conf)"))
    if facts["nvidia_driver"]:
        add(Check("nvidia driver", "ok", f"NVIDIA host driver {facts['nvidia_driver']}"))
    else:
        add(Check("nvidia driver", "fail", "no NVIDIA host driver is loaded (no /proc/driver/nvidia/version)",
                  "install NVIDIA's vGPU Manager (the host driver of NVIDIA AI Enterprise / vGPU) for this kernel "
                  "and check that `nvidia-smi` works; without it only whole-GPU passthrough is possible"))
    if not facts["gpus"]:
        add(Check("gpus", "fail", "no NVIDIA GPU on the host's PCI bus",
                  "check that the GPUs are seated and visible (`lspci -d 10de:`)"))
    for g in facts["gpus"]:
        _gpu_checks(add, g, facts, backing)
    for pci, mode in sorted(facts.get("mig", {}).items()):
        add(Check(f"mig {pci}", "ok", f"{pci}: MIG mode {'on' if mode else 'off'}",
                  "" if mode else f"for MIG or MIG-backed vGPU an admin runs `nvidia-smi -i {pci} -mig 1` "
                                  "(resets the GPU); vgpu-ctl never changes MIG mode"))
    for note in facts.get("notes", []):
        add(Check("nvml", "warn", note, "MIG mode and profiles can't be read without NVML (the NVIDIA driver)"))
    if backing == "mdev" and (facts["mdev_parents"] or facts["gpus"]):
        if facts["mdevctl"] is None:
            add(Check("mdevctl", "fail", "mdevctl is not installed: libvirt cannot define persistent mdevs "
                      "(\"Cannot find 'mdevctl' in path\")", "install the mdevctl package on the host"))
        else:
            add(Check("mdevctl", "ok", f"mdevctl at {facts['mdevctl']}"))
        if lib is not None and lib < MDEVCTL_MIN_LIBVIRT:
            add(Check("libvirt mdev", "fail", f"libvirt {_version(lib)} cannot define persistent mdevs",
                      "upgrade libvirt to 7.3 or newer"))
    return report


def _gpu_checks(add: Any, g: dict[str, Any], facts: dict[str, Any], backing: str) -> None:
    pci = g["pci"]
    on_bus = pci in facts["mdev_parents"] or any(
        p.startswith(pci.rsplit(":", 1)[0] + ":") for p in facts["mdev_parents"])
    if g["sriov_totalvfs"] and not g["sriov_numvfs"]:
        add(Check(f"gpu {pci}", "fail", f"GPU {pci} supports {g['sriov_totalvfs']} SR-IOV VFs but none are enabled: "
                  "no vGPU can be created on it", f"run `/usr/lib/nvidia/sriov-manage -e {pci}` (again after "
                  "every reboot; a systemd unit of the vGPU Manager does it)"))
    elif backing == "vfio" and g["sriov_numvfs"]:
        add(Check(f"gpu {pci}", "ok", f"GPU {pci}: {g['sriov_numvfs']} VFs for vendor-specific VFIO vGPUs"))
    elif on_bus:
        add(Check(f"gpu {pci}", "ok", f"GPU {pci} offers mdev types (mdev bus)"
                  + (f", {g['sriov_numvfs']} VFs" if g["sriov_numvfs"] else "")))
    else:
        add(Check(f"gpu {pci}", "warn", f"GPU {pci} (driver {g['driver'] or 'none'}) offers no vGPUs: no mdev "
                  "types and no VFs", "load the NVIDIA vGPU Manager for vGPUs; as it is, only whole-GPU "
                  "passthrough works (GPU mode passthrough)"))
