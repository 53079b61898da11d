"""MIG GPU instances through NVML (pynvml): discovery, and creation at explicit placements. Local to a host.

MIG mode itself is never changed here: an admin enables it (it may reset the GPU).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice

_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


class GpuInfo(TypedDict):
    """A physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # "0000:41:00.0"
    pci_device_id: str  # "0x2330"
    memory_mib: int
    mig_current: bool | None  # None: the GPU has no MIG
    mig_pending: bool | None


class GiProfileInfo(TypedDict):
    """A GPU-instance profile the GPU offers."""

    id: int
    name: str  # "3g.40gb"
    nvml_index: int
    slice_count: int  # compute slices
    memory_slices: int
    instance_count: int
    memory_mib: int
    sm_count: int
    placements: list[int]  # allowed starts on the memory-slice axis


class GiInfo(TypedDict):
    """An existing GPU instance."""

    id: int
    profile_id: int
    start: int
    size: int


def normalize_bus_id(bus_id: str | bytes) -> str:
    """A PCI address in the controller's form "0000:41:00.0", from NVML's "00000000:41:00.0" and the like."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    m = _BUS_ID.fullmatch(text.strip())
    if m is None:
        raise InvalidInput(f"not a PCI address: {text!r} (expected e.g. 0000:41:00.0)")
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlMig:
    """MIG GPU instances on this host's GPUs, through an NVML binding (the `pynvml` module by default)."""

    def __init__(self, nvml: ModuleType | Any = None, state_file: Path | None = None) -> None:
        self.state_file = state_file  # which controller device each GPU instance is (uuid -> gpu, profile, start)
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml

    # --- queries ---------------------------------------------------------------------------------------
    def gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees, with its PCI identity, memory and MIG mode."""
        n = self._nvml
        out: list[GpuInfo] = []
        with self._session("this host", "list GPUs"):
            for i in range(n.nvmlDeviceGetCount()):
                h = n.nvmlDeviceGetHandleByIndex(i)
                pci = n.nvmlDeviceGetPciInfo(h)
                try:
                    current, pending = n.nvmlDeviceGetMigMode(h)
                    mig: tuple[bool | None, bool | None] = (
                        current == n.NVML_DEVICE_MIG_ENABLE, pending == n.NVML_DEVICE_MIG_ENABLE)
                except n.NVMLError as exc:
                    if exc.value != n.NVML_ERROR_NOT_SUPPORTED:
                        raise
                    mig = (None, None)
                out.append(GpuInfo(
                    index=i, uuid=_text(n.nvmlDeviceGetUUID(h)), name=_text(n.nvmlDeviceGetName(h)),
                    pci_bus_id=normalize_bus_id(pci.busId), pci_device_id=f"0x{pci.pciDeviceId >> 16:04x}",
                    memory_mib=int(n.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
                    mig_current=mig[0], mig_pending=mig[1],
                ))
        return out

    def driver_version(self) -> str:
        """The NVIDIA host driver's version, as NVML reports it."""
        with self._session("this host", "read the driver version"):
            return _text(self._nvml.nvmlSystemGetDriverVersion())

    def gi_profiles(self, gpu_pci: str) -> list[GiProfileInfo]:
        """The GPU-instance profiles the GPU offers, with their allowed placements (MIG mode not required)."""
        gpu = normalize_bus_id(gpu_pci)
        with self._session(gpu, "list MIG profiles"):
            return self._profiles(self._device(gpu))

    def list_gis(self, gpu_pci: str) -> list[GiInfo]:
        """The GPU instances on the GPU, ordered by start (none when MIG mode is off)."""
        gpu = normalize_bus_id(gpu_pci)
        with self._session(gpu, "list MIG instances"):
            h = self._device(gpu)
            if not self._mig_enabled(h):
                return []
            return [info for _gi, info in self._gis(h)]

    # --- changes ---------------------------------------------------------------------------------------
    def create_gi(self, gpu_pci: str, profile_id: int, start: int) -> int:
        """Create a GPU instance of `profile_id` at memory slice `start`, with one compute instance using all
        of it; returns the GPU instance id."""
        gpu = normalize_bus_id(gpu_pci)
        with self._session(gpu, "create MIG instance"):
            h = self._device(gpu)
            self._require_mig(h, gpu)
            return self._create_gi(h, gpu, profile_id, start)

    def destroy_gi(self, gpu_pci: str, gi_id: int) -> None:
        """Destroy a GPU instance and its compute instances (idempotent: absent is fine)."""
        gpu = normalize_bus_id(gpu_pci)
        with self._session(gpu, f"destroy MIG instance {gi_id}"):
            h = self._device(gpu)
            if not self._mig_enabled(h):
                return
            found = next((gi for gi, info in self._gis(h) if info["id"] == gi_id), None)
            if found is not None:
                self._destroy(found)

    # --- DeviceBackend ---------------------------------------------------------------------------------
    def create(self, spec: DeviceSpec) -> DeviceHandle:
        """Make the spec's MIG instance exist at its start (idempotent: an instance of the same profile at the
        same start is reused, and given its compute instance if it lacks one)."""
        profile_id = self._spec_profile(spec)
        gpu = normalize_bus_id(spec.gpu_pci)
        with self._session(gpu, f"create MIG instance for device {spec.device_id}"):
            h = self._device(gpu)
            self._require_mig(h, gpu)
            found = next((info["id"] for gi, info in self._gis(h)
                          if info["profile_id"] == profile_id and info["start"] == spec.start), None)
            if found is not None:
                gi = next(g for g, info in self._gis(h) if info["id"] == found)
                if not self._cis(gi):
                    self._create_full_ci(gi, self._slices(h, profile_id))
                gi_id = found
            else:
                gi_id = self._create_gi(h, gpu, profile_id, spec.start)
        self._remember(spec.uuid, {"gpu": gpu, "profile_id": profile_id, "start": spec.start})
        return DeviceHandle(backing=DeviceBacking.MIG, gpu_instance_id=gi_id)

    def remove(self, spec: DeviceSpec) -> None:
        """Destroy the spec's MIG instance, found by profile and start (idempotent: absent is fine)."""
        profile_id = self._spec_profile(spec)
        gpu = normalize_bus_id(spec.gpu_pci)
        with self._session(gpu, f"remove MIG instance of device {spec.device_id}"):
            h = self._device(gpu)
            if self._mig_enabled(h):
                for gi, info in self._gis(h):
                    if info["profile_id"] == profile_id and info["start"] == spec.start:
                        self._destroy(gi)
        self._remember(spec.uuid, None)

    def _state(self) -> dict[str, Any]:
        if self.state_file is None:
            return {}
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise HostError(f"cannot read the MIG state file {self.state_file}: {exc}") from None
        return dict(data) if isinstance(data, dict) else {}

    def _remember(self, uuid: str, entry: dict[str, Any] | None) -> None:
        """Record (or with None forget) which GPU instance the controller's device `uuid` is."""
        if self.state_file is None:
            return
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            with self.state_file.with_name(self.state_file.name + ".lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                state = self._state()
                if entry is None:
                    state.pop(uuid, None)
                else:
                    state[uuid] = entry
                fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=self.state_file.name + ".")
                with os.fdopen(fd, "w") as fh:
                    json.dump(state, fh, indent=2, sort_keys=True)
                os.replace(tmp, self.state_file)
        except OSError as exc:
            raise HostError(f"cannot write the MIG state file {self.state_file}: {exc.strerror or exc}") from None

    def list_devices(self) -> list[HostDevice]:
        """Every GPU instance on every MIG-enabled GPU of the host, with its profile name and the controller's
        uuid where this backend made it (none on a host without the NVIDIA driver: no instance can exist)."""
        out: list[HostDevice] = []
        uuids = {(e["gpu"], e["profile_id"], e["start"]): u for u, e in self._state().items()}
        n = self._nvml
        try:
            gpus = self.gpus()
        except HostError as exc:
            absent = (n.NVML_ERROR_DRIVER_NOT_LOADED, n.NVML_ERROR_LIBRARY_NOT_FOUND)
            if any(r.get("nvml_error") in absent for r in exc.reasons):
                return []
            raise
        for g in gpus:
            if not g["mig_current"]:
                continue
            gpu = g["pci_bus_id"]
            with self._session(gpu, "list MIG instances"):
                h = self._device(gpu)
                names = {p["id"]: p["name"] for p in self._profiles(h)}
                out.extend(
                    HostDevice(backing=DeviceBacking.MIG, gpu_pci=gpu, gpu_instance_id=info["id"],
                               profile=names.get(info["profile_id"]),
                               uuid=uuids.get((gpu, info["profile_id"], info["start"])))
                    for _gi, info in self._gis(h)
                )
        return out

    # --- internals -------------------------------------------------------------------------------------
    @contextmanager
    def _session(self, gpu: str, action: str) -> Iterator[None]:
        n = self._nvml
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            raise self._error(exc, gpu, action) from None
        try:
            yield
        except n.NVMLError as exc:
            raise self._error(exc, gpu, action) from None
        finally:
            with suppress(n.NVMLError):
                n.nvmlShutdown()

    def _error(self, exc: Any, gpu: str, action: str, placement: str | None = None) -> HostError:
        n = self._nvml
        code = getattr(exc, "value", None)
        if code == n.NVML_ERROR_INSUFFICIENT_RESOURCES and placement is not None:
            text = f"MIG placement {placement} on {gpu} overlaps an existing instance or exceeds capacity"
        elif code == n.NVML_ERROR_IN_USE:
            text = f"{action} on {gpu}: instance in use by processes or compute instances"
        elif code == n.NVML_ERROR_NO_PERMISSION:
            text = f"{action} on {gpu}: needs root"
        elif code == n.NVML_ERROR_NOT_SUPPORTED:
            text = f"{action} on {gpu}: MIG not supported on this GPU"
        elif code in (n.NVML_ERROR_DRIVER_NOT_LOADED, n.NVML_ERROR_LIBRARY_NOT_FOUND):
            text = f"{action} on {gpu}: NVIDIA driver not loaded (NVML unavailable)"
        else:
            text = f"{action} on {gpu} failed: NVML error {code} ({exc})"
        return HostError(text, reasons=[{"gpu": gpu, "action": action, "nvml_error": code,
                                         "placement": placement}])

    def _device(self, gpu: str) -> Any:
        n = self._nvml
        try:
            return n.nvmlDeviceGetHandleByPciBusId(gpu)
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_NOT_FOUND:
                raise HostError(f"GPU {gpu} not found by NVML on this host") from None
            raise

    def _mig_enabled(self, h: Any) -> bool:
        n = self._nvml
        try:
            return bool(n.nvmlDeviceGetMigMode(h)[0] == n.NVML_DEVICE_MIG_ENABLE)
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_NOT_SUPPORTED:
                return False
            raise

    def _require_mig(self, h: Any, gpu: str) -> None:
        n = self._nvml
        try:
            current, pending = n.nvmlDeviceGetMigMode(h)
        except n.NVMLError as exc:
            if exc.value == n.NVML_ERROR_NOT_SUPPORTED:
                raise HostError(f"GPU {gpu}: MIG not supported on this GPU") from None
            raise
        if current != n.NVML_DEVICE_MIG_ENABLE:
            hint = (" (it is pending: reset the GPU or reboot to apply it)"
                    if pending == n.NVML_DEVICE_MIG_ENABLE
                    else f"; an admin must enable it: nvidia-smi -i {gpu} -mig 1")
            raise HostError(f"MIG mode is not enabled on GPU {gpu}{hint}; vgpu-ctl never changes MIG mode",
                            reasons=[{"gpu": gpu, "mig_current": current, "mig_pending": pending}])

    def _profiles(self, h: Any) -> list[GiProfileInfo]:
        n = self._nvml
        out: list[GiProfileInfo] = []
        for idx in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except n.NVMLError as exc:
                if exc.value in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            placements = self._placements(h, int(info.id))
            out.append(GiProfileInfo(
                id=int(info.id), name=_text(info.name).removeprefix("MIG "), nvml_index=idx,
                slice_count=int(info.sliceCount), memory_slices=placements[0][1] if placements else 0,
                instance_count=int(info.instanceCount), memory_mib=int(info.memorySizeMB),
                sm_count=int(info.multiprocessorCount), placements=[start for start, _size in placements],
            ))
        return out

    def _placements(self, h: Any, profile_id: int) -> list[tuple[int, int]]:
        n = self._nvml
        count = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
        if count.value == 0:
            return []
        array = (n.c_nvmlGpuInstancePlacement_t * count.value)()
        n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, array, ctypes.byref(count))
        return [(int(array[i].start), int(array[i].size)) for i in range(count.value)]

    def _gis(self, h: Any) -> list[tuple[Any, GiInfo]]:
        n = self._nvml
        out: list[tuple[Any, GiInfo]] = []
        for p in self._profiles(h):
            if p["instance_count"] == 0:
                continue
            array = (n.c_nvmlGpuInstance_t * p["instance_count"])()
            count = ctypes.c_uint(0)
            n.nvmlDeviceGetGpuInstances(h, p["id"], array, ctypes.byref(count))
            for i in range(count.value):
                info = n.nvmlGpuInstanceGetInfo(array[i])
                out.append((array[i], GiInfo(id=int(info.id), profile_id=int(info.profileId),
                                             start=int(info.placement.start), size=int(info.placement.size))))
        return sorted(out, key=lambda pair: pair[1]["start"])

    def _slices(self, h: Any, profile_id: int) -> int:
        return next(p["slice_count"] for p in self._profiles(h) if p["id"] == profile_id)

    def _create_gi(self, h: Any, gpu: str, profile_id: int, start: int) -> int:
        n = self._nvml
        profile = next((p for p in self._profiles(h) if p["id"] == profile_id), None)
        if profile is None:
            known = ", ".join(f"{p['name']} (id {p['id']})" for p in self._profiles(h))
            raise InvalidInput(f"GPU {gpu} has no MIG profile id {profile_id}; it offers: {known}")
        where = f"{profile['name']}@{start}"
        if start not in profile["placements"]:
            starts = ", ".join(map(str, profile["placements"]))
            raise InvalidInput(f"MIG placement {where} on {gpu} is not allowed: {profile['name']} can "
                               f"start at {starts}")
        placement = n.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, profile["memory_slices"]
        try:
            gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, ctypes.byref(placement))
        except n.NVMLError as exc:
            raise self._error(exc, gpu, f"create MIG instance {where}", where) from None
        try:
            self._create_full_ci(gi, profile["slice_count"])
        except (n.NVMLError, HostError) as exc:
            with suppress(n.NVMLError):
                n.nvmlGpuInstanceDestroy(gi)
            if isinstance(exc, HostError):
                raise
            raise self._error(exc, gpu, f"create compute instance on MIG instance {where}") from None
        return int(n.nvmlGpuInstanceGetInfo(gi).id)

    def _ci_profiles(self, gi: Any) -> list[Any]:
        n = self._nvml
        out: list[Any] = []
        for idx in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                out.append(n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, idx, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED))
            except n.NVMLError as exc:
                if exc.value not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    raise
        return out

    def _create_full_ci(self, gi: Any, slices: int) -> None:
        n = self._nvml
        info = next((p for p in self._ci_profiles(gi) if p.sliceCount == slices), None)
        if info is None:
            raise HostError(f"no compute-instance profile spans all {slices} compute slices of the MIG "
                            "instance")
        n.nvmlGpuInstanceCreateComputeInstance(gi, info.id)

    def _cis(self, gi: Any) -> list[Any]:
        n = self._nvml
        out: list[Any] = []
        for p in self._ci_profiles(gi):
            array = (n.c_nvmlComputeInstance_t * max(int(p.instanceCount), 1))()
            count = ctypes.c_uint(0)
            n.nvmlGpuInstanceGetComputeInstances(gi, p.id, array, ctypes.byref(count))
            out.extend(array[i] for i in range(count.value))
        return out

    def _destroy(self, gi: Any) -> None:
        n = self._nvml
        for ci in self._cis(gi):
            n.nvmlComputeInstanceDestroy(ci)
        n.nvmlGpuInstanceDestroy(gi)

    @staticmethod
    def _spec_profile(spec: DeviceSpec) -> int:
        if spec.mig_profile_id is None:
            raise InvalidInput(f"device {spec.device_id}: a MIG device needs mig_profile_id "
                               "(the NVML GPU-instance profile id)")
        return spec.mig_profile_id
