"""best-fit: the GPU left with the least free space."""

from __future__ import annotations

from collections.abc import Mapping

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement_types import CandidateOrder, Demand, GpuView, HostView, Policy, Score
from vgpu_ctl.core.policies import PolicyDef


def best_fit_score(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    """The GPU left with the least free share, then host order."""
    return (after.free_units / after.geometry.axis, host.order, gpu.gpu_id, start)


def make(demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy (it ignores the demand mix and the supply)."""
    return Policy("best-fit", best_fit_score, CandidateOrder.FULLEST_FIRST, "GPU left with the least free space")


POLICY = PolicyDef("best-fit", "GPU left with the least free space", make)
