"""Ranked placement candidates: every host a VM request could go to, in the order the pools' policies rank
them, and why not for the others (nothing is claimed)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from .deps import controller, principal_of
from .problems import problem_responses
from .routes_vms import _tenant_of
from .schemas import VmCreate

router = APIRouter(prefix="/v1", tags=["vms"], responses=problem_responses(400, 401, 403, 404),
                   dependencies=[Depends(principal_of)])


class CandidateDevice(BaseModel):
    """Where one vGPU would go on the host."""

    gpu: str
    profile: str
    start: int
    size: int


class PlacementCandidate(BaseModel):
    """One host for the request: its rank in its pool (1: where the request goes; null: it does not fit), the
    policy's score (smaller is better), the positions, or why not."""

    pool: str
    host: str
    rank: int | None
    score: list[float] | None
    devices: list[CandidateDevice]
    why_not: str | None
    reasons: dict[str, int]


@router.post("/placements/candidates", summary="Every host a VM could go to, ranked, with reasons",
             response_model=list[PlacementCandidate])
def candidates(request: Request, body: VmCreate, limit: int = Query(20)) -> list[PlacementCandidate]:
    """The hosts of the pools that offer the request, ranked as each pool's policy would (pools in the order
    a request tries them), then those it does not fit with why not; quotas are not applied (see POST
    /v1/placements for a dry run that applies them)."""
    rows = controller(request).placement_candidates(
        _tenant_of(request, body), [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
        memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
        limit=limit)
    return [PlacementCandidate.model_validate(r) for r in rows]
