"""spread: the least-loaded GPU and host first."""

from __future__ import annotations

from collections.abc import Mapping

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement_types import CandidateOrder, Demand, GpuView, HostView, Policy, Score
from vgpu_ctl.core.policies import PolicyDef


def spread_score(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
    """The least used GPU, on the host with the most free vCPUs, then host order."""
    used = 1 - gpu.occupancy.free_units / gpu.occupancy.geometry.axis
    return (used, -host.free_vcpus, host.order, gpu.gpu_id, start)


def make(demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy (it ignores the demand mix and the supply)."""
    return Policy("spread", spread_score, CandidateOrder.EMPTIEST_FIRST, "least-loaded GPU and host first")


POLICY = PolicyDef("spread", "least-loaded GPU and host first", make)
