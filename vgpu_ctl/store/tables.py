"""The table handles of the store's models, for the statements of this package (and, until they move here,
the service modules that still build their own)."""

from __future__ import annotations

from sqlalchemy import Table

from vgpu_ctl.store.models import (
    ApiToken,
    Device,
    Event,
    Gpu,
    GpuLoad,
    Host,
    HostFit,
    IdempotentRequest,
    Meta,
    Operation,
    Pool,
    PriorityClass,
    ScopedQuota,
    ServerLease,
    ShareAccount,
    Tenant,
    TenantPriorityClass,
    TenantSched,
    UsageInterval,
    UsageLedger,
    Vm,
    VmSched,
)

API_TOKEN: Table = ApiToken.__table__  # type: ignore[attr-defined]
DEVICE: Table = Device.__table__  # type: ignore[attr-defined]
EVENT: Table = Event.__table__  # type: ignore[attr-defined]
GPU: Table = Gpu.__table__  # type: ignore[attr-defined]
GPU_LOAD: Table = GpuLoad.__table__  # type: ignore[attr-defined]
HOST: Table = Host.__table__  # type: ignore[attr-defined]
HOST_FIT: Table = HostFit.__table__  # type: ignore[attr-defined]
IDEMPOTENT: Table = IdempotentRequest.__table__  # type: ignore[attr-defined]
META: Table = Meta.__table__  # type: ignore[attr-defined]
OPERATION: Table = Operation.__table__  # type: ignore[attr-defined]
POOL: Table = Pool.__table__  # type: ignore[attr-defined]
PRIORITY_CLASS: Table = PriorityClass.__table__  # type: ignore[attr-defined]
SCOPED: Table = ScopedQuota.__table__  # type: ignore[attr-defined]
SERVER_LEASE: Table = ServerLease.__table__  # type: ignore[attr-defined]
SHARE_ACCOUNT: Table = ShareAccount.__table__  # type: ignore[attr-defined]
TENANT: Table = Tenant.__table__  # type: ignore[attr-defined]
TENANT_CLASS: Table = TenantPriorityClass.__table__  # type: ignore[attr-defined]
TENANT_SCHED: Table = TenantSched.__table__  # type: ignore[attr-defined]
USAGE_INTERVAL: Table = UsageInterval.__table__  # type: ignore[attr-defined]
USAGE_LEDGER: Table = UsageLedger.__table__  # type: ignore[attr-defined]
VM: Table = Vm.__table__  # type: ignore[attr-defined]
VM_SCHED: Table = VmSched.__table__  # type: ignore[attr-defined]
