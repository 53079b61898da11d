"""The tables of the state store (SQLModel). Invariants are constraints here, not only checks in Python."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, CheckConstraint, Column, Index, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)


class Pool(SQLModel, table=True):
    """A named set of GPUs with a placement policy."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    policy: str = "pack"
    template: str | None = None
    description: str = ""
    demand: dict[str, float] | list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON))


class Host(SQLModel, table=True):
    """A KVM host. `used_*` are what placed VMs take; capacity is `vcpus * cpu_overcommit` etc."""

    __table_args__ = (
        CheckConstraint("vcpus >= 0 AND memory_mib >= 0", name="host_capacity_nonneg"),
        CheckConstraint("cpu_overcommit > 0 AND memory_overcommit > 0", name="host_overcommit_pos"),
        CheckConstraint("used_vcpus >= 0 AND used_memory_mib >= 0", name="host_used_nonneg"),
        CheckConstraint("state IN ('active', 'draining', 'down')", name="host_state_known"),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    uri: str
    driver: str = "libvirt"
    vgpu_backing: str = "mdev"
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    vcpus: int = Field(sa_type=BigInteger)
    memory_mib: int = Field(sa_type=BigInteger)
    cpu_overcommit: float = 1.0
    memory_overcommit: float = 1.0
    used_vcpus: int = Field(default=0, sa_type=BigInteger)
    used_memory_mib: int = Field(default=0, sa_type=BigInteger)
    state: str = "active"


class Gpu(SQLModel, table=True):
    """A physical GPU. `layout`, `free_units`, `active_type` and `fits` mirror its devices and change only by
    a conditional update on `version`, so two claims can never both take the same space. `fits` is the
    geometry's fit mask (`core.geometry.fit_mask`): the candidate query skips GPUs where a profile can't go."""

    __table_args__ = (
        UniqueConstraint("host_id", "pci_address", name="gpu_host_pci_unique"),
        CheckConstraint("free_units >= 0 AND free_units <= axis_units", name="gpu_free_in_axis"),
        CheckConstraint("mode IN ('vgpu-equal', 'vgpu-mixed', 'mig', 'passthrough', 'unmanaged')",
                        name="gpu_mode_known"),
        CheckConstraint("pinned_type IS NULL OR mode = 'vgpu-equal'", name="gpu_pin_equal_only"),
        CheckConstraint("active_type IS NULL OR mode = 'vgpu-equal'", name="gpu_type_equal_only"),
        CheckConstraint("pinned_type IS NULL OR active_type IS NULL OR active_type = pinned_type",
                        name="gpu_active_matches_pin"),
        Index("gpu_candidates", "pool_id", "mode", "model", "free_units"),
    )

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="host.id")
    pci_address: str
    model: str
    mode: str
    pool_id: int | None = Field(default=None, foreign_key="pool.id")
    pinned_type: str | None = None
    mig_layout: str = ""  # fixed MIG carving, compact form; "" = free carving
    axis_units: int
    free_units: int
    active_type: str | None = None
    layout: str = ""  # occupied slots, compact form (geometry.encode_layout)
    device_count: int = 0
    fits: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    version: int = 0


class Tenant(SQLModel, table=True):
    """A tenant, with its global limits (NULL = unlimited) and usage. Claims update usage with a
    conditional UPDATE on this row, so a limit can never be passed, also under concurrency."""

    __table_args__ = tuple(
        CheckConstraint(f"{r}_used >= 0", name=f"tenant_{r}_used_nonneg")
        for r in ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")
    ) + tuple(
        CheckConstraint(f"{r}_limit IS NULL OR {r}_limit >= 0", name=f"tenant_{r}_limit_nonneg")
        for r in ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    token_hash: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    vms_used: int = Field(default=0, sa_type=BigInteger)
    vgpus_used: int = Field(default=0, sa_type=BigInteger)
    framebuffer_mib_used: int = Field(default=0, sa_type=BigInteger)
    vcpus_used: int = Field(default=0, sa_type=BigInteger)
    memory_mib_used: int = Field(default=0, sa_type=BigInteger)
    vms_limit: int | None = Field(default=None, sa_type=BigInteger)
    vgpus_limit: int | None = Field(default=None, sa_type=BigInteger)
    framebuffer_mib_limit: int | None = Field(default=None, sa_type=BigInteger)
    vcpus_limit: int | None = Field(default=None, sa_type=BigInteger)
    memory_mib_limit: int | None = Field(default=None, sa_type=BigInteger)
    has_scoped_limits: bool = False
    generation: int = Field(default=1, sa_type=BigInteger)  # bumped by a trigger on every change (ETag)


class ScopedQuota(SQLModel, table=True):
    """A limit of a tenant within one pool (`scope` = pool name) or on one profile (`resource` =
    'profile:NAME', scope '*' for all pools). Rows exist only where a limit is set."""

    __tablename__ = "scoped_quota"
    __table_args__ = (
        UniqueConstraint("tenant_id", "scope", "resource", name="scoped_quota_unique"),
        CheckConstraint("used >= 0", name="scoped_quota_used_nonneg"),
        CheckConstraint("limit_value >= 0", name="scoped_quota_limit_nonneg"),
    )

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    scope: str
    resource: str
    limit_value: int = Field(sa_type=BigInteger)
    used: int = Field(default=0, sa_type=BigInteger)


class Vm(SQLModel, table=True):
    """A tenant's VM and where it is in the provisioning state machine."""

    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="vm_tenant_name_unique"),
        UniqueConstraint("tenant_id", "idempotency_key", name="vm_idempotency_unique"),
        CheckConstraint("vcpus > 0 AND memory_mib > 0", name="vm_size_pos"),
        CheckConstraint(
            "state IN ('requested', 'placed', 'devices-ready', 'defined', 'running', 'stopped', "
            "'releasing', 'failed')", name="vm_state_known"),
    )

    id: str = Field(primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    name: str
    pool_id: int | None = Field(default=None, foreign_key="pool.id")
    host_id: int | None = Field(default=None, foreign_key="host.id", index=True)
    vcpus: int = Field(sa_type=BigInteger)
    memory_mib: int = Field(sa_type=BigInteger)
    framebuffer_mib: int = Field(default=0, sa_type=BigInteger)
    state: str = "requested"
    idempotency_key: str | None = None
    anti_affinity: str | None = None
    domain_uuid: str | None = None
    template: str = "domain.xml.j2"
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    error: str | None = None
    lease_holder: str | None = None  # the process running an operation on the VM (see service.leases)
    lease_expires: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    generation: int = Field(default=1, sa_type=BigInteger)  # bumped by a trigger on every change (ETag)


class Device(SQLModel, table=True):
    """One carved vGPU or MIG instance on a GPU, held by a VM. (gpu_id, start) is unique and positions
    never overlap (an insert trigger on both engines, behind the compare-and-set on the GPU row)."""

    __table_args__ = (
        UniqueConstraint("gpu_id", "start", name="device_position_unique"),
        CheckConstraint("start >= 0 AND size > 0", name="device_interval_valid"),
        CheckConstraint("state IN ('claimed', 'ready', 'failed', 'releasing')", name="device_state_known"),
    )

    id: str = Field(primary_key=True)
    gpu_id: int = Field(foreign_key="gpu.id")
    vm_id: str = Field(foreign_key="vm.id", index=True)
    profile: str
    kind: str
    start: int
    size: int
    framebuffer_mib: int = Field(sa_type=BigInteger)
    uuid: str
    backing: str
    handle: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    state: str = "claimed"


class Event(SQLModel, table=True):
    """The audit trail: who did what to which object, when, with what result."""

    id: int | None = Field(default=None, primary_key=True)
    time: datetime = Field(default_factory=utcnow, index=True)
    actor: str
    tenant: str | None = Field(default=None, index=True)
    action: str
    target: str
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    result: str = "ok"
    error: str | None = None


class Meta(SQLModel, table=True):
    """Facts about the store itself (e.g. which catalog the GPUs' fit masks were computed with)."""

    key: str = Field(primary_key=True)
    value: str


class GpuTypeId(SQLModel, table=True):
    """What a host calls a profile on one of its GPUs, as discovery found it: the mdev type id (`nvidia-558`),
    the vendor-VFIO type id (`1428`) or the NVML GPU-instance profile id (`9`). Gone with its GPU."""

    __tablename__ = "gpu_type_id"
    __table_args__ = (
        UniqueConstraint("gpu_id", "kind", "profile", name="gpu_type_id_unique"),
        CheckConstraint("kind IN ('mdev', 'vfio', 'mig')", name="gpu_type_id_kind_known"),
    )

    id: int | None = Field(default=None, primary_key=True)
    gpu_id: int = Field(foreign_key="gpu.id", ondelete="CASCADE")
    kind: str
    profile: str
    type_id: str
    seen_at: datetime = Field(default_factory=utcnow)


class ApiToken(SQLModel, table=True):
    """A token the admin issued for a role over the API: `admin` (everything) or `reader` (every read, metrics,
    no change). Only its hash is stored."""

    __tablename__ = "api_token"
    __table_args__ = (CheckConstraint("role IN ('admin', 'reader')", name="api_token_role_known"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    role: str
    token_hash: str = Field(unique=True)
    created_at: datetime = Field(default_factory=utcnow)


class Operation(SQLModel, table=True):
    """Long work a caller asked for (create or delete a VM), run by a server's workers: its state, who asked,
    what they asked, the result or error, and the lease of the worker running it (renewed while it works; an
    operation whose lease ran out is taken over by the leader)."""

    __table_args__ = (
        CheckConstraint("state IN ('pending', 'running', 'succeeded', 'failed')", name="operation_state_known"),
        CheckConstraint("kind IN ('vm.create', 'vm.delete')", name="operation_kind_known"),
        Index("operation_unfinished", "state", "lease_expires"),
    )

    id: str = Field(primary_key=True)
    kind: str
    state: str = "pending"
    actor: str
    role: str  # of the principal who asked: admin, reader or tenant
    tenant_id: int | None = Field(default=None, foreign_key="tenant.id", ondelete="CASCADE")
    vm_id: str | None = None  # no foreign key: the operation outlives the VM it deleted
    request: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    error: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    lease_holder: str | None = None
    lease_expires: datetime | None = None
    attempts: int = 0  # how many workers have taken it (more than one: a takeover after a worker died)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None


class IdempotentRequest(SQLModel, table=True):
    """A POST made with an `Idempotency-Key`: per caller (`scope`) and key, a fingerprint of the request, and
    once answered the response to replay to a retry. Expires at `expires_at`."""

    __tablename__ = "idempotent_request"
    __table_args__ = (
        UniqueConstraint("scope", "key", name="idempotent_request_unique"),
        CheckConstraint("state IN ('in-flight', 'done')", name="idempotent_request_state_known"),
        Index("idempotent_request_expiry", "expires_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    scope: str
    key: str
    fingerprint: str
    state: str = "in-flight"
    status_code: int | None = None
    response: dict[str, Any] | list[Any] | None = Field(default=None, sa_column=Column(JSON))
    headers: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime


class ServerLease(SQLModel, table=True):
    """Who leads the servers of this store (runs the loops: operations left behind, reconcile), until when;
    written by the leader while it holds the election lock, read by every replica's /readyz."""

    __tablename__ = "server_lease"

    name: str = Field(primary_key=True)
    holder: str
    address: str = ""
    expires_at: datetime
