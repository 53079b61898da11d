"""Replaying a demand against a fleet with the real geometry and placement policies, on a copy.

Each VM of the demand is placed once, in arrival order, by `core.placement.plan_on_host` and the chosen policy;
refused VMs are dropped (the first refusal of each request shape is explained with `core.placement.explain`);
nothing departs. GPUs are grouped by (pool, model, mode); a request sees the groups its pool and models allow,
each host through its GPUs of one group. Hosts in the same state (the group's GPU occupancies, free vCPUs and
memory) get the same plan from every policy, first in host order among equals, so only the first host of each
state is tried: that keeps the cost per request to the number of distinct host states, not hosts.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Geometry, Mode, Occupancy
from vgpu_ctl.core.placement import (
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    Policy,
    Score,
    TaskShape,
    describe_refusal,
    explain,
    get_policy,
    plan_on_host,
)
from vgpu_ctl.planning.demand import Ask, Demand, largest_share
from vgpu_ctl.planning.fleet import Fleet, PlanGpu
from vgpu_ctl.planning.trace import profile_for

Key = tuple[str | None, str, Mode]  # (pool, model, mode): GPUs a request sees together on one host


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request shape was first refused: reason codes counted per GPU, and the same in words."""

    counts: dict[str, int]
    text: str


@dataclass
class Outcome:
    """What a replay placed and refused per request shape, and the fleet afterwards."""

    fleet: Fleet
    placed: list[int]
    refused: list[int]
    refusals: dict[int, Refusal]
    asked_gpus: list[float]  # per shape, the GPUs' worth one VM asks for
    consumed_gpus: list[float]  # per shape, the GPUs' worth its placed VMs' devices take
    rounding_gpus: float  # what share requests took beyond their share, rounded up to a profile
    placements: list[tuple[int, int, PlacementPlan]] = field(default_factory=list)  # (ask, host, plan)
    refused_order: list[int] = field(default_factory=list)  # the refused VMs' shapes, in arrival order

    @property
    def placed_vms(self) -> int:
        """VMs placed."""
        return sum(self.placed)

    @property
    def refused_vms(self) -> int:
        """VMs refused."""
        return sum(self.refused)

    @property
    def placed_share(self) -> float:
        """The placed VMs' GPUs' worth over the whole demand's (0..1)."""
        total = sum((p + r) * w for p, r, w in zip(self.placed, self.refused, self.asked_gpus, strict=True))
        done = sum(p * w for p, w in zip(self.placed, self.asked_gpus, strict=True))
        return done / total if total else 1.0


def resolve(catalog: Catalog, ask: Ask, geometry: Geometry) -> str | None:
    """The profile `ask` takes on a GPU of this geometry: its first named profile the geometry offers, or the
    smallest profile holding its share; None if it can't run there (another model, pool aside)."""
    if ask.models is not None and geometry.model not in ask.models:
        return None
    if ask.profiles:
        return next((p for p in ask.profiles if p in geometry.shapes), None)
    assert ask.share is not None
    return profile_for(catalog, geometry, round(ask.share * 1000))


def asked_gpus(catalog: Catalog, ask: Ask) -> float:
    """The GPUs' worth one VM of the shape asks for: its share, or its profile's share of its GPU's memory."""
    return ask.gpus * (ask.share if ask.share is not None else largest_share(catalog, ask.profiles))


COST_MEMO = 1 << 20  # pack's costs remembered per host class and request
GpuSet = frozenset[tuple[Occupancy, int]]  # a host's GPUs of one group: occupancy -> how many GPUs hold it
Room = tuple[float, float]  # a host's free milli-vCPUs and memory


class Replay:
    """One fleet being filled by one policy. `place` takes a request shape's index and returns the host index and
    plan, or None (refused).

    Hosts are indexed per group by their GPUs' occupancies, then by their free room. Among hosts with the same
    GPUs, first-fit and best-fit take the first host in order that has the room, spread the one with the most
    free vCPUs, and pack's cost depends on the room only through which typical tasks of the mix the host admits
    before and after the request (the mix's vCPU thresholds), so one host per such class is priced, and a class's
    cost is remembered (hosts change class only when a VM lands on them): the plans are those
    `core.placement.plan` would choose over every host."""

    def __init__(self, catalog: Catalog, fleet: Fleet, asks: Sequence[Ask], policy_name: str,
                 weights: Sequence[float] | None = None) -> None:
        self.catalog = catalog
        self.fleet = fleet
        self.asks = tuple(asks)
        hosts = fleet.hosts
        self.occ: list[list[Occupancy]] = [[g.occupancy for g in h.gpus] for h in hosts]
        self.vcpus = [h.free_vcpus * 1000 for h in hosts]  # milli-vCPUs: trace tasks ask for fractions
        self.memory = [h.free_memory_mib for h in hosts]
        self.members: list[dict[Key, list[int]]] = []  # per host: group -> its GPU indexes
        self.index: dict[Key, dict[GpuSet, dict[Room, list[int]]]] = {}
        self.inactive: Counter[tuple[Key, str]] = Counter()  # GPUs on hosts not active, per group and state
        self.geometries: dict[Key, Geometry] = {}  # one per group: (model, mode) has one geometry
        for hi, h in enumerate(hosts):
            groups: dict[Key, list[int]] = {}
            for gi, g in enumerate(h.gpus):
                key = (g.pool, g.model, g.mode)
                groups.setdefault(key, []).append(gi)
                self.geometries.setdefault(key, g.occupancy.geometry)
            self.members.append(groups)
            for key, gids in groups.items():
                states = self.index.setdefault(key, {})
                if h.state == "active":
                    insort(states.setdefault(self._gpus(hi, key), {}).setdefault(self._room(hi), []), hi)
                else:
                    self.inactive[(key, h.state)] += len(gids)
        self.options: list[list[tuple[Key, str]]] = [self._options(a) for a in self.asks]
        mix: dict[TaskShape, float] = {}
        for i, a in enumerate(self.asks):
            profiles = tuple(dict.fromkeys(p for _, p in self.options[i]))
            if profiles:  # memory left out, as in FGD's typical tasks
                shape = TaskShape(profiles, a.gpus, float(round(a.vcpus * 1000)), 0.0, a.models)
                mix[shape] = mix.get(shape, 0.0) + (weights[i] if weights else 1.0)
        self.thresholds = sorted({t.vcpus for t in mix})
        supply: Counter[str] = Counter(g.model for h in hosts for g in h.gpus)
        self.policy: Policy = get_policy(policy_name, mix or None,
                                         {m: float(n) for m, n in supply.items()} if policy_name == "pack" else None)
        self._fits: dict[tuple[GpuSet, str], int] = {}
        self._costs: dict[tuple[tuple[GpuSet, int, int], tuple[str, ...], int, int], Score | None] = {}

    def _options(self, ask: Ask) -> list[tuple[Key, str]]:
        out = []
        for key, geometry in self.geometries.items():
            if ask.pool is not None and key[0] != ask.pool:
                continue
            profile = resolve(self.catalog, ask, geometry)
            if profile is not None:
                out.append((key, profile))
        return out

    def _gpus(self, hi: int, key: Key) -> GpuSet:
        occ = self.occ[hi]
        return frozenset(Counter(occ[g] for g in self.members[hi][key]).items())

    def _room(self, hi: int) -> Room:
        return self.vcpus[hi], self.memory[hi]

    def view(self, hi: int, key: Key) -> HostView:
        """Host `hi` as placement sees it through its GPUs of group `key` (vCPUs in milli-vCPUs)."""
        h = self.fleet.hosts[hi]
        gids = self.members[hi][key]
        gpus = tuple(GpuView(g, h.gpus[g].pci, self.occ[hi][g], h.gpus[g].pool) for g in gids)
        return HostView(hi, h.name, self.vcpus[hi], self.memory[hi], gpus, h.state, h.labels, order=hi,
                        gpu_count=len(gids))

    def request(self, ask: Ask, profile: str) -> PlacementRequest:
        """The placement request of one VM of `ask` taking `profile` (vCPUs in milli-vCPUs)."""
        return PlacementRequest((profile,) * ask.gpus, round(ask.vcpus * 1000), round(ask.memory_mib))

    def _fit_count(self, gpus: GpuSet, profile: str) -> int:
        key = (gpus, profile)
        hit = self._fits.get(key)
        if hit is None:
            hit = self._fits[key] = sum(k for o, k in gpus if o.misfit(profile) is None)
        return hit

    def candidates(self, key: Key, req: PlacementRequest) -> list[tuple[int, tuple[GpuSet, int, int] | None]]:
        """The hosts of group `key` whose plans for `req` the policy has to compare (see the class docstring), each
        with its state class for pack (GPUs, and where its vCPUs fall among the mix's thresholds before and after
        the request: hosts of one class cost the same)."""
        profile, n = req.profiles[0], len(req.profiles)
        out: list[tuple[int, tuple[GpuSet, int, int] | None]] = []
        pack = self.policy.host_cost is not None
        spread = self.policy.name == "spread"
        th = self.thresholds
        for gpus, rooms in self.index.get(key, {}).items():
            if self._fit_count(gpus, profile) < n:
                continue
            if pack:
                classes: dict[tuple[int, int], int] = {}
                for (v, m), holders in rooms.items():
                    if v >= req.vcpus and m >= req.memory_mib:
                        c = (bisect_right(th, v), bisect_right(th, v - req.vcpus))
                        if c not in classes or holders[0] < classes[c]:
                            classes[c] = holders[0]
                out.extend((hi, (gpus, *c)) for c, hi in classes.items())
                continue
            best: tuple[float, int] | None = None
            for (v, m), holders in rooms.items():
                if v >= req.vcpus and m >= req.memory_mib:
                    rank = (-v if spread else 0.0, holders[0])
                    if best is None or rank < best:
                        best = rank
            if best is not None:
                out.append((best[1], None))
        return out

    def place(self, i: int) -> tuple[int, PlacementPlan] | None:
        """Place one VM of shape `i` (the best plan of every group it may use) and record it; None if refused."""
        ask = self.asks[i]
        best: tuple[Score, int, Key, PlacementRequest] | None = None
        costs = self._costs
        if len(costs) > COST_MEMO:
            costs.clear()
        for key, profile in self.options[i]:
            req = self.request(ask, profile)
            for hi, cls in self.candidates(key, req):
                rank: Score | None
                if cls is None:
                    found = plan_on_host(self.view(hi, key), req, self.policy)
                    rank = found[0] if found is not None else None
                else:  # pack: the cost is the class's, the rest of the score is host order
                    memo = (cls, req.profiles, req.vcpus, req.memory_mib)
                    if memo in costs:
                        cost = costs[memo]
                    else:
                        found = plan_on_host(self.view(hi, key), req, self.policy)
                        cost = costs[memo] = found[0][:1] if found is not None else None
                    rank = (*cost, hi) if cost is not None else None
                if rank is not None and (best is None or (rank, hi) < (best[0], best[1])):
                    best = (rank, hi, key, req)
        if best is None:
            return None
        _, hi, key, req = best
        found = plan_on_host(self.view(hi, key), req, self.policy)
        assert found is not None
        self._apply(hi, found[1], ask)
        return hi, found[1]

    def _apply(self, hi: int, plan: PlacementPlan, ask: Ask) -> None:
        before = {key: (self._gpus(hi, key), self._room(hi)) for key in self.members[hi]}
        for gid, occ in plan.occupancies.items():
            self.occ[hi][gid] = occ
        self.vcpus[hi] -= round(ask.vcpus * 1000)
        self.memory[hi] -= round(ask.memory_mib)
        for key, (gpus, room) in before.items():
            states = self.index[key]
            rooms = states[gpus]
            holders = rooms[room]
            holders.remove(hi)
            if not holders:
                del rooms[room]
                if not rooms:
                    del states[gpus]
            insort(states.setdefault(self._gpus(hi, key), {}).setdefault(self._room(hi), []), hi)

    def why(self, i: int) -> Refusal:
        """Why a VM of shape `i` can't be placed now, counted per GPU over every group it may use."""
        ask = self.asks[i]
        if not self.options[i]:
            where = f"pool {ask.pool}" if ask.pool else "the fleet"
            what = ", ".join(ask.profiles) if ask.profiles else f"a {ask.share:g} GPU share"
            models = f" of model {', '.join(sorted(ask.models))}" if ask.models else ""
            return Refusal({}, f"no GPU{models} in {where} offers {what} in its mode")
        counts: Counter[str] = Counter()
        for key, profile in self.options[i]:
            req = self.request(ask, profile)
            for rooms in self.index.get(key, {}).values():
                for holders in rooms.values():
                    for code, k in explain(req, [self.view(holders[0], key)]).items():
                        counts[code] += k * len(holders)
            for (k2, state), k in self.inactive.items():
                if k2 == key:
                    counts[f"host-{state}"] += k
        return Refusal(dict(counts), describe_refusal(counts))

    def fleet_now(self) -> Fleet:
        """The fleet as it stands: every GPU's occupancy, every host's free vCPUs and memory."""
        hosts = []
        for hi, h in enumerate(self.fleet.hosts):
            gpus = tuple(PlanGpu(g.pci, g.model, g.pool, self.occ[hi][gi]) for gi, g in enumerate(h.gpus))
            hosts.append(replace(h, gpus=gpus, free_vcpus=self.vcpus[hi] / 1000, free_memory_mib=self.memory[hi]))
        return replace(self.fleet, hosts=tuple(hosts))


def run(catalog: Catalog, fleet: Fleet, demand: Demand, policy_name: str = "pack",
        keep_placements: bool = False) -> Outcome:
    """Place every VM of the demand in arrival order on a copy of the fleet; what was placed and refused."""
    replay = Replay(catalog, fleet, demand.asks, policy_name, [float(c) for c in demand.counts])
    n = len(demand.asks)
    placed, refused = [0] * n, [0] * n
    consumed = [0.0] * n
    rounding = 0.0
    refusals: dict[int, Refusal] = {}
    asked = [asked_gpus(catalog, a) for a in demand.asks]
    kept: list[tuple[int, int, PlacementPlan]] = []
    refused_order: list[int] = []
    for i in demand.order:
        got = replay.place(i)
        if got is None:
            refused[i] += 1
            refused_order.append(i)
            if i not in refusals:
                refusals[i] = replay.why(i)
            continue
        hi, plan = got
        placed[i] += 1
        took = sum(d.size / plan.occupancies[d.gpu_id].geometry.axis for d in plan.devices)
        consumed[i] += took
        if demand.asks[i].share is not None:
            rounding += took - asked[i]
        if keep_placements:
            kept.append((i, hi, plan))
    return Outcome(replay.fleet_now(), placed, refused, refusals, asked, consumed, rounding, kept, refused_order)
