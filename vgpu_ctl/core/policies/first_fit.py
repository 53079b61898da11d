"""first-fit: the first GPU in host order that fits."""

from __future__ import annotations

from collections.abc import Mapping

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement_types import CandidateOrder, Demand, GpuView, HostView, Policy, Score
from vgpu_ctl.core.policies import PolicyDef


def first_fit_score(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    """The first GPU in host order, then the lowest position."""
    return (host.order, gpu.gpu_id, start)


def make(demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy (it ignores the demand mix and the supply)."""
    return Policy("first-fit", first_fit_score, CandidateOrder.HOST_ORDER, "first GPU in host order that fits")


POLICY = PolicyDef("first-fit", "first GPU in host order that fits", make)
