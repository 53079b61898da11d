"""Choosing a host, GPUs and positions for a VM's vGPUs from candidate views, by a pluggable policy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

from vgpu_ctl.core.geometry import Geometry, Misfit, Occupancy


@dataclass(frozen=True, slots=True)
class GpuView:
    """A candidate GPU as placement sees it."""

    gpu_id: int
    pci: str
    occupancy: Occupancy
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class HostView:
    """A candidate host with its free vCPUs and memory (after overcommit) and its candidate GPUs."""

    host_id: int
    name: str
    free_vcpus: float
    free_memory_mib: float
    gpus: tuple[GpuView, ...]
    state: str = "active"
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: frozenset[str] = frozenset()
    order: int = 0  # fixed host order for deterministic tie-breaks
    gpu_count: int | None = None  # all the host's GPUs, when `gpus` is the whole host (None: maybe only some)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a VM needs: one profile name per vGPU, vCPUs, memory, labels, anti-affinity group."""

    profiles: tuple[str, ...]
    vcpus: int
    memory_mib: int
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: str | None = None


@dataclass(frozen=True, slots=True)
class DevicePlacement:
    """One vGPU's chosen GPU and position."""

    gpu_id: int
    profile: str
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Where a VM goes."""

    host_id: int
    host: str
    devices: tuple[DevicePlacement, ...]
    occupancies: Mapping[int, Occupancy]  # each touched GPU's occupancy after the plan


@dataclass(frozen=True, slots=True)
class TaskShape:
    """A typical request of a demand mix: its profile (one per GPU model it may use), GPU count, vCPUs, memory, and
    the GPU models it may run on (None: any model that offers one of its profiles)."""

    profiles: tuple[str, ...]  # on a GPU, the first of them its geometry offers
    gpus: int = 1
    vcpus: float = 0.0
    memory_mib: float = 0.0
    models: frozenset[str] | None = None


# What a pool's requests look like: profile (a one-GPU request needing no vCPUs or memory) or task shape -> weight.
Demand = Mapping[str, float] | Mapping[TaskShape, float]

Score = tuple[float, ...]
# A policy scores placing `profile` at `start` on a GPU: smaller is better. It sees the GPU before and after.
ScoreFn = Callable[[HostView, GpuView, Occupancy, str, int], Score]
# The cost of a draft plan on one host: given the GPUs the draft changed so far (GPU id -> occupancy after), one more
# GPU `gid` and its occupancy after, a number (smaller is better).
PlanCost = Callable[[Mapping[int, Occupancy], int, Occupancy], float]
# A host-aware policy prices the drafts of a request on a host; positions are ranked by that cost, then by the score.
HostCostFn = Callable[[HostView, PlacementRequest], PlanCost]


class CandidateOrder(StrEnum):
    """The order in which the store hands a policy its candidate GPUs (pages of the candidate index), so that
    the first page holds the positions the policy prefers."""

    FULLEST_FIRST = "fullest-first"  # least free space first, then host order
    EMPTIEST_FIRST = "emptiest-first"  # most free space first, then host order
    HOST_ORDER = "host-order"  # the order hosts and GPUs were declared in


@dataclass(frozen=True)
class Policy:
    """A placement policy: a score for each feasible position (after a host cost, if it has one); the smallest wins.
    `order` is the candidate order it wants from the store."""

    name: str
    score: ScoreFn
    order: CandidateOrder
    description: str = ""
    host_cost: HostCostFn | None = None


def _first_fit(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    return (host.order, gpu.gpu_id, start)


def _best_fit(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    return (after.free_units / after.geometry.axis, host.order, gpu.gpu_id, start)


def _spread(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    used = 1 - gpu.occupancy.free_units / gpu.occupancy.geometry.axis
    return (used, -host.free_vcpus, host.order, gpu.gpu_id, start)


Mix = tuple[tuple[TaskShape, float], ...]  # weights sum to 1


@dataclass(frozen=True, slots=True, eq=False)
class _Kind:
    """The task shapes of a mix that ask for the same profiles and GPU count: what each needs besides GPUs
    (compared by identity: kinds are cached)."""

    profiles: tuple[str, ...]
    gpus: int
    needs: tuple[tuple[float, float, float], ...]  # (vcpus, memory_mib, weight) per shape
    models: frozenset[str] | None = None

    @property
    def weight(self) -> float:
        """The weight of the kind's shapes together."""
        return sum(w for _, _, w in self.needs)


@lru_cache(maxsize=1024)
def _kinds(mix: Mix) -> tuple[_Kind, ...]:
    Key = tuple[tuple[str, ...], int, frozenset[str] | None]
    grouped: dict[Key, list[tuple[float, float, float]]] = {}
    for shape, w in mix:
        grouped.setdefault((shape.profiles, shape.gpus, shape.models), []).append(
            (shape.vcpus, shape.memory_mib, w))
    return tuple(_Kind(p, n, tuple(needs), models) for (p, n, models), needs in grouped.items())


@lru_cache(maxsize=1024)
def _profiles_on(kinds: tuple[_Kind, ...], geometry: Geometry) -> tuple[str | None, ...]:
    """Per kind, the profile it takes on a GPU of this geometry (None: it cannot run there)."""
    return tuple(None if k.models is not None and geometry.model not in k.models else
                 next((p for p in k.profiles if p in geometry.shapes), None) for k in kinds)


@lru_cache(maxsize=1024)
def _gang(kinds: tuple[_Kind, ...]) -> tuple[int, ...]:
    return tuple(k for k, kind in enumerate(kinds) if kind.gpus > 1)


GpuStats = tuple[float, tuple[float, ...], tuple[int, ...]]


@lru_cache(maxsize=200_000)
def _gpu_stats(occ: Occupancy, kinds: tuple[_Kind, ...]) -> GpuStats:
    """The GPU's free share, and per kind of task its stranded free share and whether one more fits (1 or 0)."""
    axis = occ.geometry.axis
    free = occ.free_units
    stranded: list[float] = []
    usable: list[int] = []
    for profile in _profiles_on(kinds, occ.geometry):
        n = size = 0
        if profile is not None and free:
            n, size = occ.capacity(profile), occ.geometry.shapes[profile].size
        stranded.append((free - min(n * size, free)) / axis)
        usable.append(1 if n else 0)
    return free / axis, tuple(stranded), tuple(usable)


@lru_cache(maxsize=200_000)
def _admitted_weights(kinds: tuple[_Kind, ...], vcpus: float, memory_mib: float) -> tuple[float, ...]:
    """Per kind, the weight of its shapes whose vCPUs and memory a host with this much free could give."""
    return tuple(sum(w for c, m, w in k.needs if c <= vcpus and m <= memory_mib) for k in kinds)


@lru_cache(maxsize=4096)
def _runnable_weight(kinds: tuple[_Kind, ...], geometry: Geometry, gpus: int) -> float:
    """The weight of the kinds of task a host of `gpus` GPUs of this geometry could ever run: its model and mode
    offer their profile, and it has as many GPUs as they ask for."""
    return sum(k.weight for k, p in zip(kinds, _profiles_on(kinds, geometry), strict=True)
               if p is not None and k.gpus <= gpus)


@lru_cache(maxsize=200_000)
def _gpu_fragmentation(occ: Occupancy, kinds: tuple[_Kind, ...], admitted: tuple[float, ...], gpus: int) -> float:
    """The GPU's share of its host's fragmentation, except for multi-GPU kinds (see `_host_cost`), on a host of
    `gpus` GPUs. Tasks the host could never run (another model, more GPUs) see none of it."""
    free, stranded, _ = _gpu_stats(occ, kinds)
    return free * _runnable_weight(kinds, occ.geometry, gpus) + \
        sum(w * (st - free) for kind, w, st in zip(kinds, admitted, stranded, strict=True) if w and kind.gpus == 1)


def _gang_fragmentation(kinds: tuple[_Kind, ...], totals: GpuStats, moves: Sequence[tuple[GpuStats, GpuStats]],
                        admitted: tuple[float, ...]) -> float:
    """The multi-GPU kinds' part of a host's fragmentation, from the host's totals and its GPUs' moves (before,
    after)."""
    free, stranded, usable = totals
    free += sum(s1[0] - s0[0] for s0, s1 in moves)
    total = 0.0
    for k in _gang(kinds):
        if admitted[k] and usable[k] + sum(s1[2][k] - s0[2][k] for s0, s1 in moves) >= kinds[k].gpus:
            total += admitted[k] * (stranded[k] + sum(s1[1][k] - s0[1][k] for s0, s1 in moves) - free)
    return total


_ANY_WIDTH = 1 << 16
Supply = tuple[tuple[str, float], ...]  # GPU model -> GPUs of it, sorted


@lru_cache(maxsize=1024)
def _scarcity(kinds: tuple[_Kind, ...], supply: Supply, geometry: Geometry) -> float:
    """The price of a GPU's worth of room on this geometry's model: the demand that can run on that model only
    (weight x GPUs x the share its profile takes there), over the model's share of the GPUs supplied."""
    total = sum(n for _, n in supply)
    have = dict(supply).get(geometry.model, 0.0)
    if total <= 0 or have <= 0:
        return 0.0
    only = frozenset((geometry.model,))
    demand = 0.0
    for k, p in zip(kinds, _profiles_on(kinds, geometry), strict=True):
        if p is not None and k.models == only:
            demand += k.weight * k.gpus * geometry.shapes[p].size / geometry.axis
    return demand * total / have


def _host_cost(mix: Mix | None, supply: Supply = ()) -> HostCostFn:
    """The change in a host's expected fragmentation (FGD) against the mix: for each typical task, weighted, the
    host's free GPU share it could not use: none if the host could never run the task (its GPUs' model does not
    offer it, the host has fewer GPUs than it asks for), all of it if the host cannot take it now (vCPUs, memory,
    fewer GPUs with room than it asks for), else the share stranded on GPUs with no room for it. One-GPU tasks add
    up per GPU; multi-GPU tasks are counted over the host's totals. With a supply, plus the room the placement takes,
    priced per model by `_scarcity`."""

    fixed = _kinds(mix) if mix else None
    known: dict[Geometry, float] = {}  # the scarcity price per geometry, for the fixed kinds

    def priced(kinds: tuple[_Kind, ...], geometry: Geometry) -> float:
        if kinds is not fixed:
            return _scarcity(kinds, supply, geometry)
        hit = known.get(geometry)
        if hit is None:
            hit = known[geometry] = _scarcity(kinds, supply, geometry)
        return hit

    def price(host: HostView, req: PlacementRequest) -> PlanCost:
        kinds = fixed or _kinds(_uniform_mix(tuple(dict.fromkeys(g.occupancy.geometry for g in host.gpus))))
        gang = _gang(kinds)
        now = _admitted_weights(kinds, host.free_vcpus, host.free_memory_mib)
        then = _admitted_weights(kinds, host.free_vcpus - req.vcpus, host.free_memory_mib - req.memory_mib)
        before = {g.gpu_id: g.occupancy for g in host.gpus}
        prices = {g: priced(kinds, o.geometry) for g, o in before.items()} if supply else {}
        # The request's vCPUs and memory may shut tasks out of the whole host, the GPUs it leaves alone included.
        # Tasks wider than the host never run there; unknown when the view holds only some of its GPUs.
        width = host.gpu_count if host.gpu_count is not None else _ANY_WIDTH
        shift = 0.0 if then == now else sum(_gpu_fragmentation(o, kinds, then, width) -
                                            _gpu_fragmentation(o, kinds, now, width) for o in before.values())
        totals: GpuStats | None = None
        gang_now = 0.0
        if any(now[k] or then[k] for k in gang):
            stats = [_gpu_stats(o, kinds) for o in before.values()]
            totals = (sum(s[0] for s in stats), tuple(map(sum, zip(*(s[1] for s in stats), strict=True))),
                      tuple(map(sum, zip(*(s[2] for s in stats), strict=True))))
            gang_now = _gang_fragmentation(kinds, totals, (), now)

        def cost(draft: Mapping[int, Occupancy], gid: int, after: Occupancy) -> float:
            changes = (*draft.items(), (gid, after)) if draft else ((gid, after),)
            delta = shift
            for g, occ in changes:
                delta += _gpu_fragmentation(occ, kinds, then, width) - \
                    _gpu_fragmentation(before[g], kinds, then, width)
                if prices:
                    delta += prices[g] * (before[g].free_units - occ.free_units) / occ.geometry.axis
            if totals is not None:
                moves = [(_gpu_stats(before[g], kinds), _gpu_stats(occ, kinds)) for g, occ in changes]
                delta += _gang_fragmentation(kinds, totals, moves, then) - gang_now
            return round(delta, 9)

        return cost

    return price


def pack_policy(demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """Fragmentation-aware packing (FGD): the host and position where the host's expected fragmentation against the
    demand mix grows least, first in host order among equals; no demand: every profile of the host's GPUs alike.
    With `supply` (GPU model -> GPUs of it), room on a model is also priced by the demand that can run only there
    against the model's share of the GPUs, so tasks that could run elsewhere leave scarce models' room to it."""
    return Policy("pack", _first_fit, CandidateOrder.FULLEST_FIRST, "fragmentation-aware packing (default)",
                  _host_cost(_mix(demand), tuple(sorted((supply or {}).items()))))


def _mix(demand: Demand | None) -> Mix | None:
    """The demand as task shapes with weights summing to 1 (None when empty)."""
    if not demand:
        return None
    items = [(k if isinstance(k, TaskShape) else TaskShape((k,)), float(w)) for k, w in demand.items()]
    total = sum(w for _, w in items)
    if total <= 0:
        return None
    return tuple((shape, w / total) for shape, w in items)


@lru_cache(maxsize=1024)
def _uniform_mix(geometries: tuple[Geometry, ...]) -> Mix:
    profiles = tuple(dict.fromkeys(p for g in geometries for p in g.shapes))
    return tuple((TaskShape((p,)), 1 / len(profiles)) for p in profiles) if profiles else ()


def _fixed(name: str, score: ScoreFn, order: CandidateOrder, description: str) -> Callable[[Demand | None], Policy]:
    """A policy factory for a policy that ignores the demand mix."""
    def make(_demand: Demand | None = None) -> Policy:
        return Policy(name, score, order, description)
    return make


POLICIES: dict[str, Callable[[Demand | None], Policy]] = {
    "pack": pack_policy,
    "spread": _fixed("spread", _spread, CandidateOrder.EMPTIEST_FIRST, "least-loaded GPU and host first"),
    "first-fit": _fixed("first-fit", _first_fit, CandidateOrder.HOST_ORDER, "first GPU in host order that fits"),
    "best-fit": _fixed("best-fit", _best_fit, CandidateOrder.FULLEST_FIRST, "GPU left with the least free space"),
}


def get_policy(name: str, demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy called `name`, configured with a demand mix (and for pack the GPUs per model) where it uses one."""
    from vgpu_ctl.errors import InvalidInput

    if name == "pack" and supply:
        return pack_policy(demand, supply)
    try:
        return POLICIES[name](demand)
    except KeyError:
        raise InvalidInput(f"unknown placement policy {name!r} (field policy); known: "
                           f"{', '.join(sorted(POLICIES))}") from None


def host_admits(host: HostView, req: PlacementRequest) -> str | None:
    """Why a host as a whole cannot take the request (state, labels, anti-affinity, vCPUs, memory)."""
    if host.state != "active":
        return f"host-{host.state}"
    for k, v in req.labels.items():
        if host.labels.get(k) != v:
            return "labels"
    if req.anti_affinity and req.anti_affinity in host.anti_affinity:
        return "anti-affinity"
    if host.free_vcpus < req.vcpus:
        return "vcpus"
    if host.free_memory_mib < req.memory_mib:
        return "memory"
    return None


def plan_on_host(host: HostView, req: PlacementRequest, policy: Policy) -> tuple[Score, PlacementPlan] | None:
    """The best placement of every vGPU of the request on this host (each on its own GPU), or None."""
    price: PlanCost | None = None  # the host cost, set up at the first feasible position
    draft: dict[int, Occupancy] = {}  # the GPUs the plan takes so far, with their occupancy after
    chosen: list[DevicePlacement] = []
    worst: Score = ()
    cost: Score = ()
    # Largest devices first: they have the fewest places to go.
    profiles = req.profiles if len(req.profiles) == 1 else sorted(req.profiles, key=lambda p: -_size_of(host, p))
    for profile in profiles:
        best: tuple[Score, Score, int, int, Occupancy] | None = None
        for view in host.gpus:
            gid, occ = view.gpu_id, view.occupancy
            if gid in draft or occ.misfit(profile) is not None:
                continue
            for start in occ.placements(profile):
                after = occ.placed(profile, start)  # misfit and fit_starts were just checked
                c: Score = ()
                if policy.host_cost is not None:
                    price = price or policy.host_cost(host, req)
                    c = (price(draft, gid, after),)
                s = policy.score(host, view, after, profile, start)
                if best is None or (c, s) < best[:2]:
                    best = (c, s, gid, start, after)
        if best is None:
            return None
        cost, s, gid, start, after = best
        draft[gid] = after
        worst = max(worst, s)
        chosen.append(DevicePlacement(gid, profile, start, after.geometry.shapes[profile].size))
    return (*cost, *worst), PlacementPlan(host.host_id, host.name, tuple(chosen), dict(draft))


def _size_of(host: HostView, profile: str) -> int:
    for g in host.gpus:
        shape = g.occupancy.geometry.shapes.get(profile)
        if shape is not None:
            return shape.size
    return 0


def plan(req: PlacementRequest, hosts: Iterable[HostView], policy: Policy) -> PlacementPlan | None:
    """The best plan over the candidate hosts by the policy, or None when nothing fits."""
    best: tuple[Score, PlacementPlan] | None = None
    for host in hosts:
        if host_admits(host, req) is not None:
            continue
        found = plan_on_host(host, req, policy)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best[1] if best else None


def explain(req: PlacementRequest, hosts: Sequence[HostView]) -> dict[str, int]:
    """Why each GPU could not take the request, as counts of reason codes that add up to the GPUs considered:
    the material of a refusal (`describe_refusal` says it in words)."""
    counts: Counter[str] = Counter()
    for host in hosts:
        why_host = host_admits(host, req)
        if why_host is not None:
            counts[why_host] += len(host.gpus)
            continue
        whole = len(req.profiles) == 1 or plan_on_host(host, req, POLICIES["first-fit"](None)) is not None
        for g in host.gpus:
            reasons = {g.occupancy.misfit(p) for p in set(req.profiles)}
            if reasons == {None}:
                counts["fits-alone" if whole else "host-too-few-gpus"] += 1
            else:
                worst = min((r for r in reasons if r is not None), key=_misfit_rank)
                counts[str(worst)] += 1
    return dict(counts)


REFUSAL_WORDS = {
    "host-draining": "on a cordoned (draining) host",
    "host-down": "on a host that is down",
    "labels": "on a host without the labels asked for",
    "anti-affinity": "on a host already running a VM of the anti-affinity group",
    "vcpus": "on a host short of vCPUs",
    "memory": "on a host short of memory",
    str(Misfit.OTHER_MODE): "whose model or mode does not offer the profile",
    str(Misfit.OTHER_TYPE): "holding (or pinned to) another vGPU type",
    str(Misfit.NO_SPACE): "without a free place for it",
    str(Misfit.MAX_COUNT): "at the most vGPUs of that type they can hold",
    str(Misfit.COMPUTE): "out of MIG compute slices",
    str(Misfit.MEDIA): "already holding their one media-extension instance",
    str(Misfit.LAYOUT): "whose fixed MIG layout has no free slot for it",
    "host-too-few-gpus": "with room, on a host without room for all the VM's vGPUs",
    "fits-alone": "with room for it alone",
}


def describe_refusal(counts: Mapping[str, int]) -> str:
    """A refusal's counts in an admin's words, most first: '3 GPUs on a host short of vCPUs, 1 GPU without a free
    place for it'."""
    parts = [f"{n} GPU{'' if n == 1 else 's'} {REFUSAL_WORDS.get(code, code)}"
             for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return ", ".join(parts) or "no GPUs in the pool"


def _misfit_rank(m: Misfit) -> int:
    order = [Misfit.OTHER_MODE, Misfit.OTHER_TYPE, Misfit.LAYOUT, Misfit.MEDIA, Misfit.MAX_COUNT,
             Misfit.COMPUTE, Misfit.NO_SPACE]
    return order.index(m)
