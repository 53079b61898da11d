"""Scheduling in the store: priority classes, tenants' scheduling settings and allowed classes, the accounts of
the share tree, the scheduling settings (`meta` keys `sched.NAME`), closed usage intervals and the ledgers they
fold into, the queue of requests waiting for capacity (pending operations held by the queue), and what a
preemption plans from (the VMs it could free, their devices, charges and their tenants' guarantees)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Table, bindparam, delete, func, insert, or_, select, update

from vgpu_ctl.store.operations import OperationRow
from vgpu_ctl.store.prepared import Prepared
from vgpu_ctl.store.tables import (
    DEVICE,
    EVENT,
    GPU,
    HOST,
    META,
    OPERATION,
    POOL,
    PRIORITY_CLASS,
    SCOPED,
    SHARE_ACCOUNT,
    TENANT,
    TENANT_CLASS,
    TENANT_SCHED,
    USAGE_INTERVAL,
    USAGE_LEDGER,
    VM,
    VM_SCHED,
)
from vgpu_ctl.store.unit import Tx

SETTING = "sched."
"""The prefix of the scheduling settings' keys in `meta`."""


# -- settings ---------------------------------------------------------------------------------------------------

def stored_settings(tx: Tx) -> dict[str, float]:
    """The scheduling settings stored, by name."""
    return {str(key).removeprefix(SETTING): float(value) for key, value in tx.execute(
        select(META.c.key, META.c.value).where(META.c.key.like(f"{SETTING}%")))}


def put_setting(tx: Tx, name: str, value: float | None) -> None:
    """Store a scheduling setting (None: delete it)."""
    tx.execute(delete(META).where(META.c.key == f"{SETTING}{name}"))
    if value is not None:
        tx.execute(insert(META).values(key=f"{SETTING}{name}", value=repr(float(value))))


# -- priority classes -------------------------------------------------------------------------------------------

class ClassRow(NamedTuple):
    """A priority class as stored."""

    name: str
    value: int
    preemptible: bool
    preemption_policy: str
    preemption_mode: str
    is_default: bool
    description: str


class ClassUse(NamedTuple):
    """What uses a priority class: VMs, tenants' defaults, tenants' allowed classes."""

    vms: int
    tenant_defaults: int
    tenant_limits: int


_CLASSES = Prepared(select(*[PRIORITY_CLASS.c[name] for name in ClassRow._fields])
                    .order_by(PRIORITY_CLASS.c.value.desc(), PRIORITY_CLASS.c.name))  # every claim resolves its class
_ANY_CLASS = Prepared(select(PRIORITY_CLASS.c.name).limit(1))


def class_rows(tx: Tx) -> list[ClassRow]:
    """Every priority class, highest value first, then by name."""
    return [ClassRow(r.name, int(r.value), bool(r.preemptible), r.preemption_policy, r.preemption_mode,
                     bool(r.is_default), r.description) for r in _CLASSES.rows(tx)]


def any_class(tx: Tx) -> bool:
    """Whether there is any priority class."""
    return any_class_sent(tx)()


def any_class_sent(tx: Tx) -> Callable[[], bool]:
    """`any_class` sent (inside `sent_together`); its answer is read by the callable it returns."""
    cur = _ANY_CLASS.run(tx)
    return lambda: cur.fetchone() is not None


def has_class(tx: Tx, name: str) -> bool:
    """Whether the priority class `name` exists."""
    return tx.execute(select(PRIORITY_CLASS.c.name).where(PRIORITY_CLASS.c.name == name)).first() is not None


def add_class(tx: Tx, row: ClassRow, created_at: datetime) -> None:
    """Insert a priority class; when it is the default, the previous default stops being one."""
    if row.is_default:
        tx.execute(update(PRIORITY_CLASS).where(PRIORITY_CLASS.c.is_default.is_(True)).values(is_default=False))
    tx.execute(insert(PRIORITY_CLASS).values(**row._asdict(), created_at=created_at))


def class_use(tx: Tx, name: str) -> ClassUse:
    """What uses the priority class `name`."""
    def count(table: Table, column: str) -> int:
        return int(tx.execute(select(func.count()).select_from(table).where(table.c[column] == name)).scalar() or 0)
    return ClassUse(count(VM_SCHED, "class_name"), count(TENANT_SCHED, "default_class"),
                    count(TENANT_CLASS, "class_name"))


def remove_class(tx: Tx, name: str) -> None:
    """Delete the priority class `name`."""
    tx.execute(delete(PRIORITY_CLASS).where(PRIORITY_CLASS.c.name == name))


# -- tenants' scheduling settings -------------------------------------------------------------------------------

class TenantSchedRow(NamedTuple):
    """A tenant's scheduling settings as stored: shares, account and default class."""

    shares: int
    account: str | None
    default_class: str | None


class TenantShare(NamedTuple):
    """A tenant with its shares and account (None for each: no scheduling row)."""

    id: int
    name: str
    shares: int | None
    account: str | None


_TSCHED = Prepared(select(TENANT_SCHED.c.shares, TENANT_SCHED.c.account, TENANT_SCHED.c.default_class)
                   .where(TENANT_SCHED.c.tenant_id == bindparam("t_id")))  # every claim with classes reads these
_TCLASSES = Prepared(select(TENANT_CLASS.c.class_name).where(TENANT_CLASS.c.tenant_id == bindparam("t_id")))


def tenant_sched(tx: Tx, tenant_id: int) -> TenantSchedRow | None:
    """The tenant's scheduling row, if it has one."""
    rows = _TSCHED.rows(tx, {"t_id": tenant_id})
    return TenantSchedRow(int(rows[0].shares), rows[0].account, rows[0].default_class) if rows else None


def tenant_classes(tx: Tx, tenant_id: int) -> list[str]:
    """The priority classes the tenant may use, sorted (none: any)."""
    return sorted(str(r[0]) for r in _TCLASSES.run(tx, {"t_id": tenant_id}).fetchall())


def put_tenant_sched(tx: Tx, tenant_id: int, row: TenantSchedRow, classes: Collection[str]) -> None:
    """Replace the tenant's scheduling row and the classes it may use."""
    tx.execute(delete(TENANT_SCHED).where(TENANT_SCHED.c.tenant_id == tenant_id))
    tx.execute(insert(TENANT_SCHED).values(tenant_id=tenant_id, **row._asdict()))
    tx.execute(delete(TENANT_CLASS).where(TENANT_CLASS.c.tenant_id == tenant_id))
    for c in classes:
        tx.execute(insert(TENANT_CLASS).values(tenant_id=tenant_id, class_name=c))


def tenant_shares(tx: Tx) -> list[TenantShare]:
    """Every tenant with its shares and account."""
    return [TenantShare(*r) for r in tx.execute(
        select(TENANT.c.id, TENANT.c.name, TENANT_SCHED.c.shares, TENANT_SCHED.c.account)
        .outerjoin(TENANT_SCHED, TENANT_SCHED.c.tenant_id == TENANT.c.id))]


# -- accounts ---------------------------------------------------------------------------------------------------

class AccountRow(NamedTuple):
    """An account of the share tree."""

    name: str
    shares: int
    parent: str | None


def account_rows(tx: Tx) -> list[AccountRow]:
    """Every account."""
    return [AccountRow(r.name, int(r.shares), r.parent) for r in tx.execute(
        select(SHARE_ACCOUNT.c.name, SHARE_ACCOUNT.c.shares, SHARE_ACCOUNT.c.parent))]


def has_account(tx: Tx, name: str) -> bool:
    """Whether the account `name` exists."""
    return tx.execute(select(SHARE_ACCOUNT.c.name).where(SHARE_ACCOUNT.c.name == name)).first() is not None


def put_account(tx: Tx, row: AccountRow) -> None:
    """Set an account's shares and parent, inserting it when there is none."""
    if tx.execute(update(SHARE_ACCOUNT).where(SHARE_ACCOUNT.c.name == row.name)
                  .values(shares=row.shares, parent=row.parent)).rowcount == 0:
        tx.execute(insert(SHARE_ACCOUNT).values(**row._asdict()))


def account_members(tx: Tx, name: str) -> list[str]:
    """The accounts, then the tenants, directly under the account `name`."""
    accounts = [str(r[0]) for r in tx.execute(select(SHARE_ACCOUNT.c.name).where(SHARE_ACCOUNT.c.parent == name))]
    return accounts + [str(r[0]) for r in tx.execute(
        select(TENANT.c.name).join(TENANT_SCHED, TENANT_SCHED.c.tenant_id == TENANT.c.id)
        .where(TENANT_SCHED.c.account == name))]


def remove_account(tx: Tx, name: str) -> None:
    """Delete the account `name`."""
    tx.execute(delete(SHARE_ACCOUNT).where(SHARE_ACCOUNT.c.name == name))


# -- fair-share usage -------------------------------------------------------------------------------------------

class LedgerRow(NamedTuple):
    """A tenant's folded past usage: decayed framebuffer-GiB-hours and compute-slice-hours as of `as_of`."""

    tenant_id: int
    fb_gib_h: float
    compute_h: float
    as_of: float


class IntervalRow(NamedTuple):
    """A closed holding of a VM: its tenant, from `started` to `ended` (epoch seconds), what it was charged."""

    id: int
    tenant_id: int
    started: float
    ended: float
    fb_gib: float
    compute_slices: float


def gpu_model_counts(tx: Tx) -> list[tuple[str, int]]:
    """How many managed GPUs of each model the fleet has."""
    return [(str(m), int(n)) for m, n in tx.execute(
        select(GPU.c.model, func.count()).where(GPU.c.mode != "unmanaged").group_by(GPU.c.model))]


def ledger_rows(tx: Tx) -> list[LedgerRow]:
    """Every tenant's ledger."""
    return [LedgerRow(*r) for r in tx.execute(select(*[USAGE_LEDGER.c[name] for name in LedgerRow._fields]))]


def put_ledger(tx: Tx, row: LedgerRow) -> None:
    """Set a tenant's ledger, inserting it when there is none."""
    if tx.execute(update(USAGE_LEDGER).where(USAGE_LEDGER.c.tenant_id == row.tenant_id)
                  .values(fb_gib_h=row.fb_gib_h, compute_h=row.compute_h, as_of=row.as_of)).rowcount == 0:
        tx.execute(insert(USAGE_LEDGER).values(**row._asdict()))


def interval_rows(tx: Tx) -> list[IntervalRow]:
    """Every closed usage interval not yet folded."""
    return [IntervalRow(*r) for r in tx.execute(select(*[USAGE_INTERVAL.c[name] for name in IntervalRow._fields]))]


def interval_count(tx: Tx) -> int:
    """How many closed usage intervals wait to be folded."""
    return int(tx.execute(select(func.count()).select_from(USAGE_INTERVAL)).scalar() or 0)


def drop_intervals(tx: Tx, ids: Collection[int]) -> None:
    """Delete these usage intervals (folded)."""
    tx.execute(delete(USAGE_INTERVAL).where(USAGE_INTERVAL.c.id.in_(list(ids))))


# -- what a preemption plans from -------------------------------------------------------------------------------

class HolderRow(NamedTuple):
    """A VM a preemption could free: the VM, its scheduling row, its host's name and the modes it allows."""

    id: str
    name: str
    host_id: int
    vcpus: int
    memory_mib: int
    state: str
    lease_holder: str | None
    tenant_id: int
    priority: int
    preemptible: bool
    admitted_at: float
    protected_below: int | None
    protected_until: float | None
    class_name: str | None
    preemptions: int
    pool: str | None
    spec: dict[str, Any]
    host_name: str
    victim_modes: dict[str, list[str]] | None


class DeviceKind(NamedTuple):
    """A VM's device: where it sits, its profile and backing."""

    vm_id: str
    gpu_id: int
    start: int
    profile: str
    backing: str


class DevicePlace(NamedTuple):
    """A VM's device by profile, its GPU's PCI address and its start."""

    profile: str
    pci_address: str
    start: int


class VmCharge(NamedTuple):
    """What a VM charges its tenant (`spec["delta"]`), and its pool's name."""

    id: str
    tenant_id: int
    spec: dict[str, Any]
    pool: str | None


class Guarantee(NamedTuple):
    """A tenant's guarantee of a resource, globally (`scope` None) or in a scope (a pool's name), and its use."""

    tenant_id: int
    resource: str
    scope: str | None
    used: int
    guarantee: int


_HOLDER_COLUMNS = [*(VM.c[n] for n in ("id", "name", "host_id", "vcpus", "memory_mib", "state", "lease_holder",
                                       "tenant_id")),
                   *(VM_SCHED.c[n] for n in ("priority", "preemptible", "admitted_at", "protected_below",
                                             "protected_until", "class_name", "preemptions")),
                   POOL.c.name.label("pool"), VM.c.spec, HOST.c.name.label("host_name"), HOST.c.victim_modes]


def free_vms_on(tx: Tx, host_ids: Collection[int], states: Collection[str]) -> list[HolderRow]:
    """The VMs with a scheduling row on these hosts that are in `states` and that no process holds."""
    return [HolderRow(*r) for r in tx.execute(
        select(*_HOLDER_COLUMNS).join(VM_SCHED, VM_SCHED.c.vm_id == VM.c.id).join(HOST, HOST.c.id == VM.c.host_id)
        .outerjoin(POOL, POOL.c.id == VM.c.pool_id)
        .where(VM.c.host_id.in_(list(host_ids)), VM.c.state.in_([str(s) for s in states]),
               VM.c.lease_holder.is_(None)))]


def device_kinds(tx: Tx, vm_ids: Collection[str]) -> list[DeviceKind]:
    """The devices of these VMs."""
    return [DeviceKind(*r) for r in tx.execute(
        select(DEVICE.c.vm_id, DEVICE.c.gpu_id, DEVICE.c.start, DEVICE.c.profile, DEVICE.c.backing)
        .where(DEVICE.c.vm_id.in_(list(vm_ids))))]


def device_places(tx: Tx, vm_id: str) -> list[DevicePlace]:
    """The VM's devices, by PCI address and start."""
    return [DevicePlace(*r) for r in tx.execute(
        select(DEVICE.c.profile, GPU.c.pci_address, DEVICE.c.start).join(GPU, GPU.c.id == DEVICE.c.gpu_id)
        .where(DEVICE.c.vm_id == vm_id).order_by(GPU.c.pci_address, DEVICE.c.start))]


_CHARGES = select(VM.c.id, VM.c.tenant_id, VM.c.spec, POOL.c.name.label("pool")).outerjoin(
    POOL, POOL.c.id == VM.c.pool_id)


def claim_charges(tx: Tx, tenant_ids: Collection[int], states: Collection[str]) -> list[VmCharge]:
    """What the VMs in `states` of these tenants charge, oldest admission first (a VM without a scheduling row
    as admitted at 0), then by id."""
    return [VmCharge(*r) for r in tx.execute(
        _CHARGES.outerjoin(VM_SCHED, VM_SCHED.c.vm_id == VM.c.id)
        .where(VM.c.tenant_id.in_(list(tenant_ids)), VM.c.state.in_([str(s) for s in states]))
        .order_by(func.coalesce(VM_SCHED.c.admitted_at, 0.0), VM.c.id))]


def vm_charges(tx: Tx, vm_ids: Collection[str]) -> list[VmCharge]:
    """What these VMs charge."""
    return [VmCharge(*r) for r in tx.execute(_CHARGES.where(VM.c.id.in_(list(vm_ids))))]


def guarantees(tx: Tx, tenant_ids: Collection[int], resources: Sequence[str],
               scope: str | None = None) -> list[Guarantee]:
    """These tenants' guarantees: of `resources` on their rows, and every scoped one (only `scope`'s when
    given)."""
    if not tenant_ids:
        return []
    ids = list(tenant_ids)
    out = []
    for t in tx.execute(select(TENANT.c.id, *(TENANT.c[f"{r}_{k}"] for r in resources for k in ("used", "guarantee")))
                        .where(TENANT.c.id.in_(ids))):
        for i, r in enumerate(resources):
            used, guarantee = t[1 + 2 * i], t[2 + 2 * i]
            if guarantee is not None:
                out.append(Guarantee(int(t.id), r, None, int(used), int(guarantee)))
    scoped = select(SCOPED.c.tenant_id, SCOPED.c.resource, SCOPED.c.scope, SCOPED.c.used, SCOPED.c.guarantee).where(
        SCOPED.c.tenant_id.in_(ids), SCOPED.c.guarantee.is_not(None))
    if scope is not None:
        scoped = scoped.where(SCOPED.c.scope == scope)
    out += [Guarantee(int(s.tenant_id), s.resource, s.scope, int(s.used), int(s.guarantee))
            for s in tx.execute(scoped)]
    return out


def event_params(tx: Tx, action: str, result: str) -> list[Any]:
    """The parameters of every audit event of `action` that ended in `result`."""
    return [r[0] for r in tx.execute(select(EVENT.c.params).where(EVENT.c.action == action,
                                                                  EVENT.c.result == result))]


# -- the queue --------------------------------------------------------------------------------------------------

_OP_COLUMNS = [OPERATION.c[name] for name in OperationRow._fields]


def _queued_where(holder: str, trying: str | None = None) -> tuple[Any, ...]:
    held = OPERATION.c.lease_holder == holder
    if trying is not None:
        held = or_(held, OPERATION.c.lease_holder.startswith(trying, autoescape=True))
    return OPERATION.c.state == "pending", held


def queued(tx: Tx, holder: str, trying: str | None = None) -> list[OperationRow]:
    """The pending operations the queue holds (`holder` its lease holder); with `trying`, also those an admitter
    is trying now (its holder starts with `trying`), which wait on if the try fails."""
    return [OperationRow(*r) for r in tx.execute(select(*_OP_COLUMNS).where(*_queued_where(holder, trying)))]


def queued_count(tx: Tx, holder: str) -> int:
    """How many pending operations the queue holds."""
    return int(tx.execute(select(func.count()).select_from(OPERATION).where(*_queued_where(holder))).scalar() or 0)


def take_queued(tx: Tx, op_id: str, holder: str, taker: str, now: datetime) -> bool:
    """Give a queued operation to `taker` if the queue (`holder`) still holds it; whether this call did."""
    res = tx.execute(update(OPERATION).where(OPERATION.c.id == op_id, *_queued_where(holder))
                     .values(lease_holder=taker, updated_at=now))
    return bool(res.rowcount == 1)


def drop_queued(tx: Tx, op_id: str, error: dict[str, Any], now: datetime) -> None:
    """End a pending operation as failed with `error`."""
    tx.execute(update(OPERATION).where(OPERATION.c.id == op_id, OPERATION.c.state == "pending")
               .values(state="failed", lease_holder=None, updated_at=now, finished_at=now, error=error))


def end_admission(tx: Tx, op_id: str, taker: str, state: str, *, holder_after: str | None, vm_id: str | None,
                  result: dict[str, Any] | None, error: dict[str, Any] | None, now: datetime) -> None:
    """Record one try of a queued operation `taker` took: its state, result or error and its VM, one more
    attempt, held by `holder_after` (the queue again, or none: finished now)."""
    tx.execute(update(OPERATION).where(OPERATION.c.id == op_id, OPERATION.c.lease_holder == taker)
               .values(state=state, result=result, error=error, updated_at=now, lease_holder=holder_after,
                       attempts=OPERATION.c.attempts + 1, finished_at=now if holder_after is None else None,
                       vm_id=vm_id))
