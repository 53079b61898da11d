"""Claims in the store (service/claim.py, service/allocator.py): the pools a claim reads, the VM rows it inserts,
the transaction it writes in, and a group commit's GPU compare-and-sets.

The claim's conditional updates themselves (tenant and scoped charges, host capacity, a GPU's version) are the
ones of service/allocation.py; what is here lets a group commit write many claims with one statement per GPU
(the occupancy after the batch's last claim there, its version moved on by the batch's claims) and one INSERT
of all its VMs, and lets the claim tell the store's errors apart without knowing the driver.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

from sqlalchemy import BigInteger, Integer, String, bindparam, cast, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from vgpu_ctl.store.candidates import insert_devices, write_gpu_sent
from vgpu_ctl.store.charges import charge_tenant_sent, claim_host_sent, group_on_host_sent
from vgpu_ctl.store.events import NewEvent, add_events
from vgpu_ctl.store.leader import lock_key
from vgpu_ctl.store.prepared import Prepared, end_read, fill_defaults, insert_all, sent_together
from vgpu_ctl.store.scheduling import any_class_sent
from vgpu_ctl.store.tables import GPU, POOL, TENANT, VM
from vgpu_ctl.store.tenants import tenant_id_sent
from vgpu_ctl.store.unit import Tx
from vgpu_ctl.store.vm_sched import VmSchedRow, add_vm_scheds


class PoolRow(NamedTuple):
    """A pool with the columns a claim needs; its demand as the stored JSON text (policies are cached by it)."""

    id: int
    name: str
    policy: str
    template: str | None
    demand: str | None


_POOL_COLS = (POOL.c.id, POOL.c.name, POOL.c.policy, POOL.c.template, cast(POOL.c.demand, String).label("demand"))
_POOL_BY_NAME = Prepared(select(*_POOL_COLS).where(POOL.c.name == bindparam("name")))
_ALL_POOLS = Prepared(select(*_POOL_COLS).order_by(POOL.c.name))
_POOL_NAMES = Prepared(select(POOL.c.name).order_by(POOL.c.name))
_INSERT_VM = insert_all(VM)
_VM_BY_KEY = Prepared(select(VM.c.id).where(VM.c.tenant_id == bindparam("t_id", type_=Integer),
                                            VM.c.idempotency_key == bindparam("key")))
_VM_BY_TENANT_KEY = Prepared(select(VM.c.id).join(TENANT, TENANT.c.id == VM.c.tenant_id).where(
    TENANT.c.name == bindparam("tenant"), VM.c.idempotency_key == bindparam("key")))


class ClaimRead(NamedTuple):
    """What a claim reads before it plans: the tenant's id (None: no such tenant), the id of its VM made with
    the request's idempotency key, the named pool (empty: no such pool) or every pool, and whether there is
    any priority class."""

    tenant_id: int | None
    made: str | None
    pools: list[PoolRow]
    any_class: bool


def read_claim(tx: Tx, tenant: str, pool: str | None, key: str | None) -> ClaimRead:
    """The claim's first read, its statements sent together (one round trip on PostgreSQL, none of them needing
    another's answer)."""
    with sent_together(tx):
        t_id = tenant_id_sent(tx, tenant)
        made = _VM_BY_TENANT_KEY.rows_sent(tx, {"tenant": tenant, "key": key}) if key is not None else None
        pools = _POOL_BY_NAME.rows_sent(tx, {"name": pool}) if pool is not None else _ALL_POOLS.rows_sent(tx)
        classes = any_class_sent(tx)
    made_rows = made() if made is not None else []
    return ClaimRead(t_id(), str(made_rows[0][0]) if made_rows else None, [PoolRow(*r) for r in pools()],
                     classes())


def pool_row(tx: Tx, name: str) -> PoolRow | None:
    """The pool named `name`."""
    rows = _POOL_BY_NAME.rows(tx, {"name": name})
    return PoolRow(*rows[0]) if rows else None


def all_pools(tx: Tx) -> list[PoolRow]:
    """Every pool, by name."""
    return [PoolRow(*r) for r in _ALL_POOLS.rows(tx)]


def pool_names(tx: Tx) -> list[str]:
    """Every pool's name, sorted."""
    return [r[0] for r in _POOL_NAMES.run(tx).fetchall()]


def vm_by_key(tx: Tx, tenant_id: int, key: str) -> str | None:
    """The id of the tenant's VM made with idempotency key `key`."""
    row = _VM_BY_KEY.run(tx, {"t_id": tenant_id, "key": key}).fetchone()
    return None if row is None else str(row[0])


def add_vms(tx: Tx, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert VM rows (columns by name; those left out take their defaults) in one statement."""
    _INSERT_VM.run_many(tx, [fill_defaults(VM, r) for r in rows])


together = sent_together  # a claim's inserts sent together: one round trip on PostgreSQL


def insert_claims(tx: Tx, vms: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]],
                  scheds: Sequence[VmSchedRow], events: Sequence[NewEvent]) -> None:
    """Insert claims' VM rows, then their device rows (the unique position and the overlap trigger guard
    them), scheduling rows and audit events: a statement per kind for all of them."""
    add_vms(tx, vms)
    insert_devices(tx, devices)
    add_vm_scheds(tx, scheds)
    add_events(tx, events)


class ClaimWrite(NamedTuple):
    """Everything one claim writes: the tenant's charge, the host's capacity, the anti-affinity group that must
    not be on the host yet, each GPU's compare-and-set (id, version read, state columns after) and the rows
    `insert_claims` inserts."""

    tenant_id: int
    delta: Mapping[str, int]
    host_id: int
    vcpus: int
    memory_mib: int
    group: str | None
    gpus: Sequence[tuple[int, int, Mapping[str, Any]]]
    vms: Sequence[Mapping[str, Any]]
    devices: Sequence[Mapping[str, Any]]
    scheds: Sequence[VmSchedRow]
    events: Sequence[NewEvent]


_TURN_KEYS: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
_ALONE = Prepared(select(func.pg_advisory_lock(bindparam("k", type_=BigInteger))))
_ALONE_NO_MORE = Prepared(select(func.pg_advisory_unlock(bindparam("k", type_=BigInteger))))
_BESIDE = Prepared(select(func.pg_advisory_xact_lock_shared(bindparam("k", type_=BigInteger))))


def _turn_key(tx: Tx) -> int:
    """The advisory lock key of the claim turn of the store `tx` is on (its schema's; asked once per engine)."""
    key = _TURN_KEYS.get(tx.engine)
    if key is None:
        schema = str(tx.exec_driver_sql("SELECT current_schema()").scalar())
        key = _TURN_KEYS[tx.engine] = lock_key(f"claim turn:{schema}")
    return key


@contextmanager
def claim_turn_alone(tx: Tx) -> Iterator[None]:
    """On PostgreSQL, the store's claim turn for this claim alone, across every replica, while the block runs
    (over the read's and the write's transactions on `tx`): a session advisory lock, which every claim's write
    takes beside the others (`share_claim_turn`), let go at the end, or with the connection when it cannot be.
    Nothing elsewhere: on SQLite the writer queue is the turn."""
    if tx.dialect.name != "postgresql":
        yield
        return
    key = _turn_key(tx)
    _ALONE.run(tx, {"k": key})
    try:
        yield
    finally:
        try:
            _ALONE_NO_MORE.run(tx, {"k": key})
        except Exception:  # e.g. the transaction failed: a connection that keeps the lock must not be reused
            tx.invalidate()


def share_claim_turn(tx: Tx) -> None:
    """On PostgreSQL, take the claim turn beside the other claims' writes until `tx`'s transaction ends, so that
    none lands while a claim holds it alone (`claim_turn_alone`); sent with what follows inside `sent_together`
    (the key asked before it: `_claim_writes`). Nothing elsewhere."""
    if tx.dialect.name == "postgresql":
        _BESIDE.run(tx, {"k": _turn_key(tx)})


@contextmanager
def _claim_writes(tx: Tx) -> Iterator[None]:
    """The block's statements sent together (`sent_together`), the claim turn shared first (`share_claim_turn`;
    its key asked before the pipeline, where asking would fail)."""
    if tx.dialect.name == "postgresql":
        _turn_key(tx)
    with sent_together(tx):
        share_claim_turn(tx)
        yield


ClaimOutcome = Literal["written", "written_scoped", "quota", "host", "group", "gpu"]
"""What `write_claim` did: all of it ("written_scoped": the tenant has pool-scoped limits, still to be charged
in the same transaction), or which check failed first, in the order a claim makes them (the caller then rolls
back): a global limit would pass, the host is inactive or full, the anti-affinity group is on it, a GPU changed."""


def write_claim(tx: Tx, w: ClaimWrite) -> ClaimOutcome:
    """Make every write of one claim in the caller's transaction, sent together (on PostgreSQL one round trip;
    rows locked in the order of the step-by-step claim: tenant, host, GPUs by id), then read what the
    conditional updates did. A unique VM name, idempotency key or device position taken is raised as the
    store's IntegrityError, unless a global limit would pass (that is the answer then, as when the charge
    comes first)."""
    checks: list[Callable[[], Any]] = []
    try:
        with _claim_writes(tx):
            checks.append(charge_tenant_sent(tx, w.tenant_id, w.delta))
            checks.append(claim_host_sent(tx, w.host_id, w.vcpus, w.memory_mib))
            if w.group is not None:
                checks.append(group_on_host_sent(tx, w.group, w.host_id))
            checks.extend(write_gpu_sent(tx, g, version, state) for g, version, state in sorted(w.gpus))
            insert_claims(tx, w.vms, w.devices, w.scheds, w.events)
    except IntegrityError:
        if checks and checks[0]() is None:
            return "quota"
        raise
    scoped = checks[0]()
    if scoped is None:
        return "quota"
    if not checks[1]():
        return "host"
    at = 2
    if w.group is not None:
        if checks[2]():
            return "group"
        at = 3
    if not all(check() for check in checks[at:]):
        return "gpu"
    return "written_scoped" if scoped else "written"


class GpuAfter(NamedTuple):
    """A GPU as a group commit leaves it: the version its first claim read, how many claims of the batch change
    it, and the state columns (allocation.GPU_STATE_COLUMNS) after the last of them."""

    gpu_id: int
    version: int
    claims: int
    state: Mapping[str, Any]


_STATE = ("layout", "free_units", "active_type", "device_count")
# The fit mask less the bits of the profiles the GPU's host lacks type ids for (as allocation.write_gpu stores it).
_WRITE_GPU_AFTER = Prepared(update(GPU).where(GPU.c.id == bindparam("g_id", type_=Integer),
                                               GPU.c.version == bindparam("g_version", type_=Integer)).values(
    {**{name: bindparam(f"g_{name}", type_=GPU.c[name].type) for name in _STATE},
     "fits": bindparam("g_fits", type_=BigInteger) - bindparam("g_fits", type_=BigInteger).op("&")(GPU.c.lacks),
     "version": GPU.c.version + bindparam("g_claims", type_=Integer)}))


class BatchWrite(NamedTuple):
    """What a group commit writes: each tenant's summed charge (tenant id, resource -> amount), each host's
    summed vCPUs and memory (host id, vCPUs, MiB), each GPU's state after the batch, and the rows
    `insert_claims` inserts."""

    tenants: Sequence[tuple[int, Mapping[str, int]]]
    hosts: Sequence[tuple[int, int, int]]
    gpus: Sequence[GpuAfter]
    vms: Sequence[Mapping[str, Any]]
    devices: Sequence[Mapping[str, Any]]
    scheds: Sequence[VmSchedRow]
    events: Sequence[NewEvent]


def write_batch(tx: Tx, w: BatchWrite) -> list[int] | None:
    """Make every write of a group commit in the caller's transaction, sent together (on PostgreSQL one round
    trip; rows locked tenants, then hosts, then GPUs, each in id order, as a single claim locks them), then read
    what the conditional updates did: None if one did not pass (the caller rolls back), else the tenants with
    pool-scoped limits still to charge. A unique name, key or device position taken is raised as the store's
    IntegrityError."""
    tenants = sorted(w.tenants, key=lambda t: t[0])
    with _claim_writes(tx):
        charged = [charge_tenant_sent(tx, t_id, delta) for t_id, delta in tenants]
        took = [claim_host_sent(tx, *h) for h in sorted(w.hosts)]
        moved = [_WRITE_GPU_AFTER.run(tx, {"g_id": g.gpu_id, "g_version": g.version, "g_claims": g.claims,
                                           **{f"g_{k}": g.state[k] for k in (*_STATE, "fits")}})
                 for g in sorted(w.gpus, key=lambda g: g.gpu_id)]
        insert_claims(tx, w.vms, w.devices, w.scheds, w.events)
    scoped = [check() for check in charged]
    if None in scoped or not all(check() for check in took) or any(cur.rowcount != 1 for cur in moved):
        return None
    return [t_id for (t_id, _), has in zip(tenants, scoped, strict=True) if has]


def end_read_on(tx: Tx) -> None:
    """End the read's transaction on `tx`, so that a write there starts a fresh one (the read may have run
    prepared statements at the driver only, or also ordinary ones, e.g. for an anti-affinity group)."""
    if tx.in_transaction():
        tx.rollback()
    else:
        end_read(tx)


def read_to_write(tx: Tx) -> None:
    """Ready `tx`, where a claim's read ran, for the write that follows. On PostgreSQL a read of prepared
    statements only goes on as the write's transaction: no ROLLBACK and BEGIN between them, two round trips
    fewer. That is sound because every statement of a READ COMMITTED transaction sees what was committed before
    it ran, and the write decides by its conditional updates, not by what the read saw (under a stricter
    isolation a write that lost a race is a serialization failure, which the claim retries). Elsewhere, or
    after ordinary statements (SQLAlchemy's own transaction), the read ends (`end_read_on`)."""
    if tx.dialect.name != "postgresql" or tx.in_transaction():
        end_read_on(tx)


@contextmanager
def write_on(tx: Tx) -> Iterator[Callable[[], None]]:
    """A write transaction on `tx` (a connection a read ended on), rolled back unless the caller calls the
    commit it is given."""
    trans = tx.begin()
    try:
        yield trans.commit
    finally:
        if trans.is_active:
            trans.rollback()


class _RolledBack(Exception):
    """Raised inside `savepoint` by `undo` to roll back its block without an error."""


@contextmanager
def savepoint(tx: Tx) -> Iterator[Callable[[], None]]:
    """A savepoint in the caller's transaction: released at the end of the block, rolled back if it raises
    (the error goes on) or if the block calls the `undo` it is given (and then leaves at once)."""
    nested = tx.begin_nested()
    try:
        yield _undo
    except _RolledBack:
        nested.rollback()
        return
    except BaseException:
        nested.rollback()
        raise
    nested.commit()


def _undo() -> None:
    raise _RolledBack


ClaimError = Literal["contended", "idempotency_key", "name", "position", "layout"]


def claim_error(exc: BaseException) -> ClaimError | None:
    """What a store error raised by a claim's write means: a lock, deadlock or serialization failure
    ("contended": try again), a unique idempotency key or VM name taken, a device position held or overlapping,
    a GPU layout that would drop a device the GPU holds (its stored layout already lacks one); None for anything
    else (a broken store, another constraint)."""
    if isinstance(exc, OperationalError):
        text = str(exc).lower()
        return "contended" if "lock" in text or "deadlock" in text or "serializ" in text else None
    if not isinstance(exc, IntegrityError):
        return None
    why = str(exc.orig)  # the driver's message only: str(exc) also holds the statement's SQL
    if "vm_idempotency_unique" in why or "vm.idempotency_key" in why:
        return "idempotency_key"
    if "vm_tenant_name_unique" in why or "vm.name" in why:
        return "name"
    if "overlap" in why or "device_position" in why or "device.gpu_id" in why:
        return "position"
    if "GPU layout drops a device" in why:
        return "layout"
    return None
