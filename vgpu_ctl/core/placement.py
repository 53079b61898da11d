"""Choosing a host, GPUs and positions for a VM's vGPUs from candidate views, by a pluggable policy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
    """A typical request of a demand mix: its profile (one per GPU model it may use), GPU count, vCPUs, memory."""

    profiles: tuple[str, ...]  # on a GPU, the first of them its geometry offers
    gpus: int = 1
    vcpus: float = 0.0
    memory_mib: float = 0.0


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


@dataclass(frozen=True)
class Policy:
    """A placement policy: a score for each feasible position (after a host cost, if it has one); the smallest wins."""

    name: str
    score: ScoreFn
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


@lru_cache(maxsize=1024)
def _kinds(mix: Mix) -> tuple[_Kind, ...]:
    grouped: dict[tuple[tuple[str, ...], int], list[tuple[float, float, float]]] = {}
    for shape, w in mix:
        grouped.setdefault((shape.profiles, shape.gpus), []).append((shape.vcpus, shape.memory_mib, w))
    return tuple(_Kind(p, n, tuple(needs)) for (p, n), needs in grouped.items())


@lru_cache(maxsize=1024)
def _profiles_on(kinds: tuple[_Kind, ...], geometry: Geometry) -> tuple[str | None, ...]:
    return tuple(next((p for p in k.profiles if p in geometry.shapes), None) for k in kinds)


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


@lru_cache(maxsize=200_000)
def _gpu_fragmentation(occ: Occupancy, kinds: tuple[_Kind, ...], admitted: tuple[float, ...]) -> float:
    """The GPU's share of its host's fragmentation, except for multi-GPU kinds (see `_host_cost`)."""
    free, stranded, _ = _gpu_stats(occ, kinds)
    return free + sum(w * (st - free) for kind, w, st in zip(kinds, admitted, stranded, strict=True)
                      if w and kind.gpus == 1)


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


def _host_cost(mix: Mix | None) -> HostCostFn:
    """The change in a host's expected fragmentation (FGD) against the mix: for each typical task, weighted, the
    host's free GPU share it could not use: all of it if the host cannot take the task (vCPUs, memory, fewer GPUs
    with room than it asks for), else the share stranded on GPUs with no room for it. One-GPU tasks add up per GPU;
    multi-GPU tasks are counted over the host's totals."""

    fixed = _kinds(mix) if mix else None

    def price(host: HostView, req: PlacementRequest) -> PlanCost:
        kinds = fixed or _kinds(_uniform_mix(tuple(dict.fromkeys(g.occupancy.geometry for g in host.gpus))))
        gang = _gang(kinds)
        now = _admitted_weights(kinds, host.free_vcpus, host.free_memory_mib)
        then = _admitted_weights(kinds, host.free_vcpus - req.vcpus, host.free_memory_mib - req.memory_mib)
        before = {g.gpu_id: g.occupancy for g in host.gpus}
        # The request's vCPUs and memory may shut tasks out of the whole host, the GPUs it leaves alone included.
        shift = 0.0 if then == now else \
            sum(_gpu_fragmentation(o, kinds, then) - _gpu_fragmentation(o, kinds, now) for o in before.values())
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
                delta += _gpu_fragmentation(occ, kinds, then) - _gpu_fragmentation(before[g], kinds, then)
            if totals is not None:
                moves = [(_gpu_stats(before[g], kinds), _gpu_stats(occ, kinds)) for g, occ in changes]
                delta += _gang_fragmentation(kinds, totals, moves, then) - gang_now
            return round(delta, 9)

        return cost

    return price


def pack_policy(demand: Demand | None = None) -> Policy:
    """Fragmentation-aware packing (FGD): the host and position where the host's expected fragmentation against the
    demand mix grows least, first in host order among equals; no demand: every profile of the host's GPUs alike."""
    return Policy("pack", _first_fit, "fragmentation-aware packing (default)", _host_cost(_mix(demand)))


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


def _fixed(name: str, score: ScoreFn, description: str) -> Callable[[Demand | None], Policy]:
    """A policy factory for a policy that ignores the demand mix."""
    def make(_demand: Demand | None = None) -> Policy:
        return Policy(name, score, description)
    return make


POLICIES: dict[str, Callable[[Demand | None], Policy]] = {
    "pack": pack_policy,
    "spread": _fixed("spread", _spread, "least-loaded GPU and host first"),
    "first-fit": _fixed("first-fit", _first_fit, "first GPU in host order that fits"),
    "best-fit": _fixed("best-fit", _best_fit, "GPU left with the least free space"),
}


def get_policy(name: str, demand: Demand | None = None) -> Policy:
    """The policy called `name`, configured with a demand mix where it uses one."""
    from vgpu_ctl.errors import InvalidInput

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
    """Counts of why each GPU (or host) could not take the request: the material of a refusal."""
    counts: Counter[str] = Counter()
    for host in hosts:
        why_host = host_admits(host, req)
        if why_host is not None:
            counts[why_host] += len(host.gpus) or 1
            continue
        for g in host.gpus:
            reasons = {g.occupancy.misfit(p) for p in set(req.profiles)}
            if reasons == {None}:
                counts["fits-alone"] += 1
            else:
                worst = min((r for r in reasons if r is not None), key=_misfit_rank)
                counts[str(worst)] += 1
        if len(req.profiles) > 1 and plan_on_host(host, req, POLICIES["first-fit"](None)) is None:
            counts["host-too-few-gpus"] += 1
    return dict(counts)


def _misfit_rank(m: Misfit) -> int:
    order = [Misfit.OTHER_MODE, Misfit.OTHER_TYPE, Misfit.LAYOUT, Misfit.MEDIA, Misfit.MAX_COUNT,
             Misfit.COMPUTE, Misfit.NO_SPACE]
    return order.index(m)
