"""Choosing a host, GPUs and positions for a VM's vGPUs from candidate views, by a pluggable policy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from vgpu_ctl.core.geometry import Misfit, Occupancy


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


Score = tuple[float, ...]
# A policy scores placing `profile` at `start` on a GPU: smaller is better. It sees the GPU before and after.
ScoreFn = Callable[[HostView, GpuView, Occupancy, str, int], Score]


@dataclass(frozen=True)
class Policy:
    """A placement policy: a score for each feasible position; the smallest wins."""

    name: str
    score: ScoreFn
    description: str = ""


def _first_fit(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    return (host.order, gpu.gpu_id, start)


def _best_fit(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    return (after.free_units / after.geometry.axis, host.order, gpu.gpu_id, start)


def _spread(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    used = 1 - gpu.occupancy.free_units / gpu.occupancy.geometry.axis
    return (used, -host.free_vcpus, host.order, gpu.gpu_id, start)


@lru_cache(maxsize=200_000)
def fragmentation(occ: Occupancy, demand: tuple[tuple[str, float], ...]) -> float:
    """Share of the GPU's axis that typical requests (weighted profiles) could not use: free but stranded."""
    free = occ.free_units
    if free == 0:
        return 0.0
    axis = occ.geometry.axis
    total = 0.0
    weight = 0.0
    for profile, w in demand:
        shape = occ.geometry.shapes.get(profile)
        if shape is None:
            continue
        usable = occ.capacity(profile) * shape.size
        total += w * (free - min(usable, free)) / axis
        weight += w
    return total / weight if weight else 0.0


def pack_policy(demand: Mapping[str, float] | None = None) -> Policy:
    """Fragmentation-aware packing: the position that strands the least capacity for the demand mix."""
    fixed = tuple(sorted(demand.items())) if demand else None

    def score(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
        mix = fixed or _uniform_demand(after)
        delta = fragmentation(after, mix) - fragmentation(gpu.occupancy, mix)
        return (round(delta, 9), host.order, gpu.gpu_id, start)

    return Policy("pack", score, "fragmentation-aware packing (default)")


def _uniform_demand(occ: Occupancy) -> tuple[tuple[str, float], ...]:
    return _uniform_for(tuple(occ.geometry.shapes))


@lru_cache(maxsize=1024)
def _uniform_for(profiles: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    return tuple((p, 1.0) for p in profiles)


def _fixed(name: str, score: ScoreFn, description: str) -> Callable[[Mapping[str, float] | None], Policy]:
    """A policy factory for a policy that ignores the demand mix."""
    def make(_demand: Mapping[str, float] | None = None) -> Policy:
        return Policy(name, score, description)
    return make


POLICIES: dict[str, Callable[[Mapping[str, float] | None], Policy]] = {
    "pack": pack_policy,
    "spread": _fixed("spread", _spread, "least-loaded GPU and host first"),
    "first-fit": _fixed("first-fit", _first_fit, "first GPU in host order that fits"),
    "best-fit": _fixed("best-fit", _best_fit, "GPU left with the least free space"),
}


def get_policy(name: str, demand: Mapping[str, float] | None = None) -> Policy:
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
    occs = {g.gpu_id: g.occupancy for g in host.gpus}
    views = {g.gpu_id: g for g in host.gpus}
    used: set[int] = set()
    chosen: list[DevicePlacement] = []
    worst: Score = ()
    # Largest devices first: they have the fewest places to go.
    for profile in sorted(req.profiles, key=lambda p: -_size_of(host, p)):
        best: tuple[Score, int, int, Occupancy] | None = None
        for gid, occ in occs.items():
            if gid in used or occ.misfit(profile) is not None:
                continue
            for start in occ.fit_starts(profile):
                after = occ.placed(profile, start)  # misfit and fit_starts were just checked
                s = policy.score(host, views[gid], after, profile, start)
                if best is None or s < best[0]:
                    best = (s, gid, start, after)
        if best is None:
            return None
        s, gid, start, after = best
        used.add(gid)
        occs[gid] = after
        worst = max(worst, s)
        chosen.append(DevicePlacement(gid, profile, start, after.geometry.shapes[profile].size))
    return worst, PlacementPlan(host.host_id, host.name, tuple(chosen), {d.gpu_id: occs[d.gpu_id] for d in chosen})


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
