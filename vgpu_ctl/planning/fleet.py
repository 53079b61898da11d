"""The fleet a plan runs on, as plain values: hosts with their free vCPUs and memory and their GPUs' occupancy.

Built from an inventory file, from a trace's node list, or (by the service layer) from the store. Planning only ever
changes copies of these values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Mode, Occupancy, Slot, geometry_for, parse_mig_layout
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import parse_inventory
from vgpu_ctl.planning.trace import load_nodes, mode_of


@dataclass(frozen=True, slots=True)
class PlanGpu:
    """One GPU: where it is, its model, pool and carving, and what it holds (`occupancy.slots`, one per device)."""

    pci: str
    model: str
    pool: str | None
    occupancy: Occupancy

    @property
    def mode(self) -> Mode:
        """The GPU's sharing mode."""
        return self.occupancy.geometry.mode

    @property
    def in_use(self) -> bool:
        """True when the GPU holds devices (its carving can't change before they move)."""
        return bool(self.occupancy.slots)


@dataclass(frozen=True, slots=True)
class PlanHost:
    """One host: capacity after overcommit, what is free of it, its state and labels, its GPUs."""

    name: str
    vcpus: float
    memory_mib: float
    free_vcpus: float
    free_memory_mib: float
    gpus: tuple[PlanGpu, ...]
    state: str = "active"
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Fleet:
    """The hosts a plan runs on, and where they came from (for the report)."""

    hosts: tuple[PlanHost, ...]
    source: str = ""

    @property
    def gpu_count(self) -> int:
        """All the fleet's GPUs."""
        return sum(len(h.gpus) for h in self.hosts)

    def pools(self) -> frozenset[str]:
        """The pools the fleet's GPUs belong to."""
        return frozenset(g.pool for h in self.hosts for g in h.gpus if g.pool is not None)

    def models(self) -> frozenset[str]:
        """The GPU models in the fleet."""
        return frozenset(g.model for h in self.hosts for g in h.gpus)


def carve(catalog: Catalog, model: str, mode: Mode | str, vgpu_type: str | None = None,
          mig_layout: Sequence[Slot] | None = None, slots: Sequence[Slot] = ()) -> Occupancy:
    """The occupancy of a GPU of `model` carved in `mode` (with a pinned type or a fixed MIG layout) holding
    `slots`; InvalidInput naming the field when the carving is not one NVIDIA allows."""
    geom = geometry_for(catalog, model, mode)
    if vgpu_type is not None:
        if geom.mode is not Mode.VGPU_EQUAL:
            raise InvalidInput(f"field vgpu_type: a pinned vGPU type needs mode vgpu-equal, not {geom.mode.value}",
                               reasons=[{"field": "vgpu_type", "value": vgpu_type}])
        if vgpu_type not in geom.shapes:
            raise InvalidInput(f"field vgpu_type: {model} has no vGPU type {vgpu_type!r}; known: "
                               f"{', '.join(sorted(geom.shapes))}",
                               reasons=[{"field": "vgpu_type", "value": vgpu_type}])
    fixed = None
    if mig_layout is not None:
        if geom.mode is not Mode.MIG:
            raise InvalidInput(f"field mig_layout: a MIG layout needs mode mig, not {geom.mode.value}",
                               reasons=[{"field": "mig_layout"}])
        fixed = frozenset((geom.shapes[s.profile].group, s.start) for s in mig_layout)
    return Occupancy(geom, tuple(sorted(slots)), vgpu_type, fixed)


def mig_slots(catalog: Catalog, model: str, entries: Iterable[str]) -> tuple[Slot, ...]:
    """A MIG layout written as `["3g.40gb@0", ...]` on a GPU of `model`, checked against NVIDIA's rules."""
    return parse_mig_layout(geometry_for(catalog, model, Mode.MIG), entries)


def fleet_from_inventory(path: Path, catalog: Catalog) -> Fleet:
    """The fleet an inventory file declares (nothing in use); InventoryError naming file, line and field if bad."""
    inv = parse_inventory(path, catalog)
    hosts = []
    for h in inv.hosts:
        gpus = []
        for g in h.gpus:
            layout = mig_slots(catalog, g.model, g.mig_layout) if g.mig_layout is not None else None
            gpus.append(PlanGpu(g.pci, g.model, g.pool, carve(catalog, g.model, g.mode, g.vgpu_type, layout)))
        vcpus, memory = h.vcpus * h.cpu_overcommit, h.memory_mib * h.memory_overcommit
        hosts.append(PlanHost(h.name, vcpus, memory, vcpus, memory, tuple(gpus), h.state, dict(h.labels)))
    return Fleet(tuple(hosts), f"inventory {path}")


def fleet_from_trace(path: Path, catalog: Catalog, mode: str = Mode.VGPU_EQUAL.value,
                     min_gpus: int | None = None) -> Fleet:
    """The fleet of a trace's node list (vCPUs as whole vCPUs from milli-vCPUs), every GPU in `mode` where its model
    has it (else vgpu-equal), no pools; with `min_gpus` the node list is repeated (hosts renamed `-cN`) until the
    fleet has at least that many GPUs."""
    nodes = [n for n in load_nodes(path) if n.gpus]
    if not nodes:
        raise InvalidInput(f"trace file {path}: no node with GPUs", reasons=[{"file": str(path)}])
    per_copy = sum(n.gpus for n in nodes)
    copies = max(1, math.ceil((min_gpus or 0) / per_copy))
    empty = {m: carve(catalog, m, mode_of(catalog, m, mode)) for m in {n.model for n in nodes}}
    hosts: list[PlanHost] = []
    total = 0
    target = per_copy if min_gpus is None else min_gpus
    while total < target:  # the node list over and over, cut where the GPUs are enough
        n = nodes[len(hosts) % len(nodes)]
        c = len(hosts) // len(nodes)
        name = n.name if copies == 1 else f"{n.name}-c{c}"
        gpus = tuple(PlanGpu(f"0000:{0x10 + j:02x}:00.0", n.model, None, empty[n.model]) for j in range(n.gpus))
        vcpus = n.cpu_milli / 1000
        hosts.append(PlanHost(name, vcpus, float(n.memory_mib), vcpus, float(n.memory_mib), gpus))
        total += n.gpus
    return Fleet(tuple(hosts), f"trace nodes {path}" + (f" repeated to {total} GPUs" if copies > 1 else ""))


def with_gpu(fleet: Fleet, host: int, gpu: int, new: PlanGpu) -> Fleet:
    """A copy of the fleet with one GPU replaced."""
    h = fleet.hosts[host]
    gpus = list(h.gpus)
    gpus[gpu] = new
    hosts = list(fleet.hosts)
    hosts[host] = replace(h, gpus=tuple(gpus))
    return replace(fleet, hosts=tuple(hosts))
