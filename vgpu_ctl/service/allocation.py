"""Claiming and releasing placements in the store: candidate queries and conditional updates.

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
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    and_,
    bindparam,
    cast,
    exists,
    func,
    literal,
    null,
    or_,
    select,
)
from sqlalchemy.engine import Connection

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import (
    Mode,
    Occupancy,
    decode_layout,
    encode_layout,
    fit_mask,
    geometry_for,
    profile_bit,
    supported_modes,
)
from vgpu_ctl.core.placement import (
    CandidateOrder,
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    host_rank,
)
from vgpu_ctl.errors import QuotaExceeded
from vgpu_ctl.service.ports import STORE
from vgpu_ctl.store.candidates import GPU_STATE_COLUMNS as GPU_STATE_COLUMNS
from vgpu_ctl.store.prepared import Prepared

# Re-exported for the modules that still take their table handles from here (until their SQL moves too).
from vgpu_ctl.store.tables import DEVICE as DEVICE
from vgpu_ctl.store.tables import GPU as GPU
from vgpu_ctl.store.tables import HOST as HOST
from vgpu_ctl.store.tables import HOST_FIT as HOST_FIT
from vgpu_ctl.store.tables import SCOPED as SCOPED
from vgpu_ctl.store.tables import TENANT as TENANT

PAGE = 16  # GPUs per single-GPU candidate page
# Hosts per whole-host candidate page (each with all its GPUs in the pool). On the openb store replay (seed 42) the
# gap to the pure policy moves by about 0.1 point with the page's make-up, not steadily with its size; with pack's
# pages widest first (`_widest_order`), gpuspec33n/mig and default/mig gave -0.07/-0.28 with 4 hosts, -0.07/-0.10
# with 6 and -0.04/-0.06 with 8. A single-GPU pack request plans over these hosts: at 10k GPUs one stream ran 195/s
# with 6 against 140/s with 8 (and 168/s for fullest-first pages of 8).
HOST_PAGE = 6


class ClaimConflict(Exception):
    """Another claim changed a GPU or host between reading and writing: retry."""


def modes_for(kind: ProfileKind) -> tuple[str, ...]:
    """The GPU modes in which a profile of this kind can be placed."""
    return {
        ProfileKind.VGPU: (Mode.VGPU_EQUAL.value, Mode.VGPU_MIXED.value),
        ProfileKind.MIG: (Mode.MIG.value,),
        ProfileKind.MIG_VGPU: (Mode.MIG.value,),
        ProfileKind.PASSTHROUGH: (Mode.PASSTHROUGH.value,),
    }[kind]


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


@dataclass(frozen=True, slots=True)
class Placeable:
    """GPUs that can hold a profile: their model and mode, the profile's size on that axis, and its bit in
    the GPUs' fit masks."""

    model: str
    mode: str
    size: int
    bit: int


@lru_cache(maxsize=1024)
def placeables(catalog: Catalog, profiles: frozenset[str]) -> tuple[Placeable, ...]:
    """One entry per (model, mode) that offers one of the profiles, with that profile's size and bit."""
    out = []
    for name in sorted(profiles):
        for model in catalog.models_offering(name):
            p = catalog.profile(model, name)
            assert p is not None
            for mode in modes_for(p.kind):
                if mode not in supported_modes(catalog, model):
                    continue  # e.g. T4 and V100 have no mixed-size mode
                geom = geometry_for(catalog, model, mode)
                shape = geom.shape(name)
                if shape is not None:
                    out.append(Placeable(model, mode, shape.size, profile_bit(geom, name)))
    return tuple(out)


def _can_take(model: Any, mode: Any, size: Any, bit: Any) -> Any:
    """SQL condition: a GPU of this model and mode with room for a profile of this size and fit-mask bit (the mask
    also rules out an equal-size GPU holding or pinned to another type)."""
    return and_(GPU.c.model == model, GPU.c.mode == mode, GPU.c.free_units >= size, GPU.c.fits.op("&")(bit) != 0)


# _can_take with the Placeable bound at execution (c_model, c_mode, c_size, c_bit).
_GPU_MATCH = _can_take(bindparam("c_model"), bindparam("c_mode"), bindparam("c_size", type_=Integer),
                       bindparam("c_bit", type_=BigInteger))


def _match_params(c: Placeable) -> dict[str, Any]:
    return {"c_model": c.model, "c_mode": c.mode, "c_size": c.size, "c_bit": c.bit}


@lru_cache(maxsize=1024)
def _gpu_filter_for(catalog: Catalog, profiles: frozenset[str]) -> Any:
    """SQL condition: a GPU that can take one of the profiles now (the OR over their placeables)."""
    clauses = [_can_take(c.model, c.mode, c.size, literal(c.bit, BigInteger)) for c in placeables(catalog, profiles)]
    return or_(*clauses) if clauses else literal(False)


def pool_offers(conn: Connection, catalog: Catalog, pool_id: int, profile: str) -> bool:
    """True when some GPU of the pool, by its model and mode, can hold `profile` (indexed lookups)."""
    return any(STORE.candidates.pool_has(conn, pool_id, c.model, c.mode)
               for c in placeables(catalog, frozenset((profile,))))


# The host condition of a request, its sizes bound at execution (req_vcpus, req_memory_mib).
_HOST_FILTER = and_(
    HOST.c.state == "active",
    HOST.c.used_vcpus + bindparam("req_vcpus", type_=BigInteger) <= HOST.c.vcpus * HOST.c.cpu_overcommit,
    HOST.c.used_memory_mib + bindparam("req_memory_mib", type_=BigInteger)
    <= HOST.c.memory_mib * HOST.c.memory_overcommit,
)


_GPU_COLS = (GPU.c.id, GPU.c.host_id, GPU.c.pci_address, GPU.c.model, GPU.c.mode, GPU.c.pool_id,
             GPU.c.pinned_type, GPU.c.mig_layout, GPU.c.layout, GPU.c.version, GPU.c.free_units)
_HOST_COLS = (HOST.c.id, HOST.c.name, HOST.c.vgpu_backing, HOST.c.driver, HOST.c.vcpus, HOST.c.memory_mib,
              HOST.c.cpu_overcommit,
              HOST.c.memory_overcommit, HOST.c.used_vcpus, HOST.c.used_memory_mib, HOST.c.state,
              HOST.c.labels)


class CandidateRow(NamedTuple):
    """A candidate GPU with its host's columns (a row of the candidate queries)."""

    id: int
    host_id: int
    pci_address: str
    model: str
    mode: str
    pool_id: int | None
    pinned_type: str | None
    mig_layout: str
    layout: str
    version: int
    free_units: int
    host_name: str
    vgpu_backing: str
    driver: str
    vcpus: int
    memory_mib: int
    cpu_overcommit: float
    memory_overcommit: float
    used_vcpus: int
    used_memory_mib: int
    state: str
    labels: Any = None  # read only for requests with labels


# The GPU columns, then its host's (`_HOST_COLS` less the id, the name labelled), in CandidateRow's order.
_CANDIDATE_COLS = (*_GPU_COLS, HOST.c.name.label("host_name"), *_HOST_COLS[2:])
_NO_LABELS = (*_CANDIDATE_COLS[:-1], null().label("labels"))


def _order(order: CandidateOrder) -> list[Any]:
    # Only columns of the gpu_candidates index (which ends in the GPU id): the engine then reads the first page
    # straight from the index instead of sorting every GPU with the same free space. GPU ids follow the
    # order hosts were declared in, which is the fixed host order placement breaks ties by.
    if order is CandidateOrder.EMPTIEST_FIRST:
        return [GPU.c.free_units.desc(), GPU.c.id]
    if order is CandidateOrder.HOST_ORDER:
        return [GPU.c.id]
    return [GPU.c.free_units, GPU.c.id]


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


def _host_order(order: CandidateOrder, free: Any, host_id: Any) -> list[Any]:
    """`_order` for whole hosts, by the free units of their matching GPUs (`free`), then their id."""
    if order is CandidateOrder.EMPTIEST_FIRST:
        return [free.desc(), host_id]
    if order is CandidateOrder.HOST_ORDER:
        return [host_id]
    return [free, host_id]


def _host_key(order: CandidateOrder, widest: bool = False) -> Callable[[int, float, int], tuple[float, ...]]:
    """`_host_order` (`widest`: `_widest_order`) in Python, on (width, free units, host id): the core's
    `host_rank`, which the in-memory allocator ranks by too."""
    return functools.partial(host_rank, order, widest)


def _mean_free(hf: Any) -> Any:
    """SQL: the mean free units of a summary's GPUs that can take its profile (its rows have `n_fit > 0`)."""
    return cast(hf.c.free_units, Float).op("/")(hf.c.n_fit)  # as the index has it: SQL would cast n_fit


def _widest_order(hf: Any) -> list[Any]:
    """The order of whole-host pages for a policy with a host cost (pack), on host summaries: the widest hosts
    first (most GPUs in the pool), then the fullest by the mean free units of their GPUs that can take the profile,
    then host order (the `host_fit_by_width` index). pack prices the room a placement takes by the typical tasks a
    host could ever run, more on a wider host (it also runs the tasks that ask for more GPUs), and strands least on
    a full GPU, so its choice is near the front of this order; fullest first by the free units of the host's GPUs
    together, it was often pages behind (on the openb gpuspec33n/mig replay, seed 42: 8-GPU V100 hosts behind every
    2-GPU one)."""
    return [hf.c.gpus.desc(), _mean_free(hf), hf.c.host_id]


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


def _views(conn: Connection, catalog: Catalog, rows: Iterable[CandidateRow], anti_affinity: str | None,
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
        out.backings[hid] = h.vgpu_backing
        out.simulated[hid] = h.driver == "simulated"
        out.hosts.append(HostView(
            hid, h.host_name, h.vcpus * h.cpu_overcommit - h.used_vcpus,
            h.memory_mib * h.memory_overcommit - h.used_memory_mib, tuple(gpus), h.state,
            _labels(h.labels), frozenset({anti_affinity}) if hid in grouped and anti_affinity else frozenset(),
            order=hid, gpu_count=len(gpus) if whole else None))
    return out


def _grouped(conn: Connection, anti_affinity: str | None, host_ids: Sequence[int]) -> set[int]:
    """Which of the hosts already run a VM of the anti-affinity group."""
    if not anti_affinity or not host_ids:
        return set()
    return hosts_of_group(conn, anti_affinity) & set(host_ids)


_IN_POOL = GPU.c.pool_id == bindparam("pool_id", type_=Integer)


@lru_cache(maxsize=16)
def _page_query(order: CandidateOrder, labels: bool) -> Prepared:
    """Single GPU: the first page_limit GPUs of one placeable, in the policy's candidate order (a range of the
    gpu_candidates index). Bound at execution: pool_id, the placeable, req_vcpus, req_memory_mib,
    page_limit."""
    return Prepared(select(*(_CANDIDATE_COLS if labels else _NO_LABELS)).join(HOST, HOST.c.id == GPU.c.host_id)
                    .where(_IN_POOL, _GPU_MATCH, _HOST_FILTER).order_by(*_order(order))
                    .limit(bindparam("page_limit", type_=Integer)))


@lru_cache(maxsize=1024)
def _hosts_query(catalog: Catalog, profiles: frozenset[str], order: CandidateOrder, labels: bool) -> Prepared:
    """Multi-GPU, several profiles: the GPUs of a page of hosts with enough GPUs that can take one of them,
    the hosts in the policy's candidate order of their free units (host order for HOST_ORDER); it groups every
    matching GPU of the pool. Bound at execution: pool_id, req_vcpus, req_memory_mib, page_limit, page_offset,
    ndev."""
    cols = _CANDIDATE_COLS if labels else _NO_LABELS
    limit = bindparam("page_limit", type_=Integer)
    where = and_(_IN_POOL, _gpu_filter_for(catalog, profiles), _HOST_FILTER)
    free = func.sum(GPU.c.free_units)
    hosts_page = (select(GPU.c.host_id).join(HOST, HOST.c.id == GPU.c.host_id).where(where)
                  .group_by(GPU.c.host_id).having(func.count() >= bindparam("ndev", type_=Integer))
                  .order_by(*_host_order(order, free, GPU.c.host_id))
                  .limit(limit).offset(bindparam("page_offset", type_=Integer)))
    return Prepared(select(*cols).join(HOST, HOST.c.id == GPU.c.host_id)
                    .where(where, GPU.c.host_id.in_(hosts_page.scalar_subquery())))


@lru_cache(maxsize=16)
def _summary_query(order: CandidateOrder, labels: bool, widest: bool) -> Prepared:
    """Whole hosts by their summaries: every GPU of the pool on the first page_limit hosts (from page_offset)
    that have at least `ndev` GPUs of one placeable that can take its profile now, in the policy's candidate
    order of those GPUs' free units (`widest`: the widest hosts first, see `_widest_order`), with the order's
    key (`host_width`, `host_key`). It reads one `host_fit` row per candidate host (a range of a partial index)
    and the page's GPUs, never the rest of the pool. Bound at execution: pool_id, the placeable, ndev,
    req_vcpus, req_memory_mib, page_limit, page_offset."""
    hf = HOST_FIT
    free = _mean_free(hf) if widest else hf.c.free_units
    ranked = _widest_order(hf) if widest else _host_order(order, free, hf.c.host_id)
    page = (select(hf.c.host_id, hf.c.gpus, free.label("free")).join(HOST, HOST.c.id == hf.c.host_id)
            .where(hf.c.pool_id == bindparam("pool_id", type_=Integer), hf.c.model == bindparam("c_model"),
                   hf.c.mode == bindparam("c_mode"), hf.c.bitval == bindparam("c_bit", type_=BigInteger),
                   hf.c.n_fit > 0, hf.c.n_fit >= bindparam("ndev", type_=Integer), _HOST_FILTER)
            .order_by(*ranked)
            .limit(bindparam("page_limit", type_=Integer)).offset(bindparam("page_offset", type_=Integer))
            .subquery("page"))
    cols = _CANDIDATE_COLS if labels else _NO_LABELS
    return Prepared(select(*cols, page.c.gpus.label("host_width"), page.c.free.label("host_key"))
                    .select_from(page.join(GPU, and_(GPU.c.host_id == page.c.host_id, _IN_POOL))
                                 .join(HOST, HOST.c.id == GPU.c.host_id)))


def _host_pages(conn: Connection, catalog: Catalog, req: PlacementRequest, pool_id: int, order: CandidateOrder,
                pool_names: Mapping[int, str], targets: Sequence[Placeable], widest: bool) -> Iterator[Candidates]:
    """Pages of whole candidate hosts for a request whose vGPUs all have one profile, from the hosts'
    summaries: hosts with as many GPUs of one placeable as the request has vGPUs, best first by the policy's
    order (`widest`: for a policy with a host cost, `_widest_order`), merged over the placeables as the
    single-GPU pages are."""
    labels = bool(req.labels)
    params: dict[str, Any] = {"pool_id": pool_id, "req_vcpus": req.vcpus, "req_memory_mib": req.memory_mib,
                              "ndev": len(req.profiles)}
    key = _host_key(order, widest)
    offset = 0
    while True:
        by_host: dict[int, list[CandidateRow]] = {}
        keys: dict[int, tuple[float, ...]] = {}
        limits = {"page_limit": HOST_PAGE, "page_offset": offset} if len(targets) == 1 else \
            {"page_limit": offset + HOST_PAGE, "page_offset": 0}
        for c in targets:  # a host found through two placeables comes with the same GPUs twice: kept once
            found: dict[int, list[CandidateRow]] = {}
            for t in _summary_query(order, labels, widest).run(conn, {**params, **limits,
                                                                      **_match_params(c)}).fetchall():
                row = CandidateRow._make(t[:-2])
                found.setdefault(row.host_id, []).append(row)
                k = key(t[-2], t[-1], row.host_id)
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


def candidate_pages(conn: Connection, catalog: Catalog, req: PlacementRequest, pool_id: int,
                    order: CandidateOrder, pool_names: Mapping[int, str],
                    whole_hosts: bool = False) -> Iterable[Candidates]:
    """Pages of candidate hosts in a pool, best first by the policy's candidate order; each page is a few
    GPUs or hosts. A request for several vGPUs of one profile, or any request with `whole_hosts` (a policy
    that scores whole hosts), gets whole hosts from their summaries (`host_fit`); for such a policy, widest
    first (`_widest_order`)."""
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


def _gpu_pages(conn: Connection, catalog: Catalog, req: PlacementRequest, pool_id: int, order: CandidateOrder,
               pool_names: Mapping[int, str], targets: Sequence[Placeable]) -> Iterator[Candidates]:
    """Pages read from the GPU rows: the first GPUs of each placeable for one vGPU, the grouped hosts for
    several."""
    ndev = len(req.profiles)
    labels = bool(req.labels)
    params: dict[str, Any] = {"pool_id": pool_id, "req_vcpus": req.vcpus, "req_memory_mib": req.memory_mib}
    order_key = _order_key(order)
    offset = 0
    rows: list[CandidateRow]
    while True:
        if ndev == 1:
            # Rows offset .. offset+PAGE of the merged order of the placeables' ranges (the same rows and
            # order as their OR, which SQLite can only answer by reading and sorting every matching GPU).
            params["page_limit"] = offset + PAGE
            merged: dict[int, CandidateRow] = {}
            for c in targets:
                for t in _page_query(order, labels).run(conn, {**params, **_match_params(c)}).fetchall():
                    merged.setdefault(t[0], CandidateRow._make(t))
            rows = sorted(merged.values(), key=order_key)[offset:offset + PAGE] if len(targets) > 1 \
                else list(merged.values())[offset:]
            step = PAGE
        else:
            q = _hosts_query(catalog, frozenset(req.profiles), order, labels)
            rows = [CandidateRow._make(t) for t in q.run(conn, {**params, "page_limit": HOST_PAGE,
                                                                  "page_offset": offset, "ndev": ndev})]
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


@lru_cache(maxsize=8)
def _bare_hosts_query(order: CandidateOrder, labels: bool) -> Prepared:
    """A request without vGPUs: a page of the hosts of the pool (those holding one of its GPUs) with room for
    its vCPUs and memory, in the policy's order of their free vCPUs and memory (`core.placement.host_score`'s).
    Bound at execution: pool_id, req_vcpus, req_memory_mib, page_limit, page_offset."""
    free_vcpus = HOST.c.vcpus * HOST.c.cpu_overcommit - HOST.c.used_vcpus
    free_memory = HOST.c.memory_mib * HOST.c.memory_overcommit - HOST.c.used_memory_mib
    keys = {CandidateOrder.FULLEST_FIRST: [free_vcpus, free_memory, HOST.c.id],
            CandidateOrder.EMPTIEST_FIRST: [free_vcpus.desc(), free_memory.desc(), HOST.c.id]}
    cols = [*_HOST_COLS[:-1], HOST.c.labels if labels else null().label("labels")]
    return Prepared(select(*cols).where(_HOST_FILTER, exists(select(GPU.c.id).where(
        GPU.c.host_id == HOST.c.id, _IN_POOL))).order_by(*keys.get(order, [HOST.c.id]))
        .limit(bindparam("page_limit", type_=Integer)).offset(bindparam("page_offset", type_=Integer)))


def _bare_host_pages(conn: Connection, req: PlacementRequest, pool_id: int,
                     order: CandidateOrder) -> Iterator[Candidates]:
    """Pages of candidate hosts, without GPUs, for a request without vGPUs (see `_bare_hosts_query`)."""
    offset = 0
    while True:
        rows = _bare_hosts_query(order, bool(req.labels)).run(conn, {
            "pool_id": pool_id, "req_vcpus": req.vcpus, "req_memory_mib": req.memory_mib,
            "page_limit": HOST_PAGE, "page_offset": offset}).fetchall()
        if not rows:
            return
        grouped = _grouped(conn, req.anti_affinity, [r[0] for r in rows])
        out = Candidates([], {})
        for hid, name, backing, driver, vcpus, memory, cpu_over, memory_over, used_vcpus, used_memory, state, \
                labels in rows:
            out.backings[hid] = backing
            out.simulated[hid] = driver == "simulated"
            out.hosts.append(HostView(
                hid, name, vcpus * cpu_over - used_vcpus, memory * memory_over - used_memory, (), state,
                _labels(labels), frozenset({req.anti_affinity}) if req.anti_affinity and hid in grouped
                else frozenset(), order=hid))
        yield out
        offset += HOST_PAGE


def all_candidates(conn: Connection, catalog: Catalog, pool_ids: Sequence[int], profiles: Sequence[str],
                   anti_affinity: str | None, pool_names: Mapping[int, str],
                   host_ids: Sequence[int] | None = None) -> Candidates:
    """Every GPU of the pools (on `host_ids` only, if given) whose model offers a profile (any mode; no
    profiles: every GPU), for explaining a refusal or loading the allocator's memory; each GPU's view says
    which profiles its host lacks type ids for."""
    models = {m for p in set(profiles) for m in catalog.models_offering(p)}
    where = [GPU.c.pool_id.in_(list(pool_ids))] + ([GPU.c.host_id.in_(list(host_ids))] if host_ids is not None else [])
    rows = [CandidateRow._make(r) for r in conn.execute(select(*_CANDIDATE_COLS).join(HOST, HOST.c.id == GPU.c.host_id)
                                                   .where(*where))]
    rows = [r for r in rows if r.model in models] or rows
    lacked = {gid: frozenset(names or ()) for gid, names in conn.execute(
        select(GPU.c.id, GPU.c.lacked_types).where(*where, GPU.c.lacks != 0))}
    return _views(conn, catalog, rows, anti_affinity, pool_names, lacked=lacked)


class TenantCharge(Enum):
    """What charging a tenant's global usage did."""

    OVER_LIMIT = "over_limit"  # a limit would pass: nothing charged
    CHARGED = "charged"  # charged; the tenant has no pool-scoped limits
    CHARGED_SCOPED = "charged_scoped"  # charged; the tenant has pool-scoped limits, to be charged too


def charge_tenant(conn: Connection, tenant_id: int, delta: Mapping[str, int]) -> TenantCharge:
    """Add `delta` to the tenant's global usage if no limit is passed; whether it did and whether the tenant
    has scoped limits (read under the row lock this update takes)."""
    scoped = STORE.charges.charge_tenant(conn, tenant_id, delta)
    if scoped is None:
        return TenantCharge.OVER_LIMIT
    return TenantCharge.CHARGED_SCOPED if scoped else TenantCharge.CHARGED


GUARANTEED = ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")
"""The resources a quota may guarantee part of (globally and per pool): the base ones, not profiles."""


def charge_scoped(conn: Connection, tenant_id: int,
                  charges: Mapping[tuple[str, str], int]) -> list[tuple[str, str]]:
    """Add to each scoped limit row that exists; returns the (scope, resource) pairs whose limit would
    pass."""
    failed = []
    for scope, resource in STORE.charges.scoped_keys(conn, tenant_id):
        n = charges.get((scope, resource), 0)
        if n and not STORE.charges.charge_scoped_row(conn, tenant_id, scope, resource, n):
            failed.append((scope, resource))
    return failed


def uncharge(conn: Connection, tenant_id: int, delta: Mapping[str, int],
             scoped: Mapping[tuple[str, str], int]) -> None:
    """Give back what a VM held (global usage and every scoped row that exists)."""
    STORE.charges.uncharge(conn, tenant_id, delta, scoped)


def quota_refusal(conn: Connection, tenant_id: int, tenant: str, delta: Mapping[str, int],
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


def claim_host(conn: Connection, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Take vCPUs and memory on the host if it is active and has room (overcommit applied)."""
    if not STORE.charges.claim_host(conn, host_id, vcpus, memory_mib):
        raise ClaimConflict(f"host {host_id} changed")


def hosts_of_group(conn: Connection, group: str) -> set[int]:
    """The hosts a VM of anti-affinity `group` is on (a prepared read: a claim's read takes no write lock)."""
    return STORE.charges.hosts_of_group(conn, group)


def group_on_host(conn: Connection, group: str, host_id: int) -> bool:
    """Whether a VM of anti-affinity `group` is on the host (asked after `claim_host` locked the host row, so
    a claim committed meanwhile is seen)."""
    return STORE.charges.group_on_host(conn, group, host_id)


def release_host(conn: Connection, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Give back a VM's vCPUs and memory."""
    STORE.charges.release_host(conn, host_id, vcpus, memory_mib)


def gpu_state(occ: Occupancy) -> dict[str, Any]:
    """The GPU row's columns that mirror its occupancy (GPU_STATE_COLUMNS)."""
    return {"layout": encode_layout(occ.slots), "free_units": occ.free_units,
            "active_type": occ.slots[0].profile if occ.geometry.homogeneous and occ.slots else None,
            "device_count": len(occ.slots), "fits": fit_mask(occ)}


def write_gpu(conn: Connection, gpu_id: int, version: int, occ: Occupancy) -> None:
    """Store a GPU's new occupancy if nobody changed it since `version` was read."""
    if not STORE.candidates.write_gpu(conn, gpu_id, version, gpu_state(occ)):
        raise ClaimConflict(f"gpu {gpu_id} changed")


def insert_devices(conn: Connection, catalog: Catalog, vm_id: str, plan: PlacementPlan,
                   backing_of: Mapping[int, str]) -> list[dict[str, Any]]:
    """Insert a device row per planned vGPU; the unique position and the overlap trigger guard them."""
    rows = []
    for d in plan.devices:
        shape = plan.occupancies[d.gpu_id].geometry.shapes[d.profile]
        dev_id = str(uuid.uuid4())
        rows.append({"id": dev_id, "gpu_id": d.gpu_id, "vm_id": vm_id, "profile": d.profile,
                     "kind": shape.kind.value, "start": d.start, "size": d.size,
                     "framebuffer_mib": shape.framebuffer_mib, "uuid": dev_id,
                     "backing": backing_of[d.gpu_id],
                     "handle": {}, "state": "claimed"})
    STORE.candidates.insert_devices(conn, rows)  # a VM without vGPUs has none
    return rows


def free_devices(conn: Connection, catalog: Catalog, devices: Sequence[Mapping[str, Any]]) -> None:
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
