"""Typed request and result objects of the service API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import MAX_DISK_GIB, MAX_MEMORY_MIB, MAX_VM_VCPUS, check_int, check_name

BASE_RESOURCES = ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")


@dataclass(frozen=True)
class VgpuRequest:
    """`count` vGPUs of `profile`."""

    profile: str
    count: int = 1


@dataclass(frozen=True)
class VmRequest:
    """Everything a tenant asks for when it requests a VM."""

    tenant: str
    name: str
    vgpus: tuple[VgpuRequest, ...]
    vcpus: int
    memory_mib: int
    pool: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    anti_affinity: str | None = None
    idempotency_key: str | None = None
    template: str | None = None
    disk_gib: int = 20
    network: str = "default"
    lease_holder: str | None = None  # who provisions the VM once claimed (see service.leases)
    priority: str | None = None  # the priority class asked for (None: the tenant's default, else the global one)
    vm_id: str | None = None  # a requeued VM admitted again keeps its id (and so its disk)
    history: dict[str, Any] | None = None  # a requeued VM's preemption history (see service.scheduling)

    def validate(self) -> None:
        """InvalidInput naming the field and value of the first bad one."""
        check_name("tenant", self.tenant)
        check_name("name", self.name)
        if self.pool is not None:
            check_name("pool", self.pool)
        if self.anti_affinity is not None:
            check_name("anti_affinity", self.anti_affinity)
        if self.priority is not None:
            check_name("priority", self.priority)
        if self.idempotency_key is not None and not (0 < len(self.idempotency_key) <= 128
                                                      and self.idempotency_key.isprintable()):
            raise InvalidInput(f"idempotency_key {self.idempotency_key!r} must be 1-128 printable characters",
                               reasons=[{"field": "idempotency_key", "value": self.idempotency_key}])
        for fname, value, high in (("vcpus", self.vcpus, MAX_VM_VCPUS), ("memory_mib", self.memory_mib, MAX_MEMORY_MIB),
                                   ("disk_gib", self.disk_gib, MAX_DISK_GIB)):
            check_int(fname, value, 1, high)
        for v in self.vgpus:
            if isinstance(v.count, bool) or not isinstance(v.count, int) or not 0 < v.count <= 16:
                raise InvalidInput(f"count of profile {v.profile!r} must be a whole number from 1 to 16, got "
                                   f"{v.count!r}", reasons=[{"field": "count", "value": v.count}])
        if sum(v.count for v in self.vgpus) > 16:
            total = sum(v.count for v in self.vgpus)
            raise InvalidInput(f"a VM may hold at most 16 vGPUs (field count, value {total})",
                               reasons=[{"field": "count", "value": total}])

    def profiles(self) -> tuple[str, ...]:
        """One profile name per vGPU."""
        return tuple(v.profile for v in self.vgpus for _ in range(v.count))


@dataclass(frozen=True)
class DeviceInfo:
    """A device of a VM as the API reports it."""

    id: str
    gpu: str  # "host/0000:41:00.0"
    gpu_id: int
    profile: str
    kind: str
    start: int
    size: int
    uuid: str
    backing: str
    state: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class VmInfo:
    """A VM as the API reports it."""

    id: str
    name: str
    tenant: str
    host: str | None
    pool: str | None
    state: str
    vcpus: int
    memory_mib: int
    framebuffer_mib: int
    devices: tuple[DeviceInfo, ...]
    error: str | None = None
    domain_uuid: str | None = None
    simulated: bool = False
    generation: int = 0  # changes on every change of the VM (its ETag)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = dict(self.__dict__)
        d["devices"] = [x.to_dict() for x in self.devices]
        return d


@dataclass(frozen=True)
class PlacedDevice:
    """Where a dry run would put one vGPU: the GPU ("host/0000:41:00.0"), the profile, its position."""

    gpu: str
    profile: str
    start: int
    size: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Placement:
    """What a dry run decided: the host, the pool and where each vGPU would go."""

    host: str
    pool: str | None
    devices: tuple[PlacedDevice, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"host": self.host, "pool": self.pool, "devices": [d.to_dict() for d in self.devices]}


@dataclass(frozen=True)
class OperationInfo:
    """An operation as the API reports it."""

    id: str
    kind: str
    state: str  # pending, running, succeeded, failed
    tenant: str | None
    vm_id: str | None
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: str
    updated_at: str
    finished_at: str | None

    @property
    def done(self) -> bool:
        """True once it succeeded or failed."""
        return self.state in ("succeeded", "failed")

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass
class Finding:
    """One difference between store and host, and what was (or would be) done about it."""

    kind: str
    host: str
    target: str
    detail: str
    action: str = "report"
    fixed: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass
class ReconcileReport:
    """All findings of one reconcile run."""

    findings: list[Finding] = field(default_factory=list)
    hosts: int = 0

    @property
    def clean(self) -> bool:
        """True when nothing differs (or everything found was fixed); a VM another process is still working
        on (`in-progress`) is not clean."""
        return all(f.fixed for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"hosts": self.hosts, "clean": self.clean, "findings": [f.to_dict() for f in self.findings]}
