#!/usr/bin/env python3
"""Benchmark VM placement through the store (Controller.request_vm) against the pure placement core.

For each fleet size (GPUs, 8 per host; hosts alternate A100-80GB vgpu-equal / A100-80GB / H100-80GB mig /
L40S vgpu-mixed, i.e. 50 % / 25 % / 25 % of the GPUs, in the pools `ampere`, `hopper`, `ada`, each with the
pack policy and a demand mix), one fresh SQLite store in a temporary folder:

1. build: pools, tenants and quotas through the Controller; hosts and GPUs through `apply_declaration`
   (`--build declare`) or bulk-inserted with SQLAlchemy Core into the same tables (`--build bulk`; default
   `auto`: declare up to 10,000 GPUs, bulk above). The fleet is then pre-filled with bulk-inserted VMs and
   devices consistent with the geometry (GPU layout/free_units/active_type/device_count, host and tenant
   usage), to the level from which the timed window ends near 90 % full.
2. core: the same request sequence through `vgpu_ctl.core.placement.plan` over in-memory HostViews of the
   same (pre-filled) fleet, no store. The candidates come from an in-memory index that yields exactly the
   candidate pages the store's query yields (same filter, order and page size), so both make the same choice;
   the `agree` column counts requests where store and core chose the same GPUs and positions (or both refused).
3. store: the timed window: `Controller.request_vm(..., provision=False)`, one request at a time, until the
   requests are used up or the fleet is 90 % full. Timed: the whole call (read and plan, then the claim's
   write transaction, and the VmInfo it returns); no host is touched.
4. clients (--clients N, default 2): from a copy of the pre-filled store, the same requests from N processes
   at once (request i from process i mod N), all starting together: placements per wall-clock second of the
   window, and the latency of every request. What several controller processes on one store do.
5. provision (smaller run, first size only): from a copy of the pre-filled store, the same first requests with
   `provision=False` and with `provision=True` through simulated hosts, to show provisioning's extra cost.

Fill is measured by GPU axis units, each GPU counted by its share: sum((axis - free) / axis) / GPUs.
Each phase runs in its own forked process, so "peak MiB" is the maximum resident set of the store phase.

Usage: bench_placement.py [--sizes 1000,10000,100000] [--requests 2000] [--json] [--build auto|declare|bulk]
       [--provision-requests 200] [--clients 2] [--seed 7] [--profile DIR] [--in-process]
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import contextlib
import cProfile
import datetime as dt
import importlib
import json
import math
import multiprocessing
import os
import platform
import random
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from vgpu_ctl.catalog import Catalog, load_catalog
from vgpu_ctl.core.geometry import FIT_BITS, Mode, Occupancy, fit_mask, geometry_for, profile_bit
from vgpu_ctl.core.placement import (
    CandidateOrder,
    GpuView,
    HostView,
    PlacementPlan,
    PlacementRequest,
    host_rank,
    plan,
)
from vgpu_ctl.errors import NoCapacity
from vgpu_ctl.inventory import GpuDecl, HostDecl, InventoryDecl, PoolDecl
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.claim import pool_policy
from vgpu_ctl.service.controller import Controller
from vgpu_ctl.store import candidate_pages, tables
from vgpu_ctl.store.models import utcnow
from vgpu_ctl.store.tables import POOL, VM

GPUS_PER_HOST = 8
FILL_TARGET = 0.90
DECLARE_MAX = 10_000
TENANTS = ("t0", "t1", "t2", "t3")  # t2: global limits; t3: a pool-scoped limit (both never reached)
HOST_VCPUS, CPU_OVERCOMMIT = 128, 4.0
HOST_MEMORY_MIB = 2 * 1024 * 1024
COLUMNS = (
    "fleet GPUs",
    "build",
    "prefill %",
    "requests",
    "placed",
    "refused",
    "fill %",
    "placements/s",
    "p50 ms",
    "p99 ms",
    "peak MiB",
    "core placements/s",
    "store/core",
    "agree",
    "raw sqlite3/s",
    "store/raw",
)


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the benchmark fleet: its GPUs and the profile mix its tenants ask for."""

    name: str
    model: str
    mode: Mode
    share: int  # hosts of every 4
    mix: tuple[tuple[str, int], ...]  # single-GPU profiles and weights
    whole: str  # the whole-GPU profile (also used for 2-GPU VMs)
    multi_weight: int  # weight of 2-GPU VMs (2 x whole) beside the mix


POOLS = (
    PoolSpec(
        "ampere",
        "A100-80GB",
        Mode.VGPU_EQUAL,
        2,
        (
            ("A100D-4C", 20),
            ("A100D-8C", 25),
            ("A100D-10C", 15),
            ("A100D-16C", 8),
            ("A100D-20C", 12),
            ("A100D-40C", 10),
            ("A100D-80C", 6),
        ),
        "A100D-80C",
        2,
    ),
    PoolSpec(
        "hopper",
        "H100-80GB",
        Mode.MIG,
        1,
        (
            ("1g.10gb", 22),
            ("H100-1-10C", 6),
            ("1g.20gb", 14),
            ("2g.20gb", 20),
            ("3g.40gb", 15),
            ("4g.40gb", 7),
            ("7g.80gb", 6),
        ),
        "7g.80gb",
        2,
    ),
    PoolSpec(
        "ada",
        "L40S",
        Mode.VGPU_MIXED,
        1,
        (
            ("L40S-4C", 20),
            ("L40S-6C", 14),
            ("L40S-8C", 20),
            ("L40S-12C", 15),
            ("L40S-16C", 8),
            ("L40S-24C", 10),
            ("L40S-48C", 6),
        ),
        "L40S-48C",
        2,
    ),
)
HOST_POOL = ("ampere", "ampere", "hopper", "ada")  # host i belongs to HOST_POOL[i % 4]


@dataclass(frozen=True)
class Req:
    """One request of the sequence."""

    index: int
    tenant: str
    pool: str
    profiles: tuple[str, ...]
    vcpus: int
    memory_mib: int


def _spec(name: str) -> PoolSpec:
    return next(p for p in POOLS if p.name == name)


def _frac(catalog: Catalog, spec: PoolSpec, profile: str) -> float:
    geom = geometry_for(catalog, spec.model, spec.mode)
    return geom.shapes[profile].size / geom.axis


def vm_size(frac: float) -> tuple[int, int]:
    """vCPUs and memory of a VM holding `frac` of a GPU per vGPU."""
    vcpus = 2 + int(30 * frac)
    return vcpus, vcpus * 4096


def pool_demand(catalog: Catalog, spec: PoolSpec) -> list[dict[str, Any]]:
    """The pool's typical requests as its inventory declares them: each profile of the mix with the vCPUs and
    memory its VMs get, and the 2-GPU VM (what pack keeps room for)."""
    tasks = []
    for name, w in spec.mix:
        vcpus, mem = vm_size(_frac(catalog, spec, name))
        tasks.append({"profile": name, "gpus": 1, "vcpus": vcpus, "memory_mib": mem, "weight": float(w)})
    vcpus, mem = vm_size(_frac(catalog, spec, spec.whole))
    tasks.append(
        {
            "profile": spec.whole,
            "gpus": 2,
            "vcpus": 2 * vcpus,
            "memory_mib": 2 * mem,
            "weight": float(spec.multi_weight),
        }
    )
    return tasks


def request_sequence(catalog: Catalog, seed: int, n: int) -> list[Req]:
    """The window's requests: a pool by GPU share, then a profile from the pool's mix, or a 2-GPU VM."""
    rng = random.Random(seed)
    pools = [p for p in POOLS for _ in range(p.share)]
    out = []
    for i in range(n):
        spec = rng.choice(pools)
        names = [p for p, _ in spec.mix] + ["2x"]
        weights = [w for _, w in spec.mix] + [spec.multi_weight]
        pick = rng.choices(names, weights)[0]
        profiles = (spec.whole, spec.whole) if pick == "2x" else (pick,)
        vcpus, mem = vm_size(_frac(catalog, spec, profiles[0]))
        out.append(Req(i, TENANTS[i % len(TENANTS)], spec.name, profiles, vcpus * len(profiles), mem * len(profiles)))
    return out


def expected_fill(catalog: Catalog, n_gpus: int, n_requests: int) -> float:
    """The fleet share the window's requests are expected to take."""
    total = 0.0
    for spec in POOLS:
        w_all = sum(w for _, w in spec.mix) + spec.multi_weight
        per = (sum(w * _frac(catalog, spec, p) for p, w in spec.mix) + spec.multi_weight * 2) / w_all
        total += per * spec.share / sum(p.share for p in POOLS)
    return total * n_requests / max(n_gpus, 1)


# -- building the fleet ---------------------------------------------------------------------------------------


def fleet_layout(n_gpus: int) -> list[tuple[str, str, int]]:
    """(host name, pool, GPUs) per host, in id order."""
    hosts = []
    left = n_gpus
    i = 0
    while left > 0:
        k = min(GPUS_PER_HOST, left)
        pool = HOST_POOL[i % len(HOST_POOL)]
        hosts.append((f"{pool}-h{i:06d}", pool, k))
        left -= k
        i += 1
    return hosts


def _pci(k: int) -> str:
    return f"0000:{0x41 + k:02x}:00.0"


def _labels(i: int) -> dict[str, str]:
    return {"zone": f"z{i % 3}", "rack": f"r{i // 16}"}


def build_store(url: str, state: Path, catalog: Catalog, n_gpus: int, build: str) -> str:
    """Pools, tenants, quotas, hosts and GPUs; returns the build path used."""
    ctl = Controller(url, catalog=catalog, state_path=state)
    try:
        path = build if build != "auto" else ("declare" if n_gpus <= DECLARE_MAX else "bulk")
        pools = [
            PoolDecl(
                name=p.name,
                policy="pack",
                description=f"{p.model} {p.mode.value}",
                demand=pool_demand(catalog, p),  # type: ignore[arg-type]  # validated into TaskDecls
            )
            for p in POOLS
        ]
        hosts = []
        if path == "declare":
            for i, (name, pool, k) in enumerate(fleet_layout(n_gpus)):
                spec = _spec(pool)
                hosts.append(
                    HostDecl(
                        name=name,
                        uri=f"simulated:///{name}",
                        driver="simulated",
                        labels=_labels(i),
                        vcpus=HOST_VCPUS,
                        memory_mib=HOST_MEMORY_MIB,
                        cpu_overcommit=CPU_OVERCOMMIT,
                        gpus=[GpuDecl(pci=_pci(j), model=spec.model, mode=spec.mode, pool=pool) for j in range(k)],
                    )
                )
        ctl.apply_declaration(InventoryDecl(pools=pools, hosts=hosts), source="bench")
        if path == "bulk":
            _bulk_hosts(ctl, catalog, n_gpus)
        for t in TENANTS:
            ctl.create_tenant(t)
        ctl.set_quota("t2", {"vms": 10**9, "vgpus": 10**9, "framebuffer_mib": 10**12})
        ctl.set_quota("t3", {"vgpus": 10**9}, pool="ampere")
        return path
    finally:
        ctl.close()


def _bulk_hosts(ctl: Controller, catalog: Catalog, n_gpus: int) -> None:
    with ctl.tx() as conn:
        pool_ids = {r.name: r.id for r in conn.execute(select(POOL.c.name, POOL.c.id))}
        layout = fleet_layout(n_gpus)
        conn.execute(
            tables.HOST.insert(),
            [
                {
                    "id": i + 1,
                    "name": name,
                    "uri": f"simulated:///{name}",
                    "driver": "simulated",
                    "vgpu_backing": "mdev",
                    "labels": _labels(i),
                    "vcpus": HOST_VCPUS,
                    "memory_mib": HOST_MEMORY_MIB,
                    "cpu_overcommit": CPU_OVERCOMMIT,
                    "memory_overcommit": 1.0,
                    "used_vcpus": 0,
                    "used_memory_mib": 0,
                    "state": "active",
                }
                for i, (name, _pool, _k) in enumerate(layout)
            ],
        )
        rows: list[dict[str, Any]] = []
        for i, (_name, pool, k) in enumerate(layout):
            spec = _spec(pool)
            axis = geometry_for(catalog, spec.model, spec.mode).axis
            rows.extend(
                {
                    "host_id": i + 1,
                    "pci_address": _pci(j),
                    "model": spec.model,
                    "mode": spec.mode.value,
                    "pool_id": pool_ids[pool],
                    "pinned_type": None,
                    "mig_layout": "",
                    "axis_units": axis,
                    "free_units": axis,
                    "active_type": None,
                    "layout": "",
                    "device_count": 0,
                    "fits": fit_mask(Occupancy(geometry_for(catalog, spec.model, spec.mode))),
                    "version": 0,
                }
                for j in range(k)
            )
        for c in range(0, len(rows), 20_000):
            conn.execute(tables.GPU.insert(), rows[c : c + 20_000])


def _fill_gpu(rng: random.Random, occ: Occupancy, spec: PoolSpec, target: float) -> Occupancy:
    if rng.random() < 0.15:
        return occ.add(spec.whole, 0)
    names = [p for p, _ in spec.mix if p != spec.whole]
    weights = [w for p, w in spec.mix if p != spec.whole]
    axis = occ.geometry.axis
    one = rng.choices(names, weights)[0] if occ.geometry.homogeneous else None  # equal-size: one type per GPU
    misses = 0
    while (axis - occ.free_units) / axis < target and misses < 8:
        p = one or rng.choices(names, weights)[0]
        starts = occ.fit_starts(p) if occ.misfit(p) is None else ()
        if not starts:
            if one:
                break
            misses += 1
            continue
        occ = occ.add(p, starts[0])
    return occ


def prefill(url: str, catalog: Catalog, target: float, seed: int) -> float:
    """Fill GPUs in random order, each to a drawn level, until the fleet is `target` full; the fill reached."""
    from vgpu_ctl.store.engine import make_engine

    engine = make_engine(url)
    rng = random.Random(seed)
    try:
        with engine.begin() as conn:
            gpus = conn.execute(select(tables.GPU.c.id, tables.GPU.c.host_id, tables.GPU.c.pool_id)).all()
            pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
            tenants = {r.name: r.id for r in conn.execute(select(tables.TENANT.c.name, tables.TENANT.c.id))}
            order = list(gpus)
            rng.shuffle(order)
            goal = target * len(gpus)
            filled = 0.0
            gpu_updates: list[dict[str, Any]] = []
            host_use: dict[int, list[int]] = {}
            t_use = {t: [0, 0, 0, 0, 0] for t in TENANTS[:3]}
            vms: list[dict[str, Any]] = []
            devs: list[dict[str, Any]] = []
            now = utcnow()
            n_vm = 0
            for g in order:
                if filled >= goal:
                    break
                spec = _spec(pools[g.pool_id])
                geom = geometry_for(catalog, spec.model, spec.mode)
                occ = _fill_gpu(rng, Occupancy(geom), spec, rng.uniform(0.8, 1.0))
                filled += (geom.axis - occ.free_units) / geom.axis
                gpu_updates.append({"g_id": g.id, **{f"g_{k}": v for k, v in alloc.gpu_state(occ).items()}})
                for s in occ.slots:
                    shape = geom.shapes[s.profile]
                    vcpus, mem = vm_size(shape.size / geom.axis)
                    tenant = TENANTS[n_vm % 3]
                    n_vm += 1
                    vm_id, dev_id = str(uuid.uuid4()), str(uuid.uuid4())
                    delta = {
                        "vms": 1,
                        "vgpus": 1,
                        "framebuffer_mib": shape.framebuffer_mib,
                        "vcpus": vcpus,
                        "memory_mib": mem,
                    }
                    vms.append(
                        {
                            "id": vm_id,
                            "tenant_id": tenants[tenant],
                            "name": f"pre{n_vm:07d}",
                            "pool_id": g.pool_id,
                            "host_id": g.host_id,
                            "vcpus": vcpus,
                            "memory_mib": mem,
                            "framebuffer_mib": shape.framebuffer_mib,
                            "state": "running",
                            "idempotency_key": None,
                            "anti_affinity": None,
                            "domain_uuid": None,
                            "template": "domain.xml.j2",
                            "error": None,
                            "created_at": now,
                            "updated_at": now,
                            "spec": {
                                "vgpus": [[s.profile, 1]],
                                "labels": {},
                                "delta": delta,
                                "charges": [],
                                "disk_gib": 20,
                                "network": "default",
                            },
                        }
                    )
                    devs.append(
                        {
                            "id": dev_id,
                            "gpu_id": g.id,
                            "vm_id": vm_id,
                            "profile": s.profile,
                            "kind": shape.kind.value,
                            "start": s.start,
                            "size": s.size,
                            "framebuffer_mib": shape.framebuffer_mib,
                            "uuid": dev_id,
                            "backing": "mig" if shape.kind.value == "mig" else "mdev",
                            "handle": {},
                            "state": "ready",
                        }
                    )
                    hu = host_use.setdefault(g.host_id, [0, 0])
                    hu[0] += vcpus
                    hu[1] += mem
                    for k, v in enumerate(delta.values()):
                        t_use[tenant][k] += v
                if len(vms) >= 20_000:
                    _flush(conn, vms, devs)
            _flush(conn, vms, devs)
            from sqlalchemy import bindparam

            upd = (
                tables.GPU.update()
                .where(tables.GPU.c.id == bindparam("g_id"))
                .values(
                    {name: bindparam(f"g_{name}") for name in alloc.GPU_STATE_COLUMNS}
                    | {"version": tables.GPU.c.version + 1}
                )
            )
            for c in range(0, len(gpu_updates), 20_000):
                conn.execute(upd, gpu_updates[c : c + 20_000])
            hupd = (
                tables.HOST.update()
                .where(tables.HOST.c.id == bindparam("h_id"))
                .values(used_vcpus=bindparam("uv"), used_memory_mib=bindparam("um"))
            )
            if host_use:
                conn.execute(hupd, [{"h_id": h, "uv": v[0], "um": v[1]} for h, v in host_use.items()])
            for t, use in t_use.items():
                conn.execute(
                    tables.TENANT.update()
                    .where(tables.TENANT.c.id == tenants[t])
                    .values(
                        vms_used=use[0],
                        vgpus_used=use[1],
                        framebuffer_mib_used=use[2],
                        vcpus_used=use[3],
                        memory_mib_used=use[4],
                    )
                )
        return filled / max(len(gpus), 1)
    finally:
        engine.dispose()


def _flush(conn: Any, vms: list[dict[str, Any]], devs: list[dict[str, Any]]) -> None:
    if vms:
        conn.execute(VM.insert(), vms)
        conn.execute(tables.DEVICE.insert(), devs)
    vms.clear()
    devs.clear()


# -- the pure core over an in-memory fleet ----------------------------------------------------------------------


@dataclass
class _Gpu:
    id: int
    host_id: int
    pci: str
    pool: str
    occ: Occupancy


@dataclass
class _Host:
    id: int
    name: str
    cap_vcpus: float
    cap_mem: float
    used_vcpus: int
    used_mem: int
    state: str
    labels: dict[str, str]


@dataclass
class CoreFleet:
    """The fleet in memory, with an index giving the same candidate pages as the store's query."""

    catalog: Catalog
    gpus: dict[int, _Gpu]
    hosts: dict[int, _Host]
    # (pool, model, mode) -> free_units -> sorted GPU ids (ids follow host order, as the query's tie-break)
    buckets: dict[tuple[str, str, str], dict[int, list[int]]] = field(default_factory=dict)
    # the store's host_fit in memory: (pool, model, mode, bit) -> host id -> (n_fit, free units), and per key the
    # pack order (`host_rank`: widest, then mean free units, then host id) of the hosts with n_fit > 0, sorted
    # (the host_fit_by_width index's order); the hosts' widths by (pool, model, mode, host id)
    summary: dict[tuple[str, str, str, int], dict[int, tuple[int, int]]] = field(default_factory=dict)
    ranked: dict[tuple[str, str, str, int], list[tuple[float, ...]]] = field(default_factory=dict)
    widths: dict[tuple[str, str, str, int], int] = field(default_factory=dict)
    by_host: dict[int, list[_Gpu]] = field(default_factory=dict)

    @classmethod
    def load(cls, url: str, catalog: Catalog) -> CoreFleet:
        """Read the fleet from the store."""
        from vgpu_ctl.store.engine import make_engine

        engine = make_engine(url)
        with engine.connect() as conn:
            pools = {r.id: r.name for r in conn.execute(select(POOL.c.id, POOL.c.name))}
            hosts = {
                h.id: _Host(
                    h.id,
                    h.name,
                    h.vcpus * h.cpu_overcommit,
                    h.memory_mib * h.memory_overcommit,
                    h.used_vcpus,
                    h.used_memory_mib,
                    h.state,
                    alloc._labels(h.labels),
                )
                for h in conn.execute(select(*candidate_pages.HOST_COLUMNS))
            }
            gpus = {
                r.id: _Gpu(r.id, r.host_id, r.pci_address, pools[r.pool_id], alloc.occupancy_of(catalog, r._mapping))
                for r in conn.execute(select(*candidate_pages.GPU_COLUMNS).order_by(tables.GPU.c.id))
            }
        engine.dispose()
        fleet = cls(catalog, gpus, hosts)
        for g in gpus.values():
            wkey = (g.pool, g.occ.geometry.model, g.occ.geometry.mode.value, g.host_id)
            fleet.widths[wkey] = fleet.widths.get(wkey, 0) + 1
        for g in gpus.values():
            fleet._bucket(g).setdefault(g.occ.free_units, []).append(g.id)
            fleet.by_host.setdefault(g.host_id, []).append(g)
            fleet._summarize(g, 1)
        return fleet

    def _bucket(self, g: _Gpu) -> dict[int, list[int]]:
        geom = g.occ.geometry
        return self.buckets.setdefault((g.pool, geom.model, geom.mode.value), {})

    def _clauses(self, pool: str, profiles: Sequence[str]) -> list[tuple[tuple[str, str, str], int, str]]:
        out = []
        for name in set(profiles):
            for model in self.catalog.models_offering(name):
                p = self.catalog.profile(model, name)
                assert p is not None
                for mode in alloc.modes_for(p.kind):
                    shape = geometry_for(self.catalog, model, mode).shape(name)
                    if shape is not None:
                        out.append(((pool, model, mode), shape.size, name))
        return out

    def _matching(self, pool: str, req: PlacementRequest) -> Iterator[_Gpu]:
        """GPUs passing the store's WHERE, in its ORDER BY (free_units, host_id, id)."""
        clauses = [c for c in self._clauses(pool, req.profiles) if c[0] in self.buckets]
        if not clauses:
            return
        lo = min(size for _, size, _ in clauses)
        hi = max(max(self.buckets[k], default=0) for k, _, _ in clauses)
        for free in range(lo, hi + 1):
            ids: list[int] = []
            for key, size, _ in clauses:
                if free >= size:
                    ids.extend(self.buckets[key].get(free, ()))
            if len(clauses) > 1:
                ids = sorted(set(ids))
            for gid in ids:
                g = self.gpus[gid]
                if self._gpu_ok(g, free, clauses) and self._host_ok(self.hosts[g.host_id], req):
                    yield g

    @staticmethod
    def _gpu_ok(g: _Gpu, free: int, clauses: Sequence[tuple[tuple[str, str, str], int, str]]) -> bool:
        geom = g.occ.geometry
        for (_pool, model, mode), size, name in clauses:
            if (
                geom.model == model
                and geom.mode.value == mode
                and free >= size
                and fit_mask(g.occ) & profile_bit(geom, name)
            ):
                return True
        return False

    @staticmethod
    def _host_ok(h: _Host, req: PlacementRequest) -> bool:
        return (
            h.state == "active" and h.used_vcpus + req.vcpus <= h.cap_vcpus and h.used_mem + req.memory_mib <= h.cap_mem
        )

    def _views(self, gpus: Sequence[_Gpu], whole: bool = False) -> list[HostView]:
        by_host: dict[int, list[_Gpu]] = {}
        for g in gpus:
            by_host.setdefault(g.host_id, []).append(g)
        views = []
        for hid in sorted(by_host):
            h = self.hosts[hid]
            views.append(
                HostView(
                    h.id,
                    h.name,
                    h.cap_vcpus - h.used_vcpus,
                    h.cap_mem - h.used_mem,
                    tuple(GpuView(g.id, g.pci, g.occ, g.pool) for g in by_host[hid]),
                    h.state,
                    h.labels,
                    frozenset(),
                    order=h.id,
                    gpu_count=len(by_host[hid]) if whole else None,
                )
            )
        return views

    def pages(self, pool: str, req: PlacementRequest) -> Iterator[list[HostView]]:
        """The candidate pages `allocation.candidate_pages` gives for the request in the pool (every pool here
        is pack's, which scores whole hosts)."""
        if len(set(req.profiles)) == 1:
            yield from self._host_pages(pool, req)
            return
        per_host: dict[int, list[_Gpu]] = {}
        for g in self._matching(pool, req):
            per_host.setdefault(g.host_id, []).append(g)
        ranked = sorted(
            (sum(g.occ.free_units for g in gs), hid) for hid, gs in per_host.items() if len(gs) >= len(req.profiles)
        )
        step = alloc.HOST_PAGE
        for c in range(0, len(ranked), step):
            yield self._views([g for _, hid in ranked[c : c + step] for g in per_host[hid]])

    def _host_pages(self, pool: str, req: PlacementRequest) -> Iterator[list[HostView]]:
        """Whole hosts by their summaries, as `allocation._host_pages` reads them: hosts with as many GPUs of
        one placeable that can take the profile as the request has vGPUs, in pack's order (`host_rank`: the
        widest first, then the fullest by the mean free units of those GPUs, then host id), merged over the
        placeables."""
        lists: list[tuple[tuple[str, str, str, int], list[tuple[float, ...]]]] = []
        for (p, model, mode), _size, name in self._clauses(pool, req.profiles):
            skey = (p, model, mode, profile_bit(geometry_for(self.catalog, model, mode), name))
            if self.ranked.get(skey):
                lists.append((skey, self.ranked[skey]))
        ndev = len(req.profiles)
        ordered: Iterator[int]
        if len(lists) == 1:  # one placeable: its index range, in order
            one, r = lists[0]
            ordered = (int(k[-1]) for k in r if self.summary[one][int(k[-1])][0] >= ndev)
        else:  # several: merged by each host's best key
            best: dict[int, tuple[float, ...]] = {}
            for skey, r in lists:
                for k in r:
                    hid = int(k[-1])
                    if self.summary[skey][hid][0] >= ndev and (hid not in best or k < best[hid]):
                        best[hid] = k
            ordered = iter(sorted(best, key=best.__getitem__))
        page: list[int] = []
        for hid in ordered:
            if self._host_ok(self.hosts[hid], req):
                page.append(hid)
            if len(page) == alloc.HOST_PAGE:
                yield self._views([g for h in page for g in self.by_host[h] if g.pool == pool], whole=True)
                page = []
        if page:
            yield self._views([g for h in page for g in self.by_host[h] if g.pool == pool], whole=True)

    def _summarize(self, g: _Gpu, sign: int) -> None:
        """Add (sign 1) or take off (-1) a GPU's part of its host's summaries."""
        geom = g.occ.geometry
        mask = fit_mask(g.occ)
        for b in range(FIT_BITS):
            if not mask & (1 << b):
                continue
            key = (g.pool, geom.model, geom.mode.value, 1 << b)
            per = self.summary.setdefault(key, {})
            n, free = per.get(g.host_id, (0, 0))
            ranked = self.ranked.setdefault(key, [])
            width = self.widths[(g.pool, geom.model, geom.mode.value, g.host_id)]
            if n:
                ranked.pop(bisect.bisect_left(ranked, self._rank(width, n, free, g.host_id)))
            n, free = n + sign, free + sign * g.occ.free_units
            per[g.host_id] = (n, free)
            if n:
                bisect.insort(ranked, self._rank(width, n, free, g.host_id))

    @staticmethod
    def _rank(width: int, n_fit: int, free: int, host_id: int) -> tuple[float, ...]:
        """A host summary's place in pack's whole-host pages (every pool here is pack's, a policy with a host
        cost: the order ranks widest first whatever the policy's GPU order)."""
        return host_rank(CandidateOrder.FULLEST_FIRST, True, width, free / n_fit, host_id)

    def apply(self, req: PlacementRequest, chosen: PlacementPlan) -> None:
        """Record a plan: the GPUs' new occupancy and the host's usage."""
        for gid, occ in chosen.occupancies.items():
            g = self.gpus[gid]
            old = self._bucket(g)[g.occ.free_units]
            old.pop(bisect.bisect_left(old, gid))
            self._summarize(g, -1)
            g.occ = occ
            self._summarize(g, 1)
            bisect.insort(self._bucket(g).setdefault(occ.free_units, []), gid)
        h = self.hosts[chosen.host_id]
        h.used_vcpus += req.vcpus
        h.used_mem += req.memory_mib


# -- phases (each in its own process) -------------------------------------------------------------------------


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fill_step(catalog: Catalog, req: Req) -> float:
    spec = _spec(req.pool)
    return sum(_frac(catalog, spec, p) for p in req.profiles)


def phase_build(url: str, state: str, n_gpus: int, build: str, target: float, seed: int,
                empty_copy: str | None = None) -> dict[str, Any]:
    """Build and pre-fill the store (a copy of the empty fleet to `empty_copy` first, when given)."""
    catalog = load_catalog()
    t0 = time.perf_counter()
    path = build_store(url, Path(state), catalog, n_gpus, build)
    if empty_copy:
        _backup(Path(url.removeprefix("sqlite:///")), Path(empty_copy))
    t1 = time.perf_counter()
    fill = prefill(url, catalog, target, seed + 1) if target > 0 else 0.0
    return {
        "build": path,
        "build_s": t1 - t0,
        "prefill_s": time.perf_counter() - t1,
        "prefill": fill,
        "build_peak_mib": _peak_mib(),
    }


def phase_core(url: str, n_requests: int, seed: int, start_fill: float, n_gpus: int) -> dict[str, Any]:
    """The request sequence through the pure core over the in-memory fleet."""
    catalog = load_catalog()
    fleet = CoreFleet.load(url, catalog)
    policies = {p.name: pool_policy("pack", json.dumps(pool_demand(catalog, p))) for p in POOLS}
    fill = start_fill * n_gpus
    lat: list[float] = []
    results: list[Any] = []
    cpu0 = time.process_time()
    for r in request_sequence(catalog, seed, n_requests):
        if fill >= FILL_TARGET * n_gpus:
            break
        preq = PlacementRequest(r.profiles, r.vcpus, r.memory_mib)
        t0 = time.perf_counter()
        chosen = None
        for page in fleet.pages(r.pool, preq):
            chosen = plan(preq, page, policies[r.pool])
            if chosen is not None:
                break
        if chosen is not None:
            fleet.apply(preq, chosen)
        lat.append(time.perf_counter() - t0)
        if chosen is None:
            results.append(None)
        else:
            fill += _fill_step(catalog, r)
            results.append([chosen.host, sorted([d.gpu_id, d.start, d.profile] for d in chosen.devices)])
    return {"latencies": lat, "results": results, "peak_mib": _peak_mib(), "cpu_s": time.process_time() - cpu0}


# What `request_vm` imports on first use (service/hosts.py opens a host's driver module, request_vm and the claim
# import provisioning and scheduling lazily so that the CLI starts fast).
LAZY_IMPORTS = ("vgpu_ctl.service.provision", "vgpu_ctl.service.scheduling", "vgpu_ctl.hosts.simulated")


def phase_store(
    url: str,
    state: str,
    n_requests: int,
    seed: int,
    start_fill: float,
    n_gpus: int,
    provision: bool,
    profile_to: str | None,
) -> dict[str, Any]:
    """The request sequence through Controller.request_vm; latencies, decisions, refusals. The modules that
    the request path imports on first use are imported before the timed window, in either mode: an import is a
    process's one-time cost, not a request's (and here, with PYTHONDONTWRITEBYTECODE=1, it compiles the source:
    about 80 ms for the provisioning path, 0.4 ms on the mean of 200 requests)."""
    for module in LAZY_IMPORTS:
        importlib.import_module(module)
    catalog = load_catalog()
    ctl = Controller(url, catalog=catalog, state_path=Path(state))
    fill = start_fill * n_gpus
    lat: list[float] = []
    results: list[Any] = []
    refusal_lat: list[float] = []
    prof = cProfile.Profile() if profile_to else None
    cpu0 = time.process_time()
    try:
        for r in request_sequence(catalog, seed, n_requests):
            if fill >= FILL_TARGET * n_gpus:
                break
            vgpus = [(r.profiles[0], len(r.profiles))]
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            try:
                vm = ctl.request_vm(
                    r.tenant,
                    f"w{r.index:07d}",
                    vgpus,
                    vcpus=r.vcpus,
                    memory_mib=r.memory_mib,
                    pool=r.pool,
                    provision=provision,
                )
            except NoCapacity:
                vm = None
            dt_s = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            lat.append(dt_s)
            if vm is None:
                refusal_lat.append(dt_s)
                results.append(None)
            else:
                fill += _fill_step(catalog, r)
                results.append([vm.host, sorted([d.gpu_id, d.start, d.profile] for d in vm.devices)])
    finally:
        cpu_s = time.process_time() - cpu0
        ctl.close()
    if prof is not None and profile_to:
        prof.dump_stats(profile_to)
    return {
        "latencies": lat,
        "results": results,
        "refusal_latencies": refusal_lat,
        "peak_mib": _peak_mib(),
        "end_fill": fill / max(n_gpus, 1),
        "cpu_s": cpu_s,
    }


MULTI_PROFILE = ("ampere", "A100D-4C")  # small, so that 8-GPU VMs fit many times on an A100 host
MULTI_SIZES = (1, 2, 4, 8)


def phase_multi(url: str, state: str, gpus: int, n_requests: int) -> dict[str, Any]:
    """`n_requests` VMs of `gpus` x MULTI_PROFILE each through Controller.request_vm on the empty fleet: the
    latencies (what a request for k GPUs costs beside one for a single GPU)."""
    ctl = Controller(url, catalog=load_catalog(), state_path=Path(state))
    pool, profile = MULTI_PROFILE
    lat: list[float] = []
    placed = 0
    try:
        for i in range(n_requests):
            t0 = time.perf_counter()
            try:
                ctl.request_vm("t0", f"m{gpus}-{i:06d}", [(profile, gpus)], vcpus=gpus, memory_mib=1024 * gpus,
                               pool=pool, provision=False)
                placed += 1
            except NoCapacity:
                pass
            lat.append(time.perf_counter() - t0)
    finally:
        ctl.close()
    return {"gpus": gpus, **_stats(lat, placed), "placed": placed, "requests": len(lat)}


RAW_SQL = (
    "UPDATE tenant SET vms_used = vms_used + 1, vgpus_used = vgpus_used + 1 WHERE id = ? "
    "AND (vms_limit IS NULL OR vms_used + 1 <= vms_limit)",
    "SELECT g.id, g.host_id, g.version, g.free_units FROM gpu g JOIN host h ON h.id = g.host_id "
    "WHERE g.pool_id = ? AND g.mode = ? AND g.model = ? AND g.free_units >= 1 AND (g.fits & ?) <> 0 "
    "AND h.state = 'active' AND h.used_vcpus + 2 <= h.vcpus * h.cpu_overcommit ORDER BY g.free_units, g.id LIMIT 16",
    "UPDATE host SET used_vcpus = used_vcpus + 2 WHERE id = ? AND used_vcpus + 2 <= vcpus * cpu_overcommit",
    "UPDATE gpu SET free_units = free_units - 1, version = version + 1 WHERE id = ? AND version = ?",
)


def phase_raw(db: str, n: int) -> dict[str, Any]:
    """The raw sqlite3 reference: `n` claim+quota transactions written by hand (charge the tenant, read a
    candidate page from the gpu_candidates index, take the host's vCPUs, compare-and-set the GPU), on a copy of
    the pre-filled store, with the store's own schema (its triggers included) and pragmas (WAL, synchronous
    NORMAL). What the store's claim is measured against."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    pool_id = conn.execute("SELECT id FROM pool WHERE name = ?", (MULTI_PROFILE[0],)).fetchone()[0]
    spec = _spec(MULTI_PROFILE[0])
    bit = profile_bit(geometry_for(load_catalog(), spec.model, spec.mode), MULTI_PROFILE[1])
    t0 = time.perf_counter()
    done = 0
    for _ in range(n):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(RAW_SQL[0], (1,))
        page = conn.execute(RAW_SQL[1], (pool_id, spec.mode.value, spec.model, bit)).fetchall()
        if page:
            gid, hid, version, _free = page[0]
            conn.execute(RAW_SQL[2], (hid,))
            done += conn.execute(RAW_SQL[3], (gid, version)).rowcount
        conn.execute("COMMIT")
    wall = time.perf_counter() - t0
    conn.close()
    return {"transactions": n, "claimed": done, "per_s": n / wall if wall else 0.0}


def _client(url: str, state: str, reqs: Sequence[Req], start_at: float, prefix: str = "w") -> dict[str, Any]:
    """One client process of the concurrent window: its share of the requests, one at a time."""
    ctl = Controller(url, catalog=load_catalog(), state_path=Path(state))
    lat: list[float] = []
    placed = 0
    time.sleep(max(0.0, start_at - time.time()))  # every client starts at the same moment
    t_start = time.perf_counter()
    try:
        for r in reqs:
            t0 = time.perf_counter()
            try:
                ctl.request_vm(
                    r.tenant,
                    f"{prefix}{r.index:07d}",
                    [(r.profiles[0], len(r.profiles))],
                    vcpus=r.vcpus,
                    memory_mib=r.memory_mib,
                    pool=r.pool,
                    provision=False,
                )
                placed += 1
            except NoCapacity:
                pass
            lat.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
    finally:
        ctl.close()
    return {"latencies": lat, "placed": placed, "wall": wall, "start": start_at}


def phase_clients(url: str, state: str, n_requests: int, seed: int, clients: int, prefix: str = "w") -> dict[str, Any]:
    """The same request sequence from `clients` processes at once (request i goes to client i mod N; VMs named
    `prefix` and the request's index): placements per wall-clock second of the whole window and the latency of
    every request."""
    reqs = request_sequence(load_catalog(), seed, n_requests)
    ctx = multiprocessing.get_context("fork")
    start_at = time.time() + 1.0
    with concurrent.futures.ProcessPoolExecutor(max_workers=clients, mp_context=ctx) as ex:
        outs = list(
            ex.map(
                _client,
                [url] * clients,
                [f"{state}-{k}" for k in range(clients)],
                [reqs[k::clients] for k in range(clients)],
                [start_at] * clients,
                [prefix] * clients,
            )
        )
    lat = [x for o in outs for x in o["latencies"]]
    placed = sum(o["placed"] for o in outs)
    wall = max(o["wall"] for o in outs)
    s = _stats(lat, placed)
    return {
        "clients": clients,
        "requests": len(lat),
        "placed": placed,
        "placements_per_s": placed / wall if wall else 0.0,
        "p50_ms": s["p50_ms"],
        "p99_ms": s["p99_ms"],
    }


ENGINE_PROCESSES = (1, 2, 4)


@contextlib.contextmanager
def pg_schema(base: str) -> Iterator[str]:
    """A fresh schema in the PostgreSQL database at `base` (dropped afterwards); a store URL that uses only it."""
    import psycopg

    name = f"vgpu_bench_{uuid.uuid4().hex[:10]}"
    admin = psycopg.connect(base, autocommit=True, connect_timeout=5)
    try:
        admin.execute(f'CREATE SCHEMA "{name}"')
        yield f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{name}"
    finally:
        try:
            admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            admin.close()


def bench_engines(n_gpus: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """SQLite and PostgreSQL on the same fleet, pre-filled alike, each taking the same request sequence from 1, 2
    and 4 processes at once (one window after the other on the same store, the pre-fill leaving room for all):
    placements/s and p99 per engine and process count, and PostgreSQL's ratio to SQLite."""
    n = args.engine_requests
    target = max(0.0, FILL_TARGET - len(ENGINE_PROCESSES) * expected_fill(load_catalog(), n_gpus, n) - 0.05)
    out: dict[str, Any] = {"fleet_gpus": n_gpus, "requests": n, "rows": []}
    runs: dict[str, list[dict[str, Any]]] = {}
    work = tmp / f"engines-{n_gpus}"
    work.mkdir()
    with pg_schema(args.postgres) as pg_url:
        for engine, url in (("sqlite", f"sqlite:///{work / 'store.db'}"), ("postgresql", pg_url)):
            built = _run(args.isolate, phase_build, url, str(work / f"state-{engine}"), n_gpus, args.build, target,
                         args.seed)
            out[f"{engine}_prefill"] = built["prefill"]
            runs[engine] = [phase_clients(url, str(work / f"state-{engine}-{k}"), n, args.seed, k, f"e{k}-")
                            for k in ENGINE_PROCESSES]
    for sq, pg in zip(runs["sqlite"], runs["postgresql"], strict=True):
        out["rows"].append({"processes": sq["clients"], "sqlite": sq, "postgresql": pg,
                            "ratio": pg["placements_per_s"] / sq["placements_per_s"] if sq["placements_per_s"]
                            else 0.0})
    shutil.rmtree(work, ignore_errors=True)
    return out


def _run(isolate: bool, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    if not isolate:
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args).result()


def _backup(src: Path, dst: Path) -> None:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    a.close()
    b.close()


def _stats(lat: Sequence[float], placed: int) -> dict[str, float]:
    total = sum(lat)
    s = sorted(lat)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] * 1000 if s else 0.0

    return {
        "placements_per_s": placed / total if total else 0.0,
        "requests_per_s": len(lat) / total if total else 0.0,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.fmean(lat) * 1000 if lat else 0.0,
    }


def bench_size(
    n_gpus: int, args: argparse.Namespace, catalog: Catalog, tmp: Path, with_provision: bool
) -> dict[str, Any]:
    """Build, pre-fill and measure one fleet size."""
    work = tmp / f"fleet-{n_gpus}"
    work.mkdir()
    db = work / "store.db"
    url = f"sqlite:///{db}"
    target = min(0.88, max(0.0, FILL_TARGET - expected_fill(catalog, n_gpus, args.requests) - 0.02))
    empty = work / "empty.db"
    built = _run(args.isolate, phase_build, url, str(work / "state"), n_gpus, args.build, target, args.seed,
                 str(empty) if args.multi_requests else None)
    snap = work / "snap.db"
    _backup(db, snap)
    raw_copy = work / "raw.db"
    _backup(snap, raw_copy)
    raw = _run(args.isolate, phase_raw, str(raw_copy), args.raw_transactions)
    core = _run(args.isolate, phase_core, url, args.requests, args.seed, built["prefill"], n_gpus)
    prof = str(Path(args.profile) / f"store-{n_gpus}.prof") if args.profile else None
    store = _run(
        args.isolate,
        phase_store,
        url,
        str(work / "state"),
        args.requests,
        args.seed,
        built["prefill"],
        n_gpus,
        False,
        prof,
    )
    placed = sum(1 for r in store["results"] if r is not None)
    lat_s = store["latencies"]
    n = min(len(store["results"]), len(core["results"]))
    agree = sum(1 for a, b in zip(store["results"], core["results"], strict=False) if a == b)
    s = _stats(store["latencies"], placed)
    c = _stats(core["latencies"], sum(1 for r in core["results"] if r is not None))
    row: dict[str, Any] = {
        "fleet_gpus": n_gpus,
        "build": built["build"],
        "prefill": built["prefill"],
        "requests": len(store["results"]),
        "placed": placed,
        "refused": len(store["results"]) - placed,
        "end_fill": store["end_fill"],
        **s,
        "peak_mib": store["peak_mib"],
        "core_placements_per_s": c["placements_per_s"],
        "core_p50_ms": c["p50_ms"],
        "core_p99_ms": c["p99_ms"],
        "store_core_ratio": (c["placements_per_s"] / s["placements_per_s"]) if s["placements_per_s"] else 0.0,
        "agree": agree,
        "compared": n,
        "core_requests": len(core["results"]),
        "refusal_mean_ms": statistics.fmean(store["refusal_latencies"]) * 1000 if store["refusal_latencies"] else 0.0,
        "build_s": built["build_s"],
        "prefill_s": built["prefill_s"],
        "build_peak_mib": built["build_peak_mib"],
        "core_peak_mib": core["peak_mib"],
        "store_cpu_ms_per_request": 1000 * store["cpu_s"] / max(len(lat_s), 1),
        "core_cpu_ms_per_request": 1000 * core["cpu_s"] / max(len(core["latencies"]), 1),
        "raw_per_s": raw["per_s"],
        "store_raw_ratio": s["placements_per_s"] / raw["per_s"] if raw["per_s"] else 0.0,
    }
    if args.multi_requests:
        multi = []
        for k in MULTI_SIZES:
            copy = work / f"multi-{k}.db"
            _backup(empty, copy)
            multi.append(_run(args.isolate, phase_multi, f"sqlite:///{copy}", str(work / f"state-m{k}"), k,
                              args.multi_requests))
        base = multi[0]["mean_ms"]
        for m in multi:
            m["ratio"] = m["mean_ms"] / base if base else 0.0
        row["multi"] = multi
    if args.clients > 1:
        copy = work / "clients.db"
        _backup(snap, copy)
        row["concurrent"] = phase_clients(
            f"sqlite:///{copy}", str(work / "state-clients"), len(store["results"]), args.seed, args.clients
        )
    if with_provision:
        k = min(args.provision_requests, args.requests)
        runs = {}
        for prov in (False, True):
            copy = work / f"prov-{int(prov)}.db"
            _backup(snap, copy)
            out = _run(
                args.isolate,
                phase_store,
                f"sqlite:///{copy}",
                str(work / f"state-{int(prov)}"),
                k,
                args.seed,
                built["prefill"],
                n_gpus,
                prov,
                None,
            )
            runs[prov] = {
                "requests": len(out["results"]),
                **_stats(out["latencies"], sum(1 for r in out["results"] if r is not None)),
            }
        row["provision"] = {"claim_only": runs[False], "provisioned": runs[True]}
    shutil.rmtree(work, ignore_errors=True)
    return row


def targets(rows: Sequence[Mapping[str, Any]], engines: Mapping[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(target, measured, PASS/FAIL/n/a) for each target of the issue."""
    by = {r["fleet_gpus"]: r for r in rows}
    out = []
    r10 = by.get(10_000)
    if r10:
        out.append(
            (
                ">= 1,000 placements/s at 10,000 GPUs",
                f"{r10['placements_per_s']:.0f}/s",
                "PASS" if r10["placements_per_s"] >= 1000 else "FAIL",
            )
        )
        out.append(("p99 < 10 ms at 10,000 GPUs", f"{r10['p99_ms']:.2f} ms", "PASS" if r10["p99_ms"] < 10 else "FAIL"))
    else:
        out.append((">= 1,000 placements/s and p99 < 10 ms at 10,000 GPUs", "size not run", "n/a"))
    if 1000 in by and 100_000 in by:
        half = by[1000]["placements_per_s"] / 2
        got = by[100_000]["placements_per_s"]
        out.append(
            (
                "100,000 GPUs at >= half the rate of 1,000",
                f"{got:.0f}/s vs {half:.0f}/s",
                "PASS" if got >= half else "FAIL",
            )
        )
    else:
        out.append(("100,000 GPUs at >= half the rate of 1,000", "sizes not run", "n/a"))
    for r in rows:
        if "multi" in r:
            worst = max(r["multi"], key=lambda m: m["ratio"])
            out.append(
                (
                    f"requests for 2, 4 and 8 GPUs within 2x of 1 GPU at {r['fleet_gpus']:,} GPUs",
                    f"worst k={worst['gpus']}: {worst['ratio']:.2f}x",
                    "PASS" if worst["ratio"] <= 2.0 else "FAIL",
                )
            )
    if engines:
        two = next(r for r in engines["rows"] if r["processes"] == 2)
        out.append(
            (
                "PostgreSQL >= 0.5 of SQLite with 2 processes",
                f"{two['ratio']:.2f} ({two['postgresql']['placements_per_s']:.0f}/s vs "
                f"{two['sqlite']['placements_per_s']:.0f}/s)",
                "PASS" if two["ratio"] >= 0.5 else "FAIL",
            )
        )
    peak = max((r["peak_mib"] for r in rows), default=0.0)
    out.append(("peak memory < 1 GiB (store process)", f"{peak:.0f} MiB", "PASS" if peak < 1024 else "FAIL"))
    return out


def _cells(r: Mapping[str, Any]) -> list[str]:
    return [
        str(r["fleet_gpus"]),
        r["build"],
        f"{100 * r['prefill']:.1f}",
        str(r["requests"]),
        str(r["placed"]),
        str(r["refused"]),
        f"{100 * r['end_fill']:.1f}",
        f"{r['placements_per_s']:.0f}",
        f"{r['p50_ms']:.2f}",
        f"{r['p99_ms']:.2f}",
        f"{r['peak_mib']:.0f}",
        f"{r['core_placements_per_s']:.0f}",
        f"{r['store_core_ratio']:.1f}",
        f"{r['agree']}/{r['compared']}",
        f"{r['raw_per_s']:.0f}",
        f"{r['store_raw_ratio']:.3f}",
    ]


def render(report: Mapping[str, Any]) -> str:
    """The plain-text report."""
    rows = report["rows"]
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = [
        f"machine: {report['machine']['cpus']} CPUs, {report['machine']['platform']}, "
        f"Python {report['machine']['python']}, SQLite {report['machine']['sqlite']}; date {report['date']}",
        "store: Controller.request_vm(provision=False), one request at a time: read and plan, then the claim's "
        "write transaction; core: placement.plan over in-memory HostViews, same candidate pages, no store",
        "",
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in table]
    for r in rows:
        if r["refused"]:
            lines.append(
                f"  {r['fleet_gpus']} GPUs: {r['refused']} refusals (NoCapacity), "
                f"mean {r['refusal_mean_ms']:.1f} ms each"
            )
        if "concurrent" in r:
            c = r["concurrent"]
            lines.append(
                f"  {r['fleet_gpus']} GPUs, the same {c['requests']} requests from {c['clients']} processes at once: "
                f"{c['placements_per_s']:.0f} placements/s (wall clock), p50 {c['p50_ms']:.2f} ms, "
                f"p99 {c['p99_ms']:.2f} ms"
            )
        if "provision" in r:
            a, b = r["provision"]["claim_only"], r["provision"]["provisioned"]
            lines.append(
                f"  provisioning through simulated hosts ({r['fleet_gpus']} GPUs, {b['requests']} requests): "
                f"{b['placements_per_s']:.0f}/s, p50 {b['p50_ms']:.2f} ms, p99 {b['p99_ms']:.2f} ms vs "
                f"claim only {a['placements_per_s']:.0f}/s, p50 {a['p50_ms']:.2f} ms, p99 "
                f"{a['p99_ms']:.2f} ms ({(b['mean_ms'] / a['mean_ms']) if a['mean_ms'] else 0:.1f}x)"
            )
    if "engines" in report:
        e = report["engines"]
        lines += ["", f"engines ({e['fleet_gpus']:,} GPUs, pre-filled to {100 * e['sqlite_prefill']:.1f}% / "
                  f"{100 * e['postgresql_prefill']:.1f}%, {e['requests']} requests per window from N processes at "
                  "once, wall clock): placements/s (p99 ms)",
                  "  processes       SQLite   PostgreSQL  PostgreSQL/SQLite"]
        for r in e["rows"]:
            sq, pg = r["sqlite"], r["postgresql"]
            lines.append(f"  {r['processes']:>9}  {sq['placements_per_s']:5.0f} ({sq['p99_ms']:5.1f})  "
                         f"{pg['placements_per_s']:5.0f} ({pg['p99_ms']:5.1f})  {r['ratio']:17.2f}")
    multi = [r for r in rows if "multi" in r]
    if multi:
        lines += ["", f"requests for k GPUs ({MULTI_PROFILE[1]} x k in pool {MULTI_PROFILE[0]}, empty fleet, "
                  "Controller.request_vm, provision=False): mean ms (ratio to k = 1), raw sqlite3 reference in ms"]
        lines.append("  fleet GPUs  " + "  ".join(f"{f'k={k}':>14}" for k in MULTI_SIZES) + "  raw sqlite3")
        for r in multi:
            cells = [f"{m['mean_ms']:7.2f} ({m['ratio']:.2f})" for m in r["multi"]]
            lines.append(f"  {r['fleet_gpus']:>10}  " + "  ".join(f"{c:>14}" for c in cells)
                         + f"  {1000 / r['raw_per_s'] if r['raw_per_s'] else 0:11.3f}")
    lines.append("")
    for name, got, verdict in report["targets"]:
        lines.append(f"{verdict:4}  {name}: {got}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table (or JSON). Exit 1 if a target fails."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1000,10000,100000", help="fleet sizes in GPUs, comma-separated")
    ap.add_argument("--requests", type=int, default=2000, help="timed requests per size (at most; stops at 90%%)")
    ap.add_argument(
        "--provision-requests",
        type=int,
        default=200,
        help="requests of the provisioning comparison on the first size (0: skip)",
    )
    ap.add_argument("--build", choices=("auto", "declare", "bulk"), default="auto")
    ap.add_argument(
        "--clients",
        type=int,
        default=2,
        help="also replay each window's requests from this many processes at once (1: skip)",
    )
    ap.add_argument(
        "--multi-requests",
        type=int,
        default=200,
        help="VMs per GPU count (1, 2, 4, 8) timed on the empty fleet (0: skip)",
    )
    ap.add_argument(
        "--raw-transactions",
        type=int,
        default=3000,
        help="raw sqlite3 claim+quota transactions timed as the reference of each size",
    )
    ap.add_argument(
        "--postgres",
        metavar="URL",
        help="also compare SQLite and PostgreSQL (a fresh schema in this database, e.g. "
        "postgresql://postgres@127.0.0.1:5432/test) from 1, 2 and 4 processes at --engine-gpus GPUs",
    )
    ap.add_argument("--engine-gpus", type=int, default=10_000, help="fleet size of the engine comparison")
    ap.add_argument("--engine-requests", type=int, default=500, help="requests per window of the engine comparison")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--profile", metavar="DIR", help="write a cProfile of each store window to DIR")
    ap.add_argument(
        "--in-process",
        dest="isolate",
        action="store_false",
        help="run the phases in this process (peak memory then covers all of them)",
    )
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    catalog = load_catalog()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        for i, n in enumerate(sizes):
            rows.append(bench_size(n, args, catalog, Path(tmp), i == 0 and args.provision_requests > 0))
        engines = bench_engines(args.engine_gpus, args, Path(tmp)) if args.postgres else None
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
        },
        "rows": rows,
        "targets": targets(rows, engines),
    }
    if engines:
        report["engines"] = engines
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if any(v == "FAIL" for _, _, v in report["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
