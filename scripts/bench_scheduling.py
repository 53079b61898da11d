#!/usr/bin/env python3
"""Time-based replay of Alibaba's openb trace with priorities, preemption and fair share, beside FIFO.

Method (stated so it can be rerun and argued with):
- Fleet: every k-th node of openb_node_list_gpu_node.csv (k chosen so the sample has about --gpus GPUs), each GPU in
  vgpu-equal mode (the planning default), the trace's models mapped to catalog models as `planning.trace` does.
- Tasks: openb_pod_list_<trace>.csv, those asking for a GPU whose run time (deletion_time - scheduled_time) is
  positive; --tasks keeps the first N. A task arrives at creation_time and runs for its run time once started;
  each GPU it asks for becomes the smallest vGPU profile of its host's model whose memory share covers gpu_milli.
- Tenants and classes (the stated rule): tenant = t<(task number) mod 4>, with shares 1, 1, 2, 4; qos LS and
  Guaranteed -> class prod (1000, not preemptible), Burstable -> std (100, preemptible), BE -> batch (10,
  preemptible). Preempted VMs are requeued and restart from the beginning (as Slurm's REQUEUE).
- scheduler: on arrival, place (core.placement.plan, best-fit); else preempt the victims core.preemption
  chooses (prod and std requests); else queue. FIFO: place or queue, no preemption. When a task ends, the queue is
  tried in order (scheduler: priority, then the Fair Tree factor of decayed usage, then arrival; FIFO: arrival),
  with backfill (a request that does not fit does not block later ones; a shape that failed is not tried again in
  the same pass). Re-admitted victims are protected by a cool-down (--cooldown) from requests no higher than the
  one that preempted them.
- store (--store): the same replay through the real Controller, in process, on a SQLite store in a temporary
  folder: the sample as an inventory of simulated hosts (one pool per GPU model), the tenants' shares, the three
  classes and the settings (half-life, cool-down, grace 0) set through the service, and each task a
  `request_vm` (the claim, provisioning on the simulated host, preemption and reclaim by the service's rules,
  the queue). A task tries its models' pools in turn, first without preempting, then (prod and std) letting its
  class preempt; if none admits it, it is queued (`queue=True`) on the first such pool, and waits for that pool.
  Departures are `release_vm`, whose admission pass re-admits what waits. The service's clock is the replay's
  (`time.time` of the scheduling module is the trace's time), and each closed usage interval, which the store's
  trigger stamps with the wall clock, is stamped with the trace's time, so fair share decays in trace time.
- Reported per policy and class: tasks, wait p50 and p99 (hours from arrival to the last start), preemptions, and
  Jain's index of the GPU-hours each tenant got over its shares; a PNG of GPU allocation and queue length over time;
  and how long each replay took (the store's: every decision through the store, by the real code).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import math
import struct
import sys
import tempfile
import time
import types
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu_ctl import load_catalog
from vgpu_ctl.core import preemption as pre_mod
from vgpu_ctl.core.fairshare import Member, decay, decayed_hours, factors, fair_tree
from vgpu_ctl.core.geometry import Geometry, Mode, Occupancy, geometry_for
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan_on_host
from vgpu_ctl.core.preemption import Holder, choose_victims
from vgpu_ctl.planning.trace import MODEL_MAP, profile_for

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "alibaba-gpu-v2023"
CLASSES = {"prod": (1000, False), "std": (100, True), "batch": (10, True)}
QOS = {"LS": "prod", "Guaranteed": "prod", "Burstable": "std", "BE": "batch"}
SHARES = {"t0": 1, "t1": 1, "t2": 2, "t3": 4}


@dataclass
class Task:
    """One trace task as the replay sees it."""

    idx: int
    arrival: float
    run: float
    cpu: float
    memory: float
    num_gpu: int
    milli: int
    tenant: str
    cls: str
    start: float | None = None
    host: int | None = None
    gpus: tuple[tuple[int, int], ...] = ()
    preemptions: int = 0
    protected_below: int | None = None
    protected_until: float = 0.0
    gpu_hours: float = 0.0
    epoch: int = 0  # bumped when preempted: its pending departure event is stale

    @property
    def priority(self) -> int:
        """The class's value."""
        return CLASSES[self.cls][0]

    @property
    def gpu_request(self) -> float:
        """GPUs asked for."""
        return self.num_gpu * self.milli / 1000


@dataclass
class Node:
    """A host of the sample."""

    hid: int
    model: str
    geometry: Geometry
    vcpus: float
    memory: float
    gpus: dict[int, Occupancy] = field(default_factory=dict)
    used_vcpus: float = 0.0
    used_memory: float = 0.0

    def view(self) -> HostView:
        """The host as placement sees it."""
        return HostView(self.hid, f"h{self.hid}", self.vcpus - self.used_vcpus, self.memory - self.used_memory,
                        tuple(GpuView(g, f"{g}", o) for g, o in self.gpus.items()), order=self.hid,
                        gpu_count=len(self.gpus))


def load(trace: str, gpus: int, max_tasks: int | None) -> tuple[list[Node], list[Task]]:
    """The fleet sample and the tasks (see the module's method)."""
    catalog = load_catalog()
    with (TRACES / "openb_node_list_gpu_node.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["gpu"]) > 0]
    total = sum(int(r["gpu"]) for r in rows)
    step = max(1, total // max(gpus, 1))
    nodes: list[Node] = []
    gid = 0
    for r in rows[::step]:
        model = MODEL_MAP[r["model"]]
        geom = geometry_for(catalog, model, Mode.VGPU_EQUAL)
        n = Node(len(nodes), model, geom, int(r["cpu_milli"]) / 1000, int(r["memory_mib"]))
        for _ in range(int(r["gpu"])):
            n.gpus[gid] = Occupancy(geom)
            gid += 1
        nodes.append(n)
    tasks: list[Task] = []
    with (TRACES / f"openb_pod_list_{trace}.csv").open() as f:
        for i, r in enumerate(csv.DictReader(f)):
            run = float(r["deletion_time"] or 0) - float(r["scheduled_time"] or 0)
            if int(r["num_gpu"]) == 0 or run <= 0:
                continue
            cpus = max(1, math.ceil(int(r["cpu_milli"]) / 1000))  # whole vCPUs, as the store takes them
            tasks.append(Task(i, float(r["creation_time"]), run, cpus, max(1, int(r["memory_mib"])),
                              int(r["num_gpu"]), int(r["gpu_milli"]), f"t{i % 4}", QOS.get(r["qos"], "batch")))
            if max_tasks is not None and len(tasks) >= max_tasks:
                break
    return nodes, tasks


class Sim:
    """The replay of one policy (scheduler or FIFO)."""

    def __init__(self, nodes: Sequence[Node], tasks: Sequence[Task], scheduler: bool, half_life: float,
                 cooldown: float) -> None:
        """Copy the fleet and tasks."""
        self.catalog = load_catalog()
        self.nodes = [Node(n.hid, n.model, n.geometry, n.vcpus, n.memory, dict(n.gpus)) for n in nodes]
        self.tasks = [Task(t.idx, t.arrival, t.run, t.cpu, t.memory, t.num_gpu, t.milli, t.tenant, t.cls)
                      for t in tasks]
        self.scheduler, self.half_life, self.cooldown = scheduler, half_life, cooldown
        self.policy = get_policy("best-fit")
        self.queue: list[Task] = []
        self.running: dict[int, Task] = {}
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind 0 end / 1 arrival, task idx, epoch)
        self.usage = {t: 0.0 for t in SHARES}  # decayed GPU-hours, as of self.usage_at
        self.usage_at = 0.0
        self.total_gpus = sum(len(n.gpus) for n in nodes)
        self.samples: list[tuple[float, float, int]] = []
        self.preemptions = 0
        self.profiles: dict[tuple[str, int], str | None] = {}

    def profile(self, node: Node, milli: int) -> str | None:
        """The profile a task share maps to on the node's model."""
        key = (node.model, milli)
        if key not in self.profiles:
            self.profiles[key] = profile_for(self.catalog, node.geometry, milli)
        return self.profiles[key]

    def request(self, node: Node, t: Task) -> PlacementRequest | None:
        """The task's request on a node of this model (None: the model has no profile for it)."""
        p = self.profile(node, t.milli)
        return None if p is None else PlacementRequest((p,) * t.num_gpu, t.cpu, t.memory)  # type: ignore[arg-type]

    def advance(self, now: float) -> None:
        """Fold the tenants' decayed usage to `now` (exact: rates are constant between events)."""
        if now <= self.usage_at:
            return
        k = decay(now - self.usage_at, self.half_life)
        hours = decayed_hours(self.usage_at, now, now, self.half_life)
        rate = dict.fromkeys(SHARES, 0.0)
        for t in self.running.values():
            rate[t.tenant] += t.gpu_request
        for name in self.usage:
            self.usage[name] = self.usage[name] * k + rate[name] * hours
        self.usage_at = now

    def place(self, t: Task, now: float) -> bool:
        """Place the task now if it fits anywhere (best-fit over hosts)."""
        best = None
        for n in self.nodes:
            req = self.request(n, t)
            if req is None:
                continue
            view = n.view()
            if view.free_vcpus < t.cpu or view.free_memory_mib < t.memory:
                continue
            found = plan_on_host(view, req, self.policy)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], n, found[1])
        if best is None:
            return False
        self.start(t, best[1], best[2], now)
        return True

    def start(self, t: Task, node: Node, plan: object, now: float) -> None:
        """Run the task on the node by the plan."""
        self.advance(now)
        for gid, occ in plan.occupancies.items():  # type: ignore[attr-defined]
            node.gpus[gid] = occ
        node.used_vcpus += t.cpu
        node.used_memory += t.memory
        t.start, t.host = now, node.hid
        t.gpus = tuple((d.gpu_id, d.start) for d in plan.devices)  # type: ignore[attr-defined]
        self.running[t.idx] = t
        heapq.heappush(self.events, (now + t.run, 0, t.idx, t.epoch))

    def stop(self, t: Task, now: float) -> None:
        """Take the task off its host."""
        self.advance(now)
        node = self.nodes[t.host or 0]
        for gid, start in t.gpus:
            node.gpus[gid] = node.gpus[gid].remove(start)
        node.used_vcpus -= t.cpu
        node.used_memory -= t.memory
        t.gpu_hours += (now - (t.start or now)) * t.gpu_request / 3600
        del self.running[t.idx]

    def preempt(self, t: Task, now: float) -> bool:
        """Free the fewest lower-priority preemptible tasks that let `t` fit, by geometry; whether it did."""
        best = None
        by_model: dict[str, list[Node]] = {}
        for n in self.nodes:
            by_model.setdefault(n.model, []).append(n)
        for nodes in by_model.values():
            req = self.request(nodes[0], t)
            if req is None:
                continue
            ids = {n.hid for n in nodes}
            holders = [Holder(str(r.idx), r.host or 0, r.priority, CLASSES[r.cls][1], r.gpus, r.cpu, r.memory,
                              r.start or 0.0, False, r.protected_below if r.protected_until > now else None)
                       for r in self.running.values() if r.host in ids]
            found = choose_victims(req, t.priority, [n.view() for n in nodes], holders, self.policy)
            if found is not None and found.victims and (best is None or len(found.victims) < len(best.victims)):
                best = found
        if best is None:
            return False
        for v in best.victims:
            victim = self.running[int(v.vm_id)]
            self.stop(victim, now)
            victim.epoch += 1
            victim.preemptions += 1
            victim.protected_below, victim.protected_until = t.priority, -1.0  # set when re-admitted
            victim.start = None
            self.queue.append(victim)
            self.preemptions += 1
        return self.place(t, now)

    def order(self) -> list[Task]:
        """The queue in admission order."""
        if not self.scheduler:
            return sorted(self.queue, key=lambda t: (t.arrival, t.idx))
        fs = factors(fair_tree([Member(n, None, s, self.usage[n]) for n, s in SHARES.items()]))
        return sorted(self.queue, key=lambda t: (-t.priority, -fs.get(t.tenant, 0.0), t.arrival, t.idx))

    def drain(self, now: float) -> None:
        """Admit what fits from the queue, in order, with backfill."""
        self.advance(now)
        failed: set[tuple[int, int, float, float]] = set()
        for t in self.order():
            shape = (t.num_gpu, t.milli, t.cpu, t.memory)
            if shape in failed:
                continue
            if self.place(t, now):
                self.queue.remove(t)
                if t.protected_below is not None and t.protected_until < 0:
                    t.protected_until = now + self.cooldown
            else:
                failed.add(shape)

    def queue_length(self) -> int:
        """How many tasks wait."""
        return len(self.queue)

    def depart(self, t: Task, now: float) -> None:
        """A task ends: off its host, and the queue is tried."""
        self.stop(t, now)
        self.drain(now)

    def arrive(self, t: Task, now: float) -> None:
        """A task arrives: placed, else (scheduler, prod and std) preempting, else queued."""
        if not self.place(t, now) and not (self.scheduler and t.cls != "batch" and self.preempt(t, now)):
            self.queue.append(t)


def replay(sim: Any, sample_every: float) -> None:
    """Replay every arrival and departure of `sim`'s tasks in time (`sim.arrive`, `sim.depart`; an end made stale
    by a preemption is dropped), sampling GPU allocation and `sim.queue_length()` every `sample_every` seconds."""
    for t in sim.tasks:
        heapq.heappush(sim.events, (t.arrival, 1, t.idx, 0))
    by_idx = {t.idx: t for t in sim.tasks}
    next_sample = 0.0
    while sim.events:
        now, kind, idx, epoch = heapq.heappop(sim.events)
        while now >= next_sample:
            used = sum(t.gpu_request for t in sim.running.values())
            sim.samples.append((next_sample, used / sim.total_gpus, sim.queue_length()))
            next_sample += sample_every
        t = by_idx[idx]
        if kind == 1:
            sim.arrive(t, now)
        elif epoch == t.epoch and t.idx in sim.running:  # else preempted since: this end is stale
            sim.depart(t, now)


@contextmanager
def trace_clock() -> Iterator[list[float]]:
    """While open, the scheduling service's `time.time()` is the replay's clock (set `clock[0]`), its other time
    functions the real ones."""
    from vgpu_ctl.service import hibernation, scheduling
    clock = [0.0]
    fake = types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic, sleep=time.sleep)
    modules = (scheduling, hibernation)
    saved = [getattr(m, "time") for m in modules]  # noqa: B009 (the module's own `import time`)
    for m in modules:
        setattr(m, "time", fake)  # noqa: B010
    try:
        yield clock
    finally:
        for m, real in zip(modules, saved, strict=True):
            setattr(m, "time", real)  # noqa: B010


CLOCK_BASE = 1e9
"""Trace time 0 on the service's clock: in the past, so the wall clock the store's trigger stamps on a closed
usage interval is always after the trace's time of it (and is then replaced by it)."""


class StoreSim:
    """The replay through the real Controller on a temporary SQLite store (see the module's method)."""

    def __init__(self, nodes: Sequence[Node], tasks: Sequence[Task], half_life: float, cooldown: float,
                 folder: Path, clock: list[float]) -> None:
        """Declare the sample as simulated hosts, the tenants, classes and settings, through the service."""
        import os

        from vgpu_ctl import Controller
        os.environ["VGPU_CTL_STATE_DIR"] = str(folder / "state")
        self.catalog = load_catalog()
        self.tasks = [Task(t.idx, t.arrival, t.run, t.cpu, t.memory, t.num_gpu, t.milli, t.tenant, t.cls)
                      for t in tasks]
        self.models = sorted({n.model for n in nodes})
        self.geometry = {n.model: n.geometry for n in nodes}
        self.total_gpus = sum(len(n.gpus) for n in nodes)
        self.clock, self.t0 = clock, min((t.arrival for t in tasks), default=0.0)
        lines = ["pools:", *(f"  - {{name: {self.pool(m)}, policy: best-fit}}" for m in self.models), "hosts:"]
        for n in nodes:
            lines += [f"  - name: h{n.hid}", f'    uri: "simulated:///h{n.hid}"', "    driver: simulated",
                      f"    vcpus: {int(n.vcpus)}", f"    memory_mib: {int(n.memory)}", "    gpus:"]
            lines += [f'      - {{pci: "0000:{k + 1:02x}:00.0", model: {n.model}, mode: vgpu-equal, '
                      f"pool: {self.pool(n.model)}}}" for k in range(len(n.gpus))]
        (folder / "fleet.yaml").write_text("\n".join(lines) + "\n")
        self.ctl = Controller(f"sqlite:///{folder / 'store.db'}", state_path=folder / "state")
        self.ctl.apply_inventory(folder / "fleet.yaml")
        for name, (value, preemptible) in CLASSES.items():
            self.ctl.scheduling.create_class(name, value, preemptible=preemptible)
        for tenant, shares in SHARES.items():
            self.ctl.create_tenant(tenant)
            self.ctl.scheduling.set_tenant(tenant, shares=shares)
        self.ctl.scheduling.set_settings(half_life_s=half_life, grace_s=0.0, cooldown_s=cooldown)
        self.events: list[tuple[float, int, int, int]] = []
        self.running: dict[int, Task] = {}
        self.samples: list[tuple[float, float, int]] = []
        self.preemptions = 0

    @staticmethod
    def pool(model: str) -> str:
        """The pool of a GPU model's hosts."""
        return "p-" + model.lower()

    def now(self, t: float) -> None:
        """Move the service's clock to trace time `t`."""
        self.clock[0] = CLOCK_BASE + t - self.t0

    def vgpus(self, model: str, t: Task) -> list[tuple[str, int]] | None:
        """The task's vGPUs on a model (None: the model has no profile for its share)."""
        p = profile_for(self.catalog, self.geometry[model], t.milli)
        return None if p is None else [(p, t.num_gpu)]

    def request(self, t: Task) -> None:
        """Request the task's VM: each pool as it is, then (a preempting class) each pool letting it preempt,
        else queue it on its first pool."""
        from vgpu_ctl.errors import Refused
        asks = [(self.pool(m), v) for m in self.models if (v := self.vgpus(m, t)) is not None]
        tries = [(pool, v, False) for pool, v in asks]
        if t.cls != "batch":  # as the core replay: prod and std preempt, batch waits
            tries += [(pool, v, True) for pool, v in asks]
        for pool, v, preempt in tries:
            try:
                self.ctl.request_vm(t.tenant, f"t{t.idx}", v, vcpus=int(t.cpu), memory_mib=int(t.memory),
                                    pool=pool, priority=t.cls, preempt=preempt)
                return
            except Refused:
                continue
        if asks:
            self.ctl.request_vm(t.tenant, f"t{t.idx}", asks[0][1], vcpus=int(t.cpu), memory_mib=int(t.memory),
                                pool=asks[0][0], priority=t.cls, preempt=False, queue=True)

    def observe(self, now: float) -> None:
        """What the store runs now: tasks started (a departure each at now + run) and tasks preempted (their
        pending departure dropped, a restart counted); the usage intervals it closed, stamped with trace time."""
        from sqlalchemy import text
        with self.ctl.engine.begin() as conn:
            names = {int(r[0][1:]) for r in conn.execute(text("SELECT name FROM vm"))}
            conn.execute(text("UPDATE usage_interval SET ended = MAX(started, :now) WHERE ended > :now"),
                         {"now": self.clock[0]})
        by_idx = {t.idx: t for t in self.tasks}
        for idx in names - set(self.running):
            t = by_idx[idx]
            t.start = now
            self.running[idx] = t
            heapq.heappush(self.events, (now + t.run, 0, idx, t.epoch))
        for idx in set(self.running) - names:  # gone without its departure: preempted (requeued or cancelled)
            t = self.running.pop(idx)
            t.gpu_hours += (now - (t.start or now)) * t.gpu_request / 3600
            t.start, t.epoch = None, t.epoch + 1
            t.preemptions += 1
            self.preemptions += 1

    def queue_length(self) -> int:
        """How many requests wait in the store's queue."""
        from sqlalchemy import text
        with self.ctl.engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM operation WHERE state = 'pending' "
                                         "AND lease_holder = 'queue'")).scalar() or 0)

    def depart(self, t: Task, now: float) -> None:
        """A task ends: its VM is deleted (whose admission pass starts what waits)."""
        self.now(now)
        self.running.pop(t.idx)
        t.gpu_hours += (now - (t.start or now)) * t.gpu_request / 3600
        self.ctl.release_vm(f"{t.tenant}/t{t.idx}")
        self.observe(now)

    def arrive(self, t: Task, now: float) -> None:
        """A task arrives: its VM is requested (see `request`)."""
        self.now(now)
        self.request(t)
        self.observe(now)

    def close(self) -> None:
        """Close the store."""
        self.ctl.close()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def jain(sim: Any) -> float:
    """Jain's index of each tenant's GPU-hours over its shares."""
    got = dict.fromkeys(SHARES, 0.0)
    for t in sim.tasks:
        got[t.tenant] += t.gpu_hours
    total, shares = sum(got.values()) or 1.0, sum(SHARES.values())
    x = [(got[n] / total) / (s / shares) for n, s in SHARES.items()]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def report(sims: dict[str, Any]) -> str:
    """The table."""
    lines = [f"{'policy':10} {'class':6} {'tasks':>6} {'wait p50 h':>10} {'wait p99 h':>10} {'preempted':>9} "
             f"{'not run':>7}"]
    for name, sim in sims.items():
        for cls in CLASSES:
            mine = [t for t in sim.tasks if t.cls == cls]
            waits = [((t.start or 0) - t.arrival) / 3600 for t in mine if t.start is not None]
            lines.append(f"{name:10} {cls:6} {len(mine):6d} {percentile(waits, 0.5):10.2f} "
                         f"{percentile(waits, 0.99):10.2f} {sum(t.preemptions for t in mine):9d} "
                         f"{sum(1 for t in mine if t.start is None):7d}")
    for name, sim in sims.items():
        mean_alloc = sum(s[1] for s in sim.samples) / max(len(sim.samples), 1)
        lines.append(f"{name}: Jain's index over shares {jain(sim):.3f}, preemptions {sim.preemptions}, "
                     f"mean GPU allocation {mean_alloc:.1%}")
    return "\n".join(lines)


def png(path: Path, sims: dict[str, Any], width: int = 900, height: int = 500) -> None:
    """A PNG (no plotting library): GPU allocation (top) and queue length (bottom) over time, FIFO red,
    scheduler blue, the store green."""
    px = [[(255, 255, 255)] * width for _ in range(height)]
    colors = {"fifo": (220, 40, 40), "scheduler": (30, 80, 220), "store": (30, 160, 60)}
    half = height // 2
    t_end = max(s.samples[-1][0] for s in sims.values() if s.samples) or 1.0
    q_max = max((q for s in sims.values() for _, _, q in s.samples), default=1) or 1
    for y in (half - 1, half):
        px[y] = [(0, 0, 0)] * width
    for name, sim in sims.items():
        c = colors.get(name, (0, 0, 0))
        prev: tuple[int, int, int] | None = None
        for t, alloc, q in sim.samples:
            x = min(width - 1, int(t / t_end * (width - 1)))
            ya = half - 2 - int(min(alloc, 1.0) * (half - 4))
            yq = height - 1 - int(q / q_max * (half - 4))
            for y0, y1 in ((prev[1], ya), (prev[2], yq)) if prev else ((ya, ya), (yq, yq)):
                for y in range(min(y0, y1), max(y0, y1) + 1):
                    px[y][x] = c
            prev = (x, ya, yq)
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in px)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main(argv: Sequence[str] | None = None) -> int:
    """Run both policies, print the table, write the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="default", help="openb pod list: default, gpushare40, multigpu30")
    ap.add_argument("--gpus", type=int, default=120, help="about this many GPUs in the fleet sample")
    ap.add_argument("--tasks", type=int, default=None, help="only the first N tasks")
    ap.add_argument("--half-life-h", type=float, default=24.0, help="usage half-life, hours")
    ap.add_argument("--cooldown-h", type=float, default=1.0, help="cool-down of re-admitted victims, hours")
    ap.add_argument("--exact", type=int, default=6, help="victim candidates per host tried exhaustively")
    ap.add_argument("--png", type=Path, default=Path("bench_scheduling.png"), help="where to write the plot")
    ap.add_argument("--store", action="store_true",
                    help="also replay through the real Controller on a SQLite store (slower: use --tasks)")
    args = ap.parse_args(argv)
    pre_mod.EXACT_LIMIT = args.exact
    nodes, tasks = load(args.trace, args.gpus, args.tasks)
    span = max(t.arrival for t in tasks) - min(t.arrival for t in tasks)
    print(f"{len(nodes)} hosts, {sum(len(n.gpus) for n in nodes)} GPUs, {len(tasks)} tasks over "
          f"{span / 86400:.1f} days ({args.trace})")
    sims: dict[str, Any] = {}
    took: dict[str, float] = {}
    for name, sched in (("fifo", False), ("scheduler", True)):
        began = time.perf_counter()
        sim = Sim(nodes, tasks, sched, args.half_life_h * 3600, args.cooldown_h * 3600)
        replay(sim, sample_every=max(span / 400, 1.0))
        sims[name], took[name] = sim, time.perf_counter() - began
    if args.store:
        with tempfile.TemporaryDirectory(prefix="bench-sched-") as folder, trace_clock() as clock:
            began = time.perf_counter()
            store = StoreSim(nodes, tasks, args.half_life_h * 3600, args.cooldown_h * 3600, Path(folder), clock)
            try:
                replay(store, sample_every=max(span / 400, 1.0))
            finally:
                store.close()
            sims["store"], took["store"] = store, time.perf_counter() - began
    print(report(sims))
    print("replayed in " + ", ".join(f"{name} {s:.1f} s ({len(tasks) / s:.0f} tasks/s)" for name, s in took.items()))
    png(args.png, sims)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
