#!/usr/bin/env python3
"""Replay Alibaba's openb GPU traces against vgpu_ctl's placement policies, by the FGD paper's method.

Method (Weng et al., "Beware of Fragmentation", USENIX ATC'23): nodes from openb_node_list_gpu_node.csv, tasks from
openb_pod_list_<trace>.csv. For each seed the tasks are shuffled with random.Random(seed), then random clones (drawn
with the same generator) are appended until the GPU request (sum of num_gpu * gpu_milli / 1000) reaches 130% of the
cluster's GPU count. Each task is placed once, in order; failures are dropped; nothing departs. Measured when the
arrived GPU request reaches 100% of capacity and at the end (130%).

Each task becomes one vGPU profile per GPU it asks for, on the model of the node it lands on: the smallest profile the
model offers in the run's mode whose memory share (and, for MIG, compute share) is at least the task's GPU share;
whole-GPU tasks get the full-size vGPU type or the 7g MIG profile, num_gpu of them on one host, each on its own GPU.
Tasks that ask for no GPU are skipped (counted). vCPUs and memory are taken from the host with overcommit 1.0.

Placement goes through `vgpu_ctl.core.placement.plan`, shown only the hosts and GPUs that can hold the winner. For a
policy without a host cost (first-fit, best-fit, spread): for a one-vGPU task, per distinct GPU state that takes the
profile, the first admitted host in file order holding it (spread: the one with the most free vCPUs) with its first
GPU in that state; for a multi-GPU task, every admitted host with enough GPUs that take the profile. That gives the
same plan as `plan` over the whole fleet because those policies score a position by the GPU's state, then the host's
order (spread: its free vCPUs, then its order), then the GPU id. For a policy with a host cost (pack), which depends
on the whole host: per distinct host state (its GPU states, free vCPUs and free memory) that admits the task, its
first host in file order with all its GPUs; hosts in one state cost the same, and ties go to host order. `--verify`
checks that on every task (slow; the tests use it). Occupancies are memoized (MemoOccupancy).
The pack policy's demand mix is the trace's task shapes, FGD's typical tasks: per distinct (GPU share, GPU count,
vCPUs), the profile it maps to on each model, weighted by how many tasks have it. Like FGD's (TargetPodResource in
hkust-adsl/kubernetes-scheduler-simulator), they leave memory out.
vCPUs are counted in milli-vCPUs (HostView.free_vcpus and PlacementRequest.vcpus), which is the same ratio.
Restricted tasks' shapes say which models they may run on, and pack is given the fleet's GPUs per model (`supply`).

gpuspec traces (generated here from the default trace, never written to disk; the published gpuspec files hold
production constraints we do not have): gpuspecNN restricts NN% of the tasks that ask for GPUs, drawn at random, to
one trace GPU model each, the model drawn by its share of the cluster's GPUs (gpuspec33n: of its nodes, which
makes the small-node models T4 and P100/V100-16GB scarce), among the models with a node as wide as the task. The
generator is seeded with the trace's name, so every replay seed sees the same trace.

--store also replays pack, for the same traces, modes and seeds, through the real Controller on a fresh SQLite store
(the fleet declared through an inventory file: simulated hosts, one pack pool per GPU model with the trace's task
shapes on that model as its demand), placing each task as a user would: request_vm(provision=False) with the
task's profile on each model it may use, the model with the most GPUs first, the first that is not refused. Beside
it the pure policy is replayed with the same rule ("pure user"), so the gap between the two is the store's doing:
there pack sees whole hosts, but only those on the candidate pages (hosts with room, fullest first, from their
summaries) until one has a plan. Both stop at 100% arrived.

Usage: bench_packing.py TRACE_DIR [--seeds 42..44 (default: 3 seeds; the paper's 10 are 42..51)]
       [--trace default,gpushare40,multigpu30] [--modes vgpu-equal,vgpu-mixed,mig]
       [--policies pack,first-fit,best-fit,spread] [--nodes-limit N] [--jobs N] [--verify] [--store] [--json]
       (traces: default,gpushare40,multigpu30,gpuspec20,gpuspec33,gpuspec33n; --policies "" with --store runs
       only the store comparison)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import time
from bisect import insort
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from vgpu_ctl.catalog import Catalog, load_catalog
from vgpu_ctl.core.geometry import Misfit, Occupancy, geometry_for
from vgpu_ctl.core.placement import (
    CandidateOrder,
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    Policy,
    Score,
    TaskShape,
    get_policy,
    host_rank,
    plan,
    plan_on_host,
)
from vgpu_ctl.planning import trace as trace_files
from vgpu_ctl.planning.trace import MODEL_MAP, Node, Task, mode_of, profile_for
from vgpu_ctl.service.allocation import HOST_PAGE, distinct_states
from vgpu_ctl.service.claim import pool_policy

__all__ = ["MODEL_MAP", "Node", "Task", "mode_of", "profile_for"]  # the trace's parsing, shared with the planner

# Generated from the default trace (see `restrict_to_models`): name -> (share of GPU tasks restricted to one model,
# whether the model is drawn by its share of the cluster's GPUs or of its nodes).
GPUSPEC: dict[str, tuple[float, str]] = {"gpuspec20": (0.20, "gpus"), "gpuspec33": (0.33, "gpus"),
                                         "gpuspec33n": (0.33, "nodes")}
TRACES = ("default", "gpushare40", "multigpu30", *GPUSPEC)
MODES = ("vgpu-equal", "vgpu-mixed", "mig")
POLICY_NAMES = ("pack", "first-fit", "best-fit", "spread")
DEFAULT_SEEDS = "42..44"  # the paper uses 42..51: ~20 min for everything on 2 CPUs, so pass --seeds 42..51
# Policies whose plans the candidate cut (see the module's docstring) keeps; any other policy sees the whole fleet.
# Tests run with --verify to keep this true.
TRIMMABLE = frozenset(POLICY_NAMES)
ARRIVED_MEASURE = 1.0  # measure when the arrived GPU request is this share of capacity
ARRIVED_END = 1.3  # ... and stop when it reaches this share


def load_nodes(trace_dir: Path, limit: int | None = None, raw: bool = False) -> list[Node]:
    """The trace's GPU nodes in file order (the first `limit` of them if given), with catalog models (raw: the
    trace's model names); read by vgpu_ctl.planning.trace, which the planner shares."""
    return trace_files.load_nodes(trace_dir / "openb_node_list_gpu_node.csv", limit, raw)


def load_tasks(trace_dir: Path, trace: str) -> list[Task]:
    """The tasks of openb_pod_list_<trace>.csv in file order; a gpuspecNN trace is generated from the default one
    (see `restrict_to_models`)."""
    if trace in GPUSPEC:
        share, by = GPUSPEC[trace]
        return restrict_to_models(load_tasks(trace_dir, "default"), load_nodes(trace_dir, None, raw=True),
                                  share, trace, by)
    return trace_files.load_tasks(trace_dir / f"openb_pod_list_{trace}.csv")


def restrict_to_models(tasks: Sequence[Task], nodes: Sequence[Node], share: float, name: str,
                       by: str = "gpus") -> list[Task]:
    """The tasks with `share` of those asking for GPUs (and not already restricted) restricted to one trace GPU
    model each, as in the FGD paper's gpuspec traces: round(share x their count) tasks drawn at random, each given
    a model drawn by the model's share of the cluster's GPUs (by="nodes": of its nodes, which makes the models of
    small nodes, T4 and P100, scarce), among the models with a node that has as many GPUs as the task asks for.
    Deterministic: the generator is seeded with the trace's name, not the replay seed, so every seed replays the
    same trace, like the published ones. `nodes` carry trace model names (raw=True)."""
    rng = random.Random(name)
    gpus: Counter[str] = Counter()
    widest: dict[str, int] = {}
    for n in nodes:
        gpus[n.model] += n.gpus if by == "gpus" else 1
        widest[n.model] = max(widest.get(n.model, 0), n.gpus)
    models = sorted(gpus)
    open_ = [i for i, t in enumerate(tasks) if t.num_gpu > 0 and t.models is None]
    chosen = set(rng.sample(open_, round(share * len(open_))))
    out = list(tasks)
    for i in sorted(chosen):
        t = tasks[i]
        fits = [m for m in models if widest[m] >= t.num_gpu]
        if not fits:
            continue
        model = rng.choices(fits, weights=[gpus[m] for m in fits])[0]
        out[i] = Task(t.name, t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli, frozenset({MODEL_MAP[model]}))
    return out


def arrival_sequence(tasks: Sequence[Task], capacity: int, seed: int) -> list[Task]:
    """Shuffled tasks plus random clones until the GPU request reaches 130% of `capacity`, cut there."""
    rng = random.Random(seed)
    seq = list(tasks)
    rng.shuffle(seq)
    total = sum(t.gpu_request for t in seq)
    while total < ARRIVED_END * capacity:
        clone = rng.choice(tasks)
        seq.append(clone)
        total += clone.gpu_request
    out: list[Task] = []
    arrived = 0.0
    for t in seq:  # with the whole trace already past 130% (multigpu30, --nodes-limit) stop there
        if arrived >= ARRIVED_END * capacity:
            break
        out.append(t)
        arrived += t.gpu_request
    return out


_MISFIT: dict[tuple[Occupancy, str], Misfit | None] = {}
_STARTS: dict[tuple[Occupancy, str], tuple[int, ...]] = {}
_PLACED: dict[tuple[Occupancy, str, int], Occupancy] = {}


class MemoOccupancy(Occupancy):
    """An Occupancy that remembers its hash and its answers: they are pure functions of immutable state, asked
    again and again by `plan_on_host` for the same GPU states. Only speed changes, not the answers."""

    __slots__ = ("_hash",)
    _hash: int

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            h = Occupancy.__hash__(self)
            object.__setattr__(self, "_hash", h)
            return h

    def misfit(self, profile: str) -> Misfit | None:
        key = (self, profile)
        try:
            return _MISFIT[key]
        except KeyError:
            hit = _MISFIT[key] = Occupancy.misfit(self, profile)
            return hit

    def fit_starts(self, profile: str) -> tuple[int, ...]:
        key = (self, profile)
        try:
            return _STARTS[key]
        except KeyError:
            hit = _STARTS[key] = Occupancy.fit_starts(self, profile)
            return hit

    def placed(self, profile: str, start: int) -> Occupancy:
        key = (self, profile, start)
        try:
            return _PLACED[key]
        except KeyError:
            base = Occupancy.placed(self, profile, start)
            hit = _PLACED[key] = MemoOccupancy(base.geometry, base.slots, base.pinned_type, base.fixed_layout)
            return hit


HostState = tuple[frozenset[tuple[Occupancy, int]], float, float]  # GPU states with counts, free vCPUs, memory


@dataclass
class Fleet:
    """Host views of one replay, kept current, indexed by GPU state (to the hosts and GPUs holding it) and by host
    state (its GPU states, free vCPUs and memory, to the hosts in it)."""

    catalog: Catalog
    run_mode: str
    nodes: Sequence[Node]
    views: list[HostView] = field(init=False)
    holders: dict[str, dict[Occupancy, dict[int, list[int]]]] = field(init=False)  # model -> state -> host -> GPUs
    alike: dict[str, dict[HostState, list[int]]] = field(init=False)  # model -> host state -> hosts

    def __post_init__(self) -> None:
        self.views = []
        self.holders = {}
        self.alike = {}
        for i, n in enumerate(self.nodes):
            empty = MemoOccupancy(geometry_for(self.catalog, n.model, mode_of(self.catalog, n.model, self.run_mode)))
            gpus = tuple(GpuView(j, f"{n.name}/gpu{j}", empty) for j in range(n.gpus))
            self.views.append(HostView(i, n.name, float(n.cpu_milli), float(n.memory_mib), gpus, order=i,
                                       gpu_count=n.gpus))
            if n.gpus:
                self.holders.setdefault(n.model, {}).setdefault(empty, {})[i] = list(range(n.gpus))
                self.alike.setdefault(n.model, {}).setdefault(_state(self.views[i]), []).append(i)

    def candidates(self, model: str, req: PlacementRequest, most_vcpus: bool) -> list[HostView]:
        """The hosts (and GPUs) `plan` needs to see to find its best plan for `req` among hosts of `model`, for a
        policy without a host cost.

        One vGPU: per GPU state that takes the profile, the first admitted host holding it (spread: the one with
        the most free vCPUs) with only its first GPU in that state. Several: every admitted host with enough GPUs
        that take the profile, with those GPUs.
        """
        profile = req.profiles[0]
        n = len(req.profiles)
        views = self.views
        picked: dict[int, list[int]] = {}
        for occ, hosts in self.holders.get(model, {}).items():
            if occ.misfit(profile) is not None:
                continue
            if n > 1:
                for h, gids in hosts.items():
                    picked.setdefault(h, []).extend(gids)
                continue
            best: int | None
            if most_vcpus:
                ok = [h for h in hosts if _admits(views[h], req)]
                best = max(ok, key=lambda h: (views[h].free_vcpus, -h)) if ok else None
            else:
                best = min(hosts)
                if not _admits(views[best], req):
                    best = min((h for h in hosts if _admits(views[h], req)), default=None)
            if best is not None:
                picked.setdefault(best, []).append(hosts[best][0])
        out = []
        for h in sorted(picked):
            view, gids = views[h], picked[h]
            if n > 1 and (len(gids) < n or not _admits(view, req)):
                continue
            out.append(HostView(view.host_id, view.name, view.free_vcpus, view.free_memory_mib,
                                tuple(view.gpus[g] for g in sorted(gids)), view.state, view.labels,
                                view.anti_affinity, view.order))  # only some GPUs: gpu_count unknown
        return out

    def host_candidates(self, model: str, req: PlacementRequest) -> list[HostView]:
        """The hosts `plan` needs to see to find its best plan for `req` among hosts of `model`, for a policy with
        a host cost: per host state with the vCPUs, memory and enough GPUs that take the profile, its first host."""
        profile = req.profiles[0]
        n = len(req.profiles)
        picked = []
        for (gpus, vcpus, memory), hosts in self.alike.get(model, {}).items():
            if vcpus >= req.vcpus and memory >= req.memory_mib and \
                    sum(k for occ, k in gpus if occ.misfit(profile) is None) >= n:
                picked.append(hosts[0])
        return [self.views[h] for h in sorted(picked)]

    def apply(self, p: PlacementPlan, req: PlacementRequest) -> None:
        """Record a placement: the host's new GPU states, vCPUs and memory."""
        old = self.views[p.host_id]
        model = self.nodes[p.host_id].model
        index = self.holders[model]
        gpus = list(old.gpus)
        for gid, occ in p.occupancies.items():
            before = gpus[gid].occupancy
            held = index[before]
            held[p.host_id].remove(gid)
            if not held[p.host_id]:
                del held[p.host_id]
                if not held:
                    del index[before]
            insort(index.setdefault(occ, {}).setdefault(p.host_id, []), gid)
            gpus[gid] = GpuView(gpus[gid].gpu_id, gpus[gid].pci, occ, gpus[gid].pool)
        new = HostView(old.host_id, old.name, old.free_vcpus - req.vcpus, old.free_memory_mib - req.memory_mib,
                       tuple(gpus), old.state, old.labels, old.anti_affinity, old.order, old.gpu_count)
        self.views[p.host_id] = new
        alike = self.alike[model]
        key = _state(old)
        alike[key].remove(p.host_id)
        if not alike[key]:
            del alike[key]
        insort(alike.setdefault(_state(new), []), p.host_id)


def _state(view: HostView) -> HostState:
    return frozenset(Counter(g.occupancy for g in view.gpus).items()), view.free_vcpus, view.free_memory_mib


def _admits(host: HostView, req: PlacementRequest) -> bool:
    return host.free_vcpus >= req.vcpus and host.free_memory_mib >= req.memory_mib


@dataclass
class Replay:
    """Places one arrival sequence with one policy on one fleet."""

    catalog: Catalog
    run_mode: str
    nodes: Sequence[Node]
    policy: Policy
    verify: bool = False
    first_model: bool = False  # a user's rule: the task's models by their GPUs in the fleet, the first that fits
    # The store's cut (with the user's rule): per model, its pool's policy; pack then sees the store's candidate
    # pages (see `store_pages`), page by page, one host per distinct state, until one has a plan.
    pool_policies: Mapping[str, Policy] | None = None
    trim: bool = field(init=False)  # show `plan` only the hosts/GPUs that can win (see the module's docstring)
    by_host: bool = field(init=False)  # ... cut by host state: the policy has a host cost
    fleet: Fleet = field(init=False)
    models: tuple[str, ...] = field(init=False)
    _profiles: dict[tuple[str, int], str | None] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.catalog, self.run_mode, self.nodes)
        self.trim = self.policy.name in TRIMMABLE
        self.by_host = self.policy.host_cost is not None
        self.models = tuple(dict.fromkeys(n.model for n in self.nodes if n.gpus))
        if self.first_model or self.pool_policies is not None:
            self.first_model = True
            self.models = preference(self.nodes)

    def profile(self, model: str, gpu_milli: int) -> str | None:
        """The profile a GPU share maps to on `model` in this run (cached)."""
        key = (model, gpu_milli)
        if key not in self._profiles:
            geometry = geometry_for(self.catalog, model, mode_of(self.catalog, model, self.run_mode))
            self._profiles[key] = profile_for(self.catalog, geometry, gpu_milli)
        return self._profiles[key]

    def requests(self, task: Task) -> list[tuple[str, PlacementRequest]]:
        """One request per model the task may run on."""
        out = []
        for model in self.models:
            if task.models is not None and model not in task.models:
                continue
            profile = self.profile(model, task.gpu_milli)
            if profile is not None:
                out.append((model, PlacementRequest((profile,) * task.num_gpu, task.cpu_milli, task.memory_mib)))
        return out

    def place(self, task: Task) -> PlacementPlan | None:
        """Place a task (each model's best plan, the best of those by the policy's score) and record it."""
        best: tuple[Score, PlacementPlan, PlacementRequest] | None = None
        options = self.requests(task)
        spread = self.policy.name == "spread"
        for model, req in options:
            if self.pool_policies is not None:
                cut = self.store_plan(model, req)
                if cut is not None:
                    best = ((), cut, req)
                    break
                continue
            if not self.trim:
                hosts = self.fleet.views
            elif self.by_host:
                hosts = self.fleet.host_candidates(model, req)
            else:
                hosts = self.fleet.candidates(model, req, spread)
            found = plan(req, hosts, self.policy)
            if found is None:
                continue
            if len(options) == 1 or self.first_model:
                best = ((), found, req)
                break
            scored = plan_on_host(next(h for h in hosts if h.host_id == found.host_id), req, self.policy)
            assert scored is not None
            if best is None or scored[0] < best[0]:
                best = (scored[0], found, req)
        if self.verify and not self.first_model:
            self._check(options, best[1] if best else None)
        if best is None:
            return None
        self.fleet.apply(best[1], best[2])
        return best[1]

    def store_pages(self, model: str, req: PlacementRequest) -> Iterator[list[HostView]]:
        """The store's whole-host candidate pages for `req` in the pool of `model` (allocation's `_host_pages` on
        the host summaries): hosts with room and at least as many GPUs that can take the profile as it asks for,
        in `core.placement.host_rank`'s order for pack (widest first, then the fullest by the mean free units of
        those GPUs, then host order), HOST_PAGE hosts a page."""
        profile, n = req.profiles[0], len(req.profiles)
        ranked: list[tuple[tuple[float, ...], int]] = []
        for (gpus, vcpus, memory), hosts in self.fleet.alike.get(model, {}).items():
            if vcpus < req.vcpus or memory < req.memory_mib:
                continue
            fit = [(occ, k) for occ, k in gpus if occ.misfit(profile) is None]
            n_fit = sum(k for _, k in fit)
            if n_fit == 0 or n_fit < n:
                continue
            width = sum(k for _, k in gpus)
            free = sum(occ.free_units * k for occ, k in fit) / n_fit
            ranked.extend((host_rank(CandidateOrder.FULLEST_FIRST, True, width, free, h), h) for h in hosts)
        ranked.sort()
        views = self.fleet.views
        for i in range(0, len(ranked), HOST_PAGE):
            yield [views[h] for _, h in ranked[i:i + HOST_PAGE]]

    def store_plan(self, model: str, req: PlacementRequest) -> PlacementPlan | None:
        """The plan the store's pack finds for `req` in the pool of `model`: its pool policy's plan on the first
        of `store_pages` that has one, over one host per distinct state (allocation's `distinct_states`)."""
        assert self.pool_policies is not None
        policy = self.pool_policies[model]
        for page in self.store_pages(model, req):
            found = plan(req, distinct_states(page, req), policy)
            if found is not None:
                return found
        return None

    def _check(self, options: Sequence[tuple[str, PlacementRequest]], got: PlacementPlan | None) -> None:
        """Compare with `plan` over every host (the slow, obvious way)."""
        best: tuple[Score, PlacementPlan] | None = None
        for _model, req in options:
            found = plan(req, self.fleet.views, self.policy)
            if found is None:
                continue
            scored = plan_on_host(self.fleet.views[found.host_id], req, self.policy)
            assert scored is not None
            if best is None or scored[0] < best[0]:
                best = (scored[0], found)
        want = best[1] if best else None
        if (want and (want.host_id, want.devices)) != (got and (got.host_id, got.devices)):
            raise AssertionError(f"candidate filter changed the plan: {got} != {want}")


def demand_mix(catalog: Catalog, run_mode: str, nodes: Sequence[Node], tasks: Iterable[Task]) -> dict[TaskShape, float]:
    """How often each task shape (its profile on each model it may use, GPU count, vCPUs) is asked for in the trace,
    for the pack policy; memory is left out, as in FGD's typical tasks."""
    models = tuple(dict.fromkeys(n.model for n in nodes if n.gpus))
    geometries = {m: geometry_for(catalog, m, mode_of(catalog, m, run_mode)) for m in models}
    mix: Counter[TaskShape] = Counter()
    for t in tasks:
        if t.num_gpu == 0:
            continue
        profiles = (profile_for(catalog, g, t.gpu_milli) for m, g in geometries.items()
                    if t.models is None or m in t.models)
        mix[TaskShape(tuple(dict.fromkeys(p for p in profiles if p is not None)), t.num_gpu, t.cpu_milli,
                      models=t.models)] += 1
    return {shape: float(w) for shape, w in mix.items()}


def supply(nodes: Iterable[Node]) -> dict[str, float]:
    """GPUs per catalog model in the fleet, for the pack policy's price of scarce models' room."""
    out: Counter[str] = Counter()
    for n in nodes:
        out[n.model] += n.gpus
    return {m: float(k) for m, k in out.items() if k}


@dataclass(frozen=True)
class Job:
    """One replay: a trace, a mode, a policy and a seed."""

    trace_dir: str
    trace: str
    mode: str
    policy: str
    seed: int
    nodes_limit: int | None = None
    verify: bool = False
    # or "pure-first" / "store" / "cut": the user's rule (first model that fits), pure, in the store, or the store's
    # cut in the pure replay
    replay: str = "pure"


@cache
def _inputs(trace_dir: str, trace: str, nodes_limit: int | None) -> tuple[list[Node], list[Task]]:
    return load_nodes(Path(trace_dir), nodes_limit), load_tasks(Path(trace_dir), trace)


def run_job(job: Job) -> dict[str, Any]:
    """Replay one sequence; the measurements at 100% and at the end (a replay through the store stops at 100%)."""
    started = time.perf_counter()
    catalog = load_catalog()
    nodes, tasks = _inputs(job.trace_dir, job.trace, job.nodes_limit)
    capacity = sum(n.gpus for n in nodes)
    seq = arrival_sequence(tasks, capacity, job.seed)
    if job.replay == "store":
        with StoreReplay(catalog, job.mode, nodes, tasks) as store:
            out = measure(seq, capacity, store.place, stop_at_measure=True)
    else:
        demand = demand_mix(catalog, job.mode, nodes, tasks) if job.policy == "pack" else None
        pools = None
        if job.replay == "cut":
            models = preference(nodes)
            geometries = {m: geometry_for(catalog, m, mode_of(catalog, m, job.mode)) for m in models}
            declared = pool_demand(models, lambda m, milli: profile_for(catalog, geometries[m], milli), tasks)
            pools = {m: pool_policy("pack", json.dumps(d)) for m, d in declared.items()}
        replay = Replay(catalog, job.mode, nodes, get_policy(job.policy, demand, supply(nodes)), job.verify,
                        first_model=job.replay == "pure-first", pool_policies=pools)
        sizes: dict[str, float] = {}

        def place(task: Task) -> float | None:
            p = replay.place(task)
            if p is None:
                return None
            for d in p.devices:
                if d.profile not in sizes:
                    g = replay.fleet.views[p.host_id].gpus[d.gpu_id].occupancy.geometry
                    sizes[d.profile] = d.size / g.axis
            return sum(sizes[d.profile] for d in p.devices)

        out = measure(seq, capacity, place, stop_at_measure=job.replay != "pure")
    return {"trace": job.trace, "mode": job.mode, "policy": job.policy, "seed": job.seed, "replay": job.replay,
            **out, "seconds": time.perf_counter() - started}


def measure(seq: Sequence[Task], capacity: int, place: Callable[[Task], float | None],
            stop_at_measure: bool = False) -> dict[str, Any]:
    """Place the tasks in order (`place` gives the GPUs' worth a task's devices take, None if it failed): placed
    and consumed GPU share at 100% arrived and at the end, in % of capacity."""
    arrived = placed = consumed = 0.0
    at100: dict[str, float] | None = None
    failed = skipped = done = 0
    for task in seq:
        arrived += task.gpu_request
        done += 1
        if task.num_gpu == 0:
            skipped += 1
        else:
            took = place(task)
            if took is None:
                failed += 1
            else:
                placed += task.gpu_request
                consumed += took
        if at100 is None and arrived >= ARRIVED_MEASURE * capacity:
            at100 = {"placed": placed, "consumed": consumed}
            if stop_at_measure:
                break
    end = {"placed": placed, "consumed": consumed}
    at100 = at100 or end
    pct = 100.0 / capacity
    return {
        "placed_pct": at100["placed"] * pct, "consumed_pct": at100["consumed"] * pct,
        "placed_pct_end": end["placed"] * pct, "consumed_pct_end": end["consumed"] * pct,
        "arrived_pct_end": arrived * pct, "tasks": done, "skipped_cpu_only": skipped, "failed": failed,
    }


def preference(nodes: Sequence[Node]) -> tuple[str, ...]:
    """The fleet's GPU models, most GPUs first (ties by name): the order a user tries a task's models in."""
    have = supply(nodes)
    return tuple(sorted(have, key=lambda m: (-have[m], m)))


def pool_demand(models: Sequence[str], profile: Callable[[str, int], str | None],
                tasks: Iterable[Task]) -> dict[str, list[dict[str, Any]]]:
    """Per model, its pack pool's demand as the inventory declares it: the trace's task shapes on that model
    (`profile`: the profile a GPU share maps to on a model), weighted by how many tasks have them."""
    demand: dict[str, Counter[tuple[str, int, int]]] = {m: Counter() for m in models}
    for t in tasks:
        if t.num_gpu == 0:
            continue
        for m in models:
            p = profile(m, t.gpu_milli) if t.models is None or m in t.models else None
            if p is not None:
                demand[m][(p, t.num_gpu, t.cpu_milli)] += 1
    return {m: [{"profile": p, "gpus": g, "vcpus": c, "weight": float(w)} for (p, g, c), w in sorted(d.items())]
            for m, d in demand.items()}


class StoreReplay:
    """The fleet declared through an inventory file in a fresh SQLite store (simulated hosts, one `pack` pool per GPU
    model whose demand is the trace's task shapes on that model), and tasks placed as a user would: request_vm with
    the task's profile on each model it may use, most plentiful model first, the first that is not refused.
    vCPUs in milli-vCPUs as in the pure replay (a task asking for none asks for 1, as the store requires)."""

    def __init__(self, catalog: Catalog, run_mode: str, nodes: Sequence[Node], tasks: Iterable[Task]) -> None:
        import tempfile

        from vgpu_ctl import Controller

        self.catalog = catalog
        self.run_mode = run_mode
        self.models = preference(nodes)
        self.geometries = {m: geometry_for(catalog, m, mode_of(catalog, m, run_mode)) for m in self.models}
        self.pool = {m: f"gpu-{m.lower()}" for m in self.models}
        self._profiles: dict[tuple[str, int], str | None] = {}
        self._n = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-packing-")
        folder = Path(self._tmp.name)
        inventory = folder / "fleet.yaml"
        inventory.write_text(json.dumps(self.inventory(nodes, tasks)))  # JSON is YAML
        self._saved = os.environ.get("VGPU_CTL_STATE_DIR")
        os.environ["VGPU_CTL_STATE_DIR"] = str(folder / "state")
        self.ctl = Controller(f"sqlite:///{folder / 'store.db'}")
        self.ctl.apply_inventory(inventory)
        self.ctl.create_tenant("bench")

    def profile(self, model: str, gpu_milli: int) -> str | None:
        """The profile a GPU share maps to on `model` (cached)."""
        key = (model, gpu_milli)
        if key not in self._profiles:
            self._profiles[key] = profile_for(self.catalog, self.geometries[model], gpu_milli)
        return self._profiles[key]

    def inventory(self, nodes: Sequence[Node], tasks: Iterable[Task]) -> dict[str, Any]:
        """The inventory: pools with their demand, hosts with their GPUs."""
        demand = pool_demand(self.models, self.profile, tasks)
        pools = [{"name": self.pool[m], "policy": "pack", "demand": demand[m]} for m in self.models if demand[m]]
        with_demand = {m for m in self.models if demand[m]}
        hosts = []
        for i, n in enumerate(nodes):
            mode = mode_of(self.catalog, n.model, self.run_mode).value
            hosts.append({
                "name": f"node-{i:04d}", "uri": f"simulated:///node-{i:04d}", "driver": "simulated",
                "vcpus": n.cpu_milli, "memory_mib": n.memory_mib,
                "gpus": [{"pci": f"0000:{0x10 + j:02x}:00.0", "model": n.model, "mode": mode,
                          **({"pool": self.pool[n.model]} if n.model in with_demand else {})}
                         for j in range(n.gpus)]})
        return {"pools": pools, "hosts": hosts}

    def place(self, task: Task) -> float | None:
        """Request a VM for the task: the GPUs' worth its devices take, or None when every model refused it."""
        from vgpu_ctl import NoCapacity

        self._n += 1
        for m in self.models:
            if task.models is not None and m not in task.models:
                continue
            profile = self.profile(m, task.gpu_milli)
            if profile is None:
                continue
            try:
                vm = self.ctl.request_vm("bench", f"t{self._n}", [(profile, task.num_gpu)],
                                         vcpus=max(1, task.cpu_milli), memory_mib=max(1, task.memory_mib),
                                         pool=self.pool[m], provision=False)
            except NoCapacity:
                continue
            axis = self.geometries[m].axis
            return sum(d.size / axis for d in vm.devices)
        return None

    def __enter__(self) -> StoreReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctl.close()
        if self._saved is None:
            os.environ.pop("VGPU_CTL_STATE_DIR", None)
        else:
            os.environ["VGPU_CTL_STATE_DIR"] = self._saved
        self._tmp.cleanup()


def parse_seeds(text: str) -> list[int]:
    """`42..51` (inclusive) or `1,2,5`."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("..")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def _choices(text: str, known: Sequence[str], what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad:
        raise SystemExit(f"unknown {what} {', '.join(bad)} (known: {', '.join(known)})")
    return items


def summarize(results: Sequence[Mapping[str, Any]], traces: Sequence[str], modes: Sequence[str],
              policies: Sequence[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per trace x mode x policy (mean, min, max over seeds), and pack's verdict per trace x mode."""
    rows: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    for trace in traces:
        for mode in modes:
            means: dict[str, float] = {}
            for policy in policies:
                rs = [r for r in results if (r["trace"], r["mode"], r["policy"]) == (trace, mode, policy)
                      and r.get("replay", "pure") == "pure"]
                if not rs:
                    continue
                placed = [r["placed_pct"] for r in rs]
                means[policy] = statistics.fmean(placed)
                rows.append({
                    "trace": trace, "mode": mode, "policy": policy, "seeds": len(rs),
                    "placed_pct": means[policy], "placed_min": min(placed), "placed_max": max(placed),
                    "consumed_pct": statistics.fmean(r["consumed_pct"] for r in rs),
                    "placed_pct_end": statistics.fmean(r["placed_pct_end"] for r in rs),
                    "consumed_pct_end": statistics.fmean(r["consumed_pct_end"] for r in rs),
                    "failed_end": statistics.fmean(r["failed"] for r in rs),
                    "skipped_cpu_only": statistics.fmean(r["skipped_cpu_only"] for r in rs),
                    "seconds": sum(r["seconds"] for r in rs),
                })
            rivals = [p for p in ("first-fit", "best-fit") if p in means]
            if "pack" in means and rivals:
                verdicts.append({
                    "trace": trace, "mode": mode, "pack": means["pack"],
                    **{p: means[p] for p in rivals},
                    "pack_beats": all(means["pack"] > means[p] for p in rivals),
                })
    return rows, verdicts


STORE_GAP = 0.2  # points: how far the store's pack may be from the pure policy's


def summarize_store(results: Sequence[Mapping[str, Any]], traces: Sequence[str],
                    modes: Sequence[str]) -> list[dict[str, Any]]:
    """Per trace x mode, pack's placed% (mean over seeds): pure, best of the task's models; pure, the user's rule
    (first model that fits, most plentiful first); through the store and in the store's cut with the user's rule
    (each None when not run), with their gaps to the pure user's."""
    out = []
    for trace in traces:
        for mode in modes:
            means: dict[str, float] = {}
            for replay in ("pure", "pure-first", "store", "cut"):
                rs = [r["placed_pct"] for r in results if (r["trace"], r["mode"], r["policy"]) ==
                      (trace, mode, "pack") and r.get("replay", "pure") == replay]
                if rs:
                    means[replay] = statistics.fmean(rs)
            if "pure-first" not in means or not {"store", "cut"} & set(means):
                continue
            row: dict[str, Any] = {"trace": trace, "mode": mode, "pure": means.get("pure"),
                                   "pure_first": means["pure-first"]}
            for replay in ("store", "cut"):
                got = means.get(replay)
                gap = None if got is None else got - means["pure-first"]
                row |= {replay: got, f"{replay}_gap": gap, f"{replay}_within": gap is not None and
                        abs(gap) <= STORE_GAP}
            out.append(row)
    return out


def render_store(rows: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text table of pack through the store (and in the store's cut) beside the pure policy."""
    def num(v: float | None, width: int, sign: str = "") -> str:
        return f"{v:{sign}{width}.2f}" if v is not None else f"{'-':>{width}}"

    lines = ["", "pack through the store (request_vm, provision=False, SQLite, one pack pool per model) and in the "
             "store's cut (its candidate pages in the pure replay) beside the pure policy; placed% at 100% arrived; "
             "user = first model that fits, most plentiful first",
             f"{'trace':<11} {'mode':<10} {'pure best':>9} {'pure user':>9} {'store user':>10} {'gap':>6} "
             f"{'cut user':>8} {'gap':>6}  within {STORE_GAP} points"]
    for r in rows:
        within = [k for k in ("store", "cut") if r[k] is not None]
        lines.append(f"{r['trace']:<11} {r['mode']:<10} {num(r['pure'], 9)} {num(r['pure_first'], 9)} "
                     f"{num(r['store'], 10)} {num(r['store_gap'], 6, '+')} {num(r['cut'], 8)} "
                     f"{num(r['cut_gap'], 6, '+')}  "
                     + ("yes" if all(r[f"{k}_within"] for k in within) else "NO"))
    return "\n".join(lines)


def render(header: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], verdicts: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text table."""
    lines = [
        f"openb replay (FGD method): {header['nodes']} nodes, {header['gpus']} GPUs, seeds {header['seeds']}"
        + (" (default: 3 seeds; the paper's 10 are --seeds 42..51)" if header["seeds"] == DEFAULT_SEEDS else ""),
        f"machine: {header['processor'] or header['machine']}, {header['cpus']} CPUs; date {header['date']}; "
        f"wall {header['wall_seconds']:.1f} s",
        "placed% = placed tasks' GPU share / GPUs at 100% arrived (mean [min-max] over seeds); "
        "consumed% = profile sizes / GPUs at 100%; @130 = at the end; time = replay seconds summed over seeds",
        "vgpu-mixed: T4 and V100 GPUs stay vgpu-equal; mig: only A100-80GB/H100-80GB use MIG, the rest vgpu-equal; "
        "tasks with no GPU are skipped",
        "",
    ]
    cols = f"{'trace':<11} {'mode':<10} {'policy':<9} {'placed%':>7} {'[min-max]':<13} {'consumed%':>9} " \
           f"{'placed%@130':>11} {'time s':>7}"
    lines += [cols, "-" * len(cols)]
    for r in rows:
        span = f"[{r['placed_min']:.2f}-{r['placed_max']:.2f}]"
        lines.append(f"{r['trace']:<11} {r['mode']:<10} {r['policy']:<9} {r['placed_pct']:7.2f} {span:<13} "
                     f"{r['consumed_pct']:9.2f} {r['placed_pct_end']:11.2f} {r['seconds']:7.1f}")
    lines.append("")
    for v in verdicts:
        rivals = ", ".join(f"{p} {v[p]:.2f}" for p in ("first-fit", "best-fit") if p in v)
        lines.append(f"{v['trace']} / {v['mode']}: pack {v['pack']:.2f} vs {rivals}: "
                     f"{'pack beats both' if v['pack_beats'] else 'pack does NOT beat both'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--seeds", default=DEFAULT_SEEDS, help="e.g. 42..51 or 42,43 (default %(default)s)")
    ap.add_argument("--trace", default=",".join(TRACES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--nodes-limit", type=int, default=None, help="use only the first N nodes (quick runs)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)")
    ap.add_argument("--verify", action="store_true", help="check every plan against plan() over all hosts (slow)")
    ap.add_argument("--store", action="store_true",
                    help="also replay pack through the Controller and a SQLite store, beside the pure policy with the "
                         "same user's rule (slow: minutes per trace, mode and seed)")
    ap.add_argument("--cut", action="store_true",
                    help="also replay pack on the store's candidate pages in the pure replay (the store's cut: its "
                         "hosts, order, pages and pool policies, without the store; seconds, not minutes), beside "
                         "the pure policy with the user's rule")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    traces = _choices(args.trace, TRACES, "trace")
    modes = _choices(args.modes, MODES, "mode")
    policies = _choices(args.policies, tuple(POLICY_NAMES), "policy")
    seeds = parse_seeds(args.seeds)
    trace_dir = str(args.trace_dir.resolve())
    nodes = load_nodes(Path(trace_dir), args.nodes_limit)
    jobs = [Job(trace_dir, t, m, p, s, args.nodes_limit, args.verify)
            for t in traces for m in modes for p in policies for s in seeds]
    if args.store or args.cut:
        kinds = ("pure-first", *(("store",) if args.store else ()), *(("cut",) if args.cut else ()))
        jobs += [Job(trace_dir, t, m, "pack", s, args.nodes_limit, replay=r)
                 for t in traces for m in modes for s in seeds for r in kinds]
    started = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(run_job, jobs))
    else:
        results = [run_job(j) for j in jobs]
    header = {
        "nodes": len(nodes), "gpus": sum(n.gpus for n in nodes), "seeds": args.seeds,
        "processor": platform.processor(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - started,
    }
    rows, verdicts = summarize(results, traces, modes, policies)
    store = summarize_store(results, traces, modes) if args.store or args.cut else []
    if args.json:
        print(json.dumps({"header": header, "rows": rows, "verdicts": verdicts, "store": store, "runs": results},
                         indent=2))
    else:
        print(render(header, rows, verdicts) + (render_store(store) if store else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
