"""Choosing preemption victims (pure): the smallest set of lower-priority preemptible VMs on one host whose
release makes a request fit by geometry.

Fitting is the placement code itself on the host as it would be without the victims (their slots taken off their
GPUs' occupancies, their vCPUs and memory given back), so MIG starts, mixed-size placement ids and the one-type
rule of equal-size GPUs decide, not counts. Victims are ordered as Kueue orders them: borrowed work first (VMs
over their tenant's guarantee, where the caller knows of one), then lowest priority, then newest. On a host with
few candidates every subset is tried by size, so the set is the smallest and, among the smallest, the first in
that order; on a host with many the candidates are added in that order until the request fits and the set is
then minimized in reverse (no victim can be spared). Never a VM that is not preemptible, never one of equal or
higher priority, never one whose cool-down protects it from a request of this priority.

A victim to be hibernated keeps its devices (a vGPU's saved state restores only onto its own device), so it frees
only its host's vCPUs and memory. A reclaim takes only work its lender borrows now (`borrowed_now`: the lender's
newest VMs past its guarantee, from its usage as it is) and never takes a lender below its guarantee
(`keeps_floor`): a set-wide rule, which the search keeps to as it tries subsets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement import (
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    Policy,
    get_policy,
    host_admits,
    plan_on_host,
)
from vgpu_ctl.core.priority import may_preempt

EXACT_LIMIT = 10
"""Up to this many candidates on a host, every subset is tried (at most 2**10 fits)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A VM that holds devices: where (host, and per device its GPU and start), how much of the host, its
    priority and whether it may be preempted, whether it is borrowed work, when it was admitted (epoch seconds),
    and the priority its cool-down protects it from (None: none)."""

    vm_id: str
    host_id: int
    priority: int
    preemptible: bool
    devices: tuple[tuple[int, int], ...]  # (gpu_id, start)
    vcpus: float = 0
    memory_mib: float = 0
    admitted_at: float = 0.0
    borrowed: bool = False
    protected_below: int | None = None
    keeps_devices: bool = False  # freed by hibernation: its devices stay, only its vCPUs and memory go


@dataclass(frozen=True, slots=True)
class Preemption:
    """What admitting a request takes: the victims (empty: it fits now) and the plan once they are gone."""

    victims: tuple[Holder, ...]
    plan: PlacementPlan


def eligible(holder: Holder, priority: int) -> bool:
    """Whether a request of `priority` may preempt the holder."""
    return may_preempt(priority, holder.priority, holder.preemptible, holder.protected_below)


def victim_order(holder: Holder) -> tuple[bool, int, float, str]:
    """The order victims are taken in: borrowed first, then lowest priority, then newest."""
    return (not holder.borrowed, holder.priority, -holder.admitted_at, holder.vm_id)


def without(host: HostView, victims: Iterable[Holder]) -> HostView:
    """The host as it would be once the victims are gone: their vCPUs and memory back, and the slots of those
    that do not keep their devices off its GPUs."""
    gone: dict[int, set[int]] = {}
    vcpus = memory = 0.0
    for v in victims:
        vcpus += v.vcpus
        memory += v.memory_mib
        for gid, start in () if v.keeps_devices else v.devices:
            gone.setdefault(gid, set()).add(start)
    gpus = []
    for g in host.gpus:
        starts = gone.get(g.gpu_id)
        if not starts:
            gpus.append(g)
            continue
        occ = g.occupancy
        occ = Occupancy(occ.geometry, tuple(s for s in occ.slots if s.start not in starts), occ.pinned_type,
                        occ.fixed_layout)
        gpus.append(GpuView(g.gpu_id, g.pci, occ, g.pool))
    return replace(host, gpus=tuple(gpus), free_vcpus=host.free_vcpus + vcpus,
                   free_memory_mib=host.free_memory_mib + memory)


def _fits(host: HostView, req: PlacementRequest, victims: Sequence[Holder], policy: Policy) -> PlacementPlan | None:
    view = without(host, victims)
    if host_admits(view, req) is not None:
        return None
    found = plan_on_host(view, req, policy)
    return found[1] if found is not None else None


def _on_host(host: HostView, req: PlacementRequest, candidates: Sequence[Holder], policy: Policy,
             keep: Callable[[Sequence[Holder]], bool]) -> Preemption | None:
    if _fits(host, req, candidates, policy) is None:
        return None  # not even all of them make room: monotone, since freeing only adds room
    if len(candidates) <= EXACT_LIMIT:
        for size in range(1, len(candidates) + 1):
            for subset in combinations(candidates, size):  # in victim order: the first smallest set wins
                if not keep(subset):
                    continue
                found = _fits(host, req, subset, policy)
                if found is not None:
                    return Preemption(subset, found)
        return None
    chosen: list[Holder] = []
    for v in candidates:
        if not keep([*chosen, v]):
            continue  # the set-wide rule (a lender's floor) would break: not this one
        chosen.append(v)
        if _fits(host, req, chosen, policy) is not None:
            break
    for v in reversed(list(chosen)):
        rest = [c for c in chosen if c is not v]
        if _fits(host, req, rest, policy) is not None:
            chosen = rest  # a subset of a set that keeps the rule keeps it too
    found = _fits(host, req, chosen, policy)
    return Preemption(tuple(chosen), found) if found is not None else None


def _any_set(victims: Sequence[Holder]) -> bool:
    return True


def reclaimable(holder: Holder, priority: int) -> bool:
    """Whether a reclaiming request (its tenant below its guarantee) of `priority` may take the holder back:
    borrowed work only, whatever its priority or class (Kueue's reclaimWithinCohort: Any), but not while a
    cool-down protects it from a request of this priority (no loops). The caller keeps to other tenants' VMs of
    tenants still above their guarantee."""
    return holder.borrowed and (holder.protected_below is None or priority > holder.protected_below)


def borrowed_now(charges: Sequence[tuple[str, Mapping[str, float]]], guarantee: Mapping[str, float]) -> set[str]:
    """Which of a tenant's VMs are borrowed now, from its usage as it is (not as it was when each was claimed):
    `charges` are its VMs oldest first, each with what it charges per resource (keys as `guarantee`'s, such as
    "vgpus" and "vgpus@POOL"); a VM is borrowed when its charge and its elders' pass a guarantee in some resource.
    So releasing an older VM can make newer work guaranteed."""
    total: dict[str, float] = {}
    out: set[str] = set()
    for vm_id, charge in charges:
        for r, n in charge.items():
            total[r] = total.get(r, 0) + n
        if any(total.get(r, 0) > g for r, g in guarantee.items()):
            out.add(vm_id)
    return out


def keeps_floor(used: Mapping[str, float], guarantee: Mapping[str, float], freed: Mapping[str, float]) -> bool:
    """Whether a lender using `used` stays at or above its guarantee once `freed` goes (where it was already
    below one, no lower there): used - freed >= min(used, guarantee) for every resource it has a guarantee of."""
    return all(used.get(r, 0) - freed.get(r, 0) >= min(used.get(r, 0), g) for r, g in guarantee.items())


def borrowed_share(used: Mapping[str, float], guarantee: Mapping[str, float]) -> float:
    """How much a tenant borrows: the largest share above its guarantee, (used - guarantee) / guarantee, over the
    resources it has a guarantee of (a guarantee of 0 counts as 1); 0 when it borrows nothing."""
    return max((max(0.0, used.get(r, 0) - g) / max(g, 1) for r, g in guarantee.items()), default=0.0)


def strictly_improves(before: Mapping[str, float], after: Mapping[str, float]) -> bool:
    """The fair-share check of a reclaim (Kueue's rule that a preemption must make sharing strictly fairer, so
    two tenants cannot take capacity from each other in a loop): the involved tenants' borrowed shares, largest
    first, are lexicographically smaller after than before."""
    return sorted(after.values(), reverse=True) < sorted(before.values(), reverse=True)


def choose_victims(req: PlacementRequest, priority: int, hosts: Iterable[HostView], holders: Iterable[Holder],
                   policy: Policy | None = None,
                   allowed: Callable[[Holder, int], bool] | None = None,
                   keep: Callable[[Sequence[Holder]], bool] | None = None) -> Preemption | None:
    """The fewest victims (over every host, each host's VMs alone being able to free room there) whose release
    lets the request of `priority` fit, ties broken by the victims' order then host order; an empty set when it
    fits as it is; None when no allowed set makes room. `hosts` must hold every GPU of each host the request may
    use (occupied ones too), with free vCPUs and memory as they are now. `allowed` decides which holders may be
    taken (default `eligible`, the priority rule; `reclaimable` for a reclaim); `keep`, a rule on a whole set
    that every subset of a set keeping it keeps too (a lender's floor), which sets may be taken (default: any)."""
    policy = policy or get_policy("first-fit")
    allowed = allowed or eligible
    keep = keep or _any_set
    by_host: dict[int, list[Holder]] = {}
    for h in holders:
        if allowed(h, priority):
            by_host.setdefault(h.host_id, []).append(h)
    best: tuple[tuple[int, tuple[tuple[bool, int, float, str], ...], int], Preemption] | None = None
    for host in hosts:
        found = _fits(host, req, (), policy)
        if found is not None:
            pre = Preemption((), found)
        else:
            cands = sorted(by_host.get(host.host_id, []), key=victim_order)
            pre_or_none = _on_host(host, req, cands, policy, keep) if cands else None
            if pre_or_none is None:
                continue
            pre = pre_or_none
        key = (len(pre.victims), tuple(victim_order(v) for v in pre.victims), host.order)
        if best is None or key < best[0]:
            best = (key, pre)
    return best[1] if best is not None else None
