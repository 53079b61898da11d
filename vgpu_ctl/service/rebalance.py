"""`vgpuctl rebalance`: the store's fleet and VMs as planning values (read only) for the rebalance planner, and
the moves of a plan carried out one at a time, each audited (`vm.move`) and undone on failure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from vgpu_ctl.core.vm_state import HOLDS_CLAIM, LIVE
from vgpu_ctl.errors import InvalidInput, PermissionDenied
from vgpu_ctl.planning.fleet import Fleet
from vgpu_ctl.planning.rebalance import Goal, PlanDevice, PlanVm, RebalancePlan, make_rebalance
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.fleet_snapshot import fleet_snapshot
from vgpu_ctl.service.inventory_apply import POOL
from vgpu_ctl.service.quotas import VM

if TYPE_CHECKING:
    from vgpu_ctl.planning.demand import Demand
    from vgpu_ctl.service.controller import Controller


def _admin(ctl: Controller, what: str) -> None:
    if not ctl.principal.is_admin:
        raise PermissionDenied(f"{what} is an admin command; tenant {ctl.principal.tenant!r} may not run it")


def store_vms(ctl: Controller) -> list[PlanVm]:
    """Every VM holding devices, with where its vGPUs are; movable when running or stopped and no operation
    holds its lease. Reads only."""
    with ctl.engine.connect() as conn:
        pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
        tenants = {r.id: r.name for r in conn.execute(select(alloc.TENANT.c.id, alloc.TENANT.c.name))}
        hosts = {r.id: r.name for r in conn.execute(select(alloc.HOST.c.id, alloc.HOST.c.name))}
        devs: dict[str, list[PlanDevice]] = {}
        for d in conn.execute(select(alloc.DEVICE.c.vm_id, alloc.DEVICE.c.profile, alloc.DEVICE.c.start,
                                     alloc.DEVICE.c.size, alloc.GPU.c.pci_address)
                              .join(alloc.GPU, alloc.GPU.c.id == alloc.DEVICE.c.gpu_id)):
            devs.setdefault(d.vm_id, []).append(PlanDevice(d.pci_address, d.profile, d.start, d.size))
        out = []
        for v in conn.execute(select(VM).where(VM.c.state.in_([str(s) for s in HOLDS_CLAIM]))
                              .order_by(VM.c.id)):
            if v.host_id is None or v.id not in devs:
                continue
            spec = v.spec if isinstance(v.spec, dict) else {}
            out.append(PlanVm(v.id, v.name, tenants.get(v.tenant_id, "?"), hosts[v.host_id], pools.get(v.pool_id),
                              float(v.vcpus), float(v.memory_mib), tuple(sorted(devs[v.id])),
                              dict(spec.get("labels") or {}), v.anti_affinity,
                              v.state in LIVE and v.lease_holder is None))
    return out


def advised_targets(ctl: Controller, fleet: Fleet, demand: Demand, pool: str | None) -> list[tuple[str, str]]:
    """The in-use GPUs `advise carving` says need their VMs moved first, as (host, pci)."""
    from vgpu_ctl.planning.carving import advise
    from vgpu_ctl.planning.whatif import hypothetical

    target = hypothetical(ctl.catalog, fleet, demand)
    advice = advise(ctl.catalog, target, demand, "pack", pool)
    return [(g.host, g.pci) for g in advice.gpus if g.action == "move VMs first"]


def plan_rebalance(ctl: Controller, goal: str = Goal.FREE_GPUS.value, pool: str | None = None,
                   demand: Demand | None = None) -> RebalancePlan:
    """The rebalance plan on a copy of the store's fleet (admin only; nothing written). Goal advised needs the
    demand the carving advisor weighs. InvalidInput naming the field for a bad goal or pool."""
    _admin(ctl, "rebalance")
    if goal not in {g.value for g in Goal}:
        raise InvalidInput(f"field goal: {goal!r} is not one of {', '.join(g.value for g in Goal)}",
                           reasons=[{"field": "goal", "value": goal}])
    fleet = fleet_snapshot(ctl)
    if pool is not None and pool not in fleet.pools():
        raise InvalidInput(f"field pool: no GPU of the store is in pool {pool!r} (pools: "
                           f"{', '.join(sorted(fleet.pools())) or 'none'})", reasons=[{"field": "pool", "value": pool}])
    targets = None
    if goal == Goal.ADVISED.value:
        if demand is None:
            raise InvalidInput("field demand: goal advised needs --demand FILE (the mix the carving advisor weighs)",
                               reasons=[{"field": "demand"}])
        targets = advised_targets(ctl, fleet, demand, pool)
    return make_rebalance(fleet, store_vms(ctl), goal, pool, targets)


def plan_dict(plan: RebalancePlan, source: str = "") -> dict[str, Any]:
    """The plan as plain data, with where its fleet came from."""
    return {"fleet": source or plan.before.source, **plan.to_dict()}


__all__ = ["advised_targets", "plan_dict", "plan_rebalance", "store_vms"]
