"""How a claimed device exists on a host, decided in one place from the profile's kind and the host's vGPU
backing (mdev, or vGPU 17+ vendor-specific VFIO)."""

from __future__ import annotations

from enum import StrEnum


class DeviceBacking(StrEnum):
    """How a claimed device exists on the host."""

    MDEV = "mdev"  # mediated device (legacy or SR-IOV VF parent), hostdev type='mdev'
    VFIO_VF = "vfio-vf"  # vGPU 17+ vendor-specific VFIO: a VF with nvidia/current_vgpu_type set
    MIG = "mig"  # a bare MIG GPU instance (+ compute instance), created through NVML
    PCI = "pci"  # whole-GPU passthrough, hostdev type='pci' managed='yes'



def vgpu_backing(host_vgpu_backing: str) -> DeviceBacking:
    """The backing of a vGPU (time-sliced or MIG-backed) on a host whose vGPUs are `host_vgpu_backing`."""
    return DeviceBacking.VFIO_VF if host_vgpu_backing == "vfio" else DeviceBacking.MDEV


def backing_for(kind: str, host_vgpu_backing: str) -> DeviceBacking:
    """The backing a claimed device of profile kind `kind` (vgpu, mig-vgpu, mig, passthrough) gets on a host
    whose vGPUs are `host_vgpu_backing`."""
    if kind == "passthrough":
        return DeviceBacking.PCI
    if kind == "mig":
        return DeviceBacking.MIG
    return vgpu_backing(host_vgpu_backing)
