"""Stranded capacity: free GPU space the demand can't use, by cause, in GPUs' worth.

After a replay, each GPU's free units are put under one cause, judged against the demand's request shapes that
may use the GPU (its pool and model):
- usable: some shape fits there now, on a host with the vCPUs and memory for it (not stranded);
- hosts short of vCPUs or memory: some shape's profile fits on the GPU, but the host lacks room for every such
  shape; hosts draining or down: it fits, but the host takes no new VMs;
- MIG holes / mixed-size slots / equal-size type lock: no shape's profile fits in what is left (MIG starts and
  slices, mixed-size placement ids, an equal-size GPU locked to another type or with too little left);
- carving offers none of the demand: the GPU's mode offers no profile any shape may use (e.g. a passthrough GPU
  when only vGPUs are asked for);
- nothing asked for: no shape may use the GPU's pool and model at all.
Rounding to a profile is what share requests (traces) took beyond their share, rounded up to the next profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Mode, Occupancy
from vgpu_ctl.planning.demand import Ask
from vgpu_ctl.planning.fleet import Fleet
from vgpu_ctl.planning.replay import resolve

USABLE = "usable"
SHORT = "hosts short of vCPUs or memory"
INACTIVE = "hosts draining or down"
ROUNDING = "rounding to a profile"
BY_MODE = {Mode.MIG: "MIG holes", Mode.VGPU_MIXED: "mixed-size slots", Mode.VGPU_EQUAL: "equal-size type lock",
           Mode.PASSTHROUGH: "passthrough GPU in use", Mode.UNMANAGED: "unmanaged GPU"}
NO_OFFER = "carving offers none of the demand"
NOT_ASKED = "nothing asked for"
CAUSES = (ROUNDING, BY_MODE[Mode.MIG], BY_MODE[Mode.VGPU_MIXED], BY_MODE[Mode.VGPU_EQUAL], SHORT, INACTIVE,
          NO_OFFER, NOT_ASKED, USABLE)


@dataclass(frozen=True, slots=True)
class GpuFree:
    """One GPU's free share and the cause it is put under."""

    host: int
    gpu: int
    free: float  # GPUs' worth
    cause: str


def classify(catalog: Catalog, fleet: Fleet, asks: Sequence[Ask]) -> list[GpuFree]:
    """The cause of every GPU's free space (GPUs with none left out)."""
    out: list[GpuFree] = []
    memo: dict[tuple[Occupancy, str | None, float, float], str] = {}
    for hi, h in enumerate(fleet.hosts):
        for gi, g in enumerate(h.gpus):
            occ = g.occupancy
            free = occ.free_units / occ.geometry.axis if occ.geometry.axis else 0.0
            if free <= 0:
                continue
            key = (occ, g.pool, h.free_vcpus, h.free_memory_mib)
            cause = memo.get(key)
            if cause is None:
                cause = memo[key] = _cause(catalog, occ, g.pool, g.model, h.free_vcpus, h.free_memory_mib, h.state,
                                           asks)
            out.append(GpuFree(hi, gi, free, cause))
    return out


def _cause(catalog: Catalog, occ: Occupancy, pool: str | None, model: str, vcpus: float, memory: float, state: str,
           asks: Sequence[Ask]) -> str:
    mine = [a for a in asks if (a.pool is None or a.pool == pool) and (a.models is None or model in a.models)]
    if not mine:
        return NOT_ASKED
    profiles = [(a, resolve(catalog, a, occ.geometry)) for a in mine]
    offered = [(a, p) for a, p in profiles if p is not None]
    if not offered:
        return NO_OFFER
    fitting = [a for a, p in offered if occ.misfit(p) is None]
    if not fitting:
        return BY_MODE[occ.geometry.mode]
    if state != "active":
        return INACTIVE
    if any(a.vcpus <= vcpus + 1e-9 and a.memory_mib <= memory for a in fitting):
        return USABLE
    return SHORT


def by_cause(frees: Sequence[GpuFree], rounding: float) -> dict[str, float]:
    """GPUs' worth per cause (every cause of CAUSES listed, usable last; others after), rounding included."""
    total: dict[str, float] = {c: 0.0 for c in CAUSES}
    for f in frees:
        total[f.cause] = total.get(f.cause, 0.0) + f.free
    total[ROUNDING] += rounding
    return {c: round(v, 3) for c, v in total.items()}
