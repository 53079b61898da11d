"""pack: fragmentation-aware packing (FGD) against the pool's demand mix, scarcity-aware across GPU models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from vgpu_ctl.core.geometry import Geometry, Occupancy
from vgpu_ctl.core.placement_types import (
    CandidateOrder,
    Demand,
    HostCostFn,
    HostView,
    PlacementRequest,
    PlanCost,
    Policy,
    TaskShape,
)
from vgpu_ctl.core.policies import PolicyDef
from vgpu_ctl.core.policies.first_fit import first_fit_score

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
    return Policy("pack", first_fit_score, CandidateOrder.FULLEST_FIRST, "fragmentation-aware packing (default)",
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


POLICY = PolicyDef("pack", "fragmentation-aware packing (default)", pack_policy)
