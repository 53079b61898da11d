"""A fake vendor-specific VFIO sysfs tree (nvidia.md §4.2-4.3) in a temporary folder.

Layout: `bus/pci/devices/<PF>/virtfnN -> ../<VF>`, `<VF>/physfn -> ../<PF>`, and per VF
`nvidia/{creatable_vgpu_types, current_vgpu_type, vgpu_params}`. Plain files cannot react to writes, so a test
calls `refresh()` after each change: it plays the driver, checks what was written, and rewrites each VF's
`creatable_vgpu_types` (equal-size mode: once a type is in use, free VFs list only that type while its max
count is not reached; a VF holding a vGPU, or any VF of a full GPU, lists only the header).

With a fake NVML whose GPU at the PF's address is in MIG mode, the VFs offer MIG-backed types instead, each
only while a GPU instance of its profile is not held by another VF; a VF given a MIG-backed type gets the
lowest such instance (its `nvidia/gpu_instance_id`, an output), and destroying an instance a VF holds is
refused. The fake NVML refreshes the tree after each of its changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADER = "ID    : vGPU Name\n"


@dataclass(frozen=True)
class FakeVgpuType:
    """A time-sliced vGPU type as the driver lists it."""

    id: int
    name: str  # "NVIDIA H200X-35C"
    max_count: int


# Type ids 1428 (141C) and 1414 (1-18C) are the ones seen in issue reports; the others are illustrative.
H200X_TYPES = (
    FakeVgpuType(1428, "NVIDIA H200X-141C", 1),
    FakeVgpuType(1427, "NVIDIA H200X-70C", 2),
    FakeVgpuType(1425, "NVIDIA H200X-35C", 4),
)


@dataclass(frozen=True)
class FakeMigVgpuType:
    """A MIG-backed vGPU type as the driver lists it, and the GPU-instance profile it needs."""

    id: int
    name: str  # "NVIDIA H200X-1-18C"
    gi_profile: str  # "1g.18gb"


H200X_MIG_TYPES = (
    FakeMigVgpuType(1414, "NVIDIA H200X-1-18C", "1g.18gb"),
    FakeMigVgpuType(1419, "NVIDIA H200X-3-71C", "3g.71gb"),
)


def vf_address(pf: str, n: int) -> str:
    """The address of virtual function `n` of a PF, VFs starting at function 4 (0000:41:00.4, ...)."""
    domain, bus, rest = pf.split(":")
    slot = int(rest.split(".")[0], 16)
    devfn = slot * 8 + 4 + n
    return f"{domain}:{bus}:{devfn // 8:02x}.{devfn % 8}"


class FakeVfioSysfs:
    """A sysfs root holding one GPU (PF) with `num_vfs` VFs on the nvidia driver."""

    def __init__(self, root: Path, pf: str = "0000:41:00.0", num_vfs: int = 4,
                 types: tuple[FakeVgpuType, ...] = H200X_TYPES,
                 mig_types: tuple[FakeMigVgpuType, ...] = H200X_MIG_TYPES, nvml: Any = None) -> None:
        self.root = root
        self.pf = pf
        self.types = {t.id: t for t in types}
        self.mig_types = {t.id: t for t in mig_types}
        self.nvml = nvml
        if nvml is not None:
            nvml.on_change.append(lambda _call: self.refresh())
        self.devices = root / "bus" / "pci" / "devices"
        (self.devices / pf).mkdir(parents=True)
        self.vfs = [vf_address(pf, n) for n in range(num_vfs)]
        for n, vf in enumerate(self.vfs):
            nv = self.devices / vf / "nvidia"
            nv.mkdir(parents=True)
            os.symlink(f"../{vf}", self.devices / pf / f"virtfn{n}")
            os.symlink(f"../{pf}", self.devices / vf / "physfn")
            (nv / "current_vgpu_type").write_text("0\n")
            (nv / "vgpu_params").write_text("\n")
        self.refresh()

    def _mig_gpu(self) -> Any:
        """The fake NVML's GPU at the PF's address when it is in MIG mode, else None."""
        if self.nvml is None:
            return None
        key = self.pf.split(":", 1)[1].lower()
        gpu = next((g for g in self.nvml.gpus if g.bus_id.lower().endswith(key)), None)
        return gpu if gpu is not None and gpu.mig_capable and gpu.mig_current == 1 else None

    def file(self, vf: str, name: str) -> Path:
        """The path of one of the VF's nvidia/ files."""
        return self.devices / vf / "nvidia" / name

    def current(self) -> dict[str, int]:
        """Type id per VF, as the files hold it."""
        return {vf: int(self.file(vf, "current_vgpu_type").read_text().strip()) for vf in self.vfs}

    def set_type(self, vf: str, type_id: int) -> None:
        """Give a VF a vGPU behind the controller's back (another tool, or a previous run)."""
        self.file(vf, "current_vgpu_type").write_text(f"{type_id}\n")
        self.refresh()

    def refresh(self) -> None:
        """Act as the driver after writes: check them, then rewrite every VF's creatable list."""
        gpu = self._mig_gpu()
        if gpu is not None:
            self._refresh_mig(gpu)
            return
        current = self.current()
        used = {t for t in current.values() if t}
        for vf, t in current.items():
            assert t == 0 or t in self.types, f"{vf}: driver would refuse unknown type id {t}"
        assert len(used) <= 1, f"equal-size mode: driver would refuse mixing types {sorted(used)}"
        counts = {t: sum(1 for v in current.values() if v == t) for t in used}
        for t, c in counts.items():
            most = self.types[t].max_count
            assert c <= most, f"driver would refuse more than {most} of type {t}"
        if used:
            (t,) = used
            offer = [self.types[t]] if counts[t] < self.types[t].max_count else []
        else:
            offer = list(self.types.values())
        lines = "".join(f"{ty.id} : {ty.name}\n" for ty in offer)
        for vf, t in current.items():
            self.file(vf, "creatable_vgpu_types").write_text(HEADER + ("" if t else lines))

    def _refresh_mig(self, gpu: Any) -> None:
        current = self.current()
        held: dict[str, int] = {}
        for vf, t in current.items():
            gi_file = self.file(vf, "gpu_instance_id")
            if t == 0:
                gi_file.unlink(missing_ok=True)
                continue
            assert t in self.mig_types, f"{vf}: MIG mode: driver would refuse time-sliced type id {t}"
            if gi_file.exists():
                gi = int(gi_file.read_text())
                assert gi in gpu.gis, f"{vf}: GPU instance {gi} was destroyed while the VF's vGPU used it"
                held[vf] = gi
        for vf, t in current.items():
            if t == 0 or vf in held:
                continue
            want = self.mig_types[t].gi_profile
            free = sorted(i for i, g in gpu.gis.items() if g.profile.name == want and i not in held.values())
            assert free, f"{vf}: driver would refuse type {t}: no free GPU instance of profile {want}"
            held[vf] = free[0]
            self.file(vf, "gpu_instance_id").write_text(f"{free[0]}\n")
        taken = set(held.values())
        offer = [mt for mt in self.mig_types.values()
                 if any(g.profile.name == mt.gi_profile and i not in taken for i, g in gpu.gis.items())]
        lines = "".join(f"{mt.id} : {mt.name}\n" for mt in offer)
        for vf, t in current.items():
            self.file(vf, "creatable_vgpu_types").write_text(HEADER + ("" if t else lines))
