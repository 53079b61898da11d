"""What only a GPU host itself can do: NVML (MIG instances) and the vendor-VFIO sysfs writes, and what the host
calls each profile there. `LocalHostSide` does it in this process; `vgpu_ctl.hosts.agent` reaches another host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from vgpu_ctl.errors import HostError
from vgpu_ctl.hosts.nodedev import DeviceBackend


@dataclass(frozen=True)
class GpuFacts:
    """What NVML and the vendor-VFIO sysfs report for one GPU."""

    pci: str
    vfio_types: dict[str, int] = field(default_factory=dict)  # type name without "NVIDIA " -> type id
    vfs: int = 0  # SR-IOV virtual functions with the vendor-VFIO files
    mig_profiles: dict[str, int] = field(default_factory=dict)  # GPU-instance profile name -> NVML profile id
    mig_current: bool | None = None  # None: no MIG on this GPU, or NVML not reachable
    mig_pending: bool | None = None
    nvml_seen: bool = False  # NVML listed this GPU


@dataclass
class HostFacts:
    """The facts of the GPUs asked for, and what could not be read (NVML missing, no sysfs)."""

    gpus: dict[str, GpuFacts] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    driver_version: str | None = None  # NVIDIA host driver, from NVML

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"gpus": {k: v.__dict__ for k, v in self.gpus.items()}, "notes": list(self.notes),
                "driver_version": self.driver_version}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostFacts:
        """Inverse of to_dict."""
        return cls({k: GpuFacts(**v) for k, v in data.get("gpus", {}).items()}, list(data.get("notes", [])),
                   data.get("driver_version"))


class HostSide(Protocol):
    """The GPU host's own side of a libvirt host."""

    def mig(self) -> DeviceBackend:
        """The backend that creates MIG GPU instances at explicit placements."""
        ...

    def vfio(self) -> DeviceBackend:
        """The backend that sets vGPU types on SR-IOV VFs (vendor-specific VFIO)."""
        ...

    def facts(self, gpus: Sequence[str]) -> HostFacts:
        """What NVML and sysfs call each profile of these GPUs, and their MIG mode."""
        ...

    def probe(self) -> dict[str, Any]:
        """The raw facts a preflight judges (see hosts.preflight.probe), with MIG mode per GPU from NVML."""
        ...


class LocalHostSide:
    """HostSide in this process: NVML through `nvml` (pynvml by default) and sysfs under `sysfs_root`;
    which device is which VF or GPU instance is kept under `state_dir` (files named after `host` if given)."""

    def __init__(self, state_dir: Path, sysfs_root: Path = Path("/sys"), nvml: Any = None,
                 host: str | None = None, proc_root: Path = Path("/proc"), dev_root: Path = Path("/dev")) -> None:
        self.state_dir = state_dir
        self.sysfs_root = sysfs_root
        self.proc_root = proc_root
        self.dev_root = dev_root
        self._nvml = nvml
        self._host = host
        self._mig: Any = None
        self._vfio: Any = None

    def _state_file(self, kind: str) -> Path:
        return self.state_dir / (f"{kind}-{self._host}.json" if self._host else f"{kind}-devices.json")

    def mig(self) -> DeviceBackend:
        """NvmlMig over this side's NVML binding."""
        if self._mig is None:
            from vgpu_ctl.hosts.nvml_mig import NvmlMig
            self._mig = NvmlMig(self._nvml, self._state_file("mig"))
        backend: DeviceBackend = self._mig
        return backend

    def vfio(self) -> DeviceBackend:
        """VfioSysfs over this side's sysfs root."""
        if self._vfio is None:
            from vgpu_ctl.hosts.vfio import VfioSysfs
            self._vfio = VfioSysfs(self.sysfs_root, self._state_file("vfio"))
        backend: DeviceBackend = self._vfio
        return backend

    def facts(self, gpus: Sequence[str]) -> HostFacts:
        """MIG mode and GPU-instance profiles from NVML, vendor-VFIO types from the GPUs' VFs."""
        from vgpu_ctl.hosts.nvml_mig import NvmlMig
        from vgpu_ctl.hosts.vfio import VfioSysfs

        out = HostFacts()
        mig = self.mig()
        assert isinstance(mig, NvmlMig)
        nvml: dict[str, Any] = {}
        try:
            nvml = {g["pci_bus_id"]: g for g in mig.gpus()}
            out.driver_version = mig.driver_version()
        except HostError as exc:
            out.notes.append(f"NVML: {exc.message}")
        vfio = self.vfio()
        assert isinstance(vfio, VfioSysfs)
        for pci in gpus:
            g = nvml.get(pci)
            profiles: dict[str, int] = {}
            if g is not None and g["mig_current"] is not None:
                try:
                    profiles = {p["name"]: p["id"] for p in mig.gi_profiles(pci)}
                except HostError as exc:
                    out.notes.append(f"NVML on {pci}: {exc.message}")
            types, vfs = _vfio_types(vfio, pci)
            out.gpus[pci] = GpuFacts(pci, types, vfs, profiles, None if g is None else g["mig_current"],
                                     None if g is None else g["mig_pending"], g is not None)
        return out


    def probe(self) -> dict[str, Any]:
        """sysfs, procfs and PATH facts of this host, and NVML's MIG mode per GPU (or why NVML is silent)."""
        from vgpu_ctl.hosts.nvml_mig import NvmlMig
        from vgpu_ctl.hosts.preflight import probe

        facts = probe(self.sysfs_root, self.proc_root, self.dev_root)
        mig = self.mig()
        assert isinstance(mig, NvmlMig)
        facts["mig"], facts["notes"] = {}, []
        try:
            facts["mig"] = {g["pci_bus_id"]: g["mig_current"] for g in mig.gpus() if g["mig_current"] is not None}
        except HostError as exc:
            facts["notes"].append(exc.message)
        return facts


def _vfio_types(vfio: Any, pci: str) -> tuple[dict[str, int], int]:
    """The vendor-VFIO types the GPU's VFs offer now or hold (name -> id), and how many VFs have the files."""
    try:
        vfs = vfio.list_vfs(pci)
    except HostError:
        return {}, 0
    types: dict[str, int] = {}
    count = 0
    for vf in vfs:
        try:
            types.update(vfio.creatable_types(vf))
            count += 1
        except HostError:
            continue
    types.update({name: int(i) for i, name in vfio.known_types().items()})
    return types, count


def is_local_uri(uri: str) -> bool:
    """Whether a libvirt URI names this machine (no host part: qemu:///system, test:///default)."""
    parts = urlsplit(uri)
    return not parts.netloc or parts.hostname in ("localhost", "127.0.0.1", "::1")


def open_host_side(host: Any, state_path: Path) -> HostSide:
    """The HostSide of a libvirt host row, always through the agent's protocol: in process for a local URI,
    over SSH otherwise."""
    from vgpu_ctl.hosts.agent import AgentHostSide, InProcessTransport, remote_host_side
    if is_local_uri(host.uri):
        return AgentHostSide(host.name, InProcessTransport(
            LocalHostSide(state_path, host=host.name)))
    return remote_host_side(host.name, host.uri)
