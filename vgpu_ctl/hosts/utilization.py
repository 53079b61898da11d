"""What the GPUs of this host really do, read from NVML (pynvml) and the kernel log. Local to a GPU host; the
controller asks for it through the host agent (`utilization`, a read-only call).

Per vGPU: `nvmlDeviceGetVgpuInstancesUtilizationInfo` (sm, memory, encoder, decoder, jpeg, ofa), falling back to
`nvmlDeviceGetVgpuUtilization` (sm, memory, encoder, decoder) where the driver lacks it, and
`nvmlVgpuInstanceGetFbUsage`; its identity from `nvmlVgpuInstanceGetMdevUUID`, `nvmlVgpuInstanceGetVmID` and
`nvmlVgpuInstanceGetGpuInstanceId` (MIG-backed vGPUs). Per MIG instance: what NVML gives for its MIG device
(framebuffer; utilization is not supported there). Per GPU: utilization, framebuffer, power, temperature, and the
XID errors the NVIDIA driver logged (`NVRM: Xid (PCI:...)` lines of the kernel log).

Every call only reads. A call the GPU or driver does not support (NVML_ERROR_NOT_SUPPORTED, or a function the
driver lacks) leaves that value None: a metric missing, not a failed sample.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from vgpu_ctl.errors import HostError

T = TypeVar("T")
PERCENT = 100.0
INVALID_GI = 0xFFFFFFFF  # nvmlVgpuInstanceGetGpuInstanceId of a time-sliced vGPU
DEFAULT_KMSG = Path("/dev/kmsg")
# "NVRM: Xid (PCI:0000:41:00): 79, pid=..., GPU has fallen off the bus."
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?\): (\d+)")
_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


@dataclass
class VgpuSample:
    """One vGPU instance as NVML sees it on the host. Ratios are 0..1; None: not supported here."""

    gpu_pci: str
    gpu_uuid: str
    instance: int  # NVML's vGPU instance id
    mdev_uuid: str | None = None  # the mdev uuid (the controller's device uuid), or None on vendor-VFIO
    vm_id: str | None = None  # the VM's domain UUID (or domain id, see vm_id_type)
    vm_id_type: str | None = None  # "uuid" or "domain-id"
    gpu_instance_id: int | None = None  # the GPU instance of a MIG-backed vGPU
    vgpu_type: str | None = None  # NVML's type name ("NVIDIA A100D-10C")
    sm: float | None = None
    memory: float | None = None
    encoder: float | None = None
    decoder: float | None = None
    jpeg: float | None = None
    ofa: float | None = None
    fb_used_bytes: int | None = None


@dataclass
class MigSample:
    """One MIG device (a GPU instance with its compute instance) on a GPU in MIG mode."""

    gpu_pci: str
    gpu_uuid: str
    gpu_instance_id: int
    profile: str | None = None  # "3g.40gb"
    uuid: str | None = None
    fb_used_bytes: int | None = None
    fb_total_bytes: int | None = None
    utilization: float | None = None  # NVML: not supported on MIG devices; None then


@dataclass
class GpuSample:
    """One physical GPU."""

    pci: str
    uuid: str
    index: int
    name: str
    mig: bool = False
    utilization: float | None = None  # not supported on a GPU in MIG mode
    memory_utilization: float | None = None
    fb_used_bytes: int | None = None
    fb_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_c: float | None = None
    xid_errors: int | None = None  # XID lines in the kernel log for this GPU (None: the log can't be read)
    last_xid: int | None = None  # the last XID code logged (0: none)


@dataclass
class HostSample:
    """Everything one sampling of a host read, and what it could not read."""

    time: float
    gpus: list[GpuSample] = field(default_factory=list)
    vgpus: list[VgpuSample] = field(default_factory=list)
    migs: list[MigSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the agent's answer)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSample:
        """Inverse of to_dict."""
        return cls(float(data["time"]), [GpuSample(**g) for g in data.get("gpus", [])],
                   [VgpuSample(**v) for v in data.get("vgpus", [])], [MigSample(**m) for m in data.get("migs", [])],
                   [str(n) for n in data.get("notes", [])])


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus(text: str | bytes) -> str:
    """The controller's PCI form "0000:41:00.0" from NVML's "00000000:41:00.0"."""
    raw = _text(text).strip()
    m = _BUS_ID.fullmatch(raw)
    if m is None:
        return raw.lower()
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def _ratio(value: Any) -> float:
    """A vGPU utilization sample value (NVML: unsigned int percent) as a ratio."""
    return float(getattr(value, "uiVal", value)) / PERCENT


class _Reader:
    """NVML calls with NOT_SUPPORTED (and functions missing from the driver) turned into None."""

    def __init__(self, nvml: Any) -> None:
        self.n = nvml
        self.skip = {int(nvml.NVML_ERROR_NOT_SUPPORTED), int(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)}

    def get(self, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`, or None where NVML answers that it is not supported (other errors are raised)."""
        try:
            return fn(*args)
        except self.n.NVMLError as exc:
            if exc.value in self.skip:
                return None
            raise


def read_xids(path: Path = DEFAULT_KMSG) -> dict[str, list[int]] | None:
    """The XID codes the NVIDIA driver logged, per GPU (PCI "0000:41:00.0"), in the order logged; None when the
    log can't be read (not root, no such file). Reads /dev/kmsg without blocking, or a plain file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break  # /dev/kmsg: no more records now
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten while reading; go on
                    continue
                if exc.errno == errno.EINVAL:  # the buffer is too small for the record: not ours to read
                    break
                return None
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    out: dict[str, list[int]] = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        m = _XID.search(line)
        if m:
            out.setdefault(_bus(m.group(1) + ".0"), []).append(int(m.group(2)))
    return out


def _vgpu_utilization(r: _Reader, h: Any) -> dict[int, dict[str, float]]:
    """Per vGPU instance on the GPU, its utilization ratios (v1 info with jpeg/ofa where the driver has it)."""
    n = r.n
    out: dict[int, dict[str, float]] = {}
    info = None
    if hasattr(n, "nvmlDeviceGetVgpuInstancesUtilizationInfo"):
        try:
            info = r.get(n.nvmlDeviceGetVgpuInstancesUtilizationInfo, h, 0)
        except n.NVMLError as exc:
            # a driver older than the struct's version answers VERSION_MISMATCH: use the older call below
            if exc.value != getattr(n, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25):
                raise
    if info is not None:
        for s in info:
            out[int(s.vgpuInstance)] = {"sm": _ratio(s.smUtil), "memory": _ratio(s.memUtil),
                                        "encoder": _ratio(s.encUtil), "decoder": _ratio(s.decUtil),
                                        "jpeg": _ratio(s.jpgUtil), "ofa": _ratio(s.ofaUtil)}
        return out
    samples = r.get(n.nvmlDeviceGetVgpuUtilization, h, 0)
    for s in samples or []:
        out[int(s.vgpuInstance)] = {"sm": _ratio(s.smUtil), "memory": _ratio(s.memUtil),
                                    "encoder": _ratio(s.encUtil), "decoder": _ratio(s.decUtil)}
    return out


def _vgpus(r: _Reader, h: Any, gpu: GpuSample) -> list[VgpuSample]:
    n = r.n
    active = r.get(n.nvmlDeviceGetActiveVgpus, h)
    if not active:
        return []
    util = _vgpu_utilization(r, h)
    out = []
    for raw in active:
        inst = int(getattr(raw, "value", raw))
        v = VgpuSample(gpu.pci, gpu.uuid, inst)
        mdev = r.get(n.nvmlVgpuInstanceGetMdevUUID, inst)
        v.mdev_uuid = _text(mdev).lower() if mdev else None
        vm = r.get(n.nvmlVgpuInstanceGetVmID, inst)
        if vm is not None:
            vm_id, kind = vm
            v.vm_id = _text(vm_id).lower() or None
            v.vm_id_type = "uuid" if kind == getattr(n, "NVML_VGPU_VM_ID_UUID", 1) else "domain-id"
        gi = r.get(n.nvmlVgpuInstanceGetGpuInstanceId, inst) \
            if hasattr(n, "nvmlVgpuInstanceGetGpuInstanceId") else None
        v.gpu_instance_id = None if gi is None or gi == INVALID_GI else int(gi)
        type_id = r.get(n.nvmlVgpuInstanceGetType, inst)
        if type_id is not None:
            name = r.get(n.nvmlVgpuTypeGetName, type_id)
            v.vgpu_type = _text(name) if name is not None else None
        fb = r.get(n.nvmlVgpuInstanceGetFbUsage, inst)
        v.fb_used_bytes = None if fb is None else int(fb)
        for key, value in util.get(inst, {}).items():
            setattr(v, key, value)
        out.append(v)
    return out


def _migs(r: _Reader, h: Any, gpu: GpuSample) -> list[MigSample]:
    n = r.n
    most = r.get(n.nvmlDeviceGetMaxMigDeviceCount, h) or 0
    out = []
    for i in range(int(most)):
        try:
            mh = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except n.NVMLError as exc:
            if exc.value in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_INVALID_ARGUMENT, *r.skip):
                continue  # no MIG device at this index
            raise
        gi_id = r.get(n.nvmlDeviceGetGpuInstanceId, mh)
        if gi_id is None:
            continue
        m = MigSample(gpu.pci, gpu.uuid, int(gi_id))
        uuid = r.get(n.nvmlDeviceGetUUID, mh)
        m.uuid = _text(uuid) if uuid is not None else None
        mem = r.get(n.nvmlDeviceGetMemoryInfo, mh)
        if mem is not None:
            m.fb_used_bytes, m.fb_total_bytes = int(mem.used), int(mem.total)
        rates = r.get(n.nvmlDeviceGetUtilizationRates, mh)
        m.utilization = None if rates is None else rates.gpu / PERCENT
        m.profile = _mig_profile(r, h, int(gi_id))
        out.append(m)
    return out


def _mig_profile(r: _Reader, h: Any, gi_id: int) -> str | None:
    """The GPU-instance profile name ("3g.40gb") of the GPU instance `gi_id`, from the GPU's profile table."""
    n = r.n
    for index in range(int(n.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
        except n.NVMLError:
            continue
        count = ctypes.c_uint(0)
        found = (n.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
        try:
            n.nvmlDeviceGetGpuInstances(h, info.id, found, ctypes.byref(count))
        except n.NVMLError:
            continue
        for gi in found[:count.value]:
            if int(n.nvmlGpuInstanceGetInfo(gi).id) == gi_id:
                return _text(info.name).removeprefix("MIG ") if getattr(info, "name", b"") else None
    return None


def _gpu(r: _Reader, i: int, xids: dict[str, list[int]] | None) -> tuple[Any, GpuSample]:
    n = r.n
    h = n.nvmlDeviceGetHandleByIndex(i)
    pci = _bus(n.nvmlDeviceGetPciInfo(h).busId)
    g = GpuSample(pci, _text(n.nvmlDeviceGetUUID(h)), i, _text(n.nvmlDeviceGetName(h)))
    mode = r.get(n.nvmlDeviceGetMigMode, h)
    g.mig = mode is not None and mode[0] == n.NVML_DEVICE_MIG_ENABLE
    rates = r.get(n.nvmlDeviceGetUtilizationRates, h)
    if rates is not None:
        g.utilization, g.memory_utilization = rates.gpu / PERCENT, rates.memory / PERCENT
    mem = r.get(n.nvmlDeviceGetMemoryInfo, h)
    if mem is not None:
        g.fb_used_bytes, g.fb_total_bytes = int(mem.used), int(mem.total)
    power = r.get(n.nvmlDeviceGetPowerUsage, h)
    g.power_watts = None if power is None else power / 1000.0
    temp = r.get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
    g.temperature_c = None if temp is None else float(temp)
    if xids is not None:
        codes = xids.get(pci, [])
        g.xid_errors, g.last_xid = len(codes), codes[-1] if codes else 0
    return h, g


def sample(nvml: ModuleType | Any = None, kmsg: Path | None = DEFAULT_KMSG,
           clock: Callable[[], float] = time.time) -> HostSample:
    """Read every GPU of this host once (NVML opened and closed around it). HostError when NVML can't be
    opened; a GPU that fails midway is left out with a note, the others are still read. `kmsg`: where the
    kernel log is read for XID errors (None: not read)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            raise HostError(f"NVML: pynvml is not installed: {exc}") from None
        nvml = pynvml
    n = nvml
    out = HostSample(clock())
    try:
        n.nvmlInit()
    except n.NVMLError as exc:
        raise HostError(f"NVML: cannot initialise ({exc}); is the NVIDIA host driver loaded?") from None
    try:
        r = _Reader(n)
        xids = read_xids(kmsg) if kmsg is not None else None
        if kmsg is not None and xids is None:
            out.notes.append(f"XID errors: cannot read {kmsg} (root needed)")
        for i in range(n.nvmlDeviceGetCount()):
            try:
                h, g = _gpu(r, i, xids)
                out.gpus.append(g)
                out.vgpus += _vgpus(r, h, g)
                if g.mig:
                    out.migs += _migs(r, h, g)
            except n.NVMLError as exc:
                out.notes.append(f"NVML on GPU {i}: {exc}")
    finally:
        with suppress(n.NVMLError):
            n.nvmlShutdown()
    return out


def sample_side(side: Any) -> HostSample:
    """Sample the host a HostSide stands for: through its agent where it has one (`utilization()`), else in this
    process with the side's NVML binding (LocalHostSide's, pynvml by default) and its /dev (for the kernel log)."""
    through_agent = getattr(side, "utilization", None)
    if callable(through_agent):
        got = through_agent()
        if not isinstance(got, HostSample):
            raise HostError(f"the host agent answered a utilization sample of type {type(got).__name__}")
        return got
    # LocalHostSide keeps its binding private (None: pynvml); its dev_root is where /dev/kmsg is
    nvml = getattr(side, "_nvml", None)
    dev_root = getattr(side, "dev_root", Path("/dev"))
    return sample(nvml, kmsg=Path(dev_root) / "kmsg")
