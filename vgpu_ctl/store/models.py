"""The tables of the state store (SQLModel). Invariants are constraints here, not only checks in Python."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, CheckConstraint, Column, Index, UniqueConstraint, text
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
    # Per profile name ('*': every profile) the modes a preempted VM here may be freed by (NULL: the defaults).
    victim_modes: dict[str, list[str]] | None = Field(default=None, sa_column=Column(JSON))


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
        Index("gpu_candidates", "pool_id", "mode", "model", "free_units", "id"),  # the candidate order, to the id
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
    # The profiles its host has no type id for, with what to do (recorded by discovery), and their fit-mask
    # bits, which every write of `fits` leaves out (migration 0010).
    lacks: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    lacked_types: dict[str, str] | None = Field(default=None, sa_column=Column(JSON))
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
    ) + tuple(
        CheckConstraint(f"{r}_guarantee IS NULL OR ({r}_guarantee >= 0 AND ({r}_limit IS NULL OR "
                        f"{r}_guarantee <= {r}_limit))", name=f"tenant_{r}_guarantee_valid")
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
    # The guaranteed part of each limit (NULL: none): usage above it is borrowed, and reclaimable.
    vms_guarantee: int | None = Field(default=None, sa_type=BigInteger)
    vgpus_guarantee: int | None = Field(default=None, sa_type=BigInteger)
    framebuffer_mib_guarantee: int | None = Field(default=None, sa_type=BigInteger)
    vcpus_guarantee: int | None = Field(default=None, sa_type=BigInteger)
    memory_mib_guarantee: int | None = Field(default=None, sa_type=BigInteger)
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
        CheckConstraint("guarantee IS NULL OR (guarantee >= 0 AND guarantee <= limit_value "
                        "AND resource NOT LIKE 'profile:%')", name="scoped_quota_guarantee_valid"),
    )

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    scope: str
    resource: str
    limit_value: int = Field(sa_type=BigInteger)
    used: int = Field(default=0, sa_type=BigInteger)
    guarantee: int | None = Field(default=None, sa_type=BigInteger)  # the guaranteed part of the limit


class Vm(SQLModel, table=True):
    """A tenant's VM and where it is in the provisioning state machine."""

    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="vm_tenant_name_unique"),
        UniqueConstraint("tenant_id", "idempotency_key", name="vm_idempotency_unique"),
        CheckConstraint("vcpus > 0 AND memory_mib > 0", name="vm_size_pos"),
        CheckConstraint(
            "state IN ('requested', 'placed', 'devices-ready', 'defined', 'running', 'stopped', "
            "'releasing', 'failed', 'hibernated')", name="vm_state_known"),
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


# -- scheduling: priorities, fair share, preemption (migration 0006) ----------------------------------------------

class PriorityClass(SQLModel, table=True):
    """A named priority (0 to 1e9, higher first) with its preemption rules; at most one is the global default
    (a unique partial index)."""

    __tablename__ = "priority_class"
    __table_args__ = (
        CheckConstraint("value >= 0 AND value <= 1000000000", name="priority_class_value_range"),
        CheckConstraint("preemption_policy IN ('never', 'lower-priority')", name="priority_class_policy_known"),
        CheckConstraint("preemption_mode IN ('requeue', 'cancel', 'hibernate')", name="priority_class_mode_known"),
        Index("priority_class_one_default", "is_default", unique=True, sqlite_where=text("is_default"),
              postgresql_where=text("is_default")),
    )

    name: str = Field(primary_key=True)
    value: int = Field(sa_type=BigInteger)
    preemptible: bool = False
    preemption_policy: str = "lower-priority"
    preemption_mode: str = "requeue"
    is_default: bool = False
    description: str = ""
    created_at: datetime = Field(default_factory=utcnow)


class ShareAccount(SQLModel, table=True):
    """An account of the fair-share tree (Slurm's Fair Tree): its shares among its siblings, its parent."""

    __tablename__ = "share_account"
    __table_args__ = (
        CheckConstraint("shares > 0", name="share_account_shares_pos"),
        CheckConstraint("parent IS NULL OR parent <> name", name="share_account_not_own_parent"),
    )

    name: str = Field(primary_key=True)
    parent: str | None = Field(default=None, foreign_key="share_account.name")
    shares: int = Field(default=1, sa_type=BigInteger)


class TenantSched(SQLModel, table=True):
    """A tenant's scheduling settings: its fair-share shares and account, its default priority class. No row:
    1 share at the root, no default. The classes it may use are `tenant_priority_class` rows (none: any)."""

    __tablename__ = "tenant_sched"
    __table_args__ = (CheckConstraint("shares > 0", name="tenant_sched_shares_pos"),)

    tenant_id: int = Field(primary_key=True, foreign_key="tenant.id", ondelete="CASCADE")
    shares: int = Field(default=1, sa_type=BigInteger)
    account: str | None = Field(default=None, foreign_key="share_account.name")
    default_class: str | None = Field(default=None, foreign_key="priority_class.name")


class TenantPriorityClass(SQLModel, table=True):
    """A priority class a tenant may use (a tenant with none of these rows may use any)."""

    __tablename__ = "tenant_priority_class"

    tenant_id: int = Field(primary_key=True, foreign_key="tenant.id", ondelete="CASCADE")
    class_name: str = Field(primary_key=True, foreign_key="priority_class.name")


class VmSched(SQLModel, table=True):
    """A VM's priority (class and value, kept as admitted), whether it may be preempted, what it is charged for
    fair share (framebuffer GiB and compute slices from `admitted_at`, epoch seconds), and its preemption
    history (how often, and the priority its cool-down protects it from until when). Deleting the row (with the
    VM, or when the VM fails) closes its usage interval (a trigger)."""

    __tablename__ = "vm_sched"
    __table_args__ = (
        CheckConstraint("priority >= 0 AND priority <= 1000000000", name="vm_sched_priority_range"),
        CheckConstraint("fb_gib >= 0 AND compute_slices >= 0", name="vm_sched_charge_nonneg"),
        CheckConstraint("preemptions >= 0", name="vm_sched_preemptions_nonneg"),
    )

    vm_id: str = Field(primary_key=True, foreign_key="vm.id", ondelete="CASCADE")
    tenant_id: int = Field(foreign_key="tenant.id", ondelete="CASCADE", index=True)
    class_name: str | None = Field(default=None, foreign_key="priority_class.name")
    priority: int = Field(default=0, sa_type=BigInteger)
    preemptible: bool = False
    admitted_at: float
    fb_gib: float = 0.0
    compute_slices: float = 0.0
    preemptions: int = 0
    protected_below: int | None = Field(default=None, sa_type=BigInteger)
    protected_until: float | None = None


class UsageInterval(SQLModel, table=True):
    """A closed holding of a VM for fair share: tenant, from `started` to `ended` (epoch seconds), framebuffer GiB and
    compute slices; written by the trigger on `vm_sched`, folded into `usage_ledger` when old."""

    __tablename__ = "usage_interval"
    __table_args__ = (
        CheckConstraint("ended >= started", name="usage_interval_ordered"),
        CheckConstraint("fb_gib >= 0 AND compute_slices >= 0", name="usage_interval_nonneg"),
    )

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", ondelete="CASCADE", index=True)
    vm_id: str
    started: float
    ended: float
    fb_gib: float
    compute_slices: float


class UsageLedger(SQLModel, table=True):
    """A tenant's folded past usage: decayed framebuffer-GiB-hours and compute-slice-hours as of `as_of`."""

    __tablename__ = "usage_ledger"
    __table_args__ = (CheckConstraint("fb_gib_h >= 0 AND compute_h >= 0", name="usage_ledger_nonneg"),)

    tenant_id: int = Field(primary_key=True, foreign_key="tenant.id", ondelete="CASCADE")
    fb_gib_h: float = 0.0
    compute_h: float = 0.0
    as_of: float = 0.0


class GpuLoad(SQLModel, table=True):
    """What each GPU was last measured doing (0..1, NVML on its host, see service.utilization), and when: what the
    spread-load policy weighs when it places. Gone with its GPU."""

    __tablename__ = "gpu_load"
    __table_args__ = (CheckConstraint("busy >= 0 AND busy <= 1", name="gpu_load_ratio"),)

    gpu_id: int = Field(primary_key=True, foreign_key="gpu.id", ondelete="CASCADE")
    busy: float
    sampled_at: datetime = Field(default_factory=utcnow)


class UtilizationSample(SQLModel, table=True):
    """A GPU host's last NVML sample, as the server's leader took it on its interval (service.utilization_samples):
    `sample` holds each GPU's, vGPU's and MIG instance's values already attributed to device (claim), VM, tenant
    and pool, and each allocated vGPU's idle marks; `sampled_at` is when it was taken, `attempted_at` and `error`
    the last try (a failed try keeps the sample before it). Every replica's /metrics reads it; a sample older
    than a few `interval_s` is stale. Gone with its host."""

    __tablename__ = "utilization_sample"
    __table_args__ = (CheckConstraint("interval_s > 0", name="utilization_sample_interval_pos"),)

    host_id: int = Field(primary_key=True, foreign_key="host.id", ondelete="CASCADE")
    attempted_at: datetime
    sampled_at: datetime | None = None
    error: str | None = None
    interval_s: float
    sample: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


class VmMove(SQLModel, table=True):
    """A rebalance move under way (service.rebalance): written with the VM's lease, advanced in each step's
    transaction (`stopping`, `claimed`, `defined`, `done`), deleted with the old claim. Reconcile finishes one from
    `done`, or rolls it back before, once no live process holds the VM (migration 0013)."""

    __tablename__ = "vm_move"
    __table_args__ = (CheckConstraint("step IN ('stopping', 'claimed', 'defined', 'done')", name="vm_move_step_known"),)

    vm_id: str = Field(primary_key=True, foreign_key="vm.id", ondelete="CASCADE")
    step: str
    from_host_id: int = Field(foreign_key="host.id")
    to_host_id: int | None = Field(default=None, foreign_key="host.id")
    old_devices: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    new_devices: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    was_running: bool
    domain_uuid: str | None = None
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    started_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)



class FitBit(SQLModel, table=True):
    """The bits of a fit mask (core.geometry.FIT_BITS rows, written by migration 0009): what lets SQL split a mask."""

    __tablename__ = "fit_bit"
    __table_args__ = (UniqueConstraint("bitval", name="fit_bit_value_unique"),)

    bit: int = Field(primary_key=True)
    bitval: int = Field(sa_type=BigInteger)


class HostFit(SQLModel, table=True):
    """A host's summary per pool, GPU model, mode and fit-mask bit (a profile of that geometry): how many of its
    GPUs can take the profile now and their free units together, and how many GPUs it has there at all (`gpus`, its
    width; migration 0015). Kept by triggers on `gpu` in the transaction of every write of a GPU's state (migration
    0009), so a request for k GPUs or a whole-host score reads one row per candidate host (partial indexes on
    `n_fit > 0`, in the candidate orders)."""

    __tablename__ = "host_fit"
    __table_args__ = (
        CheckConstraint("n_fit >= 0 AND free_units >= 0", name="host_fit_nonneg"),
        Index("host_fit_by_free", "pool_id", "model", "mode", "bitval", "free_units", "host_id",
              sqlite_where=text("n_fit > 0"), postgresql_where=text("n_fit > 0")),
        Index("host_fit_by_host", "pool_id", "model", "mode", "bitval", "host_id",
              sqlite_where=text("n_fit > 0"), postgresql_where=text("n_fit > 0")),
        Index("host_fit_by_width", "pool_id", "model", "mode", "bitval", text("gpus DESC"),
              text("(CAST(free_units AS FLOAT) / n_fit)"), "host_id",
              sqlite_where=text("n_fit > 0"), postgresql_where=text("n_fit > 0")),
    )

    host_id: int = Field(primary_key=True)
    pool_id: int = Field(primary_key=True)
    model: str = Field(primary_key=True)
    mode: str = Field(primary_key=True)
    bitval: int = Field(primary_key=True, sa_type=BigInteger)
    n_fit: int
    free_units: int = Field(sa_type=BigInteger)
    gpus: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
