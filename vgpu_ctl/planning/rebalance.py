"""The rebalance planner: moves of VMs (stop, re-place, start) that would empty whole GPUs or hosts, on a copy.

Input: a planning Fleet (each GPU's occupancy, each host's free vCPUs and memory) and the VMs holding its devices
(`PlanVm`: where each vGPU sits). Output: a `RebalancePlan`, an ordered list of `Move`s and what they free, each
freed GPU (or host) with the VMs touched to free it.

The search is greedy and never touches the input:
- targets are the in-use GPUs (goal free-gpus), the hosts holding VMs (free-hosts), or the in-use GPUs the carving
  advisor wants re-carved (advised: the caller passes them as `targets`); only GPUs of `pool` with that option;
- targets are tried in order of fewest VMs to move, then least occupied; a target is taken only when every VM
  on it finds a new place, else the attempt is undone and the next target is tried;
- a VM moves whole (all its vGPUs together, as placement places it), stays in its pool, keeps its profiles, and
  lands where `core.placement.plan` (pack, fragmentation-aware, so that a move cuts least of what the GPUs can still
  take; the real geometry: MIG starts and slices, mixed-size placement ids,
  one type per equal-size GPU, fixed MIG layouts, host vCPUs, memory, labels, anti-affinity, host state) puts it,
  among the GPUs that are not a target being freed or already freed and that already hold devices (free-gpus,
  advised) or are on hosts that already hold VMs (free-hosts): a move never takes an empty GPU (host) to free
  another;
- a VM moves at most once, and only VMs that are running or stopped with no operation on them (`movable`);
  a target holding another VM is left alone.
So each freed GPU (host) costs exactly the VMs that held devices on it when its turn came: no plan frees it by
moving fewer. `replay_moves` applies a plan's moves to a copy of the fleet with the geometry's checks, and is
what the tests and the service use to check a plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from vgpu_ctl.core.geometry import Occupancy
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.planning.fleet import Fleet, PlanGpu

POLICY = "pack"  # fragmentation-aware: a moved VM lands where it least cuts what the GPUs can still take


class Goal(StrEnum):
    """What a rebalance frees."""

    FREE_GPUS = "free-gpus"
    FREE_HOSTS = "free-hosts"
    ADVISED = "advised"


@dataclass(frozen=True, slots=True, order=True)
class PlanDevice:
    """One vGPU of a VM: its GPU (by PCI address on the VM's host), profile and position."""

    pci: str
    profile: str
    start: int
    size: int

    def text(self) -> str:
        """`pci:profile@start`."""
        return f"{self.pci}:{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class PlanVm:
    """A VM as the planner sees it: where its vGPUs are, what it needs of a host, whether it may move."""

    id: str
    name: str
    tenant: str
    host: str
    pool: str | None
    vcpus: float
    memory_mib: float
    devices: tuple[PlanDevice, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    anti_affinity: str | None = None
    movable: bool = True


@dataclass(frozen=True, slots=True)
class Move:
    """One VM from its host and positions to new ones, to free `frees` (a `host/pci`, or a host)."""

    vm: str
    name: str
    tenant: str
    from_host: str
    from_devices: tuple[PlanDevice, ...]
    to_host: str
    to_devices: tuple[PlanDevice, ...]
    frees: str

    def to_dict(self) -> dict[str, Any]:
        """The move as plain data."""
        return {"vm": self.vm, "name": self.name, "tenant": self.tenant, "frees": self.frees,
                "from": {"host": self.from_host, "devices": [_dev(d) for d in self.from_devices]},
                "to": {"host": self.to_host, "devices": [_dev(d) for d in self.to_devices]}}


def _dev(d: PlanDevice) -> dict[str, Any]:
    return {"pci": d.pci, "profile": d.profile, "start": d.start, "size": d.size}


def move_from_dict(data: Mapping[str, Any]) -> Move:
    """A Move from its `to_dict` form."""
    def devs(side: Mapping[str, Any]) -> tuple[PlanDevice, ...]:
        """The devices of one side."""
        return tuple(PlanDevice(str(d["pci"]), str(d["profile"]), int(d["start"]), int(d["size"]))
                     for d in side["devices"])
    return Move(str(data["vm"]), str(data["name"]), str(data["tenant"]), str(data["from"]["host"]),
                devs(data["from"]), str(data["to"]["host"]), devs(data["to"]), str(data["frees"]))


@dataclass(frozen=True, slots=True)
class Freed:
    """A GPU (`pci` set) or host freed by the plan, and the VMs moved to free it."""

    host: str
    pci: str | None
    vms: tuple[str, ...]

    @property
    def name(self) -> str:
        """`host/pci`, or the host."""
        return f"{self.host}/{self.pci}" if self.pci else self.host


@dataclass(frozen=True, slots=True)
class Blocked:
    """A target the plan could not free, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class RebalancePlan:
    """The moves in order, what they free, what could not be freed, and the fleet before and after."""

    goal: Goal
    pool: str | None
    moves: tuple[Move, ...]
    freed: tuple[Freed, ...]
    blocked: tuple[Blocked, ...]
    before: Fleet
    after: Fleet

    @property
    def vms_moved(self) -> int:
        """VMs the plan moves (each at most once)."""
        return len(self.moves)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data: summary, freed (with VMs touched each), moves, blocked targets."""
        return {
            "goal": self.goal.value, "pool": self.pool,
            "summary": {"moves": len(self.moves), "vms_moved": self.vms_moved,
                        "gpus_freed": gpus_freed(self.before, self.after),
                        "hosts_freed": hosts_freed(self.before, self.after),
                        "in_use_gpus_before": in_use_gpus(self.before), "in_use_gpus_after": in_use_gpus(self.after),
                        "vms_per_freed": round(self.vms_moved / len(self.freed), 2) if self.freed else 0.0},
            "freed": [{"target": f.name, "host": f.host, "pci": f.pci, "vms_touched": len(f.vms), "vms": list(f.vms)}
                      for f in self.freed],
            "moves": [m.to_dict() for m in self.moves],
            "blocked": [{"target": b.name, "reason": b.reason} for b in self.blocked],
        }


def in_use_gpus(fleet: Fleet) -> int:
    """GPUs of the fleet holding devices."""
    return sum(1 for h in fleet.hosts for g in h.gpus if g.in_use)


def gpus_freed(before: Fleet, after: Fleet) -> int:
    """GPUs in use in `before` and empty in `after` (same hosts and GPUs in the same order)."""
    return sum(1 for hb, ha in zip(before.hosts, after.hosts, strict=True)
               for gb, ga in zip(hb.gpus, ha.gpus, strict=True) if gb.in_use and not ga.in_use)


def hosts_freed(before: Fleet, after: Fleet) -> int:
    """Hosts with a device in `before` and none in `after`."""
    return sum(1 for hb, ha in zip(before.hosts, after.hosts, strict=True)
               if any(g.in_use for g in hb.gpus) and not any(g.in_use for g in ha.gpus))


class _State:
    """The fleet being changed by moves, with an undo log so that a failed attempt leaves no trace."""

    def __init__(self, fleet: Fleet, vms: Sequence[PlanVm]) -> None:
        self.fleet = fleet
        self.host_index = {h.name: i for i, h in enumerate(fleet.hosts)}
        self.gpu_index = [{g.pci: j for j, g in enumerate(h.gpus)} for h in fleet.hosts]
        self.occ: dict[tuple[int, int], Occupancy] = {(i, j): g.occupancy for i, h in enumerate(fleet.hosts)
                                                      for j, g in enumerate(h.gpus)}
        self.room = [[h.free_vcpus, h.free_memory_mib] for h in fleet.hosts]
        self.vms = {v.id: v for v in vms}
        self.where: dict[str, tuple[int, tuple[tuple[int, PlanDevice], ...]]] = {}
        self.holders: dict[tuple[int, int], set[str]] = {}
        self.host_vms: dict[int, set[str]] = {}
        for v in vms:
            hi = self._host(v.host, v.name)
            devs = []
            for d in v.devices:
                gi = self.gpu_index[hi].get(d.pci)
                if gi is None:
                    raise InvalidInput(f"VM {v.name!r}: host {v.host} has no GPU {d.pci} (field devices)",
                                       reasons=[{"field": "devices", "vm": v.name, "value": d.pci}])
                if not any(s.start == d.start and s.profile == d.profile for s in self.occ[(hi, gi)].slots):
                    raise InvalidInput(f"VM {v.name!r}: GPU {v.host}/{d.pci} holds no {d.profile} at {d.start} "
                                       "(field devices)", reasons=[{"field": "devices", "vm": v.name}])
                devs.append((gi, d))
            self._place(v.id, hi, tuple(devs))
        self.log: list[tuple[str, Any, Any]] = []

    def _host(self, name: str, vm: str) -> int:
        hi = self.host_index.get(name)
        if hi is None:
            raise InvalidInput(f"VM {vm!r}: no host {name!r} in the fleet (field host)",
                               reasons=[{"field": "host", "value": name}])
        return hi

    def _place(self, vm_id: str, hi: int, devs: tuple[tuple[int, PlanDevice], ...]) -> None:
        self.where[vm_id] = (hi, devs)
        for gi, _ in devs:
            self.holders.setdefault((hi, gi), set()).add(vm_id)
        self.host_vms.setdefault(hi, set()).add(vm_id)

    def _unplace(self, vm_id: str) -> None:
        hi, devs = self.where.pop(vm_id)
        for gi, _ in devs:
            self.holders[(hi, gi)].discard(vm_id)
        self.host_vms[hi].discard(vm_id)

    def set_occ(self, key: tuple[int, int], occ: Occupancy) -> None:
        """Change one GPU's occupancy (logged)."""
        self.log.append(("occ", key, self.occ[key]))
        self.occ[key] = occ

    def add_room(self, hi: int, vcpus: float, memory: float) -> None:
        """Change a host's free room (logged)."""
        self.log.append(("room", hi, tuple(self.room[hi])))
        self.room[hi][0] += vcpus
        self.room[hi][1] += memory

    def relocate(self, vm_id: str, hi: int, devs: tuple[tuple[int, PlanDevice], ...]) -> None:
        """Record the VM's new place (logged)."""
        self.log.append(("where", vm_id, self.where[vm_id]))
        self._unplace(vm_id)
        self._place(vm_id, hi, devs)

    def mark(self) -> int:
        """A point to undo back to."""
        return len(self.log)

    def undo(self, mark: int) -> None:
        """Undo every change since `mark`, newest first."""
        while len(self.log) > mark:
            kind, key, old = self.log.pop()
            if kind == "occ":
                self.occ[key] = old
            elif kind == "room":
                self.room[key] = list(old)
            else:
                self._unplace(key)
                self._place(key, *old)

    def fleet_now(self) -> Fleet:
        """The fleet as it stands."""
        hosts = []
        for i, h in enumerate(self.fleet.hosts):
            gpus = tuple(PlanGpu(g.pci, g.model, g.pool, self.occ[(i, j)]) for j, g in enumerate(h.gpus))
            hosts.append(replace(h, gpus=gpus, free_vcpus=self.room[i][0], free_memory_mib=self.room[i][1]))
        return replace(self.fleet, hosts=tuple(hosts))


def _vacate(st: _State, vm: PlanVm) -> None:
    hi, devs = st.where[vm.id]
    for gi, d in devs:
        st.set_occ((hi, gi), st.occ[(hi, gi)].remove(d.start))
    st.add_room(hi, vm.vcpus, vm.memory_mib)


def _destinations(st: _State, vm: PlanVm, frozen: Collection[tuple[int, int]], goal: Goal) -> list[HostView]:
    views = []
    for hi, h in enumerate(st.fleet.hosts):
        if goal is Goal.FREE_HOSTS and not st.host_vms.get(hi):
            continue  # an empty host stays empty
        gpus = []
        for gi, g in enumerate(h.gpus):
            occ = st.occ[(hi, gi)]
            if g.pool != vm.pool or (hi, gi) in frozen:
                continue
            if goal is not Goal.FREE_HOSTS and not occ.slots:
                continue  # an empty GPU stays empty
            gpus.append(GpuView(gi, g.pci, occ, g.pool))
        if not gpus:
            continue
        groups = frozenset(a for v in st.host_vms.get(hi, ()) if (a := st.vms[v].anti_affinity))
        views.append(HostView(hi, h.name, st.room[hi][0], st.room[hi][1], tuple(gpus), h.state, h.labels,
                              groups, order=hi))
    return views


def _move(st: _State, vm: PlanVm, frozen: Collection[tuple[int, int]], goal: Goal, frees: str) -> Move | None:
    """Move one VM off its place to the best destination; None (nothing changed) if it fits nowhere."""
    mark = st.mark()
    from_hi, from_devs = st.where[vm.id]
    _vacate(st, vm)
    profiles = tuple(d.profile for d in vm.devices)
    req = PlacementRequest(profiles, round(vm.vcpus), round(vm.memory_mib), dict(vm.labels), vm.anti_affinity)
    chosen = plan(req, _destinations(st, vm, frozen, goal), get_policy(POLICY))
    if chosen is None:
        st.undo(mark)
        return None
    hi = chosen.host_id
    h = st.fleet.hosts[hi]
    for gi, occ in chosen.occupancies.items():
        st.set_occ((hi, gi), occ)
    st.add_room(hi, -vm.vcpus, -vm.memory_mib)
    to = tuple((d.gpu_id, PlanDevice(h.gpus[d.gpu_id].pci, d.profile, d.start, d.size)) for d in chosen.devices)
    st.relocate(vm.id, hi, to)
    return Move(vm.id, vm.name, vm.tenant, st.fleet.hosts[from_hi].name, tuple(sorted(d for _, d in from_devs)),
                h.name, tuple(sorted(d for _, d in to)), frees)


def _order(vms: Sequence[PlanVm]) -> list[PlanVm]:
    """Largest first: they have the fewest places to go."""
    return sorted(vms, key=lambda v: (-sum(d.size for d in v.devices), -v.vcpus, v.name, v.id))


def make_rebalance(fleet: Fleet, vms: Sequence[PlanVm], goal: Goal | str = Goal.FREE_GPUS, pool: str | None = None,
                   targets: Collection[tuple[str, str]] | None = None) -> RebalancePlan:
    """The moves that free whole GPUs (goal free-gpus, or advised with `targets`: the `(host, pci)` GPUs to free)
    or whole hosts (free-hosts), on a copy of the fleet (see the module's docstring); InvalidInput naming the field
    for a bad goal, pool or target."""
    try:
        goal = Goal(goal)
    except ValueError:
        raise InvalidInput(f"field goal: {goal!r} is not one of {', '.join(g.value for g in Goal)}",
                           reasons=[{"field": "goal", "value": str(goal)}]) from None
    if pool is not None and pool not in fleet.pools():
        raise InvalidInput(f"field pool: no GPU of the fleet is in pool {pool!r} (pools: "
                           f"{', '.join(sorted(fleet.pools())) or 'none'})", reasons=[{"field": "pool", "value": pool}])
    if goal is Goal.ADVISED and targets is None:
        raise InvalidInput("field goal: goal advised needs the GPUs the carving advisor wants freed (a demand)",
                           reasons=[{"field": "goal", "value": goal.value}])
    st = _State(fleet, vms)
    wanted: set[tuple[int, int]] | None = None
    if targets is not None:
        wanted = set()
        for host, pci in targets:
            hi = st.host_index.get(host)
            gi = st.gpu_index[hi].get(pci) if hi is not None else None
            if hi is None or gi is None:
                raise InvalidInput(f"field targets: no GPU {host}/{pci} in the fleet",
                                   reasons=[{"field": "targets", "value": f"{host}/{pci}"}])
            wanted.add((hi, gi))
    moved: set[str] = set()
    frozen: set[tuple[int, int]] = set()  # GPUs freed (or being freed): nothing moves onto them
    freed: list[Freed] = []
    blocked: dict[str, str] = {}
    moves: list[Move] = []
    units = [(hi, gi) for hi, h in enumerate(fleet.hosts) for gi, g in enumerate(h.gpus)]
    if goal is Goal.FREE_HOSTS:
        groups = [[(hi, gi) for gi, g in enumerate(h.gpus) if pool is None or g.pool == pool]
                  for hi, h in enumerate(fleet.hosts)]
        # A host is freed when none of its GPUs holds devices; with --pool, only hosts whose GPUs are all the pool's.
        candidates = [(hi, g) for hi, g in enumerate(groups) if g and len(g) == len(fleet.hosts[hi].gpus)]
    else:
        candidates = [(hi, [(hi, gi)]) for hi, gi in units
                      if (pool is None or fleet.hosts[hi].gpus[gi].pool == pool) and (wanted is None or
                                                                                       (hi, gi) in wanted)]
    progress = True
    while progress:  # a target refused early may be freed once others have moved (they only ever fill)
        progress = False
        todo = []
        for hi, gs in candidates:
            holders = set().union(*(st.holders.get(k, set()) for k in gs))
            if holders and not frozen.issuperset(gs):
                used = sum(st.occ[k].geometry.axis - st.occ[k].free_units for k in gs)
                todo.append((len(holders), used, hi, gs[0][1], gs, holders))
        todo.sort(key=lambda t: t[:4])
        for _n, _used, hi, gi0, gs, _ in todo:
            holders = set().union(*(st.holders.get(k, set()) for k in gs))
            name = fleet.hosts[hi].name if goal is Goal.FREE_HOSTS else f"{fleet.hosts[hi].name}/" \
                f"{fleet.hosts[hi].gpus[gi0].pci}"
            if not holders:
                continue
            stuck = sorted(st.vms[v].name for v in holders if v in moved or not st.vms[v].movable)
            if stuck:
                blocked[name] = f"VM {stuck[0]} may not move (busy, or moved once already)"
                continue
            mark = st.mark()
            lock = frozen | set(gs)
            done: list[Move] = []
            for vm in _order([st.vms[v] for v in holders]):
                m = _move(st, vm, lock, goal, name)
                if m is None:
                    where = "host already holding VMs" if goal is Goal.FREE_HOSTS else "GPU already in use"
                    blocked[name] = f"VM {vm.name} ({'+'.join(d.profile for d in vm.devices)}, {vm.vcpus:g} vCPUs, " \
                        f"{vm.memory_mib:g} MiB) fits on no other {where} in pool {vm.pool}"
                    st.undo(mark)
                    done = []
                    break
                done.append(m)
            else:
                frozen.update(gs)
                moves.extend(done)
                moved.update(m.vm for m in done)
                freed.append(Freed(fleet.hosts[hi].name, None if goal is Goal.FREE_HOSTS else
                                   fleet.hosts[hi].gpus[gi0].pci, tuple(m.vm for m in done)))
                blocked.pop(name, None)
                progress = True
    done_names = {f.name for f in freed}
    rest = tuple(Blocked(n, r) for n, r in sorted(blocked.items()) if n not in done_names)
    return RebalancePlan(goal, pool, tuple(moves), tuple(freed), rest, fleet, st.fleet_now())


def replay_moves(fleet: Fleet, vms: Sequence[PlanVm], moves: Sequence[Move]) -> Fleet:
    """The fleet after the moves, each checked by the geometry on the way (the VM's devices where the move says
    they are, each new position free and allowed, the new host's vCPUs and memory); InvalidInput naming the move
    that does not hold."""
    st = _State(fleet, vms)
    for n, m in enumerate(moves, 1):
        vm = st.vms.get(m.vm)
        if vm is None or vm.id not in st.where:
            raise InvalidInput(f"move {n}: no VM {m.vm}", reasons=[{"field": "moves", "move": n}])
        hi, devs = st.where[vm.id]
        now = tuple(sorted(d for _, d in devs))
        if st.fleet.hosts[hi].name != m.from_host or now != tuple(sorted(m.from_devices)):
            raise InvalidInput(f"move {n}: VM {vm.name} is not where the move takes it from",
                               reasons=[{"field": "moves", "move": n}])
        _vacate(st, vm)
        to = st.host_index.get(m.to_host)
        if to is None:
            raise InvalidInput(f"move {n}: no host {m.to_host}", reasons=[{"field": "moves", "move": n}])
        placed = []
        for d in m.to_devices:
            gi = st.gpu_index[to].get(d.pci)
            if gi is None or st.fleet.hosts[to].gpus[gi].pool != vm.pool:
                raise InvalidInput(f"move {n}: no GPU {m.to_host}/{d.pci} in pool {vm.pool}",
                                   reasons=[{"field": "moves", "move": n}])
            st.set_occ((to, gi), st.occ[(to, gi)].add(d.profile, d.start))  # InvalidInput if it does not fit
            placed.append((gi, d))
        if sorted(d.profile for d in m.to_devices) != sorted(d.profile for d in vm.devices):
            raise InvalidInput(f"move {n}: VM {vm.name} would change profiles", reasons=[{"field": "moves"}])
        if st.room[to][0] < vm.vcpus or st.room[to][1] < vm.memory_mib:
            raise InvalidInput(f"move {n}: host {m.to_host} lacks the vCPUs or memory for VM {vm.name}",
                               reasons=[{"field": "moves", "move": n}])
        st.add_room(to, -vm.vcpus, -vm.memory_mib)
        st.relocate(vm.id, to, tuple(placed))
    return st.fleet_now()
