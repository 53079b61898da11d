"""spread-load: spread, weighing what the GPUs really do. The measured load of each GPU (0..1, from NVML on the
hosts: service.utilization.load_by_gpu) is handed in when the policy is made, so the core stays pure; the GPU
doing least comes first, then spread's order (least allocated GPU, host with the most free vCPUs, host order).

Loads are compared in steps of LOAD_STEP, so that sampling noise between two equally quiet GPUs does not
override what is allocated. Without loads (made by name only) it is spread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement_types import CandidateOrder, Demand, GpuView, HostView, Policy, Score, ScoreFn
from vgpu_ctl.core.policies import PolicyDef

NAME = "spread-load"
DESCRIPTION = "the GPU doing least (measured), then the least-loaded GPU and host"
LOAD_STEP = 0.05


def check_loads(load: Mapping[int, float]) -> dict[int, float]:
    """The loads as plain floats; ValueError naming the GPU for a load outside 0..1 or not a number."""
    out: dict[int, float] = {}
    for gpu_id, value in load.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"load of GPU {gpu_id} must be a ratio from 0 to 1, got {value!r}")
        out[int(gpu_id)] = float(value)
    return out


def load_score(load: Mapping[int, float]) -> ScoreFn:
    """A spread score with the GPU's measured load (a step count) in front; GPUs without a load count as idle."""
    loads = check_loads(load)

    def score(host: HostView, gpu: GpuView, after: Occupancy, profile: str, start: int) -> Score:
        """Load steps, then spread's keys; smaller is better."""
        steps = math.floor(loads.get(gpu.gpu_id, 0.0) / LOAD_STEP + 1e-9)
        used = 1 - gpu.occupancy.free_units / gpu.occupancy.geometry.axis
        return (float(steps), used, -host.free_vcpus, host.order, gpu.gpu_id, start)

    return score


def make_with_load(load: Mapping[int, float]) -> Policy:
    """The policy weighing these measured loads (store GPU id -> 0..1)."""
    return Policy(NAME, load_score(load), CandidateOrder.EMPTIEST_FIRST, DESCRIPTION)


def make(demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy with no loads measured (it then places as spread does); it ignores the demand and supply."""
    return make_with_load({})


POLICY = PolicyDef(NAME, DESCRIPTION, make)
