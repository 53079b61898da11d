"""The claim: a VM request placed and charged in the store, in one path.

    read (no write lock): the tenant, its idempotency key, the pools, each pool's candidates -> plan, class
    write (one short transaction per pool tried): charge the quotas -> take host and GPUs by compare-and-set
                                                  -> insert the VM and its devices -> commit
                                                  (all of it sent at once, answers read after: one round trip
                                                  on PostgreSQL; a limit that would pass goes step by step)
    one retry loop around both: any conditional update that finds the store changed since the read (a GPU's
    version, the host's capacity, an anti-affinity group placed meanwhile) rolls back and plans again

The write transaction is also where every refusal is decided and explained: a global limit that would pass
ends the claim (QuotaExceeded); a pool whose own limits would pass, or where nothing fits, adds its reasons
and the next pool is tried; a dry run takes everything and rolls back. Planning, the costly part, runs beside
other claims; only the conditional updates decide.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.backings import backing_for
from vgpu_ctl.core.placement import (
    LACKS_TYPE,
    PlacementPlan,
    PlacementRequest,
    Policy,
    TaskShape,
    describe_refusal,
    explain,
    get_policy,
    plan,
)
from vgpu_ctl.core.vm_state import VmState
from vgpu_ctl.errors import Conflict, InvalidInput, NoCapacity, NotFound, QuotaExceeded, Refused, did_you_mean
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.audit import event
from vgpu_ctl.service.leases import expiry
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.requests import DeviceInfo, PlacedDevice, Placement, VmInfo, VmRequest
from vgpu_ctl.store.claims import ClaimWrite, PoolRow
from vgpu_ctl.store.events import NewEvent
from vgpu_ctl.store.unit import StoreError
from vgpu_ctl.store.vm_sched import VmSchedRow

if TYPE_CHECKING:
    from vgpu_ctl.core.priority import PriorityClass
    from vgpu_ctl.service.controller import Controller

MAX_RETRIES = 30
CONTENDED_AFTER = 3  # races lost before a claim holds its turn from the read on (`Database.claim_turn`)


# -- results ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Claimed:
    """The VM this claim wrote (state placed), as written: nothing read back."""

    vm: VmInfo


@dataclass(frozen=True)
class AlreadyMade:
    """The id of the tenant's VM that an earlier request with the same idempotency key made; nothing claimed."""

    vm_id: str


@dataclass(frozen=True)
class Planned:
    """A dry run: where the VM would go now; nothing written."""

    placement: Placement


ClaimResult = Claimed | AlreadyMade | Planned


@dataclass(frozen=True)
class Ask:
    """A request as the claim sees it once the store has been read: tenant, pools, the quota charge."""

    tenant_id: int
    pools: list[PoolRow]
    profiles: tuple[str, ...]
    delta: dict[str, int]
    preq: PlacementRequest
    pool_names: dict[int, str]
    any_class: bool  # whether the store holds any priority class


# -- reading the request ----------------------------------------------------------------------------------------

@lru_cache(maxsize=256)
def pool_policy(name: str, demand_json: str | None) -> Policy:
    """The policy of a pool, with its demand as the store holds it: JSON text of profile -> weight, or of a list
    of typical requests (profile, gpus, vcpus, memory_mib, weight)."""
    stored = json.loads(demand_json) if demand_json else None
    if not isinstance(stored, list):
        return get_policy(name, stored)
    shapes: dict[TaskShape, float] = {}
    for t in stored:
        shape = TaskShape((t["profile"],), t.get("gpus", 1), t.get("vcpus", 0), t.get("memory_mib", 0))
        shapes[shape] = shapes.get(shape, 0.0) + float(t["weight"])
    return get_policy(name, shapes)


def pool_row(conn: Tx, name: str) -> PoolRow:
    """The pool named `name` with the columns a claim needs (id, name, policy, template, demand); NotFound
    naming the known pools."""
    row = STORE.claims.pool_row(conn, name)
    if row is None:
        known = ", ".join(STORE.claims.pool_names(conn))
        raise NotFound(f"pool {name!r} not found (known: {known or 'none'})",
                       reasons=[{"field": "pool", "value": name}])
    return row


def all_pools(conn: Tx) -> list[PoolRow]:
    """Every pool with the columns a claim needs, by name (the order a request without a pool tries them)."""
    return STORE.claims.all_pools(conn)


def check_profiles(conn: Tx | None, catalog: Catalog, req: VmRequest, pools: Sequence[PoolRow],
                   offers_too: bool = True) -> list[PoolRow]:
    """InvalidInput for an unknown or (with `offers_too`) unoffered profile; else the pools that offer every
    requested one (all of `pools` if none does, so that the refusal explains each; `conn` only for that). A VM
    without vGPUs: every pool (its hosts are those holding one of its GPUs)."""
    if not req.vgpus:
        return list(pools)
    names = catalog.profile_names()
    wanted = list(dict.fromkeys(v.profile for v in req.vgpus))
    for profile in wanted:
        if profile not in names:
            raise InvalidInput(f"unknown profile {profile!r}{did_you_mean(profile, names)} "
                               "(see vgpuctl profiles list)",
                               reasons=[{"field": "profile", "value": profile}])
    if not offers_too:
        return list(pools)
    assert conn is not None, "asking whether pools offer the profiles reads the store"
    offers = alloc.pool_offers(conn, catalog, [(p.id, w) for p in pools for w in wanted])
    for profile in wanted:
        if not any(offers[(p.id, profile)] for p in pools):
            where = f"pool {pools[0].name!r}" if len(pools) == 1 else "any pool"
            raise InvalidInput(f"profile {profile!r} is not offered by {where}",
                               reasons=[{"field": "profile", "value": profile}])
    return [p for p in pools if all(offers[(p.id, w)] for w in wanted)] or list(pools)


def framebuffer(catalog: Catalog, profile: str) -> int:
    """The framebuffer (MiB) a vGPU of `profile` takes; InvalidInput naming the field for an unknown one."""
    offering = catalog.models_offering(profile)
    if not offering:  # callers that charge before they check the profiles get the request's own error
        raise InvalidInput(f"unknown profile {profile!r}{did_you_mean(profile, catalog.profile_names())} "
                           "(see vgpuctl profiles list)", reasons=[{"field": "profile", "value": profile}])
    p = catalog.profile(offering[0], profile)
    assert p is not None
    return p.framebuffer_mib


def charge_of(catalog: Catalog, profiles: Sequence[str], vcpus: int, memory_mib: int) -> dict[str, int]:
    """What a VM of these vGPUs and size charges its tenant's base resources."""
    return {"vms": 1, "vgpus": len(profiles), "framebuffer_mib": sum(framebuffer(catalog, p) for p in profiles),
            "vcpus": vcpus, "memory_mib": memory_mib}


def read_ask(ctl: Controller, conn: Tx, req: VmRequest, offers_too: bool = True) -> Ask | AlreadyMade:
    """What the claim needs to know of the store, or the VM the request's idempotency key already made.
    Without `offers_too` a named pool is not asked whether it offers the profiles (a plan there proves it; the
    claim asks only when none is found)."""
    read = STORE.claims.read_claim(conn, req.tenant, req.pool or None, req.idempotency_key or None)
    t = ctl._visible_tenant(req.tenant, read.tenant_id)
    if read.made is not None:
        return AlreadyMade(read.made)
    if req.pool and not read.pools:
        pool_row(conn, req.pool)  # NotFound naming the known pools
    pools = check_profiles(conn, ctl.catalog, req, read.pools, offers_too or not req.pool)
    profiles = req.profiles()
    delta = charge_of(ctl.catalog, profiles, req.vcpus, req.memory_mib)
    preq = PlacementRequest(profiles, req.vcpus, req.memory_mib, req.labels, req.anti_affinity)
    return Ask(t, pools, profiles, delta, preq, {p.id: p.name for p in pools}, read.any_class)


# -- the claim --------------------------------------------------------------------------------------------------

def claim(ctl: Controller, req: VmRequest, dry_run: bool = False) -> ClaimResult:
    """Place and claim the request (state placed, quotas charged, audited), or with `dry_run` say where it
    would go; the VM an earlier request with its idempotency key made, if there is one. QuotaExceeded or
    NoCapacity explain a refusal (nothing changed); Conflict for a name the tenant uses."""
    for attempt in range(MAX_RETRIES):
        try:
            return _attempt(ctl, req, dry_run, contended=attempt >= CONTENDED_AFTER)
        except alloc.ClaimConflict:
            time.sleep(0.001 * attempt)  # the first retry at once: a conflict means the other claim committed
        except StoreError as exc:
            why = STORE.claims.claim_error(exc)
            if why is None:
                raise
            if why == "contended":
                time.sleep(0.001 * attempt)
                continue
            # The same key with the same name may trip either unique constraint first: a VM made by the key is
            # the answer whichever it was.
            made = _made_by_key(ctl, req) if req.idempotency_key else None
            if made is not None:
                return made
            if why == "idempotency_key":
                continue  # not visible yet to this connection: the next attempt finds it
            if why == "name":
                raise Conflict(f"tenant {req.tenant!r} already has a VM named {req.name!r}",
                               reasons=[{"field": "name", "value": req.name}]) from None
            if why == "layout":  # a plan read from the store's own layout: it lacks a device, and stays so
                raise Conflict("the store is inconsistent: a GPU this request was planned on has a layout that "
                               "lacks a device it holds; `vgpuctl doctor` names it and `vgpuctl reconcile --fix` "
                               "rewrites its occupancy from its devices",
                               reasons=[{"check": "gpu-occupancy", "tenant": req.tenant, "name": req.name}]) from None
            time.sleep(0.001 * (attempt + 1))  # a device position taken meanwhile
    raise Conflict("too many concurrent claims on the same GPUs; try again")


def _made_by_key(ctl: Controller, req: VmRequest) -> AlreadyMade | None:
    """The tenant's VM made with the request's idempotency key, if there is one."""
    assert req.idempotency_key is not None
    with ctl.read() as conn:
        vm_id = STORE.claims.vm_by_key(conn, ctl._tenant_id(conn, req.tenant), req.idempotency_key)
        STORE.claims.end_read_on(conn)
    return None if vm_id is None else AlreadyMade(vm_id)


def _attempt(ctl: Controller, req: VmRequest, dry_run: bool, contended: bool) -> ClaimResult:
    """One try: plan each pool from a read, then charge and take in a write transaction of its own; the
    pools in order until one takes the VM. ClaimConflict when the store changed since the read. A `contended`
    try (it lost races before) holds the claim turn from its read on."""
    from vgpu_ctl.service import scheduling
    # Retrying alone, a claim can lose every race to the others planning the same best slot (a pack pool sends
    # them all there). The turn is taken after the connection, as every claim's write takes it, and the try
    # reads nothing on another: asking the pool for a connection while holding the turn deadlocks with claims
    # that hold the pool's connections and wait for the turn.
    with ctl.read() as conn, ctl.ctx.claim_turn() if contended else nullcontext(), \
            STORE.claims.claim_turn_alone(conn) if contended else nullcontext():  # the other replicas too
        ask = read_ask(ctl, conn, req, offers_too=False)
        if isinstance(ask, AlreadyMade):
            return ask
        reasons: list[dict[str, Any]] = []
        cls: PriorityClass | None = None
        for pool in ask.pools:
            chosen, page = _plan_in_pool(ctl, conn, ask.preq, pool, ask.pool_names)
            if chosen is None and req.pool:  # the named pool was not asked whether it offers the profiles
                check_profiles(conn, ctl.catalog, req, ask.pools)
            if chosen is not None and cls is None:  # in the read: the write only sends and checks
                cls = scheduling.resolve(conn, ask.tenant_id, req.tenant, req.priority, ask.any_class)
            STORE.claims.read_to_write(conn)
            charges = scoped_charges(pool.name, ask.delta, ask.profiles)  # kept on the VM for its release
            with ctl.ctx.claim_turn():
                if chosen is not None and cls is not None and not dry_run:
                    written = _write_at_once(ctl, conn, ask, req, pool, chosen, page, charges, cls, reasons)
                    if written == "refused":
                        continue
                    if written != "over_quota":
                        return Claimed(written)
                done = _write_step_by_step(ctl, conn, ask, req, pool, chosen, page, charges, cls, dry_run, reasons)
            if done is not None:
                return done
        raise _refusal(req, ask.profiles, reasons)


def _write_at_once(ctl: Controller, conn: Tx, ask: Ask, req: VmRequest, pool: PoolRow, chosen: PlacementPlan,
                   page: alloc.Candidates, charges: Mapping[tuple[str, str], int], cls: PriorityClass,
                   reasons: list[dict[str, Any]]) -> VmInfo | Literal["refused", "over_quota"]:
    """Claim the plan with every write sent together (`write_claim`: on PostgreSQL one round trip, then the
    commit): the VM as written; "refused" when the pool's own limits are reached (their reasons added to
    `reasons`); "over_quota" when a global limit would pass (rolled back: the step-by-step write says which).
    ClaimConflict when the host, a GPU or the anti-affinity group changed since the read."""
    with STORE.claims.write_on(conn) as commit:
        row = vm_row(ask.tenant_id, req, pool, chosen, ask.delta, charges)
        records = claim_records(ctl, row, req, pool, chosen, page, cls)
        gpus = [(gid, page.versions[gid], alloc.gpu_state(occ)) for gid, occ in chosen.occupancies.items()]
        done = STORE.claims.write_claim(conn, ClaimWrite(
            ask.tenant_id, ask.delta, chosen.host_id, req.vcpus, req.memory_mib, req.anti_affinity, gpus, [row],
            records.devices, [records.sched], [records.event]))
        if done == "quota":
            return "over_quota"
        if done not in ("written", "written_scoped"):
            raise alloc.ClaimConflict(f"{done} changed since the read (host {chosen.host})")
        if done == "written_scoped":
            failed = alloc.charge_scoped(conn, ask.tenant_id, charges)
            if failed:  # this pool's own limits are reached: the next pool may take it
                reasons.extend(alloc.quota_refusal(conn, ask.tenant_id, req.tenant, {}, failed, charges).reasons)
                return "refused"
        commit()
        return records.vm


def _write_step_by_step(ctl: Controller, conn: Tx, ask: Ask, req: VmRequest, pool: PoolRow,
                        chosen: PlacementPlan | None, page: alloc.Candidates, charges: Mapping[tuple[str, str], int],
                        cls: PriorityClass | None, dry_run: bool, reasons: list[dict[str, Any]]) -> ClaimResult | None:
    """Charge, then take, then record, each step's answer read before the next (a refusal explained at the step
    that decides it, a dry run rolled back): the result, or None with the pool's reasons added to `reasons`."""
    with STORE.claims.write_on(conn) as commit:
        STORE.claims.share_claim_turn(conn)
        failed = charge(conn, ask.tenant_id, req.tenant, ask.delta, charges)
        if failed:  # this pool's own limits are reached: the next pool may take it
            reasons.extend(alloc.quota_refusal(conn, ask.tenant_id, req.tenant, {}, failed, charges).reasons)
            return None
        if chosen is None:
            reasons.append(_capacity_reason(ctl, conn, ask, pool))
            return None
        take_places(conn, req, chosen, page)
        if dry_run:
            return Planned(placement_of(chosen, page, pool.name))
        assert cls is not None
        vm = record_vm(ctl, conn, ask.tenant_id, req, pool, chosen, page, ask.delta, charges, cls)
        commit()
        return Claimed(vm)


def _plan_in_pool(ctl: Controller, conn: Tx, preq: PlacementRequest, pool: PoolRow,
                  pool_names: Mapping[int, str]) -> tuple[PlacementPlan | None, alloc.Candidates]:
    """The pool policy's plan over the pool's candidate pages, page by page, with the page it came from."""
    by_load = pool.policy == "spread-load"
    if by_load:  # weighs what the pool's GPUs were last measured doing (read with the claim's other reads)
        from vgpu_ctl.core.policies.spread_load import make_with_load
        from vgpu_ctl.service import gpu_loads
        policy = make_with_load(gpu_loads.recent(conn, pool.id))
    else:
        policy = pool_policy(pool.policy, pool.demand)
    for page in alloc.candidate_pages(conn, ctl.catalog, preq, pool.id, policy.order, pool_names,
                                      whole_hosts=policy.host_cost is not None):
        # one host per distinct state: the same plan (see distinct_states), not with GPU loads in the score
        chosen = plan(preq, page.hosts if by_load else alloc.distinct_states(page.hosts, preq), policy)
        if chosen is not None:
            return chosen, page
    return None, alloc.Candidates([], {})


def _capacity_reason(ctl: Controller, conn: Tx, ask: Ask, pool: PoolRow) -> dict[str, Any]:
    """Why nothing in the pool takes the request: its GPUs, and how many fail on what (with the GPUs whose host
    lacks a profile's type id, and what to do); for a VM without vGPUs, its hosts and why each does not."""
    everything = alloc.all_candidates(conn, ctl.catalog, [pool.id], ask.profiles, ask.preq.anti_affinity,
                                      ask.pool_names)
    counts = explain(ask.preq, everything.hosts)
    if not ask.profiles:
        return {"kind": "capacity", "pool": pool.name, "hosts": len(everything.hosts), "counts": counts}
    reason = {"kind": "capacity", "pool": pool.name, "gpus": sum(len(h.gpus) for h in everything.hosts),
              "counts": counts}
    if counts.get(LACKS_TYPE):
        from vgpu_ctl.service.host_types import lacking
        reason["lacking"] = lacking(conn, pool.id, ask.profiles)
    return reason


def _refusal(req: VmRequest, profiles: Sequence[str], reasons: list[dict[str, Any]]) -> Refused:
    """QuotaExceeded when only limits stood in the way, else NoCapacity with every pool's reasons."""
    if all(r["kind"] == "quota" for r in reasons):
        text = "; ".join(f"{r['resource']} in pool {r['scope']}: {r['used']} used + {r['requested']} "
                         f"requested > limit {r['limit']}" for r in reasons)
        return QuotaExceeded(f"tenant {req.tenant!r} is over quota: {text}", reasons=reasons)
    parts = []
    for r in reasons:
        if r["kind"] == "quota":
            parts.append(f"pool {r['scope']}: over the tenant's {r['resource']} limit "
                         f"({r['used']} used + {r['requested']} > {r['limit']})")
        elif "hosts" in r:  # a VM without vGPUs
            n = r["hosts"]
            parts.append(f"pool {r['pool']}: {n} host{'' if n == 1 else 's'}, {describe_refusal(r['counts'], 'host')}")
        else:
            from vgpu_ctl.service.host_types import describe_lacking
            parts.append(f"pool {r['pool']}: {r['gpus']} GPUs, {describe_refusal(r['counts'])}"
                         + describe_lacking(r.get("lacking", []), r["counts"].get(LACKS_TYPE, 0)))
    return NoCapacity(f"no host can take VM {req.name!r} ({', '.join(profiles) or 'no vGPUs'}, {req.vcpus} vCPUs, "
                      f"{req.memory_mib} MiB): {'; '.join(parts)}", reasons=reasons)


# -- the write's steps (also how `reconcile --adopt` claims a lost VM again) ---------------------------------------

def scoped_charges(pool: str, delta: Mapping[str, int], profiles: Sequence[str]) -> dict[tuple[str, str], int]:
    """What a VM in `pool` charges its tenant's pool-scoped limits: (scope, resource) -> amount; per profile
    both in the pool and across pools ("*")."""
    charges: dict[tuple[str, str], int] = {(pool, r): n for r, n in delta.items()}
    for p in profiles:
        for scope in ("*", pool):
            charges[(scope, f"profile:{p}")] = charges.get((scope, f"profile:{p}"), 0) + 1
    return charges


def charge(conn: Tx, tenant_id: int, tenant: str, delta: Mapping[str, int],
           charges: Mapping[tuple[str, str], int]) -> list[tuple[str, str]]:
    """Charge the tenant's global usage and its scoped limits in the caller's transaction; the scoped
    (scope, resource) limits that would pass (the caller rolls back). QuotaExceeded when a global one would."""
    charged = alloc.charge_tenant(conn, tenant_id, delta)  # read under the tenant row's lock it takes
    if charged is alloc.TenantCharge.OVER_LIMIT:
        raise alloc.quota_refusal(conn, tenant_id, tenant, delta, [], {})
    return alloc.charge_scoped(conn, tenant_id, charges) if charged is alloc.TenantCharge.CHARGED_SCOPED else []


def take(conn: Tx, tenant_id: int, req: VmRequest, chosen: PlacementPlan,
         page: alloc.Candidates) -> PriorityClass:
    """Take the plan's host capacity and GPU positions (`take_places`); the request's priority class."""
    from vgpu_ctl.service import scheduling
    cls = scheduling.resolve(conn, tenant_id, req.tenant, req.priority)
    take_places(conn, req, chosen, page)
    return cls


def take_places(conn: Tx, req: VmRequest, chosen: PlacementPlan, page: alloc.Candidates) -> None:
    """Take the plan's host capacity and GPU positions by compare-and-set (ClaimConflict when the host, a GPU
    or the request's anti-affinity group changed since `page` was read)."""
    alloc.claim_host(conn, chosen.host_id, req.vcpus, req.memory_mib)  # the host row's lock orders its claims
    if req.anti_affinity and alloc.group_on_host(conn, req.anti_affinity, chosen.host_id):
        raise alloc.ClaimConflict(f"anti-affinity group {req.anti_affinity!r} placed on host {chosen.host}")
    for gid, occ in sorted(chosen.occupancies.items()):  # GPU rows locked in id order, as on release
        alloc.write_gpu(conn, gid, page.versions[gid], occ)


def placement_of(chosen: PlacementPlan, page: alloc.Candidates, pool: str) -> Placement:
    """The plan as the caller sees it: host, pool and each device's GPU and position."""
    return Placement(chosen.host, pool, tuple(PlacedDevice(f"{chosen.host}/{page.pcis[d.gpu_id]}", d.profile,
                                                           d.start, d.size) for d in chosen.devices))


def record_vm(ctl: Controller, conn: Tx, tenant_id: int, req: VmRequest, pool: PoolRow, chosen: PlacementPlan,
              page: alloc.Candidates, delta: Mapping[str, int], charges: Mapping[tuple[str, str], int],
              cls: PriorityClass) -> VmInfo:
    """Insert the VM (placed) and its devices for a plan `take` took, with its charges and priority class
    `cls`, audited; the VM as written."""
    row = vm_row(tenant_id, req, pool, chosen, delta, charges)
    return write_records(conn, [row], [claim_records(ctl, row, req, pool, chosen, page, cls)])[0]


def vm_row(tenant_id: int, req: VmRequest, pool: PoolRow, chosen: PlacementPlan, delta: Mapping[str, int],
           charges: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    """The VM row (state placed) a claim of the plan inserts, with its charges (a new id unless the request
    brings one)."""
    spec = {"vgpus": [[v.profile, v.count] for v in req.vgpus], "labels": req.labels,
            "delta": dict(delta), "charges": [[s, r, n] for (s, r), n in charges.items()],
            "disk_gib": req.disk_gib, "network": req.network, "pool": req.pool, "template": req.template}
    return {"id": req.vm_id or str(uuid.uuid4()), "tenant_id": tenant_id, "name": req.name, "pool_id": pool.id,
            "host_id": chosen.host_id, "vcpus": req.vcpus, "memory_mib": req.memory_mib,
            "framebuffer_mib": delta["framebuffer_mib"], "state": VmState.PLACED.value,
            "idempotency_key": req.idempotency_key, "anti_affinity": req.anti_affinity,
            "template": req.template or pool.template or "domain.xml.j2", "spec": spec,
            "lease_holder": req.lease_holder, "lease_expires": expiry() if req.lease_holder else None}


@dataclass(frozen=True, slots=True)
class ClaimRecords:
    """What a claim writes beside its VM row (its device rows, scheduling row and audit event), and the VM as
    written."""

    devices: list[dict[str, Any]]
    sched: VmSchedRow
    event: NewEvent
    vm: VmInfo


def claim_records(ctl: Controller, row: Mapping[str, Any], req: VmRequest, pool: PoolRow, chosen: PlacementPlan,
                  page: alloc.Candidates, cls: PriorityClass) -> ClaimRecords:
    """For a VM row (`vm_row`): its devices, its scheduling row (class `cls`), its audit event and the VM as they
    write it (`write_records`)."""
    from vgpu_ctl.service import scheduling
    vm_id = row["id"]
    backing = {d.gpu_id: backing_for(chosen.occupancies[d.gpu_id].geometry.shapes[d.profile].kind.value,
                                     page.backings[chosen.host_id]).value for d in chosen.devices}
    placement = placement_of(chosen, page, pool.name)
    rows = alloc.device_rows(vm_id, chosen, backing)
    sched = scheduling.sched_row(ctl.catalog, vm_id, row["tenant_id"], cls, chosen, req.history)
    created = event(ctl.principal.actor, "vm.create", f"vm:{vm_id}", tenant=req.tenant,
                    params={"name": req.name, "host": chosen.host, "pool": pool.name,
                            "devices": [d.to_dict() for d in placement.devices]})
    devices = tuple(DeviceInfo(r["id"], f"{chosen.host}/{page.pcis[r['gpu_id']]}", r["gpu_id"], r["profile"],
                               r["kind"], r["start"], r["size"], r["uuid"], r["backing"], r["state"])
                    for r in sorted(rows, key=lambda r: (r["gpu_id"], r["start"])))
    return ClaimRecords(rows, sched, created, VmInfo(
        vm_id, req.name, req.tenant, chosen.host, pool.name, VmState.PLACED.value, req.vcpus, req.memory_mib,
        row["framebuffer_mib"], devices, simulated=page.simulated.get(chosen.host_id, False), generation=1))


def write_records(conn: Tx, vm_rows: Sequence[Mapping[str, Any]], records: Sequence[ClaimRecords]) -> list[VmInfo]:
    """Insert the claims' VM rows (`vm_row`), then their device rows, scheduling rows and audit events, a
    statement per kind for all of them, sent together (one round trip on PostgreSQL; a name taken or a position
    held is raised at the end); their VMs."""
    with STORE.claims.together(conn):
        STORE.claims.insert_claims(conn, vm_rows, [d for r in records for d in r.devices],
                                   [r.sched for r in records], [r.event for r in records])
    return [r.vm for r in records]


__all__ = ["MAX_RETRIES", "AlreadyMade", "Ask", "ClaimRecords", "ClaimResult", "Claimed", "Planned", "all_pools",
           "charge", "charge_of", "check_profiles", "claim", "claim_records", "framebuffer", "placement_of",
           "pool_policy", "pool_row", "read_ask", "record_vm", "scoped_charges", "take", "take_places", "vm_row",
           "write_records"]
