"""What the service asks of a host, whatever drives it (libvirt, vendor VFIO sysfs, NVML, simulation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from vgpu_ctl.core.backings import DeviceBacking as DeviceBacking  # its home is the core; re-exported
from vgpu_ctl.render import DomainClaim


@dataclass(frozen=True)
class DeviceSpec:
    """A device the controller has claimed and wants to exist on a host."""

    device_id: str
    gpu_pci: str  # the physical GPU, "0000:41:00.0"
    backing: DeviceBacking
    profile: str  # vGPU type name ("A100D-10C"), MIG profile ("3g.40gb") or model (passthrough)
    start: int  # position on the GPU's axis (MIG memory slice, framebuffer GB)
    size: int
    uuid: str  # mdev UUID (also used as a stable id for other backings)
    mdev_type: str | None = None  # "nvidia-558": the host's type id for `profile`, when known
    vfio_type_id: int | None = None  # vendor-VFIO type id for `profile` (`creatable_vgpu_types`), when known
    mig_profile_id: int | None = None  # NVML GI profile id for MIG and MIG-backed vGPUs
    placement_id: int | None = None  # mixed-size vGPU placement id

    @property
    def mig_backed(self) -> bool:
        """A MIG-backed vGPU: a GPU instance first, then an mdev or a VF type on it."""
        return self.backing in (DeviceBacking.MDEV, DeviceBacking.VFIO_VF) and self.mig_profile_id is not None


@dataclass(frozen=True)
class DeviceHandle:
    """Where a created device lives, as the domain XML needs it."""

    backing: DeviceBacking
    uuid: str | None = None  # mdev UUID
    pci_address: str | None = None  # VF or whole GPU, "0000:41:00.4"
    gpu_instance_id: int | None = None  # MIG


@dataclass(frozen=True)
class HostDevice:
    """A device found on a host, for reconcile."""

    backing: DeviceBacking
    gpu_pci: str
    uuid: str | None = None
    pci_address: str | None = None
    gpu_instance_id: int | None = None
    profile: str | None = None
    active: bool = True  # False: defined but not usable now (an mdev not started, as after a reboot)


@dataclass(frozen=True)
class DomainInfo:
    """A libvirt domain on a host, with the controller's metadata when it wrote one."""

    name: str
    uuid: str
    active: bool
    metadata: dict[str, str] = field(default_factory=dict)  # vm_id, tenant, device ids ("" if foreign)
    hostdevs: tuple[str, ...] = ()  # what its XML takes: mdev UUIDs and PCI addresses, foreign domains' too
    claim: DomainClaim | None = None  # the VM and device positions its metadata records (to adopt it)
    saved: bool = False  # it has a managed save image: its next start restores it


class HostDriver(Protocol):
    """One host. Every method is idempotent where the docstring says so; failures raise HostError."""

    name: str
    simulated: bool

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        """Make the device exist (idempotent: an existing one with this uuid is returned)."""
        ...

    def remove_device(self, spec: DeviceSpec) -> None:
        """Remove the device (idempotent: absent is fine)."""
        ...

    def list_devices(self) -> list[HostDevice]:
        """Devices of the controller's kinds present on the host."""
        ...

    def define_domain(self, xml: str) -> str:
        """Define (or redefine) a persistent domain; returns its UUID."""
        ...

    def start_domain(self, name: str) -> None:
        """Start a defined domain (idempotent)."""
        ...

    def stop_domain(self, name: str, force: bool = False) -> None:
        """Shut down (or with force, destroy) a domain (idempotent)."""
        ...

    def managed_save(self, name: str) -> None:
        """Save a running domain's memory to the host's managed save file and stop it (libvirt
        `virDomainManagedSave`); its next start restores it. Idempotent: an inactive domain with a managed save
        image is fine; HostError for one that is absent or inactive without one."""
        ...

    def undefine_domain(self, name: str) -> None:
        """Stop if needed and undefine (idempotent: absent is fine)."""
        ...

    def list_domains(self) -> list[DomainInfo]:
        """Every domain on the host."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
