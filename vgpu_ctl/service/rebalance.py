"""`vgpuctl rebalance`: the store's fleet and VMs as planning values (read only) for the rebalance planner, and
the moves of a plan carried out one at a time, each audited (`vm.move`) and undone on failure; each move's
progress is kept in the store (`vm_move`), so reconcile finishes or rolls back one a crash interrupted."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.backings import backing_for
from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement import DevicePlacement, PlacementPlan
from vgpu_ctl.core.vm_state import HOLDS_CLAIM, LIVE, VmState
from vgpu_ctl.errors import Conflict, HostError, InvalidInput, PermissionDenied, VgpuCtlError
from vgpu_ctl.planning.fleet import Fleet
from vgpu_ctl.planning.rebalance import Goal, Move, PlanDevice, PlanVm, RebalancePlan, make_rebalance
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.fleet_snapshot import fleet_snapshot
from vgpu_ctl.service.leases import Renewal, is_held, new_holder, take
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.hosts import HostRow
from vgpu_ctl.store.moves import HeldDevice, PendingMove, TargetGpu
from vgpu_ctl.store.vms import VmRow

if TYPE_CHECKING:
    from vgpu_ctl.planning.demand import Demand
    from vgpu_ctl.service.controller import Controller

CRASH_ENV = "VGPU_CTL_FAULT_MOVE"  # tests only: a move point (stopped, claimed, ...) where the process kills itself


def _admin(ctl: Controller, what: str) -> None:
    if not ctl.principal.is_admin:
        raise PermissionDenied(f"{what} is an admin command; tenant {ctl.principal.tenant!r} may not run it")


def store_vms(ctl: Controller) -> list[PlanVm]:
    """Every VM holding devices, with where its vGPUs are; movable when running or stopped and no operation
    holds its lease. Reads only."""
    with ctl.read() as conn:
        pools = {i: n for n, i in STORE.inventory.pool_ids(conn).items()}
        tenants = {t.id: t.name for t in STORE.tenants.tenant_rows(conn)}
        hosts = {h.id: h.name for h in STORE.hosts.host_rows(conn)}
        devs: dict[str, list[PlanDevice]] = {}
        for d in STORE.moves.placed_devices(conn):
            devs.setdefault(d.vm_id, []).append(PlanDevice(d.pci_address, d.profile, d.start, d.size))
        vms = sorted((v for v in STORE.vms.all_vms(conn) if v.state in HOLDS_CLAIM), key=lambda v: v.id)
    out = []
    for v in vms:
        if v.host_id is None or v.id not in devs:
            continue
        spec = v.spec if isinstance(v.spec, dict) else {}
        out.append(PlanVm(v.id, v.name, tenants.get(v.tenant_id, "?"), hosts[v.host_id],
                          None if v.pool_id is None else pools.get(v.pool_id),
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


__all__ = ["advised_targets", "apply_moves", "move_vm", "pending_moves", "plan_dict", "plan_rebalance", "resume_move",
           "settle_moves", "store_vms", "undo_move"]


# -- carrying a plan out ------------------------------------------------------------------------------------------

def _side(host: str, devs: Sequence[PlanDevice]) -> dict[str, Any]:
    return {"host": host, "devices": [{"pci": d.pci, "profile": d.profile, "start": d.start} for d in devs]}


def _words(host: str, devs: Sequence[PlanDevice]) -> str:
    return f"{host} " + " ".join(d.text() for d in devs)


def apply_moves(ctl: Controller, moves: Sequence[Move]) -> dict[str, Any]:
    """Carry the moves out in order, one at a time (`move_vm`); at the first that fails (undone: its VM runs
    where it was) stop, as the later moves were planned on the fleet the failed one would have left. Admin only.
    Returns the moves done, the one that failed (or None) and how many were not tried."""
    _admin(ctl, "rebalance --apply")
    applied: list[dict[str, Any]] = []
    for n, m in enumerate(moves):
        try:
            move_vm(ctl, m)
        except VgpuCtlError as exc:
            return {"applied": applied, "failed": {"vm": m.vm, "name": m.name, "tenant": m.tenant,
                                                   "error": exc.message, "code": exc.code},
                    "not_tried": len(moves) - n - 1, "done": False}
        applied.append({"vm": m.vm, "name": m.name, "tenant": m.tenant, "from": _words(m.from_host, m.from_devices),
                        "to": _words(m.to_host, m.to_devices)})
    return {"applied": applied, "failed": None, "not_tried": 0, "done": True}


def undo_move(ctl: Controller, vm_ref: str) -> dict[str, Any]:
    """Move a VM back to where its last rebalance move took it from (admin): its latest `vm.move` that succeeded,
    reversed, carried out as any move is (`move_vm`: stop, re-place, start, audited as `vm.move` with `undoes`,
    undone on failure). InvalidInput naming the field when the VM was never moved; Conflict (nothing changed)
    when it changed or moved since, or its old positions are taken. The move done, as `apply_moves` lists it."""
    _admin(ctl, "rebalance --undo")
    vm = ctl.get_vm(vm_ref)
    with ctl.read() as conn:
        ev = STORE.moves.last_move(conn, vm.id)
    if ev is None:
        raise InvalidInput(f"field vm: VM {vm.tenant}/{vm.name} was never moved by rebalance; nothing to undo",
                           reasons=[{"field": "vm", "value": vm_ref}])
    size = {d.profile: d.size for d in vm.devices}  # a VM moves with its profiles: each keeps its size

    def side(key: str) -> tuple[str, tuple[PlanDevice, ...]]:
        got = ev.params[key]
        return got["host"], tuple(sorted(PlanDevice(d["pci"], d["profile"], int(d["start"]),
                                                     size.get(d["profile"], 0)) for d in got["devices"]))

    (now_host, now_devs), (back_host, back_devs) = side("to"), side("from")
    back = Move(vm.id, vm.name, vm.tenant, now_host, now_devs, back_host, back_devs, "")
    with ctl.read() as conn:  # taken since: refused before the VM is stopped
        row = STORE.vms.vm_row(conn, vm.id)
        _check_to(ctl, conn, None if row is None else row.pool_id, back)
    move_vm(ctl, back, undoes=ev.id)
    return {"vm": vm.id, "name": vm.name, "tenant": vm.tenant, "undoes": ev.id,
            "from": _words(now_host, now_devs), "to": _words(back_host, back_devs)}


def _check_from(vm: VmRow, host: HostRow, devs: Sequence[HeldDevice], m: Move) -> None:
    now = tuple(sorted(PlanDevice(d.pci_address, d.profile, d.start, d.size) for d in devs))
    if vm.state not in LIVE or host.name != m.from_host or now != tuple(sorted(m.from_devices)):
        raise Conflict(f"VM {m.tenant}/{m.name} changed since the plan was made (it is {vm.state} on {host.name}); "
                       "plan again", reasons=[{"vm": m.vm, "state": vm.state, "host": host.name}])


def _check_to(ctl: Controller, conn: Tx, pool_id: int | None,
              m: Move) -> tuple[HostRow, dict[int, TargetGpu], dict[int, Occupancy], list[DevicePlacement]]:
    """Whether the move's new positions fit now, read in `conn`: the new host, its GPU rows and occupancies with
    the positions placed, by GPU id, and the placements. Conflict when the host is gone, a GPU is not in the
    VM's pool (`pool_id`), or a position is taken or not allowed there."""
    new_host = STORE.hosts.host_named(conn, m.to_host)
    if new_host is None:
        raise Conflict(f"host {m.to_host} is gone; plan again", reasons=[{"host": m.to_host}])
    gpus = {g.gpu.pci_address: g for g in STORE.moves.host_gpus(conn, new_host.id)}
    placed: list[DevicePlacement] = []
    occs: dict[int, Occupancy] = {}
    rows: dict[int, TargetGpu] = {}
    for d in m.to_devices:
        g = gpus.get(d.pci)
        if g is None or g.gpu.pool_id != pool_id:
            raise Conflict(f"GPU {m.to_host}/{d.pci} is not in the VM's pool; plan again",
                           reasons=[{"gpu": f"{m.to_host}/{d.pci}"}])
        rows[g.id] = g
        occ = occs.get(g.id) or alloc.occupancy_of(ctl.catalog, g.gpu.occupancy_row())
        why = occ.check(d.profile, d.start)
        if why is not None:
            raise Conflict(f"{d.profile} at {d.start} on {m.to_host}/{d.pci} no longer fits ({why}); plan again",
                           reasons=[{"gpu": f"{m.to_host}/{d.pci}", "reason": str(why)}])
        occs[g.id] = occ.placed(d.profile, d.start)
        placed.append(DevicePlacement(g.id, d.profile, d.start, occs[g.id].geometry.shapes[d.profile].size))
    return new_host, rows, occs, placed


def _claim_new(ctl: Controller, conn: Tx, vm: VmRow, old_host: HostRow, m: Move) -> tuple[HostRow, list[str]]:
    """Claim the move's new positions for the VM beside its old ones (inside the caller's transaction): the
    new host's vCPUs and memory when it is another host, each GPU's positions by compare-and-set, and device
    rows. Quota is not charged: the VM's charge moves with it. Conflict when a position is taken or not allowed
    there, or the host lacks room."""
    new_host, rows, occs, placed = _check_to(ctl, conn, vm.pool_id, m)
    try:
        if new_host.id != old_host.id:
            alloc.claim_host(conn, new_host.id, vm.vcpus, vm.memory_mib)
        for gid in sorted(occs):  # GPU rows in id order, as claims lock them
            alloc.write_gpu(conn, gid, rows[gid].version, occs[gid])
    except alloc.ClaimConflict:
        raise Conflict(f"host {m.to_host} changed (no room for VM {m.name}, or a GPU was claimed meanwhile); "
                       "plan again", reasons=[{"host": m.to_host}]) from None
    chosen = PlacementPlan(new_host.id, new_host.name, tuple(placed), occs)
    backing = {d.gpu_id: backing_for(occs[d.gpu_id].geometry.shapes[d.profile].kind.value,
                                     new_host.vgpu_backing).value for d in placed}
    made = alloc.insert_devices(conn, vm.id, chosen, backing)
    return new_host, [r["id"] for r in made]


def _crash_point(point: str) -> None:
    """Tests only: kill this process (as kill -9 would) at `point` of a move when VGPU_CTL_FAULT_MOVE names it."""
    if os.environ.get(CRASH_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def move_vm(ctl: Controller, m: Move, undoes: int | None = None) -> None:
    """Move one VM as the plan says, under its lease: stop it (gracefully, then forced after the grace period),
    claim the new positions beside the old ones, create its devices and define its domain there, start it (when
    it was running), then free the old claim (host side, then store) and record `vm.move` with from and to.
    Each step's progress is kept in `vm_move` in that step's transaction, so reconcile can finish or undo a move
    a crash interrupted (`resume_move`); `undoes`: the event of the move this one reverses (`undo_move`), kept
    in vm.move's params. If a step before the start fails, what the new place got is undone, the
    old claim is kept, the VM is started where it was, `vm.move` is recorded as failed, and HostError (Conflict
    when the store changed) is raised."""
    from vgpu_ctl.service.provision import device_spec, domain_name, render_vm
    from vgpu_ctl.service.scheduling import grace_stop, settings

    holder = new_holder()
    with ctl.tx() as conn:
        vm = take(conn, m.vm, holder, LIVE, what="move")
        if vm is None:
            raise Conflict(f"VM {m.tenant}/{m.name} is gone or busy; plan again", reasons=[{"vm": m.vm}])
        assert vm.host_id is not None  # a running or stopped VM holds its claim on a host
        old_host = STORE.moves.host_row(conn, vm.host_id)
        old_devs = STORE.moves.held_devices(conn, vm.id)
        _check_from(vm, old_host, old_devs, m)  # raised here, the lease is not taken (the transaction rolls back)
        grace_s = settings(conn)["grace_s"]
        params = {"name": vm.name, "from": _side(m.from_host, m.from_devices), "to": _side(m.to_host, m.to_devices),
                  "frees": m.frees, **({} if undoes is None else {"undoes": undoes})}
        STORE.moves.add_move(conn, vm.id, old_host.id, [d.id for d in old_devs], vm.state == VmState.RUNNING,
                             params)
    name = domain_name(vm)
    was_running = vm.state == VmState.RUNNING
    new_host: HostRow | None = None
    new_ids: list[str] = []
    ready: list[HeldDevice] = []
    tried = defined = started = False
    with Renewal(ctl, vm.id, holder):
        try:
            if was_running:
                grace_stop(ctl, old_host, name, grace_s)
            _crash_point("stopped")
            with ctl.tx() as conn:
                new_host, new_ids = _claim_new(ctl, conn, vm, old_host, m)
                STORE.moves.set_move_step(conn, vm.id, "claimed", to_host_id=new_host.id, new_devices=new_ids)
            _crash_point("claimed")
            new_driver = ctl.hosts.get(new_host)
            with ctl.read() as conn:
                new_devs = [d for d in STORE.moves.held_devices(conn, vm.id) if d.id in new_ids]
            for dev in new_devs:
                spec = device_spec(ctl, dev)
                handle = new_driver.create_device(spec)
                ready.append(dev)
                with ctl.tx() as conn:
                    STORE.vms.set_devices_ready(conn, {dev.id: {
                        "backing": handle.backing.value, "uuid": handle.uuid, "pci_address": handle.pci_address,
                        "gpu_instance_id": handle.gpu_instance_id}})
            _crash_point("created")
            with ctl.read() as conn:
                xml = render_vm(ctl, conn, vm.id, only=new_ids)
            tried = True  # another host may hold a domain from here on (undone by undefining it there)
            dom_uuid = new_driver.define_domain(xml)
            defined = True  # on the same host, the old definition is replaced from here on
            _crash_point("defined")
            with ctl.tx() as conn:
                STORE.moves.set_move_step(conn, vm.id, "defined", domain_uuid=dom_uuid)
            if was_running:
                started = True
                new_driver.start_domain(name)
            _crash_point("started")
            with ctl.tx() as conn:
                STORE.moves.set_move_step(conn, vm.id, "done")
            _crash_point("done")
        except Exception as exc:
            error = exc.message if isinstance(exc, VgpuCtlError) else f"{type(exc).__name__}: {exc}"
            _undo_move(ctl, vm, old_host, new_host, new_ids, ready, (tried, defined, started), was_running, holder,
                       error, params)
            if isinstance(exc, Conflict):
                raise
            raise HostError(f"moving VM {m.tenant}/{m.name} to {m.to_host} failed and was undone (it is "
                            f"{'running' if was_running else 'stopped'} where it was): {error}",
                            reasons=[{"vm": m.vm, "host": m.to_host}]) from exc
        _finish_move(ctl, vm, old_host, new_host, old_devs, dom_uuid, holder, {**params, "running": was_running})


def _finish_move(ctl: Controller, vm: VmRow, old_host: HostRow, new_host: HostRow, old_devs: Sequence[HeldDevice],
                 dom_uuid: str | None, holder: str, params: dict[str, Any], note: str | None = None) -> None:
    """The VM runs (or is defined) at its new place: the old claim goes, host side first (errors noted, nothing
    undone), then in one transaction the old devices and host room, the VM's new place, the move's row, and
    `vm.move` (with `note`, when reconcile finished it)."""
    from vgpu_ctl.service.provision import domain_name, remove_devices

    old_driver = ctl.hosts.get(old_host)
    errors = [note] if note else []
    if new_host.id != old_host.id:
        try:
            old_driver.undefine_domain(domain_name(vm))
        except Exception as exc:
            errors.append(f"undefine domain on {old_host.name}: {exc}")
    errors += remove_devices(ctl, old_driver, old_devs)
    _crash_point("removed")
    with ctl.tx() as conn:
        alloc.free_devices(conn, ctl.catalog, [d._asdict() for d in old_devs])
        if new_host.id != old_host.id:
            alloc.release_host(conn, old_host.id, vm.vcpus, vm.memory_mib)
        STORE.moves.end_move(conn, vm.id, holder, {"host_id": new_host.id, "domain_uuid": dom_uuid})
        tenant = STORE.tenants.tenant_name(conn, vm.tenant_id)
        record(conn, ctl.principal.actor, "vm.move", f"vm:{vm.id}", tenant=tenant, error="; ".join(errors) or None,
               params=params)


def _undo_move(ctl: Controller, vm: VmRow, old_host: HostRow, new_host: HostRow | None, new_ids: Sequence[str],
               ready: Sequence[HeldDevice],
               steps: tuple[bool, bool, bool], was_running: bool, holder: str, error: str,
               params: dict[str, Any]) -> list[str]:
    """Take back what a failed move gave the new place (domain, devices, claim) and start the VM where it was
    (unless it runs there already); `steps`: whether the new domain's definition was tried, done, and its start
    tried. The VM's state, lease and move row, and `vm.move` failed with `error` and what could not be undone, in
    one last transaction. What could not be done, in words (each step still tried)."""
    from vgpu_ctl.service.provision import domain_name, remove_devices, render_vm

    notes: list[str] = []
    name = domain_name(vm)
    if new_host is not None:
        new_driver = ctl.hosts.get(new_host)
        same = new_host.id == old_host.id
        tried, defined, started = steps
        if started:
            try:
                new_driver.stop_domain(name, force=True)
            except Exception as exc:
                notes.append(f"stop on {new_host.name}: {exc}")
        if (defined and same) or (tried and not same):
            try:
                if same:  # the same domain: its old definition back
                    with ctl.read() as conn:
                        old_ids = [d.id for d in STORE.moves.held_devices(conn, vm.id) if d.id not in new_ids]
                        xml = render_vm(ctl, conn, vm.id, only=old_ids)
                    new_driver.define_domain(xml)
                else:
                    new_driver.undefine_domain(name)
            except Exception as exc:
                notes.append(f"domain on {new_host.name}: {exc}")
        notes += remove_devices(ctl, new_driver, ready, on=new_host.name)
        if new_ids:
            with ctl.tx() as conn:
                rows = [d._asdict() for d in STORE.moves.held_devices(conn, vm.id) if d.id in new_ids]
                alloc.free_devices(conn, ctl.catalog, rows)
                if not same:
                    alloc.release_host(conn, new_host.id, vm.vcpus, vm.memory_mib)
    start_failed = False
    if was_running:
        old_driver = ctl.hosts.get(old_host)
        try:
            if not any(d.name == name and d.active for d in old_driver.list_domains()):
                old_driver.start_domain(name)
        except Exception as exc:
            notes.append(f"start on {old_host.name}: {exc}")
            start_failed = True
    with ctl.tx() as conn:
        STORE.moves.end_move(conn, vm.id, holder, {"state": VmState.STOPPED.value if start_failed else vm.state})
        tenant = STORE.tenants.tenant_name(conn, vm.tenant_id)
        record(conn, ctl.principal.actor, "vm.move", f"vm:{vm.id}", tenant=tenant, result="failed",
               error=error + ("; undo: " + "; ".join(notes) if notes else ""), params=params)
    return notes


# -- moves a crash interrupted -----------------------------------------------------------------------------------

def pending_moves(conn: Tx) -> list[PendingMove]:
    """Every move under way or interrupted, with its VM's name, state and lease, and the hosts' names."""
    return STORE.moves.pending_moves(conn)


def settle_moves(ctl: Controller) -> dict[str, str]:
    """Settle every move whose process stopped (admin; `resume_move` each, one failing does not stop the others):
    the server's leader runs it on every tick, so a VM is left between two places for seconds, not until the next
    reconcile. Per VM settled, "finished", "rolled back", or why it could not be."""
    with ctl.read() as conn:
        stopped = [mv.vm_id for mv in pending_moves(conn) if not is_held(mv.lease_holder, mv.lease_expires)]
    out = {}
    for vm_id in stopped:
        try:
            out[vm_id] = resume_move(ctl, vm_id)
        except Exception as exc:  # taken meanwhile (a reconcile, another leader), or a host failing: said
            out[vm_id] = exc.message if isinstance(exc, VgpuCtlError) else f"{type(exc).__name__}: {exc}"
    return out


def resume_move(ctl: Controller, vm_id: str) -> str:
    """Settle a move whose process stopped (admin; its VM's lease no longer held): from step `done` finish it
    (the old claim goes), before that roll it back (what the new place got goes, the VM starts where it was, as
    it was). Either way the VM ends on exactly one placement, with `vm.move` recorded. "finished" or "rolled
    back"; Conflict when a live process still holds the VM, when it is no longer running or stopped, or when
    no move of it is recorded."""
    from vgpu_ctl.service.provision import domain_name

    _admin(ctl, "reconcile")
    holder = new_holder()
    with ctl.tx() as conn:
        mv = STORE.moves.move_row(conn, vm_id)
        if mv is None:
            raise Conflict(f"no move of VM {vm_id} is recorded", reasons=[{"vm": vm_id}])
        vm = take(conn, vm_id, holder, LIVE, what="finish the move of")
        if vm is None:
            raise Conflict(f"VM {vm_id} is no longer running or stopped", reasons=[{"vm": vm_id}])
        old_host = STORE.moves.host_row(conn, mv.from_host_id)
        new_host = None if mv.to_host_id is None else STORE.moves.host_row(conn, mv.to_host_id)
        devs = STORE.moves.held_devices(conn, vm_id)
    note = f"interrupted at step {mv.step} (its process stopped); "
    with Renewal(ctl, vm_id, holder):
        if mv.step == "done":
            assert new_host is not None  # recorded with step claimed, before done
            _finish_move(ctl, vm, old_host, new_host, [d for d in devs if d.id in mv.old_devices], mv.domain_uuid,
                         holder, {**mv.params, "running": mv.was_running}, note + "finished by reconcile")
            return "finished"
        new = [d for d in devs if d.id in mv.new_devices]
        steps = (False, False, False)
        if new_host is not None:
            driver = ctl.hosts.get(new_host)
            on_host = {d.uuid for d in driver.list_devices()}
            new = [d for d in new if d.uuid in on_host]  # only what was made there; the rest is store only
            there = [d for d in driver.list_domains() if d.name == domain_name(vm)]
            same = new_host.id == old_host.id
            # the same host: its old definition back whatever the step; another: only a domain it has. Past the
            # claim the old domain was stopped, so a domain running there now runs the new devices: stopped.
            steps = (bool(there) or same, bool(there) or same, any(d.active for d in there))
        _undo_move(ctl, vm, old_host, new_host, list(mv.new_devices), new, steps, mv.was_running, holder,
                   note + "rolled back by reconcile", mv.params)
        return "rolled back"
