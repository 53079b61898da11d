"""The in-memory allocator a server keeps, one per store: the occupancy of every GPU and host of every pool in
memory, plans against it, and claims written to the store by group commit.

    caller:  plan against memory (under the allocator's lock) -> the plan is applied to memory at once, so the
             next caller plans around it -> queued for the committer -> wait until it is durable
    committer thread: take every queued claim (up to `max_batch`) and write them in one transaction:
             one conditional charge per tenant and per host with the batch's sums, one compare-and-set per GPU
             (its state after the batch's last claim there, its version moved on by the batch's claims), the
             priority classes read once, one INSERT of every VM, then each claim's devices, scheduling row and
             audit event -> commit once -> answer each caller
             if any of those conditional updates fails, the transaction rolls back and the batch is written
             again claim by claim, a savepoint each (claim.py's own steps), so one loser fails alone

The store stays the arbiter: the conditional updates are the store path's (a sum passes a limit or a host's
capacity exactly when each of its claims in turn would), so another replica (or process, or a release on this
one) that changed a host or GPU since memory was read makes that claim lose its savepoint; the allocator then
reloads those hosts from the store and the caller plans again. A claim planned on another that has not settled
expects that one's versions plus one; if that one fails, another writer may have reached those numbers, so the
claim is lost without a write (`_Claim.on_a_loser`) instead of landing on a state it never saw. What
memory cannot decide goes the store path (`claim.claim`), which is exact: anti-affinity, dry runs,
spread-load pools, a request nothing in memory fits (the refusal is then the store's, and memory is reloaded),
a claim refused in the write (a limit, a name taken, an idempotency key used). Memory is also reloaded every
`refresh_s`, for capacity freed elsewhere.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.geometry import Geometry, Occupancy, fit_mask, profile_bit
from vgpu_ctl.core.placement import (
    CandidateOrder,
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    Policy,
    Score,
    host_admits,
    host_rank,
    plan_on_host,
)
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service import claim as claims
from vgpu_ctl.service.fit_masks import lacked_bits
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.requests import VmInfo, VmRequest
from vgpu_ctl.store.claims import BatchWrite, GpuAfter

if TYPE_CHECKING:
    from vgpu_ctl.core.priority import PriorityClass
    from vgpu_ctl.service.context import ServiceContext
    from vgpu_ctl.service.controller import Controller

MAX_PAGES = 4  # candidate pages planned in memory before the request goes the store path
PLANS_PER_HOST = 32  # request shapes whose plan on a host is remembered until the host changes
RETRIES = 8  # lost races planned again in memory before the request goes the store path


def _key(order: CandidateOrder) -> Callable[[GpuView], tuple[int, ...]]:
    """The candidate order of a pool's policy, on GPU views (as the store's candidate index orders rows)."""
    return lambda g: alloc.order_rank(order, g.occupancy.free_units, g.gpu_id)


def _bits(occ: Occupancy, lacks: frozenset[str]) -> int:
    """The GPU's fit mask less the profiles its host lacks type ids for (as the store keeps `gpu.fits`)."""
    return fit_mask(occ) & ~lacked_bits(occ.geometry, lacks) if lacks else fit_mask(occ)


@dataclass
class _Pool:
    """One pool in memory: its row, policy, hosts (views of the pool's GPUs), and an index per (geometry, fit
    bit) of the GPUs in the policy's candidate order, and one of the hosts with GPUs there in the policy's
    candidate order of hosts (`host_rank`, as the store's `host_fit` summaries are paged), each with how many of
    its GPUs there are."""

    row: Any
    order: CandidateOrder
    whole_hosts: bool
    hosts: dict[int, HostView] = field(default_factory=dict)
    host_of: dict[int, int] = field(default_factory=dict)
    gpus: dict[int, GpuView] = field(default_factory=dict)
    geometries: dict[int, Geometry] = field(default_factory=dict)
    page: alloc.Candidates = field(default_factory=lambda: alloc.Candidates([], {}))
    index: dict[tuple[int, int], list[tuple[int, ...]]] = field(default_factory=dict)
    keys: dict[int, tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = field(default_factory=dict)
    plans: dict[int, dict[tuple[Any, ...], tuple[Score, PlacementPlan] | None]] = field(default_factory=dict)
    host_index: dict[tuple[int, int], list[tuple[tuple[float, ...], int]]] = field(default_factory=dict)
    host_keys: dict[int, dict[tuple[int, int], tuple[tuple[float, ...], int]]] = field(default_factory=dict)
    pending: dict[int, _Claim] = field(default_factory=dict)  # GPU id -> the unsettled claim memory shows there

    def unindex(self, gid: int) -> None:
        """Take a GPU out of the index."""
        slots, key = self.keys.pop(gid, ((), ()))
        for slot in slots:
            entries = self.index[slot]
            i = bisect.bisect_left(entries, key)
            if i < len(entries) and entries[i] == key:
                del entries[i]

    def reindex(self, g: GpuView) -> None:
        """Put a GPU in the index by its fit bits and candidate key."""
        self.unindex(g.gpu_id)
        key = _key(self.order)(g)
        bits = _bits(g.occupancy, g.lacks)
        geo = id(g.occupancy.geometry)
        slots = tuple((geo, 1 << b) for b in range(bits.bit_length()) if bits >> b & 1)
        for slot in slots:
            bisect.insort(self.index.setdefault(slot, []), key)
        self.keys[g.gpu_id] = (slots, key)

    def drop_host(self, hid: int) -> None:
        """Take a host and its GPUs out of the pool."""
        self.put_host(dataclasses.replace(self.hosts[hid], gpus=()))
        del self.hosts[hid]
        self.host_keys.pop(hid, None)

    def put_host(self, view: HostView) -> None:
        """Replace a host's view (and the index entries of its GPUs whose view changed); forget its plans
        unless the view is the same."""
        old = self.hosts.get(view.host_id)
        if old == view:
            return
        kept = {id(g) for g in view.gpus}
        for g in old.gpus if old else ():
            if id(g) not in kept:
                self.unindex(g.gpu_id)
                self.host_of.pop(g.gpu_id, None)
                self.gpus.pop(g.gpu_id, None)
        self.hosts[view.host_id] = view
        self.plans.pop(view.host_id, None)
        for g in view.gpus:
            if self.gpus.get(g.gpu_id) is g:
                continue
            self.host_of[g.gpu_id] = view.host_id
            self.gpus[g.gpu_id] = g
            self.geometries.setdefault(id(g.occupancy.geometry), g.occupancy.geometry)
            self.reindex(g)
        self._rank_host(view)

    def _rank_host(self, view: HostView) -> None:
        """Put a host in the host index as its `host_fit` rows rank it: per (geometry, fit bit), how many of its
        GPUs there can take the profile and their free units (the mean, for a policy with a host cost), beside
        its GPUs of that geometry."""
        for slot, entry in self.host_keys.pop(view.host_id, {}).items():
            entries = self.host_index[slot]
            i = bisect.bisect_left(entries, entry)
            if i < len(entries) and entries[i] == entry:
                del entries[i]
        width: dict[int, int] = {}
        fit: dict[tuple[int, int], list[int]] = {}
        for g in view.gpus:
            width[id(g.occupancy.geometry)] = width.get(id(g.occupancy.geometry), 0) + 1
            for slot in self.keys[g.gpu_id][0]:
                n_free = fit.setdefault(slot, [0, 0])
                n_free[0] += 1
                n_free[1] += g.occupancy.free_units
        keys = {}
        for slot, (n, free) in fit.items():
            entry = (host_rank(self.order, self.whole_hosts, width[slot[0]],
                               free / n if self.whole_hosts else free, view.host_id), n)
            bisect.insort(self.host_index.setdefault(slot, []), entry)
            keys[slot] = entry
        self.host_keys[view.host_id] = keys

    def plan(self, req: PlacementRequest, hosts: Sequence[HostView], policy: Policy) -> PlacementPlan | None:
        """`core.placement.plan` over the hosts taken in host order (as over `allocation.distinct_states` of
        them: hosts in one state score alike, the first in host order wins), each host's plan for the request's
        shape remembered until the host changes (`put_host`): a claim changes one host, so the next request of
        a shape plans again only there."""
        shape = (req.profiles, req.vcpus, req.memory_mib)
        best: tuple[Score, PlacementPlan] | None = None
        for host in sorted(hosts, key=lambda h: h.order):
            if host_admits(host, req) is not None:
                continue
            memo = self.plans.setdefault(host.host_id, {})
            # The whole host's view, or a page of some of its GPUs (named by their ids).
            key = (shape,) if host is self.hosts.get(host.host_id) else (shape, *(g.gpu_id for g in host.gpus))
            if key in memo:
                found = memo[key]
            else:
                if len(memo) >= PLANS_PER_HOST:
                    del memo[next(iter(memo))]
                found = memo[key] = plan_on_host(host, req, policy)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        return best[1] if best else None

    def candidates(self, req: PlacementRequest) -> Iterator[list[HostView]]:
        """Pages of hosts that may take the request (by fit bits and room), as `allocation.candidate_pages` reads
        them: GPU pages (only the page's GPUs in each view) for one vGPU in the policy's candidate order of GPUs;
        whole hosts in its order of hosts for several vGPUs of one profile or a policy that scores whole hosts,
        then (several vGPUs that GPUs of more than one geometry can take) the hosts with enough of them together;
        for several profiles, those hosts alone."""
        if not req.profiles:
            return
        slots = self._slots(frozenset(req.profiles))
        if len(set(req.profiles)) > 1:
            yield from self._grouped_pages(req, set(slots))
            return
        if len(req.profiles) > 1 or self.whole_hosts:
            yield from self._host_pages(req, slots)
            if len(req.profiles) > 1 and len(slots) > 1:
                yield from self._grouped_pages(req, set(slots))
            return
        yield from self._gpu_pages(req, slots)

    def _slots(self, profiles: frozenset[str]) -> list[tuple[int, int]]:
        """The (geometry, fit bit) of each of the profiles on each geometry of the pool that offers it."""
        out = []
        for geo_id, geo in self.geometries.items():
            for profile in sorted(profiles):
                bit = profile_bit(geo, profile)
                if bit:
                    out.append((geo_id, bit))
        return out

    @staticmethod
    def _room(view: HostView, req: PlacementRequest) -> bool:
        """Whether the host is active and has the request's vCPUs and memory free (the store's host filter)."""
        return view.state == "active" and view.free_vcpus >= req.vcpus and view.free_memory_mib >= req.memory_mib

    def _gpu_pages(self, req: PlacementRequest, slots: Sequence[tuple[int, int]]) -> Iterator[list[HostView]]:
        """Pages of GPUs that can take the request's one vGPU, in the policy's candidate order of GPUs."""
        lists = [self.index[slot] for slot in slots if slot in self.index]
        picked: dict[int, list[GpuView]] = {}
        count = 0
        for key in heapq.merge(*lists):
            gid = key[-1]
            hid = self.host_of[gid]
            if not self._room(self.hosts[hid], req):
                continue
            picked.setdefault(hid, []).append(self.gpus[gid])
            count += 1
            if count >= alloc.PAGE:
                yield self._page(picked, False)
                picked, count = {}, 0
        if picked:
            yield self._page(picked, False)

    def _host_pages(self, req: PlacementRequest, slots: Sequence[tuple[int, int]]) -> Iterator[list[HostView]]:
        """Pages of whole hosts with as many GPUs of one geometry that can take the profile as the request has
        vGPUs, in the policy's order of hosts (each by its best geometry), as the store pages `host_fit`."""
        lists = [self.host_index[slot] for slot in slots if slot in self.host_index]
        picked: dict[int, list[GpuView]] = {}
        for key, n in heapq.merge(*lists):
            hid = int(key[-1])
            if n < len(req.profiles) or hid in picked or not self._room(self.hosts[hid], req):
                continue
            picked[hid] = list(self.hosts[hid].gpus)
            if len(picked) >= alloc.HOST_PAGE:
                yield self._page(picked, True)
                picked = {}
        if picked:
            yield self._page(picked, True)

    def _grouped_pages(self, req: PlacementRequest, slots: set[tuple[int, int]]) -> Iterator[list[HostView]]:
        """Pages of whole hosts with as many GPUs that can take one of the profiles as the request has vGPUs, in
        the policy's order of hosts by those GPUs' free units together (the store's grouping query)."""
        ranked = []
        for hid, view in self.hosts.items():
            if not self._room(view, req):
                continue
            taking = [g for g in view.gpus if any(slot in slots for slot in self.keys[g.gpu_id][0])]
            if len(taking) >= len(req.profiles):
                free = sum(g.occupancy.free_units for g in taking)
                ranked.append((host_rank(self.order, False, 0, free, hid), hid))
        ranked.sort()
        for i in range(0, len(ranked), alloc.HOST_PAGE):
            yield self._page({hid: [] for _, hid in ranked[i:i + alloc.HOST_PAGE]}, True)

    def _page(self, picked: dict[int, list[GpuView]], whole: bool) -> list[HostView]:
        views = []
        for hid, gpus in picked.items():
            view = self.hosts[hid]
            views.append(view if whole else dataclasses.replace(view, gpus=tuple(gpus), gpu_count=None))
        return views


@dataclass
class _Claim:
    """A planned claim waiting for the committer, and its outcome."""

    ctl: Controller
    req: VmRequest
    pool: _Pool
    tenant_id: int
    chosen: PlacementPlan
    page: alloc.Candidates
    delta: dict[str, int]
    charges: dict[tuple[str, str], int]
    done: threading.Event = field(default_factory=threading.Event)
    vm: VmInfo | None = None
    lost: bool = False  # a conditional update found the store changed: plan again
    error: BaseException | None = None  # refused in the write (or failed): the store path answers
    # The unsettled claims whose outcome in memory this one was planned on: its expected GPU versions are theirs
    # plus one, a number another writer's compare-and-set can also reach if one of them fails.
    after: tuple[_Claim, ...] = ()
    settled: bool = False  # its write was tried (`vm` says whether it stands)

    def on_a_loser(self) -> bool:
        """Whether a claim this one was planned on failed: its expected versions no longer mean its states."""
        return any(p.settled and p.vm is None for p in self.after)


def _gpus_after(batch: Sequence[_Claim]) -> list[GpuAfter] | None:
    """Each GPU the batch's claims change, as the last of them leaves it, with the version the first read; None
    when a claim's expected version there is not the one its predecessor in the batch moved it to (memory was
    reloaded between their plans: only claim by claim can tell which stands)."""
    seen: dict[int, list[Any]] = {}  # GPU id -> [version read first, claims, occupancy after the last]
    for item in batch:
        for gid, occ in item.chosen.occupancies.items():
            version = item.page.versions[gid]
            chain = seen.get(gid)
            if chain is None:
                seen[gid] = [version, 1, occ]
            elif version != chain[0] + chain[1]:
                return None
            else:
                chain[1] += 1
                chain[2] = occ
    return [GpuAfter(gid, v, n, alloc.gpu_state(occ)) for gid, (v, n, occ) in seen.items()]


class Allocator:
    """The fleet in memory for one store, with a committer thread writing claims by group commit."""

    def __init__(self, ctx: ServiceContext, *, max_batch: int = 128, refresh_s: float = 5.0) -> None:
        """Load every pool's hosts and GPUs from the store (`ctx`) and start the committer."""
        self.ctx = ctx
        self.max_batch = max_batch
        self.refresh_s = refresh_s
        self._lock = threading.RLock()
        self._queue: queue.Queue[_Claim | None] = queue.Queue()
        self._pools: dict[str, _Pool] = {}
        self._tenants: dict[str, int] = {}
        self._loaded = 0.0
        self.stats: dict[str, float] = {"claims": 0, "batches": 0, "lost": 0, "store_path": 0, "reloads": 0,
                                        "split": 0,  # batches written again claim by claim
                                        "plan_s": 0.0, "write_s": 0.0}  # seconds planning, and writing batches
        self.reload()
        self._thread = threading.Thread(target=self._commit_loop, name="vgpu-allocator", daemon=True)
        self._thread.start()

    # -- memory ------------------------------------------------------------------------------------------------

    def reload(self) -> None:
        """Read every pool, host and GPU from the store again (what other replicas and releases changed): a pool
        whose row is unchanged keeps its memory, only the hosts whose view changed are indexed again (and forget
        their plans), hosts gone from the pool leave it."""
        with self.ctx.db.read() as conn:
            rows = claims.all_pools(conn)
            names = {p.id: p.name for p in rows}
            found = [(p, alloc.all_candidates(conn, self.ctx.catalog, [p.id], (), None, names)) for p in rows]
        with self._lock:
            fresh = {}
            for p, cands in found:
                pool = self._pools.get(p.name)
                if pool is None or pool.row != p:
                    policy = claims.pool_policy(p.policy, p.demand)
                    pool = _Pool(p, policy.order, policy.host_cost is not None)
                for hid in set(pool.hosts) - {v.host_id for v in cands.hosts}:
                    pool.drop_host(hid)
                self._fill(pool, cands)
                fresh[p.name] = pool
            self._pools = fresh
            self._loaded = time.monotonic()
            self.stats["reloads"] += 1

    def _reload_hosts(self, pool: _Pool, host_ids: Sequence[int]) -> None:
        """Read the pool's GPUs on these hosts again, after a claim there lost a race."""
        with self.ctx.db.read() as conn:
            names = {p.id: p.name for p in claims.all_pools(conn)}
            found = alloc.all_candidates(conn, self.ctx.catalog, [pool.row.id], (), None, names, host_ids=host_ids)
        with self._lock:
            self._fill(pool, found)

    @staticmethod
    def _fill(pool: _Pool, found: alloc.Candidates) -> None:
        for view in found.hosts:
            pool.put_host(dataclasses.replace(view, gpu_count=len(view.gpus)))
            for g in view.gpus:  # memory shows the store's state there now, no unsettled claim's
                pool.pending.pop(g.gpu_id, None)
        pool.page.versions.update(found.versions)
        pool.page.pcis.update(found.pcis)
        pool.page.backings.update(found.backings)
        pool.page.simulated.update(found.simulated)

    def _apply(self, pool: _Pool, req: VmRequest, chosen: PlacementPlan) -> alloc.Candidates:
        """Apply a plan to memory (under the lock); what the claim's compare-and-set expects of its GPUs."""
        view = pool.hosts[chosen.host_id]
        gpus = tuple(dataclasses.replace(g, occupancy=chosen.occupancies[g.gpu_id])
                     if g.gpu_id in chosen.occupancies else g for g in view.gpus)
        pool.put_host(dataclasses.replace(view, gpus=gpus, free_vcpus=view.free_vcpus - req.vcpus,
                                          free_memory_mib=view.free_memory_mib - req.memory_mib))
        expected = {gid: pool.page.versions[gid] for gid in chosen.occupancies}
        for gid in chosen.occupancies:
            pool.page.versions[gid] += 1
        return alloc.Candidates([], expected, pool.page.pcis, pool.page.backings, pool.page.simulated)

    # -- the claim ---------------------------------------------------------------------------------------------

    def claim(self, ctl: Controller, req: VmRequest, dry_run: bool = False) -> claims.ClaimResult:
        """Claim as `claim.claim` does (the same results and errors), planned in memory and written by group
        commit; the store path for what memory cannot decide."""
        if dry_run or req.anti_affinity or not req.vgpus:
            return self._store_path(ctl, req, dry_run)
        claims.check_profiles(None, ctl.catalog, req, [], offers_too=False)
        t_id = self._tenant_id(ctl, req.tenant)
        profiles = req.profiles()
        delta = claims.charge_of(ctl.catalog, profiles, req.vcpus, req.memory_mib)
        preq = PlacementRequest(profiles, req.vcpus, req.memory_mib, req.labels, None)
        for _ in range(RETRIES):
            item = self._plan(ctl, req, preq, t_id, delta)
            if item is None:
                break
            item.done.wait()
            if item.vm is not None:
                return claims.Claimed(item.vm)
            if not item.lost:
                break
        return self._store_path(ctl, req, False)

    def _store_path(self, ctl: Controller, req: VmRequest, dry_run: bool) -> claims.ClaimResult:
        with self._lock:
            self.stats["store_path"] += 1
        result = claims.claim(ctl, req, dry_run)
        if isinstance(result, claims.Claimed) and result.vm.pool in self._pools:
            pool = self._pools[result.vm.pool]
            host = next((h for h in pool.hosts.values() if h.name == result.vm.host), None)
            if host is not None:
                self._reload_hosts(pool, [host.host_id])
        return result

    def _tenant_id(self, ctl: Controller, tenant: str) -> int:
        t_id = self._tenants.get(tenant)
        if t_id is None:
            with ctl.read() as conn:
                t_id = ctl._tenant_id(conn, tenant)
            self._tenants[tenant] = t_id
        return ctl._visible_tenant(tenant, t_id)

    def _plan(self, ctl: Controller, req: VmRequest, preq: PlacementRequest, t_id: int,
              delta: dict[str, int]) -> _Claim | None:
        """The first plan memory finds in the request's pools, applied to memory and queued for the committer
        (in the order of planning: a claim's expected GPU versions follow those of the claims planned before it);
        None when memory finds none (or the pool needs the store path)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                item = self._plan_locked(ctl, req, preq, t_id, delta)
                if item is not None:
                    self._queue.put(item)
                return item
            finally:
                self.stats["plan_s"] += time.perf_counter() - t0

    def _plan_locked(self, ctl: Controller, req: VmRequest, preq: PlacementRequest, t_id: int,
                     delta: dict[str, int]) -> _Claim | None:
        """`_plan` under the lock."""
        pools = [self._pools.get(req.pool)] if req.pool else list(self._pools.values())
        for pool in pools:
            if pool is None or pool.row.policy == "spread-load":
                return None
            policy = claims.pool_policy(pool.row.policy, pool.row.demand)
            for n, hosts in enumerate(pool.candidates(preq)):
                chosen = pool.plan(preq, hosts, policy)
                if chosen is not None:
                    page = self._apply(pool, req, chosen)
                    charges = claims.scoped_charges(pool.row.name, delta, preq.profiles)
                    after = tuple({id(c): c for g in chosen.occupancies if (c := pool.pending.get(g))}.values())
                    item = _Claim(ctl, req, pool, t_id, chosen, page, delta, charges, after=after)
                    pool.pending.update((g, item) for g in chosen.occupancies)
                    return item
                if n + 1 >= MAX_PAGES:
                    break
        return None

    # -- the committer -----------------------------------------------------------------------------------------

    def _commit_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
            self._commit(batch)
            if time.monotonic() - self._loaded > self.refresh_s:
                self._safely(self.reload)

    def _commit(self, batch: list[_Claim]) -> None:
        """Write a batch in one transaction (claim by claim if it must); answer each caller once it is durable."""
        t0 = time.perf_counter()
        try:
            if any(item.on_a_loser() for item in batch) or not self._write_batch(batch):
                with self.ctx.db.write() as tx:
                    STORE.claims.share_claim_turn(tx)  # as every claim's write (and the batch's)
                    for item in batch:
                        self._write_one(tx, item)
        except BaseException as exc:  # the transaction failed as a whole: nothing of the batch is durable
            for item in batch:
                item.vm, item.lost, item.error = None, False, exc
        wrote = time.perf_counter() - t0
        with self._lock:
            for item in batch:
                item.settled, item.after = True, ()  # its own outcome now tells the claims planned on it
                for gid in item.chosen.occupancies:
                    if item.pool.pending.get(gid) is item:
                        del item.pool.pending[gid]
        stale: dict[int, tuple[_Pool, set[int]]] = {}  # memory holds plans the store did not take: read again
        for item in batch:
            if item.vm is None:
                stale.setdefault(id(item.pool), (item.pool, set()))[1].add(item.chosen.host_id)
        for pool, hosts in stale.values():
            self._safely(functools.partial(self._reload_hosts, pool, sorted(hosts)))
        with self._lock:
            self.stats["batches"] += 1
            self.stats["write_s"] += wrote
            self.stats["claims"] += sum(1 for i in batch if i.vm is not None)
            self.stats["lost"] += sum(1 for i in batch if i.lost)
        for item in batch:
            item.done.set()

    def _write_batch(self, batch: list[_Claim]) -> bool:
        """Write every claim of the batch with summed conditional updates in one transaction; False (nothing
        written) when one of them would not pass, or the batch's plans on a GPU do not follow each other."""
        gpus = _gpus_after(batch)
        try:
            if gpus is None:
                raise alloc.ClaimConflict("the batch's plans on a GPU do not follow each other")
            with self.ctx.db.write() as tx:
                vms = self._write_all(tx, batch, gpus)
        except Exception:  # a claim of the batch would lose or be refused: each on its own says which
            with self._lock:
                self.stats["split"] += 1
            return False
        for item, vm in zip(batch, vms, strict=True):
            item.vm, item.settled = vm, True
        return True

    @staticmethod
    def _write_all(tx: Tx, batch: Sequence[_Claim], gpus: Sequence[GpuAfter]) -> list[VmInfo]:
        """The batch's writes in `tx`, sent together (`write_batch`; ClaimConflict when a conditional update
        does not pass); its VMs. The priority classes are read first, the store asked once whether it holds
        any."""
        from vgpu_ctl.service import scheduling
        tenants: dict[int, tuple[dict[str, int], dict[tuple[str, str], int]]] = {}
        hosts: dict[int, list[int]] = {}
        for item in batch:
            delta, charges = tenants.setdefault(item.tenant_id, ({}, {}))
            for r, n in item.delta.items():
                delta[r] = delta.get(r, 0) + n
            for k, n in item.charges.items():
                charges[k] = charges.get(k, 0) + n
            used = hosts.setdefault(item.chosen.host_id, [0, 0])
            used[0] += item.req.vcpus
            used[1] += item.req.memory_mib
        any_class = STORE.scheduling.any_class(tx)
        classes: dict[tuple[int, str, str | None], PriorityClass] = {}
        for item in batch:
            key = (item.tenant_id, item.req.tenant, item.req.priority)
            if key not in classes:
                classes[key] = scheduling.resolve(tx, *key, any_class)
        rows = [claims.vm_row(i.tenant_id, i.req, i.pool.row, i.chosen, i.delta, i.charges) for i in batch]
        records = [claims.claim_records(i.ctl, row, i.req, i.pool.row, i.chosen, i.page,
                                        classes[(i.tenant_id, i.req.tenant, i.req.priority)])
                   for i, row in zip(batch, rows, strict=True)]
        scoped = STORE.claims.write_batch(tx, BatchWrite(
            [(t_id, delta) for t_id, (delta, _) in tenants.items()], [(h, v, m) for h, (v, m) in hosts.items()],
            gpus, rows, [d for r in records for d in r.devices], [r.sched for r in records],
            [r.event for r in records]))
        if scoped is None:
            raise alloc.ClaimConflict("the batch passes a limit, or a host or GPU changed")
        for t_id in scoped:
            if alloc.charge_scoped(tx, t_id, tenants[t_id][1]):
                raise alloc.ClaimConflict(f"tenant {t_id}: the batch passes a pool-scoped limit")
        return [r.vm for r in records]

    @staticmethod
    def _write_one(tx: Tx, item: _Claim) -> None:
        """One claim in a savepoint of the batch's transaction (its outcome on `item`). A claim planned on one
        that failed is lost without a write: the store may have reached its expected versions another way."""
        if item.on_a_loser():
            item.vm, item.lost, item.settled = None, True, True
            item.error = alloc.ClaimConflict("planned on a claim that did not stand")
            return
        try:
            with STORE.claims.savepoint(tx) as undo:
                if claims.charge(tx, item.tenant_id, item.req.tenant, item.delta, item.charges):
                    undo()  # a pool-scoped limit: the store path tries the next pool, or explains
                cls = claims.take(tx, item.tenant_id, item.req, item.chosen, item.page)
                item.vm = claims.record_vm(item.ctl, tx, item.tenant_id, item.req, item.pool.row, item.chosen,
                                           item.page, item.delta, item.charges, cls)
        except alloc.ClaimConflict as exc:  # the store changed since memory was read: plan again
            item.vm, item.lost, item.error = None, True, exc
        except Exception as exc:  # refused in the write (a limit, a name, a key) or failed: the store path answers
            item.vm, item.error = None, exc
        item.settled = True

    def _safely(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a reload that fails leaves memory as it was; the store arbitrates regardless
            with self._lock:
                self.stats["reload_errors"] = self.stats.get("reload_errors", 0) + 1

    def close(self) -> None:
        """Stop the committer once the queued claims are written."""
        self._queue.put(None)
        self._thread.join(timeout=30)


__all__ = ["Allocator"]
