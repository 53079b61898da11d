"""`vgpuctl plan`: a demand replayed on a fleet, summed up as plain data for tables, JSON and the HTML report."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.planning.changes import apply_changes
from vgpu_ctl.planning.demand import Demand
from vgpu_ctl.planning.expand import suggest
from vgpu_ctl.planning.fleet import Fleet
from vgpu_ctl.planning.replay import Outcome, run
from vgpu_ctl.planning.stranded import USABLE, by_cause, classify


def check_demand(demand: Demand, fleet: Fleet) -> None:
    """InvalidInput naming the request when it names a pool the fleet has no GPU in."""
    pools = fleet.pools()
    for a in demand.asks:
        if a.pool is not None and a.pool not in pools:
            raise InvalidInput(f"{demand.source}: field {a.where}.pool: no GPU of the fleet is in pool {a.pool!r} "
                               f"(pools: {', '.join(sorted(pools)) or 'none'})",
                               reasons=[{"field": f"{a.where}.pool", "value": a.pool}])


def hypothetical(catalog: Catalog, fleet: Fleet, demand: Demand) -> Fleet:
    """The fleet with the demand's declared changes made, checked against the demand (a copy)."""
    out = apply_changes(catalog, fleet, demand.changes) if demand.changes else fleet
    check_demand(demand, out)
    return out


@dataclass(frozen=True, slots=True)
class PlanResult:
    """A what-if: the fleet it ran on, the demand, the replay, stranded capacity and the hosts to add."""

    fleet: Fleet
    demand: Demand
    policy: str
    outcome: Outcome
    stranded: dict[str, float]
    add_hosts: tuple[str, ...]
    still_refused: int
    seconds: float
    free_causes: dict[tuple[int, int], str]  # (host, GPU) -> the cause its free space is put under

    def to_dict(self, gpus: bool = True) -> dict[str, Any]:
        """The result as plain data (what -o json prints and the HTML report draws)."""
        return to_dict(self, gpus)


def make_plan(catalog: Catalog, fleet: Fleet, demand: Demand, policy: str = "pack",
              advise_hosts: bool = True) -> PlanResult:
    """Replay the demand on (a copy of) the fleet with its changes; what was placed, refused and stranded, and the
    hosts to add for the rest."""
    started = time.perf_counter()
    target = hypothetical(catalog, fleet, demand)
    outcome = run(catalog, target, demand, policy)
    frees = classify(catalog, outcome.fleet, demand.asks)
    stranded = by_cause(frees, outcome.rounding_gpus)
    lines: tuple[str, ...] = ()
    left = outcome.refused_vms
    if advise_hosts and outcome.refused_order:
        sugg, left = suggest(catalog, target, demand, outcome.refused_order, policy)
        lines = tuple(s.text() for s in sugg)
    causes = {(f.host, f.gpu): f.cause for f in frees}
    return PlanResult(target, demand, policy, outcome, stranded, lines, left, time.perf_counter() - started, causes)


def allocation(fleet: Fleet) -> list[dict[str, Any]]:
    """Per pool and model: GPUs, GPUs' worth allocated and free."""
    rows: dict[tuple[str, str], list[float]] = {}
    for h in fleet.hosts:
        for g in h.gpus:
            occ = g.occupancy
            used = 1 - occ.free_units / occ.geometry.axis if occ.geometry.axis else 0.0
            r = rows.setdefault((g.pool or "-", g.model), [0, 0.0, 0.0])
            r[0] += 1
            r[1] += used
            r[2] += 1 - used
    return [{"pool": p, "model": m, "gpus": int(v[0]), "allocated": round(v[1], 3), "free": round(v[2], 3)}
            for (p, m), v in sorted(rows.items())]


def occupancy_map(fleet: Fleet, frees: dict[tuple[int, int], str] | None = None) -> list[dict[str, Any]]:
    """Every GPU: host, PCI address, model, mode, pool, used share, devices, and its free space's cause."""
    out = []
    for hi, h in enumerate(fleet.hosts):
        for gi, g in enumerate(h.gpus):
            occ = g.occupancy
            out.append({"host": h.name, "pci": g.pci, "model": g.model, "mode": g.mode.value, "pool": g.pool,
                        "used": round(1 - occ.free_units / occ.geometry.axis, 4) if occ.geometry.axis else 0.0,
                        "devices": len(occ.slots), "layout": [s.encode() for s in occ.slots],
                        "free_cause": (frees or {}).get((hi, gi))})
    return out


def requests_table(result: PlanResult) -> list[dict[str, Any]]:
    """Per request shape: asked, placed and refused VMs, and the first refusal's reason."""
    d, o = result.demand, result.outcome
    rows = []
    for i, a in enumerate(d.asks):
        ref = o.refusals.get(i)
        rows.append({"request": a.where, "shape": a.label, "vcpus": a.vcpus, "memory_mib": a.memory_mib,
                     "asked": d.counts[i], "placed": o.placed[i], "refused": o.refused[i],
                     "reason": ref.text if ref else None, "reason_counts": ref.counts if ref else None})
    return rows


def to_dict(result: PlanResult, gpus: bool = True) -> dict[str, Any]:
    """The plan as plain data; with `gpus` the GPU-by-GPU occupancy map too."""
    o = result.outcome
    worth_free = sum(v for k, v in result.stranded.items() if k != USABLE)
    by_mode = Counter(g.mode.value for h in result.fleet.hosts for g in h.gpus)
    out: dict[str, Any] = {
        "fleet": {"source": result.fleet.source, "hosts": len(result.fleet.hosts), "gpus": result.fleet.gpu_count,
                  "modes": dict(sorted(by_mode.items()))},
        "demand": {"source": result.demand.source, "shapes": len(result.demand.asks), "vms": result.demand.vms},
        "policy": result.policy,
        "summary": {"placed_vms": o.placed_vms, "refused_vms": o.refused_vms,
                    "placed_pct": round(100 * o.placed_share, 2), "stranded_gpus": round(worth_free, 3),
                    "seconds": round(result.seconds, 3)},
        "requests": requests_table(result),
        "stranded": result.stranded,
        "add_hosts": list(result.add_hosts),
        "still_refused_after_adding": result.still_refused,
        "allocation": allocation(o.fleet),
    }
    if gpus:
        out["gpus"] = occupancy_map(o.fleet, result.free_causes)
    return out
