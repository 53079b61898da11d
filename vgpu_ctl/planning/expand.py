"""'Add N hosts of model X': how many more hosts of a shape the fleet needs to place what a replay refused.

Templates are the fleet's own host shapes, one per (pool, model) group of GPUs: the first host holding GPUs of the
group, with only those GPUs, empty, carved as they are, at full vCPUs and memory. A request that no group offers
(another model, a profile no GPU's mode has) gets a template from the catalog: 8 GPUs of the first model offering
its profile, in the mode the profile needs, with the fleet's largest host's vCPUs and memory. The refused VMs are
replayed, in their order, on enough new hosts of each template; the hosts the replay used are the answer. The best
template (most VMs placed, then fewest GPUs) is taken and the rest tried again on the others, a few rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import Mode, Occupancy
from vgpu_ctl.planning.demand import Ask, Demand
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost, carve
from vgpu_ctl.planning.replay import asked_gpus, resolve, run

ROUNDS = 3
TEMPLATES_PER_ROUND = 3
CATALOG_GPUS = 8
_MODE_OF_KIND = {ProfileKind.VGPU: Mode.VGPU_EQUAL, ProfileKind.MIG: Mode.MIG, ProfileKind.MIG_VGPU: Mode.MIG,
                 ProfileKind.PASSTHROUGH: Mode.PASSTHROUGH}


@dataclass(frozen=True, slots=True)
class Template:
    """A host shape to add: its GPUs (empty), vCPUs and memory, and where it comes from."""

    name: str
    host: PlanHost
    origin: str  # "fleet host X" or "catalog"

    @property
    def model(self) -> str:
        """The model of its GPUs (the first, for a mixed host)."""
        return self.host.gpus[0].model

    @property
    def pool(self) -> str | None:
        """The pool of its GPUs."""
        return self.host.gpus[0].pool


@dataclass(frozen=True, slots=True)
class Suggestion:
    """Add `hosts` hosts like `template`: they place `places` of the VMs still refused before this step."""

    template: Template
    hosts: int
    places: int
    of: int

    def text(self) -> str:
        """'add 2 hosts of model H100-80GB (8 GPUs, mig, pool inference, like kvm-h100-01): places 10 of 12 VMs'."""
        h = self.template.host
        modes = ", ".join(sorted({g.mode.value for g in h.gpus}))
        pool = f", pool {self.template.pool}" if self.template.pool else ""
        like = f", like {self.template.origin}" if self.template.origin != "catalog" else ", from the catalog"
        return (f"add {self.hosts} host{'s' if self.hosts != 1 else ''} of model {self.template.model} "
                f"({len(h.gpus)} GPUs, {modes}{pool}, {h.vcpus:g} vCPUs, {h.memory_mib / 1024:g} GiB{like}): "
                f"places {self.places} of {self.of} VMs")


def templates(catalog: Catalog, fleet: Fleet, asks: Sequence[Ask]) -> list[Template]:
    """One template per (pool, model) group of the fleet, then catalog templates for asks no group offers."""
    out: list[Template] = []
    seen: set[tuple[str | None, str]] = set()
    for h in fleet.hosts:
        for g in h.gpus:
            key = (g.pool, g.model)
            if key in seen:
                continue
            seen.add(key)
            gpus = tuple(PlanGpu(x.pci, x.model, x.pool, Occupancy(x.occupancy.geometry, (), x.occupancy.pinned_type,
                                                                   x.occupancy.fixed_layout))
                         for x in h.gpus if (x.pool, x.model) == key)
            new = PlanHost("new", h.vcpus, h.memory_mib, h.vcpus, h.memory_mib, gpus, "active", h.labels)
            out.append(Template(f"{g.model}@{g.pool or '-'}", new, f"fleet host {h.name}"))
    vcpus = max((h.vcpus for h in fleet.hosts), default=128.0)
    memory = max((h.memory_mib for h in fleet.hosts), default=float(1 << 20))
    for a in asks:
        for p in a.profiles:
            models = [m for m in catalog.models_offering(p) if a.models is None or m in a.models]
            if not models:
                continue
            info = catalog.profile(models[0], p)
            assert info is not None
            mode = _MODE_OF_KIND[info.kind]
            if info.kind is ProfileKind.VGPU and catalog.model(models[0]).mixed_size:
                mode = Mode.VGPU_MIXED
            name = f"{models[0]}/{mode.value}@{a.pool or '-'}"
            if any(t.name == name for t in out):
                continue
            occ = carve(catalog, models[0], mode)
            gpus = tuple(PlanGpu(f"0000:{0x10 + j:02x}:00.0", models[0], a.pool, occ) for j in range(CATALOG_GPUS))
            out.append(Template(name, PlanHost("new", vcpus, memory, vcpus, memory, gpus), "catalog"))
    return out


def _mini_fleet(t: Template, n: int) -> Fleet:
    hosts = tuple(replace(t.host, name=f"new-{t.name}-{k + 1}") for k in range(n))
    return Fleet(hosts, f"{n} new hosts like {t.name}")


def _enough(catalog: Catalog, t: Template, asks: Sequence[Ask], seq: Sequence[int]) -> int:
    """An upper bound on the hosts of `t` the VMs could need."""
    h = t.host
    worth = sum(asked_gpus(catalog, asks[i]) for i in seq)
    vcpus = sum(asks[i].vcpus for i in seq)
    memory = sum(asks[i].memory_mib for i in seq)
    need = max(worth / max(1, len(h.gpus)), vcpus / h.vcpus if h.vcpus else 0.0,
               memory / h.memory_mib if h.memory_mib else 0.0)
    return max(1, min(len(seq), math.ceil(1.5 * need) + 1))


def suggest(catalog: Catalog, fleet: Fleet, demand: Demand, refused_order: Sequence[int],
            policy: str = "pack") -> tuple[list[Suggestion], int]:
    """The hosts to add so that the refused VMs (shape indexes, in arrival order) place; and how many would still
    be refused after the suggestions."""
    remaining = list(refused_order)
    out: list[Suggestion] = []
    pool = templates(catalog, fleet, demand.asks)
    for _ in range(ROUNDS):
        if not remaining or not pool:
            break
        usable = [(t, sum(1 for i in remaining if _can_use(catalog, demand.asks[i], t))) for t in pool]
        ranked = [t for t, k in sorted(usable, key=lambda tk: -tk[1]) if k][:TEMPLATES_PER_ROUND]
        best: tuple[int, int, Template, list[int]] | None = None
        for t in ranked:
            n = _enough(catalog, t, demand.asks, remaining)
            sub = Demand(demand.asks, demand.counts, tuple(remaining), source="refused")
            outcome = run(catalog, _mini_fleet(t, n), sub, policy, keep_placements=True)
            used = len({hi for _, hi, _ in outcome.placements})
            placed = outcome.placed_vms
            left = outcome.refused_order
            if placed and (best is None or (placed, -used * len(t.host.gpus)) > (best[0], -best[1] *
                                                                                 len(best[2].host.gpus))):
                best = (placed, used, t, left)
        if best is None:
            break
        placed, used, t, left = best
        out.append(Suggestion(t, used, placed, len(remaining)))
        remaining = left
        pool = [x for x in pool if x is not t]
    return out, len(remaining)


def _can_use(catalog: Catalog, ask: Ask, t: Template) -> bool:
    return any((ask.pool is None or ask.pool == g.pool) and resolve(catalog, ask, g.occupancy.geometry) is not None
               for g in t.host.gpus) and len(t.host.gpus) >= ask.gpus
