"""The carving advisor: per GPU the mode and vGPU type or MIG layout that places the most of a demand.

Candidates are whole-fleet carvings that re-carve only GPUs holding no devices (and, with a pool, only that pool's):
- today's carving;
- one per mode (vgpu-mixed, vgpu-equal, mig, passthrough): every free GPU whose model has the mode in it, free
  (no pinned type, no fixed layout), when some request can take a profile in that mode;
- by demand: per (pool, model), the free GPUs split over the modes in proportion to the GPUs' worth of the requests
  that can run only in each mode (requests that can run in several go to the mode holding most of the rest), whole
  hosts first; vGPUs in mixed size where the model has it and more than one type is asked for, else equal size;
- then, from the best of those, one pass over the models (those with 5% of the free GPUs or more): the model's free
  GPUs in each other useful mode, kept when that places more.
Passthrough is a candidate only when a request names a whole-GPU profile. Each candidate is replayed with the real
geometry and policy (on fleets of more than SAMPLE_ABOVE GPUs on a 1-in-k sample of the hosts with the demand
sampled alike; then today's carving and the best candidate on the whole fleet), and the one placing the most of the
demand wins; ties keep the carving that changes fewest GPUs. The advice per
GPU is the winner's mode, with the vGPU type an equal-size GPU ended up holding (to pin) and the MIG layout a MIG
GPU ended up holding (GPU-instance profiles at their starts) in the winner's replay: what to carve, found by placing
the demand under NVIDIA's rules (core.geometry). In-use GPUs are never changed; those whose carving (pinned type,
fixed layout, mode) keeps out requests the advised replay still refused, which an empty GPU of the same model could
take, are listed with the carving they would need and the devices that would have to move first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Misfit, Mode, Occupancy, geometry_for, supported_modes
from vgpu_ctl.planning.demand import Ask, Demand
from vgpu_ctl.planning.fleet import Fleet, PlanGpu
from vgpu_ctl.planning.replay import Outcome, asked_gpus, resolve, run

SAMPLE_ABOVE = 2000  # GPUs: larger fleets compare candidates on a sample first
MODE_ORDER = (Mode.VGPU_MIXED, Mode.VGPU_EQUAL, Mode.MIG, Mode.PASSTHROUGH)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A carving of the whole fleet, named, with how many GPUs it re-carves."""

    name: str
    fleet: Fleet
    changed: int


@dataclass(frozen=True, slots=True)
class Score:
    """How a candidate did: placed share of the demand's GPUs' worth, placed VMs, on the sample or the fleet."""

    name: str
    placed_share: float
    placed_vms: int
    changed: int
    sampled: bool


@dataclass(frozen=True, slots=True)
class GpuAdvice:
    """One GPU: today's carving and the advised one, what it holds, and what to do."""

    host: str
    pci: str
    model: str
    pool: str | None
    devices: int
    today: str
    advised: str
    action: str  # keep | re-carve | move VMs first


@dataclass(frozen=True, slots=True)
class Advice:
    """The advisor's answer: the winner, every candidate's score, today's and the advised replays, per GPU."""

    winner: str
    scores: tuple[Score, ...]
    today: Outcome
    advised: Outcome
    gpus: tuple[GpuAdvice, ...]

    @property
    def gain_vms(self) -> int:
        """VMs the advised carving places beyond today's."""
        return self.advised.placed_vms - self.today.placed_vms

    @property
    def gain_share(self) -> float:
        """Points of the demand's GPUs' worth (0..1) the advised carving places beyond today's."""
        return self.advised.placed_share - self.today.placed_share


def describe(occ: Occupancy) -> str:
    """A GPU's carving in words: 'vgpu-equal A100D-10C', 'mig 4g.40gb@0,2g.20gb@4', 'mig (free)'."""
    g = occ.geometry
    if g.mode is Mode.VGPU_EQUAL:
        return f"vgpu-equal {occ.pinned_type}" if occ.pinned_type else "vgpu-equal (any type)"
    if g.mode is Mode.MIG:
        if occ.fixed_layout is None:
            return "mig (free)"
        return "mig " + ",".join(f"{grp}@{start}" for grp, start in sorted(occ.fixed_layout, key=lambda x: x[1]))
    return g.mode.value


def _held(occ: Occupancy) -> str:
    """What an advised GPU should be carved to, from what it held at the end of the winner's replay."""
    g = occ.geometry
    if g.mode is Mode.VGPU_EQUAL:
        t = occ.active_type
        return f"vgpu-equal {t}" if t else "vgpu-equal (any type)"
    if g.mode is Mode.MIG:
        if not occ.slots:
            return describe(occ)
        return "mig " + ",".join(f"{g.shapes[s.profile].group}@{s.start}" for s in occ.slots) + \
            (" + free" if occ.free_units else "")
    return g.mode.value


def _in_scope(g: PlanGpu, pool: str | None) -> bool:
    return not g.in_use and (pool is None or g.pool == pool)


def _asks_for(asks: Sequence[Ask], pool: str | None, model: str) -> list[Ask]:
    return [a for a in asks if (a.pool is None or a.pool == pool) and (a.models is None or model in a.models)]


def _useful_modes(catalog: Catalog, asks: Sequence[Ask], models: frozenset[str]) -> list[Mode]:
    out = []
    for mode in MODE_ORDER:
        for m in sorted(models):
            if mode in supported_modes(catalog, m) and \
                    any(resolve(catalog, a, geometry_for(catalog, m, mode)) for a in asks):
                out.append(mode)
                break
    return out


def _recarve(catalog: Catalog, fleet: Fleet, pick: dict[tuple[int, int], Mode], name: str) -> Candidate:
    hosts = list(fleet.hosts)
    changed = 0
    for (hi, gi), mode in pick.items():
        h = hosts[hi]
        g = h.gpus[gi]
        occ = Occupancy(geometry_for(catalog, g.model, mode))
        if occ == g.occupancy:
            continue
        gpus = list(h.gpus)
        gpus[gi] = PlanGpu(g.pci, g.model, g.pool, occ)
        hosts[hi] = replace(h, gpus=tuple(gpus))
        changed += 1
    return Candidate(name, replace(fleet, hosts=tuple(hosts)), changed)


def candidates(catalog: Catalog, fleet: Fleet, demand: Demand, pool: str | None = None) -> list[Candidate]:
    """Today's carving, one candidate per useful mode, and the by-demand split (see the module's docstring)."""
    out = [Candidate("today", fleet, 0)]
    free = [(hi, gi, g) for hi, h in enumerate(fleet.hosts) for gi, g in enumerate(h.gpus) if _in_scope(g, pool)]
    for mode in _useful_modes(catalog, demand.asks, frozenset(g.model for _, _, g in free)):
        pick = {(hi, gi): mode for hi, gi, g in free if mode in supported_modes(catalog, g.model)}
        c = _recarve(catalog, fleet, pick, f"all {mode.value}")
        if c.changed:
            out.append(c)
    split = _by_demand(catalog, fleet, demand, free)
    if split:
        c = _recarve(catalog, fleet, split, "by demand")
        if c.changed and all(c.fleet != o.fleet for o in out):
            out.append(c)
    return out


def _by_demand(catalog: Catalog, fleet: Fleet, demand: Demand,
               free: Sequence[tuple[int, int, PlanGpu]]) -> dict[tuple[int, int], Mode]:
    groups: dict[tuple[str | None, str], list[tuple[int, int]]] = {}
    for hi, gi, g in free:
        groups.setdefault((g.pool, g.model), []).append((hi, gi))
    pick: dict[tuple[int, int], Mode] = {}
    for (pool, model), members in groups.items():
        modes = [m for m in MODE_ORDER if m in supported_modes(catalog, model) and m is not Mode.VGPU_MIXED]
        worth: dict[Mode, float] = {}
        flexible = 0.0
        types: set[str] = set()
        for i, a in enumerate(demand.asks):
            if a not in _asks_for([a], pool, model):
                continue
            on = [m for m in modes if resolve(catalog, a, geometry_for(catalog, model, m)) is not None]
            w = demand.counts[i] * asked_gpus(catalog, a)
            if Mode.VGPU_EQUAL in on:
                types.add(resolve(catalog, a, geometry_for(catalog, model, Mode.VGPU_EQUAL)) or "")
            if len(on) == 1:
                worth[on[0]] = worth.get(on[0], 0.0) + w
            elif on:
                flexible += w
        if not worth and not flexible:
            continue
        if flexible:
            to = max(worth, key=lambda m: worth[m]) if worth else modes[0]
            worth[to] = worth.get(to, 0.0) + flexible
        in_use = Counter(g.mode for h in fleet.hosts for g in h.gpus if g.in_use and (g.pool, g.model) == (pool, model))
        total = len(members) + sum(in_use.values())
        want = {m: max(0, math.ceil(total * w / sum(worth.values())) - in_use[m]) for m, w in worth.items() if w > 0}
        if not want:
            continue
        vgpu = Mode.VGPU_MIXED if catalog.model(model).mixed_size and len(types) > 1 else Mode.VGPU_EQUAL
        ordered = sorted(members)  # host order: whole hosts go to one mode first
        k = 0
        for m in sorted(want, key=lambda m: -worth[m]):
            for _ in range(want[m]):
                if k < len(ordered):
                    pick[ordered[k]] = vgpu if m is Mode.VGPU_EQUAL else m
                    k += 1
        last = max(want, key=lambda m: worth[m])
        for spot in ordered[k:]:
            pick[spot] = vgpu if last is Mode.VGPU_EQUAL else last
    return pick


def _sample(fleet: Fleet, demand: Demand, every: int) -> tuple[Fleet, Demand]:
    hosts = fleet.hosts[::every]
    order = demand.order[::every]
    counts = Counter(order)
    return (replace(fleet, hosts=hosts),
            Demand(demand.asks, tuple(counts[i] for i in range(len(demand.asks))), order, demand.changes,
                   demand.source + f" 1/{every}"))


def _named_passthrough(catalog: Catalog, asks: Sequence[Ask]) -> bool:
    """True when some request names a whole-GPU profile: only then is passthrough worth a candidate (a share fits
    a whole GPU too, but as well in the GPU's full-size vGPU type, which leaves the GPU shareable)."""
    return any(p in catalog.models for a in asks for p in a.profiles)


def _refine(catalog: Catalog, demand: Demand, pool: str | None, start: Candidate,
            score: Callable[[Candidate], Score], scores: list[Score]) -> Candidate:
    """From `start`, one pass over the models: each model's free GPUs in each other useful mode, kept when that
    places more (coordinate ascent; models with under 5% of the free GPUs are left as they are)."""
    free = [(hi, gi, g) for hi, h in enumerate(start.fleet.hosts) for gi, g in enumerate(h.gpus)
            if _in_scope(g, pool)]
    per_model = Counter(g.model for _, _, g in free)
    best, best_score = start, next(x for x in reversed(scores) if x.name == start.name)
    passthrough = _named_passthrough(catalog, demand.asks)
    for model, n in sorted(per_model.items(), key=lambda kv: -kv[1]):
        if n < 0.05 * len(free):
            continue
        for mode in _useful_modes(catalog, demand.asks, frozenset((model,))):
            if mode is Mode.PASSTHROUGH and not passthrough:
                continue
            pick = {(hi, gi): mode for hi, gi, g in free if g.model == model}
            c = _recarve(catalog, best.fleet, pick, f"{best.name}; {model} {mode.value}")
            if not c.changed:
                continue
            changed = sum(1 for (hi, gi) in pick if c.fleet.hosts[hi].gpus[gi].occupancy !=
                          start.fleet.hosts[hi].gpus[gi].occupancy) + start.changed
            c = Candidate(c.name, c.fleet, changed)
            sc = score(c)
            scores.append(sc)
            if (round(sc.placed_share, 9), sc.placed_vms) > (round(best_score.placed_share, 9), best_score.placed_vms):
                best, best_score = c, sc
    return best


def advise(catalog: Catalog, fleet: Fleet, demand: Demand, policy: str = "pack", pool: str | None = None) -> Advice:
    """The carving per GPU that places the most of the demand, and the gain over today's in the same run."""
    cands = candidates(catalog, fleet, demand, pool)
    if not _named_passthrough(catalog, demand.asks):
        cands = [c for c in cands if c.name != f"all {Mode.PASSTHROUGH.value}"]
    scores: list[Score] = []
    results: dict[str, Outcome] = {}
    sampled = fleet.gpu_count > SAMPLE_ABOVE
    every = math.ceil(fleet.gpu_count / SAMPLE_ABOVE)

    def score(c: Candidate) -> Score:
        """Replay the demand on the candidate (on the sample for a large fleet) and score it."""
        if sampled:
            f, d = _sample(c.fleet, demand, every)
            o = run(catalog, f, d, policy)
        else:
            o = results[c.name] = run(catalog, c.fleet, demand, policy)
        return Score(c.name, o.placed_share, o.placed_vms, c.changed, sampled)

    for c in cands:
        scores.append(score(c))
    key = {s.name: (round(s.placed_share, 9), s.placed_vms, -s.changed) for s in scores}
    start = max(cands, key=lambda c: key[c.name])
    best = _refine(catalog, demand, pool, start, score, scores)
    every_candidate = {c.name: c for c in cands} | {best.name: best}
    if sampled:
        for c in [cands[0]] + ([best] if best is not cands[0] else []):
            o = results[c.name] = run(catalog, c.fleet, demand, policy)
            scores.append(Score(c.name, o.placed_share, o.placed_vms, c.changed, False))
    full = [s for s in scores if not s.sampled and s.name in results]
    win = max(full, key=lambda s: (round(s.placed_share, 9), s.placed_vms, -s.changed))
    chosen = every_candidate[win.name]
    today, advised = results["today"], results[win.name]
    rows = _per_gpu(catalog, fleet, chosen, advised, demand.asks, pool)
    return Advice(win.name, tuple(scores), today, advised, tuple(rows))


def _blocking(catalog: Catalog, g: PlanGpu, occ: Occupancy, asks: Sequence[Ask], refused: Sequence[int]) -> str | None:
    """The carving an empty GPU like `g` would need for requests still refused that `g`'s carving (pinned type,
    fixed layout, mode) keeps out; None if its carving blocks none of them."""
    for i, a in enumerate(asks):
        if not refused[i] or (a.pool is not None and a.pool != g.pool) or (a.models is not None and
                                                                            g.model not in a.models):
            continue
        p = resolve(catalog, a, occ.geometry)
        if p is not None and occ.misfit(p) not in (Misfit.OTHER_TYPE, Misfit.LAYOUT, Misfit.OTHER_MODE):
            continue  # refused for lack of room, not because of how the GPU is carved
        for mode in (Mode.VGPU_EQUAL, Mode.VGPU_MIXED, Mode.MIG, Mode.PASSTHROUGH):  # the simplest carving first
            if mode not in supported_modes(catalog, g.model):
                continue
            empty = Occupancy(geometry_for(catalog, g.model, mode))
            q = resolve(catalog, a, empty.geometry)
            if q is not None and empty.misfit(q) is None:
                return f"{mode.value} {q}" if mode is Mode.VGPU_EQUAL else f"{mode.value} (for {q})"
    return None


def _per_gpu(catalog: Catalog, fleet: Fleet, chosen: Candidate, advised: Outcome, asks: Sequence[Ask],
             pool: str | None) -> list[GpuAdvice]:
    rows: list[GpuAdvice] = []
    for hi, h in enumerate(fleet.hosts):
        for gi, g in enumerate(h.gpus):
            after = advised.fleet.hosts[hi].gpus[gi].occupancy
            new = chosen.fleet.hosts[hi].gpus[gi].occupancy
            today = describe(g.occupancy)
            if g.in_use:
                need = _blocking(catalog, g, after, asks, advised.refused) if pool in (None, g.pool) else None
                rows.append(GpuAdvice(h.name, g.pci, g.model, g.pool, len(g.occupancy.slots), today,
                                      need or today, "move VMs first" if need else "keep"))
                continue
            advised_text = _held(after) if new != g.occupancy or after.slots else today
            action = "re-carve" if new != g.occupancy else "keep"
            rows.append(GpuAdvice(h.name, g.pci, g.model, g.pool, 0, today, advised_text, action))
    return rows


def advice_dict(advice: Advice) -> dict[str, Any]:
    """The advice as plain data: winner, gain, each candidate's score, per GPU today / advised / action."""
    def side(o: Outcome) -> dict[str, Any]:
        """One replay's placed and refused VMs."""
        return {"placed_vms": o.placed_vms, "refused_vms": o.refused_vms, "placed_pct": round(100 * o.placed_share, 2)}

    return {
        "winner": advice.winner,
        "today": side(advice.today),
        "advised": side(advice.advised),
        "gain": {"vms": advice.gain_vms, "points": round(100 * advice.gain_share, 2)},
        "candidates": [{"name": s.name, "placed_pct": round(100 * s.placed_share, 2), "placed_vms": s.placed_vms,
                        "gpus_changed": s.changed, "sampled": s.sampled} for s in advice.scores],
        "gpus": [{"host": g.host, "pci": g.pci, "model": g.model, "pool": g.pool, "devices": g.devices,
                  "today": g.today, "advised": g.advised, "action": g.action} for g in advice.gpus],
        "move_first": [f"{g.host}/{g.pci}" for g in advice.gpus if g.action == "move VMs first"],
    }
