"""What placement works on: candidate views of hosts and GPUs, requests, plans, typical task shapes, and what a
policy is (its score, host cost and the candidate order it wants from the store)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from vgpu_ctl.core.geometry import Occupancy


@dataclass(frozen=True, slots=True)
class GpuView:
    """A candidate GPU as placement sees it."""

    gpu_id: int
    pci: str
    occupancy: Occupancy
    pool: str | None = None
    lacks: frozenset[str] = frozenset()  # profiles its host has no type id for: never placed there


@dataclass(frozen=True, slots=True)
class HostView:
    """A candidate host with its free vCPUs and memory (after overcommit) and its candidate GPUs."""

    host_id: int
    name: str
    free_vcpus: float
    free_memory_mib: float
    gpus: tuple[GpuView, ...]
    state: str = "active"
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: frozenset[str] = frozenset()
    order: int = 0  # fixed host order for deterministic tie-breaks
    gpu_count: int | None = None  # all the host's GPUs, when `gpus` is the whole host (None: maybe only some)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a VM needs: one profile name per vGPU, vCPUs, memory, labels, anti-affinity group."""

    profiles: tuple[str, ...]
    vcpus: int
    memory_mib: int
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: str | None = None


@dataclass(frozen=True, slots=True)
class DevicePlacement:
    """One vGPU's chosen GPU and position."""

    gpu_id: int
    profile: str
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Where a VM goes."""

    host_id: int
    host: str
    devices: tuple[DevicePlacement, ...]
    occupancies: Mapping[int, Occupancy]  # each touched GPU's occupancy after the plan


@dataclass(frozen=True, slots=True)
class TaskShape:
    """A typical request of a demand mix: its profile (one per GPU model it may use), GPU count, vCPUs, memory, and
    the GPU models it may run on (None: any model that offers one of its profiles)."""

    profiles: tuple[str, ...]  # on a GPU, the first of them its geometry offers
    gpus: int = 1
    vcpus: float = 0.0
    memory_mib: float = 0.0
    models: frozenset[str] | None = None


# What a pool's requests look like: profile (a one-GPU request needing no vCPUs or memory) or task shape -> weight.
Demand = Mapping[str, float] | Mapping[TaskShape, float]

Score = tuple[float, ...]
# A policy scores placing `profile` at `start` on a GPU: smaller is better. It sees the GPU before and after.
ScoreFn = Callable[[HostView, GpuView, Occupancy, str, int], Score]
# The cost of a draft plan on one host: given the GPUs the draft changed so far (GPU id -> occupancy after), one more
# GPU `gid` and its occupancy after, a number (smaller is better).
PlanCost = Callable[[Mapping[int, Occupancy], int, Occupancy], float]
# A host-aware policy prices the drafts of a request on a host; positions are ranked by that cost, then by the score.
HostCostFn = Callable[[HostView, PlacementRequest], PlanCost]


class CandidateOrder(StrEnum):
    """The order in which the store hands a policy its candidate GPUs (pages of the candidate index), so that
    the first page holds the positions the policy prefers."""

    FULLEST_FIRST = "fullest-first"  # least free space first, then host order
    EMPTIEST_FIRST = "emptiest-first"  # most free space first, then host order
    HOST_ORDER = "host-order"  # the order hosts and GPUs were declared in


@dataclass(frozen=True)
class Policy:
    """A placement policy: a score for each feasible position (after a host cost, if it has one); the smallest wins.
    `order` is the candidate order it wants from the store."""

    name: str
    score: ScoreFn
    order: CandidateOrder
    description: str = ""
    host_cost: HostCostFn | None = None
