"""The SQL store: the store modules of this package, one per aggregate, gathered as the one object the
service's `Store` protocol (service/ports.py) describes. mypy checks each module against its protocol where
the service binds this object."""

from __future__ import annotations

from typing import Final

from vgpu_ctl.store import (
    candidate_pages,
    candidates,
    charges,
    claims,
    events,
    fit_masks,
    fleet,
    gpu_loads,
    host_types,
    hosts,
    idempotency,
    inventory,
    leader_lease,
    moves,
    operations,
    quotas,
    reports,
    scheduling,
    tenants,
    tokens,
    utilization,
    vm_sched,
    vms,
)


class SqlStore:
    """The store on SQLite or PostgreSQL: each attribute one aggregate's functions, each taking the unit of
    work (`vgpu_ctl.store.unit.Tx`) it runs in."""

    tokens: Final = tokens
    candidates: Final = candidates
    candidate_pages: Final = candidate_pages
    charges: Final = charges
    claims: Final = claims
    events: Final = events
    fit_masks: Final = fit_masks
    fleet: Final = fleet
    gpu_loads: Final = gpu_loads
    host_types: Final = host_types
    hosts: Final = hosts
    idempotency: Final = idempotency
    inventory: Final = inventory
    leader_lease: Final = leader_lease
    moves: Final = moves
    operations: Final = operations
    quotas: Final = quotas
    reports: Final = reports
    scheduling: Final = scheduling
    tenants: Final = tenants
    utilization: Final = utilization
    vms: Final = vms
    vm_sched: Final = vm_sched


__all__ = ["SqlStore"]
