"""The candidate queries of placement: pages of GPUs or whole hosts of a pool that can take a request now, in a
policy's candidate order, read through indexes (`gpu_candidates`, the host summaries `host_fit`) so that a page
costs its own rows, not the pool's. The service builds its host views from these rows.

Every query is `Prepared` (compiled once per process); the request's sizes, the placeable and the page bounds are
bound at execution.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Float, Integer, and_, bindparam, cast, exists, func, literal, null, or_, select

from vgpu_ctl.core.placeables import Placeable
from vgpu_ctl.core.placement import CandidateOrder
from vgpu_ctl.store.prepared import Prepared, generic_plans, sent_together
from vgpu_ctl.store.tables import GPU, HOST, HOST_FIT
from vgpu_ctl.store.unit import Tx


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


class SummaryRow(NamedTuple):
    """A GPU of a whole-host page with its host's place in the order: its width and key (`_summary_query`)."""

    gpu: CandidateRow
    host_width: int
    host_key: float


class BareHostRow(NamedTuple):
    """A candidate host for a request without vGPUs."""

    id: int
    name: str
    vgpu_backing: str
    driver: str
    vcpus: int
    memory_mib: int
    cpu_overcommit: float
    memory_overcommit: float
    used_vcpus: int
    used_memory_mib: int
    state: str
    labels: Any


class PageBounds(NamedTuple):
    """What a page asks of its hosts and where it lies: the pool, the request's vCPUs and memory, how many GPUs
    of one placeable a host needs (`ndev`), and the page's limit and offset."""

    pool_id: int
    req_vcpus: int
    req_memory_mib: int
    page_limit: int
    page_offset: int = 0
    ndev: int = 1


def _can_take(model: Any, mode: Any, size: Any, bit: Any) -> Any:
    """SQL condition: a GPU of this model and mode with room for a profile of this size and fit-mask bit (the mask
    also rules out an equal-size GPU holding or pinned to another type)."""
    return and_(GPU.c.model == model, GPU.c.mode == mode, GPU.c.free_units >= size, GPU.c.fits.op("&")(bit) != 0)


# _can_take with the Placeable bound at execution (c_model, c_mode, c_size, c_bit).
_GPU_MATCH = _can_take(bindparam("c_model"), bindparam("c_mode"), bindparam("c_size", type_=Integer),
                       bindparam("c_bit", type_=BigInteger))


def _match_params(c: Placeable) -> dict[str, Any]:
    return {"c_model": c.model, "c_mode": c.mode, "c_size": c.size, "c_bit": c.bit}


def _gpu_filter_for(targets: Sequence[Placeable]) -> Any:
    """SQL condition: a GPU that can take one of the placeables now (their OR)."""
    clauses = [_can_take(c.model, c.mode, c.size, literal(c.bit, BigInteger)) for c in targets]
    return or_(*clauses) if clauses else literal(False)


# The host condition of a request, its sizes bound at execution (req_vcpus, req_memory_mib).
_HOST_FILTER = and_(
    HOST.c.state == "active",
    HOST.c.used_vcpus + bindparam("req_vcpus", type_=BigInteger) <= HOST.c.vcpus * HOST.c.cpu_overcommit,
    HOST.c.used_memory_mib + bindparam("req_memory_mib", type_=BigInteger)
    <= HOST.c.memory_mib * HOST.c.memory_overcommit,
)

GPU_COLUMNS = (GPU.c.id, GPU.c.host_id, GPU.c.pci_address, GPU.c.model, GPU.c.mode, GPU.c.pool_id,
               GPU.c.pinned_type, GPU.c.mig_layout, GPU.c.layout, GPU.c.version, GPU.c.free_units)
"""The GPU columns of a candidate row, in `CandidateRow`'s order."""
HOST_COLUMNS = (HOST.c.id, HOST.c.name, HOST.c.vgpu_backing, HOST.c.driver, HOST.c.vcpus, HOST.c.memory_mib,
                HOST.c.cpu_overcommit, HOST.c.memory_overcommit, HOST.c.used_vcpus, HOST.c.used_memory_mib,
                HOST.c.state, HOST.c.labels)
"""The host columns of a candidate host, in `BareHostRow`'s order."""
_CANDIDATE_COLS = (*GPU_COLUMNS, HOST.c.name.label("host_name"), *HOST_COLUMNS[2:])
_NO_LABELS = (*_CANDIDATE_COLS[:-1], null().label("labels"))
_IN_POOL = GPU.c.pool_id == bindparam("pool_id", type_=Integer)


def _order(order: CandidateOrder) -> list[Any]:
    # Only columns of the gpu_candidates index (which ends in the GPU id): the engine then reads the first page
    # straight from the index instead of sorting every GPU with the same free space. GPU ids follow the
    # order hosts were declared in, which is the fixed host order placement breaks ties by.
    if order is CandidateOrder.EMPTIEST_FIRST:
        return [GPU.c.free_units.desc(), GPU.c.id]
    if order is CandidateOrder.HOST_ORDER:
        return [GPU.c.id]
    return [GPU.c.free_units, GPU.c.id]


def _host_order(order: CandidateOrder, free: Any, host_id: Any) -> list[Any]:
    """`_order` for whole hosts, by the free units of their matching GPUs (`free`), then their id
    (`core.placement.host_rank` in SQL)."""
    if order is CandidateOrder.EMPTIEST_FIRST:
        return [free.desc(), host_id]
    if order is CandidateOrder.HOST_ORDER:
        return [host_id]
    return [free, host_id]


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


@lru_cache(maxsize=16)
def _page_query(order: CandidateOrder, labels: bool) -> Prepared:
    """Single GPU: the first page_limit GPUs of one placeable, in the policy's candidate order (a range of the
    gpu_candidates index)."""
    return Prepared(select(*(_CANDIDATE_COLS if labels else _NO_LABELS)).join(HOST, HOST.c.id == GPU.c.host_id)
                    .where(_IN_POOL, _GPU_MATCH, _HOST_FILTER).order_by(*_order(order))
                    .limit(bindparam("page_limit", type_=Integer)))


def gpu_pages(tx: Tx, order: CandidateOrder, labels: bool, targets: Sequence[Placeable],
              bounds: PageBounds) -> list[list[CandidateRow]]:
    """For each placeable: the first `page_limit` GPUs of the pool that can take it, on hosts with room for the
    request, in the policy's order (labels read only when `labels`); the pages read together (one round trip on
    PostgreSQL), each with its generic plan."""
    query = _page_query(order, labels)
    with sent_together(tx):
        generic_plans(tx)
        found = [query.run(tx, {**bounds._asdict(), **_match_params(c)}) for c in targets]
    return [[CandidateRow._make(t) for t in cur.fetchall()] for cur in found]


@lru_cache(maxsize=1024)
def _hosts_query(targets: tuple[Placeable, ...], order: CandidateOrder, labels: bool) -> Prepared:
    """Multi-GPU, several profiles: the GPUs of a page of hosts with enough GPUs that can take one of them,
    the hosts in the policy's candidate order of their free units (host order for HOST_ORDER); it groups every
    matching GPU of the pool."""
    cols = _CANDIDATE_COLS if labels else _NO_LABELS
    where = and_(_IN_POOL, _gpu_filter_for(targets), _HOST_FILTER)
    free = func.sum(GPU.c.free_units)
    hosts_page = (select(GPU.c.host_id).join(HOST, HOST.c.id == GPU.c.host_id).where(where)
                  .group_by(GPU.c.host_id).having(func.count() >= bindparam("ndev", type_=Integer))
                  .order_by(*_host_order(order, free, GPU.c.host_id))
                  .limit(bindparam("page_limit", type_=Integer)).offset(bindparam("page_offset", type_=Integer)))
    return Prepared(select(*cols).join(HOST, HOST.c.id == GPU.c.host_id)
                    .where(where, GPU.c.host_id.in_(hosts_page.scalar_subquery())))


def grouped_host_page(tx: Tx, order: CandidateOrder, labels: bool, targets: tuple[Placeable, ...],
                      bounds: PageBounds) -> list[CandidateRow]:
    """The matching GPUs of a page of hosts that have `ndev` GPUs able to take one of the placeables, the hosts
    in the policy's order of those GPUs' free units."""
    return [CandidateRow._make(t) for t in _hosts_query(targets, order, labels).run(tx, bounds._asdict())]


@lru_cache(maxsize=16)
def _summary_query(order: CandidateOrder, labels: bool, widest: bool) -> Prepared:
    """Whole hosts by their summaries: every GPU of the pool on the first page_limit hosts (from page_offset)
    that have at least `ndev` GPUs of one placeable that can take its profile now, in the policy's candidate
    order of those GPUs' free units (`widest`: the widest hosts first, see `_widest_order`), with the order's
    key (`host_width`, `host_key`). It reads one `host_fit` row per candidate host (a range of a partial index)
    and the page's GPUs, never the rest of the pool."""
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


def summary_pages(tx: Tx, order: CandidateOrder, labels: bool, widest: bool, targets: Sequence[Placeable],
                  bounds: PageBounds) -> list[list[SummaryRow]]:
    """For each placeable: every GPU in the pool of a page of whole hosts that have `ndev` GPUs able to take it,
    read from the hosts' summaries, with each host's width and key in the policy's order (`widest`: pack's); the
    pages read together (one round trip on PostgreSQL), each with its generic plan."""
    query = _summary_query(order, labels, widest)
    with sent_together(tx):
        generic_plans(tx)
        found = [query.run(tx, {**bounds._asdict(), **_match_params(c)}) for c in targets]
    return [[SummaryRow(CandidateRow._make(t[:-2]), t[-2], t[-1]) for t in cur.fetchall()] for cur in found]


@lru_cache(maxsize=8)
def _bare_hosts_query(order: CandidateOrder, labels: bool) -> Prepared:
    """A request without vGPUs: a page of the hosts of the pool (those holding one of its GPUs) with room for
    its vCPUs and memory, in the policy's order of their free vCPUs and memory (`core.placement.host_score`'s)."""
    free_vcpus = HOST.c.vcpus * HOST.c.cpu_overcommit - HOST.c.used_vcpus
    free_memory = HOST.c.memory_mib * HOST.c.memory_overcommit - HOST.c.used_memory_mib
    keys = {CandidateOrder.FULLEST_FIRST: [free_vcpus, free_memory, HOST.c.id],
            CandidateOrder.EMPTIEST_FIRST: [free_vcpus.desc(), free_memory.desc(), HOST.c.id]}
    cols = [*HOST_COLUMNS[:-1], HOST.c.labels if labels else null().label("labels")]
    return Prepared(select(*cols).where(_HOST_FILTER, exists(select(GPU.c.id).where(
        GPU.c.host_id == HOST.c.id, _IN_POOL))).order_by(*keys.get(order, [HOST.c.id]))
        .limit(bindparam("page_limit", type_=Integer)).offset(bindparam("page_offset", type_=Integer)))


def bare_host_page(tx: Tx, order: CandidateOrder, labels: bool, bounds: PageBounds) -> list[BareHostRow]:
    """A page of the pool's hosts with room for a request without vGPUs, in the policy's order."""
    return [BareHostRow._make(t) for t in _bare_hosts_query(order, labels).run(tx, bounds._asdict()).fetchall()]


def _where(pool_ids: Sequence[int], host_ids: Sequence[int] | None) -> list[Any]:
    return [GPU.c.pool_id.in_(list(pool_ids))] + ([GPU.c.host_id.in_(list(host_ids))] if host_ids is not None
                                                   else [])


def pool_gpus(tx: Tx, pool_ids: Sequence[int], host_ids: Sequence[int] | None = None) -> list[CandidateRow]:
    """Every GPU of the pools (on `host_ids` only, if given) with its host's columns."""
    return [CandidateRow._make(r) for r in tx.execute(select(*_CANDIDATE_COLS).join(HOST, HOST.c.id == GPU.c.host_id)
                                                      .where(*_where(pool_ids, host_ids)))]


def lacked_types(tx: Tx, pool_ids: Sequence[int], host_ids: Sequence[int] | None = None) -> dict[int, frozenset[str]]:
    """By GPU id, the profiles the GPU's host lacks type ids for, for the pools' GPUs that lack any."""
    return {gid: frozenset(names or ()) for gid, names in tx.execute(
        select(GPU.c.id, GPU.c.lacked_types).where(*_where(pool_ids, host_ids), GPU.c.lacks != 0))}


__all__ = ["GPU_COLUMNS", "HOST_COLUMNS", "BareHostRow", "CandidateRow", "PageBounds", "SummaryRow", "bare_host_page",
           "gpu_pages", "grouped_host_page", "lacked_types", "pool_gpus", "summary_pages"]
