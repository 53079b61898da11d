"""A fake `pynvml` module that follows NVIDIA's MIG rules (reference nvidia.md §1-2), for tests without a GPU.

Constants, error classes and ctypes structs are the real binding's; the functions keep its signatures and
calling conventions (count/array references, the placement passed by reference) and apply the MIG rules:
explicit placements only at listed starts, no overlap on the memory-slice axis, per-profile and per-GPU
maximum counts, one media extension per GPU, at most 7 (A30: 4) compute slices, GI destroy refused while it
has compute instances or processes, creates refused without MIG mode or root.
"""

from __future__ import annotations

import ctypes
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real


@dataclass(frozen=True)
class GiProfile:
    """One GPU-instance profile of a model, as the hardware reports it."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_* constant
    id: int
    name: str
    compute: int
    memory: int  # memory slices = placement size
    max_count: int
    starts: tuple[int, ...]
    memory_mib: int
    sm: int
    media: bool = False


@dataclass(frozen=True)
class GpuModel:
    """A MIG-capable GPU model: its geometry and profile table."""

    name: str
    pci_device_id: int
    memory_mib: int
    compute_slices: int
    memory_slices: int
    max_gis: int
    profiles: tuple[GiProfile, ...]


H100_80GB = GpuModel(
    name="NVIDIA H100 80GB HBM3", pci_device_id=0x2330, memory_mib=81559, compute_slices=7, memory_slices=8,
    max_gis=7, profiles=(
        GiProfile(0x0, 19, "1g.10gb", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 9984, 16),
        GiProfile(0x7, 20, "1g.10gb+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 9984, 16, media=True),
        GiProfile(0x9, 15, "1g.20gb", 1, 2, 4, (0, 2, 4, 6), 20096, 26),
        GiProfile(0x1, 14, "2g.20gb", 2, 2, 3, (0, 2, 4), 20096, 32),
        GiProfile(0x2, 9, "3g.40gb", 3, 4, 2, (0, 4), 40448, 60),
        GiProfile(0x3, 5, "4g.40gb", 4, 4, 1, (0,), 40448, 64),
        GiProfile(0x4, 0, "7g.80gb", 7, 8, 1, (0,), 81152, 132),
    ),
)

A100_80GB = GpuModel(
    name="NVIDIA A100 80GB PCIe", pci_device_id=0x20B5, memory_mib=81920, compute_slices=7, memory_slices=8,
    max_gis=7, profiles=tuple(
        GiProfile(p.index, p.id, p.name, p.compute, p.memory, p.max_count, p.starts, p.memory_mib, 14 * p.compute,
                  p.media) for p in H100_80GB.profiles),
)

# H200: 1g.18gb id 19 as captured; the rest as the catalog infers them (UNCONFIRMED there too)
H200 = GpuModel(
    name="NVIDIA H200", pci_device_id=0x2335, memory_mib=143771, compute_slices=7, memory_slices=8, max_gis=7,
    profiles=(
        GiProfile(0x0, 19, "1g.18gb", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 16384, 16),
        GiProfile(0x7, 20, "1g.18gb+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 16384, 16, media=True),
        GiProfile(0x9, 15, "1g.35gb", 1, 2, 4, (0, 2, 4, 6), 32768, 26),
        GiProfile(0x1, 14, "2g.35gb", 2, 2, 3, (0, 2, 4), 32768, 32),
        GiProfile(0x2, 9, "3g.71gb", 3, 4, 2, (0, 4), 69632, 60),
        GiProfile(0x3, 5, "4g.71gb", 4, 4, 1, (0,), 69632, 64),
        GiProfile(0x4, 0, "7g.141gb", 7, 8, 1, (0,), 143360, 132),
    ),
)

A30_24GB = GpuModel(
    name="NVIDIA A30", pci_device_id=0x20B7, memory_mib=24576, compute_slices=4, memory_slices=4, max_gis=4,
    profiles=(
        GiProfile(0x0, 14, "1g.6gb", 1, 1, 4, (0, 1, 2, 3), 5952, 14),
        GiProfile(0x7, 21, "1g.6gb+me", 1, 1, 1, (0, 1, 2, 3), 5952, 14, media=True),
        GiProfile(0x1, 5, "2g.12gb", 2, 2, 2, (0, 2), 11968, 28),
        GiProfile(0x8, 6, "2g.12gb+me", 2, 2, 1, (0, 2), 11968, 28, media=True),
        GiProfile(0x3, 0, "4g.24gb", 4, 4, 1, (0,), 24064, 56),
    ),
)

L40S = GpuModel(name="NVIDIA L40S", pci_device_id=0x26B9, memory_mib=46068, compute_slices=0, memory_slices=0,
                max_gis=0, profiles=())

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (REV1 and 7_SLICE_NVL: not on these models)
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


@dataclass
class FakeCi:
    """A compute instance."""

    id: int
    profile_index: int
    slices: int


@dataclass
class FakeGi:
    """A GPU instance at a placement."""

    id: int
    profile: GiProfile
    start: int
    cis: dict[int, FakeCi] = field(default_factory=dict)
    processes: int = 0  # processes running on it: destroy is refused while > 0
    fb_used_mib: int = 0  # framebuffer its MIG device uses


@dataclass
class FakeVgpu:
    """An active vGPU instance on a GPU (host side), with what NVML reports of it. Utilization in percent."""

    instance: int  # NVML vGPU instance id, unique on the host
    type_name: str = "NVIDIA A100D-10C"
    type_id: int = 558
    mdev_uuid: str = ""  # "" on vendor-VFIO
    vm_id: str = ""  # the domain UUID
    fb_usage: int = 0  # bytes
    sm: int = 0
    mem: int = 0
    enc: int = 0
    dec: int = 0
    jpg: int = 0
    ofa: int = 0
    gpu_instance_id: int = 0xFFFFFFFF  # a MIG-backed vGPU's GPU instance; INVALID otherwise


@dataclass
class FakeGpu:
    """One physical GPU."""

    model: GpuModel
    bus_id: str  # NVML form, "00000000:41:00.0"
    uuid: str
    mig_current: int = 1
    mig_pending: int = 1
    gis: dict[int, FakeGi] = field(default_factory=dict)
    vgpus: list[FakeVgpu] = field(default_factory=list)
    util_gpu: int = 0  # percent (nvmlDeviceGetUtilizationRates: NOT_SUPPORTED in MIG mode)
    util_mem: int = 0
    mem_used_mib: int = 0
    power_mw: int = 70000
    temperature: int = 40
    unsupported: set[str] = field(default_factory=set)  # NVML function names that answer NOT_SUPPORTED here

    @property
    def mig_capable(self) -> bool:
        """Whether the model has MIG at all."""
        return bool(self.model.profiles)


def _bus_key(text: str) -> tuple[int, int, int, int] | None:
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", text.strip())
    if m is None:
        return None
    dom, bus, dev, fn = m.groups()
    return int(dom or "0", 16), int(bus, 16), int(dev, 16), int(fn)


def _deref(ref: Any) -> Any:
    """The object behind `byref(x)` or `pointer(x)`."""
    if hasattr(ref, "_obj"):
        return ref._obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    raise TypeError(f"expected byref(...) or pointer(...), got {type(ref).__name__}")


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class FakeNvml(types.ModuleType):
    """A `pynvml` stand-in holding GPUs; pass it wherever the `pynvml` module is expected."""

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        super().__init__("pynvml")
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo")):
                setattr(self, name, getattr(_real, name))
        self.gpus: list[FakeGpu] = gpus if gpus is not None else [
            FakeGpu(H100_80GB, "00000000:41:00.0", "GPU-4f6e3a52-0000-4000-8000-000000000041"),
            FakeGpu(A30_24GB, "00000000:C1:00.0", "GPU-4f6e3a52-0000-4000-8000-0000000000c1"),
        ]
        self.root = True  # False: creates and destroys fail with NO_PERMISSION
        self.driver_loaded = True  # False: nvmlInit fails with DRIVER_NOT_LOADED
        self.init_count = 0
        self.calls: list[str] = []  # names of mutating calls, in order
        self.on_change: list[Callable[[str], None]] = []  # called with each mutating call, after it
        self.driver_version = "550.90.05"
        self._next_ci = 1

    # --- helpers ---------------------------------------------------------------------------------------
    def _record(self, call: str) -> None:
        self.calls.append(call)
        for hook in self.on_change:
            hook(call)

    def _err(self, code: int) -> Exception:
        err: Exception = _real.NVMLError(code)
        return err

    def _check_init(self) -> None:
        if self.init_count <= 0:
            raise self._err(_real.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any) -> FakeGpu:
        self._check_init()
        i = _addr(handle) // 0x1000 - 1
        if not 0 <= i < len(self.gpus) or _addr(handle) % 0x1000:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[i]

    def _gi(self, handle: Any) -> tuple[FakeGpu, FakeGi]:
        self._check_init()
        a = _addr(handle)
        dev, gi_id = a >> 20, a & 0xFFFF
        if not 1 <= dev <= len(self.gpus) or gi_id not in self.gpus[dev - 1].gis or (a >> 16) & 0xF != 1:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[dev - 1]
        return gpu, gpu.gis[gi_id]

    def _ci(self, handle: Any) -> tuple[FakeGi, FakeCi]:
        self._check_init()
        a = _addr(handle)
        dev, gi_id, ci_id = a >> 20, (a >> 8) & 0xFF, a & 0xFF
        if not 1 <= dev <= len(self.gpus) or (a >> 16) & 0xF != 2:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gi = self.gpus[dev - 1].gis.get(gi_id)
        if gi is None or ci_id not in gi.cis:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gi, gi.cis[ci_id]

    def _index(self, gpu: FakeGpu) -> int:
        return next(i for i, g in enumerate(self.gpus) if g is gpu)

    def _dev_handle(self, i: int) -> Any:
        return ctypes.cast(ctypes.c_void_p((i + 1) * 0x1000), _real.c_nvmlDevice_t)

    def _gi_handle(self, gpu: FakeGpu, gi: FakeGi) -> Any:
        addr = ((self._index(gpu) + 1) << 20) | (1 << 16) | gi.id
        return ctypes.cast(ctypes.c_void_p(addr), _real.c_nvmlGpuInstance_t)

    def _ci_handle(self, gpu: FakeGpu, gi: FakeGi, ci: FakeCi) -> Any:
        addr = ((self._index(gpu) + 1) << 20) | (2 << 16) | (gi.id << 8) | ci.id
        return ctypes.cast(ctypes.c_void_p(addr), _real.c_nvmlComputeInstance_t)

    def _profile_by_id(self, gpu: FakeGpu, profile_id: int) -> GiProfile:
        for p in gpu.model.profiles:
            if p.id == profile_id:
                return p
        raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def _require_root(self) -> None:
        if not self.root:
            raise self._err(_real.NVML_ERROR_NO_PERMISSION)

    # --- library and devices ---------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise self._err(_real.NVML_ERROR_DRIVER_NOT_LOADED)
        self.init_count += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver_version

    def nvmlShutdown(self) -> None:
        self._check_init()
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev_handle(index)

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        self._check_init()
        key = _bus_key(pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId)
        if key is None:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        for i, gpu in enumerate(self.gpus):
            if _bus_key(gpu.bus_id) == key:
                return self._dev_handle(i)
        raise self._err(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).model.name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._mig(handle)
        if mig is not None:
            return f"MIG-{mig[0].uuid.removeprefix('GPU-')[:28]}{mig[1].id:08x}"
        return self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        dom, bus, dev, _fn = _bus_key(gpu.bus_id) or (0, 0, 0, 0)
        info = _real.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        info.busIdLegacy = gpu.bus_id.encode()
        info.domain, info.bus, info.device = dom, bus, dev
        info.pciDeviceId = (gpu.model.pci_device_id << 16) | 0x10DE
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        mem = _real.c_nvmlMemory_t()
        mig = self._mig(handle)
        if mig is not None:
            gpu, gi = mig
            self._supported(gpu, "nvmlDeviceGetMemoryInfo")
            mem.total, mem.used = gi.profile.memory_mib * 2**20, gi.fb_used_mib * 2**20
        else:
            gpu = self._gpu(handle)
            self._supported(gpu, "nvmlDeviceGetMemoryInfo")
            mem.total, mem.used = gpu.model.memory_mib * 2**20, gpu.mem_used_mib * 2**20
        mem.free = mem.total - mem.used
        return mem

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._gpu(device)
        if not gpu.mig_capable:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig_current, gpu.mig_pending]

    # --- GPU instances -----------------------------------------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        gpu = self._gpu(device)
        if not 0 <= profile < _real.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        p = next((p for p in gpu.model.profiles if p.index == profile), None)
        if p is None:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = _real.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {p.name}".encode()
        elif version == 1:
            info = _real.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise self._err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id, info.sliceCount, info.instanceCount = p.id, p.compute, p.max_count
        info.multiprocessorCount, info.memorySizeMB = p.sm, p.memory_mib
        info.jpegCount = info.ofaCount = int(p.media or p.compute == gpu.model.compute_slices)
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu = self._gpu(device)
        p = self._profile_by_id(gpu, profileId)
        count = _deref(countRef)
        if placementsRef is not None:
            if len(placementsRef) < len(p.starts):
                raise self._err(_real.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(p.starts):
                placementsRef[i].start, placementsRef[i].size = start, p.memory
        count.value = len(p.starts)
        return int(_real.NVML_SUCCESS)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        gpu = self._gpu(device)
        if isinstance(placement, ctypes.Structure):
            raise TypeError("the placement must be passed by reference: byref(placement)")
        place = _deref(placement)
        if not gpu.mig_capable or gpu.mig_current != _real.NVML_DEVICE_MIG_ENABLE:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        self._require_root()
        p = self._profile_by_id(gpu, profileId)
        if place.start not in p.starts or place.size != p.memory:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gis = list(gpu.gis.values())
        new = set(range(place.start, place.start + p.memory))
        if (
            any(new & set(range(g.start, g.start + g.profile.memory)) for g in gis)
            or sum(g.profile is p for g in gis) >= p.max_count
            or len(gis) >= gpu.model.max_gis
            or sum(g.profile.compute for g in gis) + p.compute > gpu.model.compute_slices
            or (p.media and any(g.profile.media for g in gis))
        ):
            raise self._err(_real.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = next(i for i in range(1, 64) if i not in gpu.gis)
        gi = gpu.gis[gi_id] = FakeGi(gi_id, p, place.start)
        self._record(f"create_gi {gpu.bus_id} {p.name}@{place.start}")
        return self._gi_handle(gpu, gi)

    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        gpu = self._gpu(device)
        if not gpu.mig_capable or gpu.mig_current != _real.NVML_DEVICE_MIG_ENABLE:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        p = self._profile_by_id(gpu, profileId)
        found = [g for g in gpu.gis.values() if g.profile is p]
        if len(gpuInstancesRef) < len(found):
            raise self._err(_real.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(found):
            gpuInstancesRef[i] = self._gi_handle(gpu, gi)
        _deref(countRef).value = len(found)
        return int(_real.NVML_SUCCESS)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gpu, gi = self._gi(gpuInstance)
        info = _real.c_nvmlGpuInstanceInfo_t()
        info.device = self._dev_handle(self._index(gpu))
        info.id, info.profileId = gi.id, gi.profile.id
        info.placement.start, info.placement.size = gi.start, gi.profile.memory
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gpu, gi = self._gi(gpuInstance)
        self._require_root()
        if gi.cis or gi.processes:
            raise self._err(_real.NVML_ERROR_IN_USE)
        del gpu.gis[gi.id]
        self._record(f"destroy_gi {gpu.bus_id} {gi.id}")
        return int(_real.NVML_SUCCESS)

    # --- compute instances -------------------------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        _gpu, gi = self._gi(device)
        if not 0 <= profile < _real.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or engProfile != 0:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        slices = _CI_SLICES.get(profile)
        if slices is None or slices > gi.profile.compute:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        info = _real.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.name = f"MIG {slices}c.{gi.profile.name}".encode()
        info.id, info.sliceCount, info.instanceCount = profile, slices, gi.profile.compute // slices
        info.multiprocessorCount = gi.profile.sm * slices // gi.profile.compute
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        gpu, gi = self._gi(gpuInstance)
        self._require_root()
        slices = _CI_SLICES.get(profileId)
        if slices is None or slices > gi.profile.compute:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if sum(c.slices for c in gi.cis.values()) + slices > gi.profile.compute:
            raise self._err(_real.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in range(0, 64) if i not in gi.cis)
        ci = gi.cis[ci_id] = FakeCi(ci_id, profileId, slices)
        self._record(f"create_ci {gpu.bus_id} gi={gi.id} slices={slices}")
        return self._ci_handle(gpu, gi, ci)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        gpu, gi = self._gi(gpuInstance)
        found = [c for c in gi.cis.values() if c.profile_index == profileId]
        if len(computeInstancesRef) < len(found):
            raise self._err(_real.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            computeInstancesRef[i] = self._ci_handle(gpu, gi, ci)
        _deref(countRef).value = len(found)
        return int(_real.NVML_SUCCESS)

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        gi, ci = self._ci(computeInstance)
        self._require_root()
        if gi.processes:
            raise self._err(_real.NVML_ERROR_IN_USE)
        del gi.cis[ci.id]
        self._record(f"destroy_ci gi={gi.id} ci={ci.id}")
        return int(_real.NVML_SUCCESS)

    # --- monitoring (read-only) ----------------------------------------------------------------------------
    def _supported(self, gpu: FakeGpu, call: str) -> None:
        if call in gpu.unsupported:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)

    def _mig(self, handle: Any) -> tuple[FakeGpu, FakeGi] | None:
        """The GPU and GPU instance of a MIG device handle; None for any other handle."""
        self._check_init()
        a = _addr(handle)
        if (a >> 16) & 0xF != 3:
            return None
        dev, gi_id = a >> 20, a & 0xFFFF
        if not 1 <= dev <= len(self.gpus) or gi_id not in self.gpus[dev - 1].gis:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[dev - 1]
        return gpu, gpu.gis[gi_id]

    def _vgpu(self, instance: int) -> tuple[FakeGpu, FakeVgpu]:
        self._check_init()
        for gpu in self.gpus:
            for v in gpu.vgpus:
                if v.instance == int(instance):
                    return gpu, v
        raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        mig = self._mig(handle)
        if mig is not None:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetUtilizationRates")
        if gpu.mig_capable and gpu.mig_current == _real.NVML_DEVICE_MIG_ENABLE:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)  # "not currently supported" on MIG-enabled GPUs
        util = _real.c_nvmlUtilization_t()
        util.gpu, util.memory = gpu.util_gpu, gpu.util_mem
        return util

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetPowerUsage")
        return gpu.power_mw

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetTemperature")
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetActiveVgpus(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetActiveVgpus")
        return [v.instance for v in gpu.vgpus]

    def nvmlDeviceGetVgpuUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetVgpuUtilization")
        out = []
        for v in gpu.vgpus:
            s = _real.c_nvmlVgpuInstanceUtilizationSample_t()
            s.vgpuInstance, s.timeStamp = v.instance, int(timeStamp) + 1
            s.smUtil.uiVal, s.memUtil.uiVal, s.encUtil.uiVal, s.decUtil.uiVal = v.sm, v.mem, v.enc, v.dec
            out.append(s)
        return out

    def nvmlDeviceGetVgpuInstancesUtilizationInfo(self, handle: Any, timeStamp: int) -> list[Any]:
        gpu = self._gpu(handle)
        self._supported(gpu, "nvmlDeviceGetVgpuInstancesUtilizationInfo")
        out = []
        for v in gpu.vgpus:
            s = _real.c_nvmlVgpuInstanceUtilizationInfo_v1_t()
            s.vgpuInstance, s.timeStamp = v.instance, int(timeStamp) + 1
            s.smUtil.uiVal, s.memUtil.uiVal, s.encUtil.uiVal, s.decUtil.uiVal = v.sm, v.mem, v.enc, v.dec
            s.jpgUtil.uiVal, s.ofaUtil.uiVal = v.jpg, v.ofa
            out.append(s)
        return out

    def nvmlVgpuInstanceGetFbUsage(self, vgpuInstance: int) -> int:
        gpu, v = self._vgpu(vgpuInstance)
        self._supported(gpu, "nvmlVgpuInstanceGetFbUsage")
        return v.fb_usage

    def nvmlVgpuInstanceGetMdevUUID(self, vgpuInstance: int) -> str:
        gpu, v = self._vgpu(vgpuInstance)
        self._supported(gpu, "nvmlVgpuInstanceGetMdevUUID")
        return v.mdev_uuid

    def nvmlVgpuInstanceGetVmID(self, vgpuInstance: int) -> tuple[str, int]:
        gpu, v = self._vgpu(vgpuInstance)
        self._supported(gpu, "nvmlVgpuInstanceGetVmID")
        return v.vm_id, _real.NVML_VGPU_VM_ID_UUID

    def nvmlVgpuInstanceGetGpuInstanceId(self, vgpuInstance: int) -> int:
        gpu, v = self._vgpu(vgpuInstance)
        self._supported(gpu, "nvmlVgpuInstanceGetGpuInstanceId")
        return v.gpu_instance_id

    def nvmlVgpuInstanceGetType(self, vgpuInstance: int) -> int:
        _gpu, v = self._vgpu(vgpuInstance)
        return v.type_id

    def nvmlVgpuTypeGetName(self, vgpuTypeId: int) -> str:
        self._check_init()
        for gpu in self.gpus:
            for v in gpu.vgpus:
                if v.type_id == vgpuTypeId:
                    return v.type_name
        raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu(device)
        if not gpu.mig_capable:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu.model.max_gis

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._gpu(device)
        if not gpu.mig_capable or gpu.mig_current != _real.NVML_DEVICE_MIG_ENABLE:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        with_ci = [gi for _id, gi in sorted(gpu.gis.items()) if gi.cis]  # a MIG device is a GI's compute instance
        if not 0 <= index < len(with_ci):
            raise self._err(_real.NVML_ERROR_NOT_FOUND)
        addr = ((self._index(gpu) + 1) << 20) | (3 << 16) | with_ci[index].id
        return ctypes.cast(ctypes.c_void_p(addr), _real.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        mig = self._mig(device)
        if mig is None:
            self._gpu(device)
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)  # a physical GPU is not a MIG device
        return mig[1].id
