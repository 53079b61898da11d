"""Real utilization of the fleet: each GPU host's NVML sample (hosts.utilization, through the host agent) joined
with the store, so every vGPU carries its device (claim), VM, tenant and pool; and idle-vGPU detection.

The join: a vGPU's mdev uuid is the store device's uuid; where NVML gives no mdev (vendor-VFIO VFs), the VM's
domain UUID (`nvmlVgpuInstanceGetVmID`) and the GPU pick the device. A MIG instance is the device on its GPU
whose handle names its GPU-instance id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.placement_types import Policy
from vgpu_ctl.core.policies.spread_load import make_with_load
from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.utilization import HostSample, sample_side
from vgpu_ctl.service.ports import STORE

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

DEFAULT_IDLE_THRESHOLD = 0.05  # a vGPU whose busiest engine is below 5 % ...
DEFAULT_IDLE_FOR_S = 1800.0  # ... for 30 minutes is idle
MAX_IDLE_FOR_S = 366 * 86400.0
SAMPLE_WORKERS = 16  # hosts sampled at once (each an SSH session to its agent)
ALLOCATED = ("claimed", "ready")  # device states that hold GPU space

# A sampler reads one host row (name, uri, driver, ...): its sample, or None when it has nothing to read there.
Sampler = Callable[[Any], HostSample | None]


def check_idle_threshold(value: object, field_name: str = "idle_threshold") -> float:
    """A utilization ratio in [0, 1] (0.05 = 5 %); InvalidInput naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise InvalidInput(f"{field_name} must be a utilization ratio from 0 to 1 (0.05 = 5 %), got {value!r}",
                           reasons=[{"field": field_name, "value": repr(value)}])
    return float(value)


def check_idle_for(value: object, field_name: str = "idle_for") -> float:
    """A duration in seconds from 0 to a year; InvalidInput naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= MAX_IDLE_FOR_S:
        raise InvalidInput(f"{field_name} must be seconds from 0 to {MAX_IDLE_FOR_S:.0f}, got {value!r}",
                           reasons=[{"field": field_name, "value": repr(value)}])
    return float(value)


@dataclass
class GpuUsage:
    """A physical GPU's sample, with where it sits in the store."""

    host: str
    pci: str
    uuid: str
    index: int
    name: str
    model: str | None = None
    pool: str | None = None
    gpu_id: int | None = None
    mig: bool = False
    utilization: float | None = None
    memory_utilization: float | None = None
    fb_used_bytes: int | None = None
    fb_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_c: float | None = None
    xid_errors: int | None = None
    last_xid: int | None = None


@dataclass
class VgpuUsage:
    """A vGPU's (or MIG instance's) sample, attributed: its device (the claim), VM, tenant and pool. `device` is
    None for a vGPU the store does not know (made outside the controller)."""

    host: str
    gpu_pci: str
    gpu_uuid: str
    gpu_index: int
    kind: str  # "vgpu" or "mig"
    device: str | None = None
    uuid: str | None = None  # mdev uuid (vGPU) or MIG device uuid
    profile: str | None = None
    vm: str | None = None
    vm_id: str | None = None
    tenant: str | None = None
    pool: str | None = None
    gpu_instance_id: int | None = None
    gpu_instance_profile: str | None = None
    sm: float | None = None
    memory: float | None = None
    encoder: float | None = None
    decoder: float | None = None
    jpeg: float | None = None
    ofa: float | None = None
    fb_used_bytes: int | None = None
    fb_total_bytes: int | None = None

    @property
    def busiest(self) -> float | None:
        """The utilization of its busiest engine (None: NVML gives none for it)."""
        values = [v for v in (self.sm, self.memory, self.encoder, self.decoder, self.jpeg, self.ofa)
                  if v is not None]
        return max(values) if values else None


@dataclass
class FleetUsage:
    """One round of samples over the fleet, joined with the store."""

    time: float
    gpus: list[GpuUsage] = field(default_factory=list)
    vgpus: list[VgpuUsage] = field(default_factory=list)
    hosts: dict[str, str | None] = field(default_factory=dict)  # host -> None (sampled) or why not
    notes: list[str] = field(default_factory=list)
    # allocated store devices on sampled hosts that NVML showed no vGPU for: device -> (vm state, VgpuUsage)
    unseen: dict[str, tuple[str, VgpuUsage]] = field(default_factory=dict)


def default_sampler(ctl: Controller) -> Sampler:
    """Sample each libvirt host through its agent (in process for a local URI, over SSH otherwise); simulated
    hosts have no GPUs to read and are skipped."""
    def read(host: Any) -> HostSample | None:
        """The host's sample through its agent; None for a simulated host."""
        if host.driver == "simulated":
            return None
        return sample_side(ctl.hosts.side(host))
    return read


def sample_hosts(ctl: Controller, sampler: Sampler | None = None, hosts: Iterable[str] | None = None,
                 workers: int = SAMPLE_WORKERS) -> tuple[dict[str, HostSample], dict[str, str | None]]:
    """Each host's sample (admin or reader), read from up to `workers` hosts at once, and per host None
    (sampled) or why it was not: a HostError (NVML missing, agent unreachable) is that host's note, never the
    round's failure."""
    ctl.principal.require_reader("utilization")
    read = sampler or default_sampler(ctl)
    wanted = None if hosts is None else set(hosts)
    with ctl.read() as conn:
        rows = [r for r in STORE.hosts.host_rows(conn) if wanted is None or r.name in wanted]

    def one(row: Any) -> HostSample | str:
        """The host's sample, or why there is none."""
        try:
            got = read(row)
        except HostError as exc:
            return exc.message
        if got is None:
            return "simulated host: no GPUs to sample" if row.driver == "simulated" else "not sampled"
        return got

    if len(rows) > 1 and workers > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(rows)), thread_name_prefix="vgpu-sample") as pool:
            results = list(pool.map(one, rows))
    else:
        results = [one(r) for r in rows]
    out: dict[str, HostSample] = {}
    status: dict[str, str | None] = {}
    for row, got in zip(rows, results, strict=True):
        if isinstance(got, HostSample):
            out[row.name] = got
            status[row.name] = None
        else:
            status[row.name] = got
    return out, status


def fleet_usage(ctl: Controller, samples: Mapping[str, HostSample], now: float | None = None,
                hosts: Mapping[str, str | None] | None = None) -> FleetUsage:
    """Join host samples with the store: GPUs to their pool, vGPUs and MIG instances to their device, VM,
    tenant and pool (admin or reader: it shows every tenant's VMs)."""
    ctl.principal.require_reader("utilization")
    times = [s.time for s in samples.values()]
    out = FleetUsage(now if now is not None else (max(times) if times else 0.0), hosts=dict(hosts or {}))
    if not samples:
        return out
    with ctl.read() as conn:
        gpu_rows = STORE.utilization.gpus_on_hosts(conn, list(samples))
        dev_rows = STORE.utilization.devices_on_gpus(conn, [g.id for g in gpu_rows])
    gpu_at = {(g.host, g.pci_address.lower()): g for g in gpu_rows}
    gpu_by_id = {g.id: g for g in gpu_rows}
    by_uuid = {str(d.uuid).lower(): d for d in dev_rows if d.uuid}
    by_domain: dict[tuple[int, str], list[Any]] = {}
    by_gi: dict[tuple[int, int], Any] = {}
    for d in dev_rows:
        if d.domain_uuid:
            by_domain.setdefault((d.gpu_id, str(d.domain_uuid).lower()), []).append(d)
        gi = (d.handle or {}).get("gpu_instance_id")
        if gi is not None:
            by_gi[(d.gpu_id, int(gi))] = d
    seen: set[str] = set()
    for host, s in sorted(samples.items()):
        out.notes += [f"{host}: {n}" for n in s.notes]
        index_of: dict[str, int] = {}
        for g in s.gpus:
            row = gpu_at.get((host, g.pci.lower()))
            index_of[g.pci] = g.index
            out.gpus.append(GpuUsage(host, g.pci, g.uuid, g.index, g.name, row.model if row else None,
                                     row.pool if row else None, row.id if row else None, g.mig, g.utilization,
                                     g.memory_utilization, g.fb_used_bytes, g.fb_total_bytes, g.power_watts,
                                     g.temperature_c, g.xid_errors, g.last_xid))
        gi_profiles = {(m.gpu_pci, m.gpu_instance_id): m.profile for m in s.migs}
        for v in s.vgpus:
            row = gpu_at.get((host, v.gpu_pci.lower()))
            dev = by_uuid.get(v.mdev_uuid or "")
            if dev is None and row is not None and v.vm_id and v.vm_id_type == "uuid":
                mine = by_domain.get((row.id, v.vm_id), [])
                dev = mine[0] if len(mine) == 1 else None
            u = VgpuUsage(host, v.gpu_pci, v.gpu_uuid, index_of.get(v.gpu_pci, -1), "vgpu", uuid=v.mdev_uuid,
                          pool=row.pool if row else None, gpu_instance_id=v.gpu_instance_id,
                          gpu_instance_profile=gi_profiles.get((v.gpu_pci, v.gpu_instance_id))
                          if v.gpu_instance_id is not None else None,
                          sm=v.sm, memory=v.memory, encoder=v.encoder, decoder=v.decoder, jpeg=v.jpeg, ofa=v.ofa,
                          fb_used_bytes=v.fb_used_bytes)
            _attribute(u, dev, gpu_by_id)
            if dev is not None:
                seen.add(dev.id)
            out.vgpus.append(u)
        for m in s.migs:
            row = gpu_at.get((host, m.gpu_pci.lower()))
            dev = by_gi.get((row.id, m.gpu_instance_id)) if row is not None else None
            if dev is not None and dev.id in seen:
                continue  # a MIG-backed vGPU: its vGPU row already carries it
            u = VgpuUsage(host, m.gpu_pci, m.gpu_uuid, index_of.get(m.gpu_pci, -1), "mig", uuid=m.uuid,
                          pool=row.pool if row else None, gpu_instance_id=m.gpu_instance_id,
                          gpu_instance_profile=m.profile, fb_used_bytes=m.fb_used_bytes,
                          fb_total_bytes=m.fb_total_bytes, sm=m.utilization)
            _attribute(u, dev, gpu_by_id)
            if dev is not None:
                seen.add(dev.id)
            out.vgpus.append(u)
    for d in dev_rows:
        if d.id in seen or d.state not in ALLOCATED or d.backing == "passthrough":
            continue  # passthrough: the host can't see into the GPU
        at = gpu_by_id[d.gpu_id]
        u = VgpuUsage(at.host, at.pci_address, "", -1, "vgpu", uuid=d.uuid, pool=at.pool)
        _attribute(u, d, gpu_by_id)
        out.unseen[d.id] = (str(d.vm_state), u)
    return out


def _attribute(u: VgpuUsage, dev: Any, gpus: Mapping[int, Any]) -> None:
    if dev is None:
        return
    u.device, u.profile, u.vm, u.vm_id, u.tenant = dev.id, dev.profile, dev.vm, dev.vm_id, dev.tenant
    u.pool = gpus[dev.gpu_id].pool
    if u.fb_total_bytes is None:
        u.fb_total_bytes = int(dev.framebuffer_mib) * 2**20


def collect_usage(ctl: Controller, sampler: Sampler | None = None, hosts: Iterable[str] | None = None,
                  now: float | None = None) -> FleetUsage:
    """Sample the hosts (or those named) and join the samples with the store, in one call."""
    samples, status = sample_hosts(ctl, sampler, hosts)
    return fleet_usage(ctl, samples, now, status)


def load_by_gpu(usage: FleetUsage) -> dict[int, float]:
    """Measured load per store GPU id, 0..1: the GPU's own utilization where NVML gives it, else (MIG mode, or
    unsupported) the largest of its vGPUs' and instances' busiest engines; GPUs NVML saw nothing on: 0."""
    out: dict[int, float] = {}
    by_gpu: dict[tuple[str, str], list[float]] = {}
    for v in usage.vgpus:
        b = v.busiest
        if b is not None:
            by_gpu.setdefault((v.host, v.gpu_pci), []).append(b)
    for g in usage.gpus:
        if g.gpu_id is None:
            continue
        if g.utilization is not None:
            out[g.gpu_id] = g.utilization
        else:
            out[g.gpu_id] = max(by_gpu.get((g.host, g.pci), [0.0]))
    return out


# An allocated vGPU's idle marks: (busiest, when the judged sample after it was taken; None: the latest), oldest
# first, busiest strictly falling: the samples no later one was as busy as. From them, for any threshold, since
# when the vGPU has been below it (`below_since`); NVML's percent steps keep them to at most 101.
Marks = list[tuple[float, float | None]]


def add_mark(marks: Marks, busy: float, at: float) -> Marks:
    """The marks after a judged sample (`busy`, 0..1, taken at `at`): the previous latest learns when the next
    sample came, and every mark no busier than this one goes."""
    dated = [(b, at if nxt is None else nxt) for b, nxt in marks]
    return [*[(b, nxt) for b, nxt in dated if b > busy], (busy, None)]


def below_since(marks: Marks, first_at: float, threshold: float) -> float | None:
    """Since when the vGPU has been below `threshold` in every judged sample (`first_at`: its first judged one,
    when none reached the threshold); None when its latest sample is not below it."""
    if not marks or marks[-1][0] >= threshold:
        return None
    for b, nxt in reversed(marks):
        if b >= threshold:
            return nxt
    return first_at


@dataclass(frozen=True)
class IdleRule:
    """When an allocated vGPU is idle: its busiest engine below `threshold` for `idle_for_s` seconds of samples.
    InvalidInput naming the field for a bad value."""

    threshold: float = DEFAULT_IDLE_THRESHOLD
    idle_for_s: float = DEFAULT_IDLE_FOR_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", check_idle_threshold(self.threshold))
        object.__setattr__(self, "idle_for_s", check_idle_for(self.idle_for_s))


@dataclass
class IdleVgpu:
    """An allocated vGPU below the threshold in its latest sample, and how long it has been."""

    device: str
    host: str
    gpu_pci: str
    profile: str | None
    vm: str | None
    tenant: str | None
    pool: str | None
    utilization: float  # its busiest engine in the latest sample (0 for a VM that is not running)
    below_since: float  # when the samples went below the threshold and stayed (epoch seconds)
    at: float  # when its latest sample was taken
    idle: bool  # below the threshold for at least idle_for
    why: str  # "utilization" or "vm <state>"

    def to_dict(self) -> dict[str, Any]:
        """JSON form, with `below_for_s`."""
        return {**self.__dict__, "below_for_s": round(max(0.0, self.at - self.below_since), 3)}


def judged(usage: FleetUsage) -> dict[str, tuple[VgpuUsage, float, str]]:
    """The allocated vGPUs this round can judge: device -> (its sample, busiest engine, why). A vGPU the store does
    not know is never judged (nothing to free), nor one NVML gives no utilization for; one of a VM that is not
    running counts as unused (0)."""
    out: dict[str, tuple[VgpuUsage, float, str]] = {}
    for v in usage.vgpus:
        b = v.busiest
        if v.device is not None and b is not None:
            out[v.device] = (v, b, "utilization")
    for device, (vm_state, v) in usage.unseen.items():
        if vm_state != "running":
            out[device] = (v, 0.0, f"vm {vm_state}")
    return out


def spread_load_policy(usage: FleetUsage) -> Policy:
    """The spread-load placement policy weighing the loads measured in this round."""
    return make_with_load(load_by_gpu(usage))
