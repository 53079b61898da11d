"""Claiming and releasing placements: candidate pages turned into host views, charges and the GPU and device
writes of a claim, through the store (store/candidate_pages.py, store/candidates.py, store/charges.py).

All statements run on one connection inside the caller's transaction. Every change of a GPU's occupancy is
a compare-and-set on its `version`, and every change of usage a conditional UPDATE, so concurrent claims by
several processes can never take the same space or pass a limit.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Any

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Occupancy, decode_layout, encode_layout, fit_mask, geometry_for
from vgpu_ctl.core.placeables import Placeable as Placeable
from vgpu_ctl.core.placeables import modes_for as modes_for
from vgpu_ctl.core.placeables import placeables as placeables
from vgpu_ctl.core.placement import (
    CandidateOrder,
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    host_rank,
)
from vgpu_ctl.errors import QuotaExceeded
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.candidate_pages import BareHostRow, PageBounds
from vgpu_ctl.store.candidate_pages import CandidateRow as CandidateRow
from vgpu_ctl.store.candidates import GPU_STATE_COLUMNS as GPU_STATE_COLUMNS

PAGE = 16  # GPUs per single-GPU candidate page
# Hosts per whole-host candidate page (each with all its GPUs in the pool). On the openb store replay (seed 42) the
# gap to the pure policy moves by about 0.1 point with the page's make-up, not steadily with its size; with pack's
# pages widest first (store/candidate_pages.py), gpuspec33n/mig and default/mig gave -0.07/-0.28 with 4 hosts,
# -0.07/-0.10 with 6 and -0.04/-0.06 with 8. A single-GPU pack request plans over these hosts: at 10k GPUs one
# stream ran 195/s with 6 against 140/s with 8 (and 168/s for fullest-first pages of 8).
HOST_PAGE = 6


class ClaimConflict(Exception):
    """Another claim changed a GPU or host between reading and writing: retry."""


def occupancy_of(catalog: Catalog, row: Mapping[Any, Any]) -> Occupancy:
    """The occupancy of a GPU row (a mapping with model, mode, mig_layout, layout and pinned_type)."""
    return _occupancy(catalog, row["model"], row["mode"], row["mig_layout"], row["layout"],
                      row["pinned_type"])


@lru_cache(maxsize=65536)
def _occupancy(catalog: Catalog, model: str, mode: str, mig_layout: str, layout: str,
               pinned_type: str | None) -> Occupancy:
    # Occupancies are immutable: GPUs in the same state share one (and the policies' caches hit on it).
    geom = geometry_for(catalog, model, mode)
    fixed = frozenset((geom.shapes[s.profile].group, s.start) for s in decode_layout(mig_layout)) \
        if mig_layout else None
    return Occupancy(geom, decode_layout(layout), pinned_type, fixed)


def pool_offers(conn: Tx, catalog: Catalog, asked: Sequence[tuple[int, str]]) -> dict[tuple[int, str], bool]:
    """For each (pool id, profile): whether some GPU of the pool, by its model and mode, can hold the profile
    (indexed lookups, read together)."""
    wanted = [(pool_id, profile, c) for pool_id, profile in asked
              for c in placeables(catalog, frozenset((profile,)))]
    has = STORE.candidates.pools_have(conn, [(pool_id, c.model, c.mode) for pool_id, _, c in wanted])
    offers = dict.fromkeys(asked, False)
    for (pool_id, profile, _), found in zip(wanted, has, strict=True):
        offers[(pool_id, profile)] = offers[(pool_id, profile)] or found
    return offers


def order_rank(order: CandidateOrder, free_units: int, gpu_id: int) -> tuple[int, ...]:
    """A GPU's place in a policy's candidate order (`_order` in Python): what it is sorted by."""
    if order is CandidateOrder.EMPTIEST_FIRST:
        return (-free_units, gpu_id)
    if order is CandidateOrder.HOST_ORDER:
        return (gpu_id,)
    return (free_units, gpu_id)


def _order_key(order: CandidateOrder) -> Callable[[CandidateRow], tuple[int, ...]]:
    """`_order` in Python, on candidate rows."""
    return lambda r: order_rank(order, r.free_units, r.id)


def _host_key(order: CandidateOrder, widest: bool = False) -> Callable[[int, float, int], tuple[float, ...]]:
    """The store's order of whole hosts (`widest`: pack's) in Python, on (width, free units, host id): the core's
    `host_rank`, which the in-memory allocator ranks by too."""
    return functools.partial(host_rank, order, widest)


@dataclass
class Candidates:
    """Candidate hosts for a request, with what the claim needs of them: each GPU's version (for the
    compare-and-set) and PCI address, and each host's vGPU backing."""

    hosts: list[HostView]
    versions: dict[int, int]
    pcis: dict[int, str] = field(default_factory=dict)
    backings: dict[int, str] = field(default_factory=dict)
    simulated: dict[int, bool] = field(default_factory=dict)


def _labels(raw: Any) -> dict[str, str]:
    return json.loads(raw) if isinstance(raw, str) else dict(raw or {})


def _add_host(out: Candidates, hid: int, name: str, h: CandidateRow | BareHostRow, gpus: tuple[GpuView, ...],
              anti_affinity: str | None, grouped: set[int], gpu_count: int | None = None) -> None:
    """Add the view of host `hid` (its capacity and labels from the row `h`, a candidate GPU's or a bare host's)
    with its GPUs' views, and its backing, to `out`."""
    out.backings[hid] = h.vgpu_backing
    out.simulated[hid] = h.driver == "simulated"
    out.hosts.append(HostView(
        hid, name, h.vcpus * h.cpu_overcommit - h.used_vcpus, h.memory_mib * h.memory_overcommit - h.used_memory_mib,
        gpus, h.state, _labels(h.labels),
        frozenset({anti_affinity}) if anti_affinity and hid in grouped else frozenset(),
        order=hid, gpu_count=gpu_count))


def _views(conn: Tx, catalog: Catalog, rows: Iterable[CandidateRow], anti_affinity: str | None,
           pool_names: Mapping[int, str], whole: bool = False,
           lacked: Mapping[int, frozenset[str]] | None = None) -> Candidates:
    """Candidate views of the GPU rows' hosts, in host order (`whole`: the rows are all of each host's GPUs in
    the pool, which the views then say, for policies that score whole hosts; `lacked`: by GPU id, the profiles
    its host lacks type ids for)."""
    by_host: dict[int, list[CandidateRow]] = {}
    for r in rows:
        by_host.setdefault(r.host_id, []).append(r)
    grouped = _grouped(conn, anti_affinity, list(by_host))
    out = Candidates([], {})
    for hid in sorted(by_host):
        gpus = []
        for r in by_host[hid]:
            gpus.append(GpuView(r.id, r.pci_address,
                                _occupancy(catalog, r.model, r.mode, r.mig_layout, r.layout, r.pinned_type),
                                pool_names.get(r.pool_id) if r.pool_id else None,
                                lacked.get(r.id, frozenset()) if lacked else frozenset()))
            out.versions[r.id] = r.version
            out.pcis[r.id] = r.pci_address
        h = by_host[hid][0]
        _add_host(out, hid, h.host_name, h, tuple(gpus), anti_affinity, grouped, len(gpus) if whole else None)
    return out


def _grouped(conn: Tx, anti_affinity: str | None, host_ids: Sequence[int]) -> set[int]:
    """Which of the hosts already run a VM of the anti-affinity group."""
    if not anti_affinity or not host_ids:
        return set()
    return hosts_of_group(conn, anti_affinity) & set(host_ids)


def _host_pages(conn: Tx, catalog: Catalog, req: PlacementRequest, pool_id: int, order: CandidateOrder,
                pool_names: Mapping[int, str], targets: Sequence[Placeable], widest: bool) -> Iterator[Candidates]:
    """Pages of whole candidate hosts for a request whose vGPUs all have one profile, from the hosts'
    summaries: hosts with as many GPUs of one placeable as the request has vGPUs, best first by the policy's
    order (`widest`: for a policy with a host cost, pack's), merged over the placeables as the
    single-GPU pages are."""
    labels = bool(req.labels)
    key = _host_key(order, widest)
    offset = 0
    while True:
        by_host: dict[int, list[CandidateRow]] = {}
        keys: dict[int, tuple[float, ...]] = {}
        bounds = PageBounds(pool_id, req.vcpus, req.memory_mib, HOST_PAGE, offset, len(req.profiles)) \
            if len(targets) == 1 else PageBounds(pool_id, req.vcpus, req.memory_mib, offset + HOST_PAGE, 0,
                                                 len(req.profiles))
        # a host found through two placeables comes with the same GPUs twice: kept once
        for page in STORE.candidate_pages.summary_pages(conn, order, labels, widest, targets, bounds):
            found: dict[int, list[CandidateRow]] = {}
            for row, width, host_key in page:
                found.setdefault(row.host_id, []).append(row)
                k = key(width, host_key, row.host_id)
                keys[row.host_id] = min(keys.get(row.host_id, k), k)
            for hid, rows in found.items():
                by_host.setdefault(hid, rows)
        chosen = sorted(keys, key=keys.__getitem__)
        if len(targets) > 1:
            chosen = chosen[offset:offset + HOST_PAGE]
        if not chosen:
            return
        yield _views(conn, catalog, [r for h in chosen for r in by_host[h]], req.anti_affinity, pool_names,
                     whole=True)
        offset += HOST_PAGE


def candidate_pages(conn: Tx, catalog: Catalog, req: PlacementRequest, pool_id: int,
                    order: CandidateOrder, pool_names: Mapping[int, str],
                    whole_hosts: bool = False) -> Iterable[Candidates]:
    """Pages of candidate hosts in a pool, best first by the policy's candidate order; each page is a few
    GPUs or hosts. A request for several vGPUs of one profile, or any request with `whole_hosts` (a policy
    that scores whole hosts), gets whole hosts from their summaries (`host_fit`); for such a policy, widest
    first."""
    ndev = len(req.profiles)
    if not ndev:
        yield from _bare_host_pages(conn, req, pool_id, order)
        return
    targets = placeables(catalog, frozenset(req.profiles))
    if not targets:
        return
    if len(set(req.profiles)) == 1 and (ndev > 1 or whole_hosts):
        yield from _host_pages(conn, catalog, req, pool_id, order, pool_names, targets, whole_hosts)
        if ndev == 1 or len(targets) == 1:
            return
        # A host may hold the request only across placeables (some GPUs of the model in each of two modes),
        # which no single summary row shows: the grouping query below still finds it.
    yield from _gpu_pages(conn, catalog, req, pool_id, order, pool_names, targets)


def _gpu_pages(conn: Tx, catalog: Catalog, req: PlacementRequest, pool_id: int, order: CandidateOrder,
               pool_names: Mapping[int, str], targets: Sequence[Placeable]) -> Iterator[Candidates]:
    """Pages read from the GPU rows: the first GPUs of each placeable for one vGPU, the grouped hosts for
    several."""
    ndev = len(req.profiles)
    labels = bool(req.labels)
    order_key = _order_key(order)
    offset = 0
    rows: list[CandidateRow]
    while True:
        if ndev == 1:
            # Rows offset .. offset+PAGE of the merged order of the placeables' ranges (the same rows and
            # order as their OR, which SQLite can only answer by reading and sorting every matching GPU).
            bounds = PageBounds(pool_id, req.vcpus, req.memory_mib, offset + PAGE)
            merged: dict[int, CandidateRow] = {}
            for page in STORE.candidate_pages.gpu_pages(conn, order, labels, targets, bounds):
                for row in page:
                    merged.setdefault(row.id, row)
            rows = sorted(merged.values(), key=order_key)[offset:offset + PAGE] if len(targets) > 1 \
                else list(merged.values())[offset:]
            step = PAGE
        else:
            rows = STORE.candidate_pages.grouped_host_page(
                conn, order, labels, tuple(targets), PageBounds(pool_id, req.vcpus, req.memory_mib, HOST_PAGE, offset,
                                                                ndev))
            step = HOST_PAGE
        if not rows:
            return
        yield _views(conn, catalog, rows, req.anti_affinity, pool_names)
        offset += step


# What a GPU view holds besides its identity (its occupancy, pool, and whatever else placement reads).
_GPU_STATE = tuple(f.name for f in fields(GpuView) if f.name not in ("gpu_id", "pci"))


def distinct_states(hosts: Sequence[HostView], req: PlacementRequest) -> list[HostView]:
    """The first host (in host order) of each distinct state the request can see: its GPU views but their ids
    as a multiset, free vCPUs and memory, state, the labels the request asks for, anti-affinity groups and GPU
    count. A policy whose score depends on that state and then on host order (all but spread-load, which also
    weighs each GPU's measured load) always prefers that first host to the others in its state, so planning
    over these alone chooses the same plan, with one host's work per state: on a fleet of identical empty
    hosts, one host per page."""
    seen: set[Any] = set()
    out = []
    for h in sorted(hosts, key=lambda v: v.order):
        gpus = Counter(tuple(getattr(g, f) for f in _GPU_STATE) for g in h.gpus)
        key = (frozenset(gpus.items()), h.free_vcpus, h.free_memory_mib, h.state,
               tuple(h.labels.get(k) for k in req.labels), h.anti_affinity, h.gpu_count)
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out


def _bare_host_pages(conn: Tx, req: PlacementRequest, pool_id: int,
                     order: CandidateOrder) -> Iterator[Candidates]:
    """Pages of candidate hosts, without GPUs, for a request without vGPUs: the pool's hosts with room for it,
    in the policy's order of their free vCPUs and memory."""
    offset = 0
    while True:
        rows = STORE.candidate_pages.bare_host_page(conn, order, bool(req.labels),
                                                    PageBounds(pool_id, req.vcpus, req.memory_mib, HOST_PAGE, offset))
        if not rows:
            return
        grouped = _grouped(conn, req.anti_affinity, [r.id for r in rows])
        out = Candidates([], {})
        for r in rows:
            _add_host(out, r.id, r.name, r, (), req.anti_affinity, grouped)
        yield out
        offset += HOST_PAGE


def all_candidates(conn: Tx, catalog: Catalog, pool_ids: Sequence[int], profiles: Sequence[str],
                   anti_affinity: str | None, pool_names: Mapping[int, str],
                   host_ids: Sequence[int] | None = None) -> Candidates:
    """Every GPU of the pools (on `host_ids` only, if given) whose model offers a profile (any mode; no
    profiles: every GPU), for explaining a refusal or loading the allocator's memory; each GPU's view says
    which profiles its host lacks type ids for."""
    models = {m for p in set(profiles) for m in catalog.models_offering(p)}
    rows = STORE.candidate_pages.pool_gpus(conn, pool_ids, host_ids)
    rows = [r for r in rows if r.model in models] or rows
    lacked = STORE.candidate_pages.lacked_types(conn, pool_ids, host_ids)
    return _views(conn, catalog, rows, anti_affinity, pool_names, lacked=lacked)


class TenantCharge(Enum):
    """What charging a tenant's global usage did."""

    OVER_LIMIT = "over_limit"  # a limit would pass: nothing charged
    CHARGED = "charged"  # charged; the tenant has no pool-scoped limits
    CHARGED_SCOPED = "charged_scoped"  # charged; the tenant has pool-scoped limits, to be charged too


def charge_tenant(conn: Tx, tenant_id: int, delta: Mapping[str, int]) -> TenantCharge:
    """Add `delta` to the tenant's global usage if no limit is passed; whether it did and whether the tenant
    has scoped limits (read under the row lock this update takes)."""
    scoped = STORE.charges.charge_tenant(conn, tenant_id, delta)
    if scoped is None:
        return TenantCharge.OVER_LIMIT
    return TenantCharge.CHARGED_SCOPED if scoped else TenantCharge.CHARGED


GUARANTEED = ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")
"""The resources a quota may guarantee part of (globally and per pool): the base ones, not profiles."""


def charge_scoped(conn: Tx, tenant_id: int,
                  charges: Mapping[tuple[str, str], int]) -> list[tuple[str, str]]:
    """Add to each scoped limit row that exists; returns the (scope, resource) pairs whose limit would
    pass."""
    failed = []
    for scope, resource in STORE.charges.scoped_keys(conn, tenant_id):
        n = charges.get((scope, resource), 0)
        if n and not STORE.charges.charge_scoped_row(conn, tenant_id, scope, resource, n):
            failed.append((scope, resource))
    return failed


def uncharge(conn: Tx, tenant_id: int, delta: Mapping[str, int],
             scoped: Mapping[tuple[str, str], int]) -> None:
    """Give back what a VM held (global usage and every scoped row that exists)."""
    STORE.charges.uncharge(conn, tenant_id, delta, scoped)


def quota_refusal(conn: Tx, tenant_id: int, tenant: str, delta: Mapping[str, int],
                  scoped_failed: Sequence[tuple[str, str]],
                  charges: Mapping[tuple[str, str], int]) -> QuotaExceeded:
    """The error for a request that would pass a limit, naming each limit with its usage and the request."""
    t = STORE.charges.tenant_usage(conn, tenant_id)
    reasons: list[dict[str, Any]] = []
    for r, n in delta.items():
        limit = t[f"{r}_limit"]
        if n > 0 and limit is not None and t[f"{r}_used"] + n > limit:
            reasons.append({"kind": "quota", "tenant": tenant, "scope": "*", "resource": r,
                            "limit": limit, "used": t[f"{r}_used"], "requested": n})
    for scope, resource in scoped_failed:
        row = STORE.charges.scoped_use(conn, tenant_id, scope, resource)
        reasons.append({"kind": "quota", "tenant": tenant, "scope": scope, "resource": resource,
                        "limit": row.limit_value, "used": row.used,
                        "requested": charges[(scope, resource)]})
    text = "; ".join(f"{x['resource']}{'' if x['scope'] == '*' else ' in pool ' + x['scope']}: "
                     f"{x['used']} used + {x['requested']} requested > limit {x['limit']}" for x in reasons)
    return QuotaExceeded(f"tenant {tenant!r} is over quota: {text}", reasons=reasons)


def claim_host(conn: Tx, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Take vCPUs and memory on the host if it is active and has room (overcommit applied)."""
    if not STORE.charges.claim_host(conn, host_id, vcpus, memory_mib):
        raise ClaimConflict(f"host {host_id} changed")


def hosts_of_group(conn: Tx, group: str) -> set[int]:
    """The hosts a VM of anti-affinity `group` is on (a prepared read: a claim's read takes no write lock)."""
    return STORE.charges.hosts_of_group(conn, group)


def group_on_host(conn: Tx, group: str, host_id: int) -> bool:
    """Whether a VM of anti-affinity `group` is on the host (asked after `claim_host` locked the host row, so
    a claim committed meanwhile is seen)."""
    return STORE.charges.group_on_host(conn, group, host_id)


def release_host(conn: Tx, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Give back a VM's vCPUs and memory."""
    STORE.charges.release_host(conn, host_id, vcpus, memory_mib)


def gpu_state(occ: Occupancy) -> dict[str, Any]:
    """The GPU row's columns that mirror its occupancy (GPU_STATE_COLUMNS)."""
    return {"layout": encode_layout(occ.slots), "free_units": occ.free_units,
            "active_type": occ.slots[0].profile if occ.geometry.homogeneous and occ.slots else None,
            "device_count": len(occ.slots), "fits": fit_mask(occ)}


def write_gpu(conn: Tx, gpu_id: int, version: int, occ: Occupancy) -> None:
    """Store a GPU's new occupancy if nobody changed it since `version` was read."""
    if not STORE.candidates.write_gpu(conn, gpu_id, version, gpu_state(occ)):
        raise ClaimConflict(f"gpu {gpu_id} changed")


def insert_devices(conn: Tx, vm_id: str, plan: PlacementPlan, backing_of: Mapping[int, str]) -> list[dict[str, Any]]:
    """Insert a device row per planned vGPU; the unique position and the overlap trigger guard them."""
    rows = device_rows(vm_id, plan, backing_of)
    STORE.candidates.insert_devices(conn, rows)  # a VM without vGPUs has none
    return rows


def device_rows(vm_id: str, plan: PlacementPlan, backing_of: Mapping[int, str]) -> list[dict[str, Any]]:
    """The device row (state claimed, a new id) of each planned vGPU of VM `vm_id`."""
    rows = []
    for d in plan.devices:
        shape = plan.occupancies[d.gpu_id].geometry.shapes[d.profile]
        dev_id = str(uuid.uuid4())
        rows.append({"id": dev_id, "gpu_id": d.gpu_id, "vm_id": vm_id, "profile": d.profile,
                     "kind": shape.kind.value, "start": d.start, "size": d.size,
                     "framebuffer_mib": shape.framebuffer_mib, "uuid": dev_id,
                     "backing": backing_of[d.gpu_id],
                     "handle": {}, "state": "claimed"})
    return rows


def free_devices(conn: Tx, catalog: Catalog, devices: Sequence[Mapping[str, Any]]) -> None:
    """Delete device rows and take their slots off their GPUs (compare-and-set, retried on conflict)."""
    for gpu_id in sorted({d["gpu_id"] for d in devices}):  # id order, as claims lock them
        starts = {d["start"] for d in devices if d["gpu_id"] == gpu_id}
        for _ in range(20):
            row = STORE.candidates.gpu_state_row(conn, gpu_id)
            occ = occupancy_of(catalog, row._asdict())
            for s in starts:
                if any(x.start == s for x in occ.slots):
                    occ = occ.remove(s)
            try:
                write_gpu(conn, gpu_id, row.version, occ)
                break
            except ClaimConflict:
                continue
    STORE.candidates.delete_devices(conn, [d["id"] for d in devices])
