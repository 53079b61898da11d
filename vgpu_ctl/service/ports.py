"""What the service needs of the store, as protocols: one per aggregate, each function taking the unit of
work (`Tx`) it runs in and returning typed rows. The service reaches the store only through `STORE`; the
store's modules (vgpu_ctl/store/*) satisfy these protocols, which mypy checks at the binding below, and they
keep the SQL and its speed machinery (prepared statements, fit masks, writer queue, checkpointer) private."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Protocol

from vgpu_ctl.core.placeables import Placeable
from vgpu_ctl.core.placement import CandidateOrder
from vgpu_ctl.store.candidate_pages import BareHostRow, CandidateRow, PageBounds, SummaryRow
from vgpu_ctl.store.candidates import GpuStateRow
from vgpu_ctl.store.charges import ScopedUse
from vgpu_ctl.store.claims import BatchWrite, ClaimError, ClaimOutcome, ClaimRead, ClaimWrite, PoolRow
from vgpu_ctl.store.events import EventRow, NewEvent
from vgpu_ctl.store.fit_masks import MaskRow, SummaryKey
from vgpu_ctl.store.fleet import FleetRows
from vgpu_ctl.store.host_types import LackingGpu, TypedGpu, TypeIds
from vgpu_ctl.store.hosts import HostGpu, HostRow, HostState
from vgpu_ctl.store.idempotency import KeyRow
from vgpu_ctl.store.inventory import Row
from vgpu_ctl.store.leader_lease import LeaderLease
from vgpu_ctl.store.moves import HeldDevice, MoveEvent, MoveRow, PendingMove, PlacedDevice, TargetGpu
from vgpu_ctl.store.operations import OperationLease, OperationRow
from vgpu_ctl.store.quotas import ScopedRow, TenantQuota
from vgpu_ctl.store.reports import (
    Count,
    GpuState,
    HeldDevices,
    MisplacedDevice,
    ModeSummary,
    OrphanDevice,
    PagedGpu,
    ProvisionEvent,
    ReportDevice,
    ReportGpu,
    ScopedUsage,
    VmSince,
)
from vgpu_ctl.store.scheduling import (
    AccountRow,
    ClassRow,
    ClassUse,
    DeviceKind,
    DevicePlace,
    Guarantee,
    HolderRow,
    IntervalRow,
    LedgerRow,
    TenantSchedRow,
    TenantShare,
    VmCharge,
)
from vgpu_ctl.store.sql import SqlStore
from vgpu_ctl.store.tenants import TenantRow
from vgpu_ctl.store.tokens import ApiTokenRow, TenantRef
from vgpu_ctl.store.unit import Tx, utcnow
from vgpu_ctl.store.utilization import HostSample, SampledDevice, SampledGpu, SampleRow
from vgpu_ctl.store.vm_sched import Holding, VmSchedRow
from vgpu_ctl.store.vms import DeviceRef, DeviceRow, VmPlace, VmRow, VmStatus


class TokenStore(Protocol):
    """Tenants' token hashes and API tokens."""

    def tenant_by_token_hash(self, tx: Tx, digest: str) -> TenantRef | None:
        """The tenant whose token hashes to `digest`."""

    def api_token_by_hash(self, tx: Tx, digest: str) -> ApiTokenRow | None:
        """The API token that hashes to `digest`."""

    def add_api_token(self, tx: Tx, name: str, role: str, digest: str) -> bool:
        """Store an API token; False when the name is taken."""

    def api_tokens(self, tx: Tx) -> list[ApiTokenRow]:
        """Every API token, by name."""

    def remove_api_token(self, tx: Tx, name: str) -> bool:
        """Delete an API token; whether there was one."""


class EventStore(Protocol):
    """The audit trail."""

    def add_events(self, tx: Tx, events: Sequence[NewEvent]) -> None:
        """Write audit events, stamped now."""

    def event_rows(self, tx: Tx, tenant: str | None, since: Any, limit: int) -> list[EventRow]:
        """Events, oldest first, of a tenant and since a time when given."""


class CandidatePageStore(Protocol):
    """Placement's candidate pages: GPUs or whole hosts of a pool that can take a request now, in a policy's
    order, each page its own rows' cost."""

    def gpu_pages(self, tx: Tx, order: CandidateOrder, labels: bool, targets: Sequence[Placeable],
                  bounds: PageBounds) -> list[list[CandidateRow]]:
        """For each placeable, the first GPUs of the pool that can take it, on hosts with room, in the policy's
        order (read together)."""

    def grouped_host_page(self, tx: Tx, order: CandidateOrder, labels: bool, targets: tuple[Placeable, ...],
                          bounds: PageBounds) -> list[CandidateRow]:
        """The matching GPUs of a page of hosts with enough GPUs able to take one of the placeables."""

    def summary_pages(self, tx: Tx, order: CandidateOrder, labels: bool, widest: bool, targets: Sequence[Placeable],
                      bounds: PageBounds) -> list[list[SummaryRow]]:
        """For each placeable, every GPU in the pool of a page of whole hosts, from their summaries, with each
        host's width and key (read together)."""

    def bare_host_page(self, tx: Tx, order: CandidateOrder, labels: bool, bounds: PageBounds) -> list[BareHostRow]:
        """A page of the pool's hosts with room for a request without vGPUs."""

    def pool_gpus(self, tx: Tx, pool_ids: Sequence[int], host_ids: Sequence[int] | None = None) -> list[CandidateRow]:
        """Every GPU of the pools (on `host_ids` only, if given) with its host's columns."""

    def lacked_types(self, tx: Tx, pool_ids: Sequence[int],
                     host_ids: Sequence[int] | None = None) -> dict[int, frozenset[str]]:
        """By GPU id, the profiles its host lacks type ids for."""


class CandidateStore(Protocol):
    """A claim's GPU and device rows: pools' offers, GPUs' compare-and-set, device rows."""

    def pools_have(self, tx: Tx, wanted: Sequence[tuple[int, str, str]]) -> list[bool]:
        """For each (pool id, model, mode): whether the pool holds a GPU of this model in this mode."""

    def write_gpu(self, tx: Tx, gpu_id: int, version: int, state: Mapping[str, Any]) -> bool:
        """Store a GPU's state columns if its version is still `version`; whether it did."""

    def gpu_state_row(self, tx: Tx, gpu_id: int) -> GpuStateRow:
        """The GPU's occupancy columns and version."""

    def insert_devices(self, tx: Tx, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert device rows."""

    def delete_devices(self, tx: Tx, device_ids: Sequence[str]) -> None:
        """Delete device rows."""


class ChargeStore(Protocol):
    """A claim's charges: tenants' global and scoped usage, hosts' used capacity, anti-affinity reads."""

    def charge_tenant(self, tx: Tx, tenant_id: int, delta: Mapping[str, int]) -> bool | None:
        """Add to the tenant's usage unless a limit would pass: None then, else whether it has scoped limits."""

    def scoped_keys(self, tx: Tx, tenant_id: int) -> list[tuple[str, str]]:
        """The (scope, resource) of the tenant's scoped limit rows."""

    def charge_scoped_row(self, tx: Tx, tenant_id: int, scope: str, resource: str, n: int) -> bool:
        """Add to one scoped limit row unless its limit would pass; whether it did."""

    def uncharge(self, tx: Tx, tenant_id: int, delta: Mapping[str, int],
                 scoped: Mapping[tuple[str, str], int]) -> None:
        """Take usage off the tenant's global and scoped rows."""

    def tenant_usage(self, tx: Tx, tenant_id: int) -> dict[str, Any]:
        """The tenant's row by column name."""

    def scoped_use(self, tx: Tx, tenant_id: int, scope: str, resource: str) -> ScopedUse:
        """One scoped limit row's limit and usage."""

    def claim_host(self, tx: Tx, host_id: int, vcpus: int, memory_mib: int) -> bool:
        """Take vCPUs and memory on an active host with room; whether it did."""

    def release_host(self, tx: Tx, host_id: int, vcpus: int, memory_mib: int) -> None:
        """Give back vCPUs and memory on the host."""

    def hosts_of_group(self, tx: Tx, group: str) -> set[int]:
        """The hosts a VM of the anti-affinity group is on."""

    def group_on_host(self, tx: Tx, group: str, host_id: int) -> bool:
        """Whether a VM of the anti-affinity group is on the host."""


class ClaimStore(Protocol):
    """What a claim reads and writes beside the conditional updates of allocation: pools, VM rows, the group
    commit's GPU writes, its transaction and savepoints, and what a store error means to it."""

    def pool_row(self, tx: Tx, name: str) -> PoolRow | None:
        """The pool named `name`."""

    def all_pools(self, tx: Tx) -> list[PoolRow]:
        """Every pool, by name."""

    def pool_names(self, tx: Tx) -> list[str]:
        """Every pool's name, sorted."""

    def vm_by_key(self, tx: Tx, tenant_id: int, key: str) -> str | None:
        """The id of the tenant's VM made with an idempotency key."""

    def read_claim(self, tx: Tx, tenant: str, pool: str | None, key: str | None) -> ClaimRead:
        """A claim's first read (tenant, VM made by the key, pools, whether any priority class), sent together."""

    def add_vms(self, tx: Tx, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert VM rows in one statement."""

    def together(self, tx: Tx) -> AbstractContextManager[None]:
        """Writes whose results nobody reads, sent to the store together (their errors raised at the end)."""

    def insert_claims(self, tx: Tx, vms: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]],
                      scheds: Sequence[VmSchedRow], events: Sequence[NewEvent]) -> None:
        """Insert claims' VM, device, scheduling and audit rows, a statement per kind."""

    def write_claim(self, tx: Tx, w: ClaimWrite) -> ClaimOutcome:
        """Every write of one claim sent together; what its conditional updates did."""

    def write_batch(self, tx: Tx, w: BatchWrite) -> list[int] | None:
        """Every write of a group commit sent together; None if a conditional update did not pass, else the
        tenants with pool-scoped limits still to charge."""

    def end_read_on(self, tx: Tx) -> None:
        """End the read's transaction on `tx`."""

    def claim_turn_alone(self, tx: Tx) -> AbstractContextManager[None]:
        """The claim turn across the store's processes for one claim alone while the block runs (PostgreSQL)."""

    def share_claim_turn(self, tx: Tx) -> None:
        """Take the claim turn beside the other claims' writes until `tx`'s transaction ends (PostgreSQL)."""

    def read_to_write(self, tx: Tx) -> None:
        """Ready `tx`, where a claim's read ran, for its write (on PostgreSQL the read's transaction goes on)."""

    def write_on(self, tx: Tx) -> AbstractContextManager[Callable[[], None]]:
        """A write transaction on `tx`, rolled back unless its commit is called."""

    def savepoint(self, tx: Tx) -> AbstractContextManager[Callable[[], None]]:
        """A savepoint, rolled back on an error or by the undo it gives."""

    def claim_error(self, exc: BaseException) -> ClaimError | None:
        """What a store error raised by a claim's write means."""


class FitMaskStore(Protocol):
    """GPUs' fit masks, the catalog they were computed with, and the host summaries."""

    def meta_value(self, tx: Tx, key: str) -> str | None:
        """A value of the store's meta table."""

    def set_meta_value(self, tx: Tx, key: str, value: str) -> None:
        """Store a value in the meta table."""

    def mask_rows(self, tx: Tx) -> list[MaskRow]:
        """Every GPU as its mask is computed from."""

    def set_masks(self, tx: Tx, changes: Sequence[tuple[int, int, int]]) -> None:
        """Set (GPU id, fit mask, lacked bits) of GPUs."""

    def summaries_from_gpus(self, tx: Tx) -> dict[SummaryKey, tuple[int, int]]:
        """The host summaries the GPU rows give."""

    def stored_summaries(self, tx: Tx) -> dict[SummaryKey, tuple[int, int]]:
        """The host summaries as stored."""

    def replace_summaries(self, tx: Tx, rows: Mapping[SummaryKey, tuple[int, int]]) -> None:
        """Make `rows` every host summary."""


class FleetStore(Protocol):
    """The whole fleet, read at once (planning)."""

    def fleet_rows(self, tx: Tx) -> FleetRows:
        """Every pool, GPU and host."""


class GpuLoadStore(Protocol):
    """GPUs' measured loads (the latest sample of each)."""

    def known_gpus(self, tx: Tx, gpu_ids: Collection[int]) -> set[int]:
        """Which of `gpu_ids` are GPUs in the store."""

    def put_loads(self, tx: Tx, loads: Mapping[int, float], at: datetime) -> None:
        """Make these loads (GPU id -> 0..1), sampled at `at`, the GPUs' latest."""

    def pool_loads(self, tx: Tx, pool_id: int, since: datetime) -> dict[int, float]:
        """The loads sampled since `since` of the pool's GPUs, by GPU id."""


class HostStore(Protocol):
    """Hosts: scheduling state and the VMs on them."""

    def host_state(self, tx: Tx, name: str) -> HostState | None:
        """A host by name."""

    def host_names(self, tx: Tx) -> list[str]:
        """Every host's name, sorted."""

    def host_rows(self, tx: Tx) -> list[HostRow]:
        """Every host, by name."""

    def set_host_state(self, tx: Tx, host_id: int, state: str) -> None:
        """Set a host's scheduling state."""

    def vms_on_host(self, tx: Tx, host_id: int, but_state: str) -> list[tuple[str, str]]:
        """(tenant, VM name) of the host's VMs not in `but_state`."""

    def host_named(self, tx: Tx, name: str) -> HostRow | None:
        """A host by name."""

    def gpus_of_host(self, tx: Tx, name: str) -> dict[str, HostGpu]:
        """The GPUs of a host (by name), by PCI address."""

    def host_of_gpu(self, tx: Tx, gpu_id: int) -> HostRow:
        """The host of a GPU."""


class HostTypeStore(Protocol):
    """What each host calls each profile (type ids per GPU), and the profiles a GPU's host lacks."""

    def type_ids(self, tx: Tx, gpu_ids: Collection[int]) -> dict[int, TypeIds]:
        """The ids recorded for each GPU, by kind and profile."""

    def replace_type_ids(self, tx: Tx, gpu_id: int, ids: Mapping[str, Mapping[str, str]]) -> None:
        """Make `ids` all the ids recorded for the GPU."""

    def discovered_gpus(self, tx: Tx, host_id: int) -> list[TypedGpu]:
        """A host's GPUs as a discovery compares them, by PCI address."""

    def set_lacked(self, tx: Tx, gpu_id: int, lacks: int, lacked_types: dict[str, str] | None, fits: int) -> None:
        """Set what the GPU's host lacks and its fit mask, with a new version."""

    def lacking_gpus(self, tx: Tx, pool_id: int) -> list[LackingGpu]:
        """The pool's GPUs whose host lacks type ids, by GPU id."""


class IdempotencyStore(Protocol):
    """Idempotency keys: per caller scope and key, the request's fingerprint and its response."""

    def drop_expired_key(self, tx: Tx, scope: str, key: str, now: datetime) -> None:
        """Delete the key if it expired by `now`."""

    def add_key(self, tx: Tx, scope: str, key: str, fingerprint: str, now: datetime, expires: datetime) -> bool:
        """Record the key in flight; False when the scope holds it already."""

    def key_row(self, tx: Tx, scope: str, key: str) -> KeyRow | None:
        """The key as stored."""

    def restart_key(self, tx: Tx, row: KeyRow, now: datetime, expires: datetime) -> bool:
        """Claim an in-flight key again if unchanged since `row`; whether this call did."""

    def complete_key(self, tx: Tx, scope: str, key: str, status_code: int, response: Any,
                     headers: dict[str, str]) -> None:
        """Mark the key done with its response."""

    def drop_in_flight_key(self, tx: Tx, scope: str, key: str) -> None:
        """Delete the key if still in flight."""

    def purge_keys(self, tx: Tx, now: datetime) -> int:
        """Delete expired keys; how many."""


class InventoryStore(Protocol):
    """Pools, hosts and GPUs as an inventory apply reads and writes them (rows by column name)."""

    def pool_rows(self, tx: Tx) -> dict[str, Row]:
        """Every pool, by name."""

    def add_pool(self, tx: Tx, name: str, fields: Mapping[str, Any]) -> None:
        """Insert a pool."""

    def update_pool(self, tx: Tx, pool_id: int, fields: Mapping[str, Any]) -> None:
        """Set a pool's columns."""

    def pool_ids(self, tx: Tx) -> dict[str, int]:
        """Every pool's id, by name."""

    def remove_pool(self, tx: Tx, pool_id: int) -> None:
        """Delete a pool, its GPUs left in none."""

    def host_rows(self, tx: Tx) -> dict[str, Row]:
        """Every host, by name."""

    def gpu_declarations(self, tx: Tx, columns: Sequence[str]) -> dict[int, dict[str, tuple[int, tuple[Any, ...]]]]:
        """Every GPU's id and the values of `columns`, by host id and PCI address."""

    def gpu_row(self, tx: Tx, gpu_id: int) -> Row:
        """One GPU's whole row."""

    def update_host(self, tx: Tx, host_id: int, fields: Mapping[str, Any]) -> None:
        """Set a host's columns."""

    def add_hosts(self, tx: Tx, rows: Sequence[dict[str, Any]]) -> dict[str, int]:
        """Insert hosts; their ids by name."""

    def remove_host(self, tx: Tx, host_id: int) -> None:
        """Delete a host and its GPUs."""

    def host_gpu_ids(self, tx: Tx, host_id: int) -> list[int]:
        """The host's GPU ids."""

    def vms_on_gpus(self, tx: Tx, gpu_ids: Sequence[int]) -> list[str]:
        """Names of the VMs with devices on these GPUs."""

    def vms_placed_on(self, tx: Tx, host_id: int) -> list[str]:
        """Names of the VMs placed on the host."""

    def vms_in_pool(self, tx: Tx, pool_id: int) -> list[str]:
        """Names of the VMs in the pool."""

    def update_gpu(self, tx: Tx, gpu_id: int, values: Mapping[str, Any], fits: int, less_lacked: bool) -> None:
        """Set a GPU's columns and fit mask, with a new version."""

    def remove_gpu(self, tx: Tx, gpu_id: int) -> None:
        """Delete a GPU."""

    def add_gpus(self, tx: Tx, rows: Sequence[dict[str, Any]]) -> None:
        """Insert GPUs."""

    def pools_by_name(self, tx: Tx) -> list[Row]:
        """Every pool, by name."""

    def hosts_by_name(self, tx: Tx) -> list[Row]:
        """Every host, by name."""

    def host_gpus(self, tx: Tx, host_id: int) -> list[Row]:
        """A host's GPUs, by PCI address."""

    def pool_gpu_kinds(self, tx: Tx, pool_id: int) -> list[tuple[str, str]]:
        """(model, mode) of each GPU in a pool."""


class LeaderLeaseStore(Protocol):
    """The leader's lease."""

    def write_leader(self, tx: Tx, holder: str, address: str, until: datetime) -> None:
        """Record the leader until `until`."""

    def clear_leader(self, tx: Tx, holder: str) -> None:
        """Delete the leader's lease if `holder` has it."""

    def leader(self, tx: Tx) -> LeaderLease | None:
        """The leader's lease, run out or not."""


class MoveStore(Protocol):
    """Rebalance moves: the row of each under way, its steps, the audit of those done, and what a move reads."""

    def placed_devices(self, tx: Tx) -> list[PlacedDevice]:
        """Every device a VM holds, where it sits."""

    def held_devices(self, tx: Tx, vm_id: str) -> list[HeldDevice]:
        """A VM's devices with their GPUs' PCI address, model and mode, by id."""

    def host_row(self, tx: Tx, host_id: int) -> HostRow:
        """A host a VM or a move refers to."""

    def host_gpus(self, tx: Tx, host_id: int) -> list[TargetGpu]:
        """A host's GPUs."""

    def last_move(self, tx: Tx, vm_id: str) -> MoveEvent | None:
        """A VM's latest `vm.move` that succeeded."""

    def add_move(self, tx: Tx, vm_id: str, from_host_id: int, old_devices: Sequence[str], was_running: bool,
                 params: dict[str, Any]) -> None:
        """Record a move starting from the VM's host and devices."""

    def set_move_step(self, tx: Tx, vm_id: str, step: str, *, to_host_id: int | None = None,
                      new_devices: Sequence[str] | None = None, domain_uuid: str | None = None) -> None:
        """Record the step a move reached (with its new host and devices, or its new domain)."""

    def end_move(self, tx: Tx, vm_id: str, holder: str, values: dict[str, Any]) -> None:
        """Set `values` on the VM and release `holder`'s lease on it; delete the move's row."""

    def move_row(self, tx: Tx, vm_id: str) -> MoveRow | None:
        """A VM's move under way."""

    def pending_moves(self, tx: Tx) -> list[PendingMove]:
        """Every move under way or interrupted, oldest first."""


class OperationStore(Protocol):
    """Operations and their leases."""

    def add_operation(self, tx: Tx, row: OperationRow) -> None:
        """Insert a new operation."""

    def operation(self, tx: Tx, op_id: str) -> OperationRow | None:
        """One operation."""

    def operations(self, tx: Tx, tenant_id: int | None, states: Collection[str] | None,
                   limit: int) -> list[OperationRow]:
        """Operations, newest first, of a tenant and in states when given."""

    def creates_since(self, tx: Tx, tenant_id: int | None, since: datetime, other_than: str) -> list[OperationRow]:
        """A tenant's vm.create operations since a time, oldest first."""

    def retake_operation(self, tx: Tx, row: OperationRow, holder: str, expires: datetime, now: datetime) -> bool:
        """Give the operation to `holder` if unchanged since `row`; whether this call did."""

    def renew_operations(self, tx: Tx, holder: str, op_ids: Collection[str], expires: datetime) -> None:
        """Extend `holder`'s leases."""

    def end_operation(self, tx: Tx, op_id: str, holder: str, state: str, *, vm_id: str | None,
                      result: dict[str, Any] | None, error: dict[str, Any] | None, now: datetime) -> bool:
        """End a running operation `holder` holds; whether it still held it."""

    def unfinished_leases(self, tx: Tx, limit: int) -> list[OperationLease]:
        """Unfinished operations that may be free to take, oldest first."""

    def operation_counts(self, tx: Tx) -> dict[str, int]:
        """Operations per state."""


class QuotaStore(Protocol):
    """Tenants' limits, guarantees and usage; hosts' used capacity; what allocations hold."""

    def allocated(self, tx: Tx, tenant_id: int, scope: str, states: Collection[str]) -> dict[str, int]:
        """What the tenant's VMs in `states` hold (all pools, or one)."""

    def tenant_quota(self, tx: Tx, tenant_id: int) -> TenantQuota:
        """The tenant's global usage, limits and guarantees."""

    def tenant_refs(self, tx: Tx) -> list[tuple[int, str]]:
        """Every tenant's (id, name), by id."""

    def lock_tenant(self, tx: Tx, tenant_id: int) -> None:
        """Lock the tenant's row for the transaction."""

    def set_tenant_columns(self, tx: Tx, tenant_id: int, values: dict[str, Any]) -> None:
        """Set usage, limit or guarantee columns of the tenant."""

    def scoped_rows(self, tx: Tx, tenant_id: int, scope: str | None = None, *,
                    by_id: bool = False) -> list[ScopedRow]:
        """The tenant's scoped limits."""

    def put_scoped(self, tx: Tx, tenant_id: int, scope: str, resource: str, used: int,
                   values: dict[str, Any]) -> None:
        """Set (or add) a scoped limit."""

    def drop_scoped(self, tx: Tx, tenant_id: int, scope: str, resource: str) -> None:
        """Delete a scoped limit."""

    def set_scoped_used(self, tx: Tx, row_id: int, used: int) -> None:
        """Set a scoped limit's usage."""

    def refresh_has_scoped(self, tx: Tx, tenant_id: int) -> None:
        """Record whether the tenant has scoped limits."""

    def host_refs(self, tx: Tx) -> list[tuple[int, str]]:
        """Every host's (id, name), by id."""

    def lock_host_usage(self, tx: Tx, host_id: int) -> tuple[int, int]:
        """Lock the host's row; its used vCPUs and memory."""

    def host_allocated(self, tx: Tx, host_id: int, states: Collection[str]) -> tuple[int, int]:
        """The vCPUs and memory the host's VMs in `states` hold."""

    def set_host_used(self, tx: Tx, host_id: int, values: dict[str, int]) -> None:
        """Set the host's used capacity."""


class ReportStore(Protocol):
    """What the operations views (status, the doctor, metrics) read: summaries, counts and the rows the doctor
    checks."""

    def pool_names(self, tx: Tx, pool_ids: Collection[int] | None = None) -> dict[int, str]:
        """Pools' names by id (only those of `pool_ids` when given)."""

    def host_id(self, tx: Tx, name: str) -> int | None:
        """The id of the host named `name`."""

    def hosts_by_state(self, tx: Tx, pool_ids: Sequence[int] | None = None, host: int | None = None) -> dict[str, int]:
        """How many hosts are in each state (of those with a GPU in `pool_ids`, and of `host`, when given)."""

    def mode_summaries(self, tx: Tx, pool_ids: Sequence[int] | None = None,
                       host: int | None = None) -> list[ModeSummary]:
        """The GPUs by mode (of `pool_ids` and `host` when given)."""

    def gpu_total(self, tx: Tx, pool_ids: Sequence[int] | None = None, host: int | None = None) -> int:
        """How many GPUs there are (of `pool_ids` and `host` when given)."""

    def gpu_page(self, tx: Tx, pool_ids: Sequence[int] | None, host: int | None, offset: int,
                 limit: int | None) -> list[PagedGpu]:
        """GPUs by host name and PCI address, `limit` of them from `offset`."""

    def pool_gpu_states(self, tx: Tx, pool_ids: Collection[int]) -> list[GpuState]:
        """The GPUs of `pool_ids` counted by pool, state and whether their host is active."""

    def all_gpus(self, tx: Tx, mode: str | None = None) -> list[ReportGpu]:
        """Every GPU (only those in `mode` when given)."""

    def all_devices(self, tx: Tx) -> list[ReportDevice]:
        """Every device's GPU and slot."""

    def vms_holding_devices(self, tx: Tx, state: str) -> list[HeldDevices]:
        """The VMs in `state` that hold devices, with how many."""

    def host_vm_usage(self, tx: Tx, states: Collection[str]) -> dict[int, tuple[int, int]]:
        """Per host, the (vCPUs, memory MiB) its VMs in `states` take."""

    def orphan_devices(self, tx: Tx) -> list[OrphanDevice]:
        """The devices whose VM is gone."""

    def misplaced_devices(self, tx: Tx) -> list[MisplacedDevice]:
        """The devices on a GPU of another host than their VM's."""

    def vms_since(self, tx: Tx, states: Collection[str], before: datetime) -> list[VmSince]:
        """The VMs in `states` that have not changed since `before`."""

    def scoped_usages(self, tx: Tx) -> list[ScopedUsage]:
        """Every tenant's stored scoped usage."""

    def gpu_counts(self, tx: Tx) -> list[Count]:
        """GPUs by (model, mode, pool id)."""

    def host_counts(self, tx: Tx) -> list[Count]:
        """Hosts by (state,)."""

    def device_counts(self, tx: Tx) -> list[Count]:
        """Devices by (profile, state)."""

    def vm_counts(self, tx: Tx) -> list[Count]:
        """VMs by (state,)."""

    def event_counts(self, tx: Tx) -> list[Count]:
        """Audit events by (action, result)."""

    def refusal_counts(self, tx: Tx) -> list[Count]:
        """Refused requests' events by (error code,)."""

    def provision_events(self, tx: Tx) -> list[ProvisionEvent]:
        """Every VM's `vm.create` and `vm.start` events, oldest first."""


class SchedulingStore(Protocol):
    """Priority classes, tenants' scheduling settings, the share tree's accounts, the scheduling settings, fair
    share's usage intervals and ledgers, the queue, and what a preemption plans from."""

    def stored_settings(self, tx: Tx) -> dict[str, float]:
        """The scheduling settings stored, by name."""

    def put_setting(self, tx: Tx, name: str, value: float | None) -> None:
        """Store a scheduling setting (None: delete it)."""

    def class_rows(self, tx: Tx) -> list[ClassRow]:
        """Every priority class, highest value first, then by name."""

    def any_class(self, tx: Tx) -> bool:
        """Whether there is any priority class."""

    def has_class(self, tx: Tx, name: str) -> bool:
        """Whether a priority class exists."""

    def add_class(self, tx: Tx, row: ClassRow, created_at: datetime) -> None:
        """Insert a priority class (a default one takes the place of the previous default)."""

    def class_use(self, tx: Tx, name: str) -> ClassUse:
        """What uses a priority class."""

    def remove_class(self, tx: Tx, name: str) -> None:
        """Delete a priority class."""

    def tenant_sched(self, tx: Tx, tenant_id: int) -> TenantSchedRow | None:
        """A tenant's scheduling row."""

    def tenant_classes(self, tx: Tx, tenant_id: int) -> list[str]:
        """The priority classes a tenant may use, sorted (none: any)."""

    def put_tenant_sched(self, tx: Tx, tenant_id: int, row: TenantSchedRow, classes: Collection[str]) -> None:
        """Replace a tenant's scheduling row and allowed classes."""

    def tenant_shares(self, tx: Tx) -> list[TenantShare]:
        """Every tenant with its shares and account."""

    def account_rows(self, tx: Tx) -> list[AccountRow]:
        """Every account of the share tree."""

    def has_account(self, tx: Tx, name: str) -> bool:
        """Whether an account exists."""

    def put_account(self, tx: Tx, row: AccountRow) -> None:
        """Set (or add) an account."""

    def account_members(self, tx: Tx, name: str) -> list[str]:
        """The accounts, then the tenants, directly under an account."""

    def remove_account(self, tx: Tx, name: str) -> None:
        """Delete an account."""

    def gpu_model_counts(self, tx: Tx) -> list[tuple[str, int]]:
        """How many managed GPUs of each model the fleet has."""

    def ledger_rows(self, tx: Tx) -> list[LedgerRow]:
        """Every tenant's folded usage."""

    def put_ledger(self, tx: Tx, row: LedgerRow) -> None:
        """Set (or add) a tenant's folded usage."""

    def interval_rows(self, tx: Tx) -> list[IntervalRow]:
        """Every closed usage interval not yet folded."""

    def interval_count(self, tx: Tx) -> int:
        """How many closed usage intervals wait to be folded."""

    def drop_intervals(self, tx: Tx, ids: Collection[int]) -> None:
        """Delete folded usage intervals."""

    def free_vms_on(self, tx: Tx, host_ids: Collection[int], states: Collection[str]) -> list[HolderRow]:
        """The VMs with a scheduling row on these hosts, in `states`, that no process holds."""

    def device_kinds(self, tx: Tx, vm_ids: Collection[str]) -> list[DeviceKind]:
        """The devices of these VMs."""

    def device_places(self, tx: Tx, vm_id: str) -> list[DevicePlace]:
        """A VM's devices, by PCI address and start."""

    def claim_charges(self, tx: Tx, tenant_ids: Collection[int], states: Collection[str]) -> list[VmCharge]:
        """What these tenants' VMs in `states` charge, oldest admission first."""

    def vm_charges(self, tx: Tx, vm_ids: Collection[str]) -> list[VmCharge]:
        """What these VMs charge."""

    def guarantees(self, tx: Tx, tenant_ids: Collection[int], resources: Sequence[str],
                   scope: str | None = None) -> list[Guarantee]:
        """These tenants' guarantees: of `resources` globally, and scoped (only `scope`'s when given)."""

    def event_params(self, tx: Tx, action: str, result: str) -> list[Any]:
        """The parameters of the audit events of `action` that ended in `result`."""

    def queued(self, tx: Tx, holder: str, trying: str | None = None) -> list[OperationRow]:
        """The pending operations the queue (`holder`) holds, and with `trying` those an admitter is trying."""

    def queued_count(self, tx: Tx, holder: str) -> int:
        """How many pending operations the queue holds."""

    def take_queued(self, tx: Tx, op_id: str, holder: str, taker: str, now: datetime) -> bool:
        """Give a queued operation to `taker` if the queue still holds it; whether this call did."""

    def drop_queued(self, tx: Tx, op_id: str, error: dict[str, Any], now: datetime) -> None:
        """End a pending operation as failed."""

    def end_admission(self, tx: Tx, op_id: str, taker: str, state: str, *, holder_after: str | None,
                      vm_id: str | None, result: dict[str, Any] | None, error: dict[str, Any] | None,
                      now: datetime) -> None:
        """Record one try of a queued operation `taker` took."""


class TenantStore(Protocol):
    """Tenants."""

    def tenant_name(self, tx: Tx, tenant_id: int) -> str | None:
        """A tenant's name by id."""

    def tenant_id(self, tx: Tx, name: str) -> int | None:
        """A tenant's id by name."""

    def tenant_by_name(self, tx: Tx, name: str) -> TenantRow | None:
        """A tenant by name."""

    def tenant_rows(self, tx: Tx, only_id: int | None = None) -> list[TenantRow]:
        """Every tenant (or one), by name."""

    def add_tenant(self, tx: Tx, name: str) -> bool:
        """Insert a tenant; False when the name is taken."""

    def tenant_vm_names(self, tx: Tx, tenant_id: int) -> list[str]:
        """The tenant's VM names, sorted."""

    def remove_tenant(self, tx: Tx, tenant_id: int) -> None:
        """Delete a tenant and its scoped limits."""

    def set_token_hash(self, tx: Tx, tenant_id: int, digest: str | None) -> None:
        """Set or clear the hash of a tenant's token."""


class VmStore(Protocol):
    """VMs: the row, and the compare-and-sets on state and lease."""

    def vm_row(self, tx: Tx, vm_id: str) -> VmRow | None:
        """One VM."""

    def retake_vm(self, tx: Tx, row: VmRow, values: dict[str, Any]) -> bool:
        """Set `values` if state and lease holder are as `row` read them; whether this call did."""

    def move_vm(self, tx: Tx, vm_id: str, holder: str, from_states: Collection[str],
                values: dict[str, Any]) -> bool:
        """Set `values` if the VM is in `from_states` and `holder` holds it; whether it did."""

    def set_vm_lease(self, tx: Tx, vm_id: str, holder: str, holder_after: str | None,
                     expires: datetime | None) -> bool:
        """Set the lease if `holder` has it; whether it did."""

    def renew_vm_leases(self, tx: Tx, leases: Collection[tuple[str, str]], expires: datetime) -> set[str]:
        """Extend the leases (VM id, holder) still held, in one statement; the VMs' ids it extended."""

    def vms_by(self, tx: Tx, *, vm_id: str | None = None, tenant: str | None = None, name: str | None = None,
               id_prefix: str | None = None, limit: int | None = None) -> list[VmRow]:
        """VMs (with their tenant's name) by id, name (in a tenant), or id prefix."""

    def tenant_vms(self, tx: Tx, tenant_id: int | None) -> list[VmRow]:
        """Every VM (or a tenant's), with its tenant's name, by tenant and name."""

    def vm_devices(self, tx: Tx, vm_id: str) -> list[DeviceRow]:
        """A VM's devices, by GPU and start."""

    def all_vms(self, tx: Tx) -> list[VmRow]:
        """Every VM, in no particular order."""

    def vm_statuses(self, tx: Tx) -> list[VmStatus]:
        """Every VM's host, state and lease, in no particular order."""

    def device_refs(self, tx: Tx) -> list[DeviceRef]:
        """Every device a VM holds."""

    def reclaim_devices(self, tx: Tx, vm_id: str) -> None:
        """Mark every device of the VM claimed (to be made again on its host)."""

    def host_of(self, tx: Tx, host_id: int) -> tuple[str, str] | None:
        """A host's (name, driver)."""

    def pool_name(self, tx: Tx, pool_id: int) -> str | None:
        """A pool's name."""

    def vm_place(self, tx: Tx, vm_id: str) -> VmPlace | None:
        """A VM with its tenant's name, host, pool's name and devices."""

    def set_devices_ready(self, tx: Tx, handles: Mapping[str, dict[str, Any]]) -> None:
        """Mark devices (by id) made on their host, with their handles."""

    def vm_generation(self, tx: Tx, vm_id: str) -> int | None:
        """A VM's generation now."""

    def set_vm_error(self, tx: Tx, vm_id: str, error: str | None) -> None:
        """Set or clear a VM's error."""

    def set_power_state(self, tx: Tx, row: VmRow, state: str) -> bool:
        """Move a VM no process holds from `row`'s state and generation to `state`; whether it did."""

    def remove_failed_vm(self, tx: Tx, vm_id: str) -> bool:
        """Delete a failed VM; whether it did."""

    def remove_vm(self, tx: Tx, vm_id: str) -> None:
        """Delete a VM and its device rows."""

    def tenant_has_scoped(self, tx: Tx, tenant_id: int) -> bool:
        """Whether a VM's tenant has scoped limits."""

    def adopt_device(self, tx: Tx, device_id: str, new_id: str, uuid: str, handle: dict[str, Any]) -> None:
        """Give a just-claimed device the id, UUID and handle it has on its host."""

    def set_adopted(self, tx: Tx, vm_id: str, state: str, domain_uuid: str) -> None:
        """Set an adopted VM's state and domain, unleased."""


class UtilizationStore(Protocol):
    """What a utilization round joins its host samples with, and each GPU host's latest sample."""

    def gpus_on_hosts(self, tx: Tx, host_names: Collection[str]) -> list[SampledGpu]:
        """The GPUs of the named hosts."""

    def devices_on_gpus(self, tx: Tx, gpu_ids: Collection[int]) -> list[SampledDevice]:
        """The devices on these GPUs, with their VM and its tenant."""

    def host_ids(self, tx: Tx, host_names: Collection[str]) -> dict[str, int]:
        """The ids of the named hosts, by name."""

    def samples_of(self, tx: Tx, host_ids: Collection[int]) -> dict[int, SampleRow]:
        """The kept samples of these hosts, by host id."""

    def put_samples(self, tx: Tx, rows: Sequence[SampleRow]) -> None:
        """Make these rows their hosts' kept samples."""

    def host_samples(self, tx: Tx, host_names: Collection[str] | None) -> list[HostSample]:
        """The kept samples of the named hosts (None: every host), with their names, by host name."""


class VmSchedStore(Protocol):
    """VMs' scheduling rows: priority, fair-share charge, preemption history."""

    def set_preemption_history(self, tx: Tx, vm_id: str, preemptions: int, protected_below: int | None,
                               protected_until: float) -> None:
        """Set the VM's preemption count and the protection (below a priority, until epoch seconds) it has."""

    def add_vm_scheds(self, tx: Tx, rows: Sequence[VmSchedRow]) -> None:
        """Insert just-claimed VMs' scheduling rows."""

    def preemptions(self, tx: Tx, vm_id: str) -> int:
        """How often a VM was preempted."""

    def holdings(self, tx: Tx) -> list[Holding]:
        """What every VM with a scheduling row is charged now."""

    def class_vm_counts(self, tx: Tx) -> dict[str | None, int]:
        """How many VMs hold each priority class."""


class Store(Protocol):
    """The store as the service uses it: one attribute per aggregate."""

    @property
    def tokens(self) -> TokenStore:
        """Credentials."""

    @property
    def events(self) -> EventStore:
        """The audit trail."""

    @property
    def candidates(self) -> CandidateStore:
        """A claim's GPU and device rows."""

    @property
    def candidate_pages(self) -> CandidatePageStore:
        """Placement's candidate pages."""

    @property
    def charges(self) -> ChargeStore:
        """A claim's charges."""

    @property
    def claims(self) -> ClaimStore:
        """Claims."""

    @property
    def fit_masks(self) -> FitMaskStore:
        """Fit masks and host summaries."""

    @property
    def fleet(self) -> FleetStore:
        """The fleet."""

    @property
    def gpu_loads(self) -> GpuLoadStore:
        """GPUs' measured loads."""

    @property
    def hosts(self) -> HostStore:
        """Hosts."""

    @property
    def host_types(self) -> HostTypeStore:
        """Hosts' type ids."""

    @property
    def idempotency(self) -> IdempotencyStore:
        """Idempotency keys."""

    @property
    def inventory(self) -> InventoryStore:
        """The inventory."""

    @property
    def leader_lease(self) -> LeaderLeaseStore:
        """The leader's lease."""

    @property
    def moves(self) -> MoveStore:
        """Rebalance moves."""

    @property
    def operations(self) -> OperationStore:
        """Operations."""

    @property
    def quotas(self) -> QuotaStore:
        """Quotas and usage."""

    @property
    def reports(self) -> ReportStore:
        """The operations views' reads."""

    @property
    def scheduling(self) -> SchedulingStore:
        """Scheduling."""

    @property
    def tenants(self) -> TenantStore:
        """Tenants."""

    @property
    def utilization(self) -> UtilizationStore:
        """Utilization rounds' reads."""

    @property
    def vms(self) -> VmStore:
        """VMs."""

    @property
    def vm_sched(self) -> VmSchedStore:
        """VMs' scheduling rows."""


STORE: Store = SqlStore()

__all__ = [
    "STORE", "CandidatePageStore", "CandidateStore", "ChargeStore", "ClaimStore", "EventStore", "FitMaskStore",
    "FleetStore",
    "GpuLoadStore", "HostStore", "HostTypeStore",
    "IdempotencyStore", "InventoryStore", "LeaderLeaseStore", "MoveStore", "OperationStore", "QuotaStore",
    "ReportStore", "SchedulingStore", "Store", "TenantStore", "TokenStore", "Tx", "UtilizationStore", "VmSchedStore",
    "VmStore", "utcnow",
]
