"""Choosing a host, GPUs and positions for a VM's vGPUs from candidate views, by a pluggable policy (one module
per policy in `vgpu_ctl.core.policies`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vgpu_ctl.core.geometry import Misfit, Occupancy
from vgpu_ctl.core.placement_types import (
    CandidateOrder,
    Demand,
    DevicePlacement,
    GpuView,
    HostCostFn,
    HostView,
    PlacementPlan,
    PlacementRequest,
    PlanCost,
    Policy,
    Score,
    ScoreFn,
    TaskShape,
)
from vgpu_ctl.core.policies import POLICIES, PolicyDef, get_policy
from vgpu_ctl.core.policies.pack import pack_policy


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
    """The best placement of every vGPU of the request on this host (each on its own GPU), or None. A request
    without vGPUs takes only vCPUs and memory: every host fits it, scored by `host_score`."""
    if not req.profiles:
        return host_score(host, policy.order), PlacementPlan(host.host_id, host.name, (), {})
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
            if gid in draft or profile in view.lacks or occ.misfit(profile) is not None:
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


def host_score(host: HostView, order: CandidateOrder) -> Score:
    """A host's score for a request without vGPUs, by the policy's candidate order applied to hosts: fullest
    first (the fewest free vCPUs, then memory) for the packing policies, emptiest first for the spreading ones,
    else host order; host order breaks ties."""
    if order is CandidateOrder.FULLEST_FIRST:
        return (host.free_vcpus, host.free_memory_mib, host.order)
    if order is CandidateOrder.EMPTIEST_FIRST:
        return (-host.free_vcpus, -host.free_memory_mib, host.order)
    return (host.order,)


def host_rank(order: CandidateOrder, widest: bool, width: int, free: float, host_id: int) -> tuple[float, ...]:
    """A whole host's place in a policy's candidate order of hosts, what it is sorted by: `widest` (a policy
    with a host cost) the widest first (`width`: the host's GPUs of the model and mode in the pool), then the
    fullest by `free` (the mean free units of its GPUs that can take the profile), then host id; otherwise the
    policy's order of `free` (the free units of those GPUs together), then host id (host id alone for host
    order)."""
    if widest:
        return (-width, free, host_id)
    if order is CandidateOrder.EMPTIEST_FIRST:
        return (-free, host_id)
    if order is CandidateOrder.HOST_ORDER:
        return (host_id,)
    return (free, host_id)


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


@dataclass(frozen=True)
class HostCandidate:
    """One host as a ranking of a request sees it: its plan and score by the policy when the request fits there
    (rank 1 is where it would go), else why not (explain's counts for the host's GPUs)."""

    host: str
    rank: int | None
    score: Score | None
    plan: PlacementPlan | None
    refusal: Mapping[str, int]


def rank_hosts(req: PlacementRequest, hosts: Sequence[HostView], policy: Policy) -> list[HostCandidate]:
    """Every host ranked for the request: those it fits, best first by the policy's score (the first is what
    `plan` chooses), then those it does not fit, by name, each with its reasons."""
    fits: list[tuple[Score, int, HostView, PlacementPlan]] = []
    others: list[HostCandidate] = []
    for i, host in enumerate(hosts):
        found = plan_on_host(host, req, policy) if host_admits(host, req) is None else None
        if found is None:
            others.append(HostCandidate(host.name, None, None, None, explain(req, [host])))
        else:
            fits.append((found[0], i, host, found[1]))
    fits.sort(key=lambda f: (f[0], f[1]))
    ranked = [HostCandidate(h.name, n, score, chosen, {}) for n, (score, _, h, chosen) in enumerate(fits, 1)]
    return ranked + sorted(others, key=lambda c: c.host)


def explain(req: PlacementRequest, hosts: Sequence[HostView]) -> dict[str, int]:
    """Why each GPU could not take the request, as counts of reason codes that add up to the GPUs considered:
    the material of a refusal (`describe_refusal` says it in words). For a request without vGPUs, why each host
    could not (counts that add up to the hosts; `describe_refusal(counts, "host")`)."""
    counts: Counter[str] = Counter()
    for host in hosts:
        why_host = host_admits(host, req)
        if not req.profiles:
            counts[why_host or "fits-alone"] += 1
            continue
        if why_host is not None:
            counts[why_host] += len(host.gpus)
            continue
        whole = len(req.profiles) == 1 or plan_on_host(host, req, get_policy("first-fit")) is not None
        for g in host.gpus:
            if set(req.profiles) & g.lacks:
                counts[LACKS_TYPE] += 1
                continue
            reasons = {g.occupancy.misfit(p) for p in set(req.profiles)}
            if reasons == {None}:
                counts["fits-alone" if whole else "host-too-few-gpus"] += 1
            else:
                worst = min((r for r in reasons if r is not None), key=_misfit_rank)
                counts[str(worst)] += 1
    return dict(counts)


LACKS_TYPE = "host-lacks-type"  # a GPU whose host has no type id for the profile (GpuView.lacks)

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
    LACKS_TYPE: "whose host has no type id for the profile (a finding of `vgpuctl inventory apply`)",
}
HOST_REFUSAL_WORDS = {  # what `explain` counts per host for a request without vGPUs
    "host-draining": "cordoned (draining)",
    "host-down": "down",
    "labels": "without the labels asked for",
    "anti-affinity": "already running a VM of the anti-affinity group",
    "vcpus": "short of vCPUs",
    "memory": "short of memory",
    "fits-alone": "with room for it",
}


def describe_refusal(counts: Mapping[str, int], unit: str = "GPU") -> str:
    """A refusal's counts in an admin's words, most first: '3 GPUs on a host short of vCPUs, 1 GPU without a free
    place for it'; with unit "host" (a request without vGPUs), '2 hosts short of vCPUs, 1 host down'."""
    words = HOST_REFUSAL_WORDS if unit == "host" else REFUSAL_WORDS
    parts = [f"{n} {unit}{'' if n == 1 else 's'} {words.get(code, code)}"
             for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return ", ".join(parts) or f"no {unit}s in the pool"


def _misfit_rank(m: Misfit) -> int:
    order = [Misfit.OTHER_MODE, Misfit.OTHER_TYPE, Misfit.LAYOUT, Misfit.MEDIA, Misfit.MAX_COUNT,
             Misfit.COMPUTE, Misfit.NO_SPACE]
    return order.index(m)


__all__ = [  # the placement API, with the types and policies it works with (their homes: placement_types, policies)
    "HOST_REFUSAL_WORDS", "LACKS_TYPE", "POLICIES", "REFUSAL_WORDS", "CandidateOrder", "Demand", "DevicePlacement",
    "GpuView", "HostCandidate", "HostCostFn", "HostView", "PlacementPlan", "PlacementRequest", "PlanCost", "Policy",
    "PolicyDef", "Score", "ScoreFn", "TaskShape", "describe_refusal", "explain", "get_policy", "host_admits",
    "host_rank", "host_score", "pack_policy", "plan", "plan_on_host", "rank_hosts",
]
