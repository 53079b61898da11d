"""Declared changes that turn a fleet into a hypothetical one: hosts added, GPUs re-carved.

The `changes` section of a demand file (or of a file given with --changes):

    changes:
      add_hosts:
        - name: new-h100          # hosts are named new-h100-1, new-h100-2, ...
          count: 2
          vcpus: 192
          memory: 2TiB
          cpu_overcommit: 2.0     # optional, default 1.0 (memory_overcommit too)
          gpus:
            - {model: H100-80GB, count: 8, mode: mig, pool: inference}
      set_gpus:                   # every GPU matching all of host, pci, model, pool (at least one given)
        - {host: kvm-a100-01, pci: "0000:c1:00.0", mode: vgpu-equal, vgpu_type: A100D-20C}
        - {pool: training, model: H100-80GB, mode: mig, mig_layout: ["3g.40gb@0", "3g.40gb@4"]}

A GPU that holds devices can't be re-carved (its VMs would have to move first): that is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Mode, Slot, supported_modes
from vgpu_ctl.errors import InvalidInput, did_you_mean
from vgpu_ctl.inventory import NAME_RE
from vgpu_ctl.planning.fields import fail, mapping, ratio, size_mib, whole
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost, carve, mig_slots

MAX_ADDED_HOSTS = 100_000


@dataclass(frozen=True, slots=True)
class Carving:
    """How a GPU is carved: mode, a pinned vGPU type (equal-size) or a fixed MIG layout."""

    mode: Mode
    vgpu_type: str | None = None
    mig_layout: tuple[Slot, ...] | None = None


@dataclass(frozen=True, slots=True)
class GpuGroup:
    """`count` GPUs of one model, pool and carving on an added host."""

    model: str
    count: int
    pool: str | None
    carving: Carving


@dataclass(frozen=True, slots=True)
class AddHosts:
    """`count` new hosts of one shape."""

    name: str
    count: int
    vcpus: float
    memory_mib: float
    gpus: tuple[GpuGroup, ...]


@dataclass(frozen=True, slots=True)
class SetGpus:
    """A new carving for every GPU matching the selector (None: any)."""

    where: str
    host: str | None
    pci: str | None
    model: str | None
    pool: str | None
    carving: Carving


@dataclass(frozen=True, slots=True)
class Changes:
    """What the hypothetical fleet adds to (or changes in) the real one."""

    add_hosts: tuple[AddHosts, ...] = ()
    set_gpus: tuple[SetGpus, ...] = ()
    path: Path = Path("-")  # the file they were declared in

    def __bool__(self) -> bool:
        return bool(self.add_hosts or self.set_gpus)


def _model(path: Path, where: str, catalog: Catalog, value: object) -> str:
    if not isinstance(value, str) or value not in catalog.models:
        raise fail(path, where, f"unknown GPU model{did_you_mean(str(value), catalog.models)}; known: "
                    f"{', '.join(sorted(catalog.models))}", value)
    return value


def _carving(path: Path, where: str, catalog: Catalog, model: str | None, item: dict[str, object]) -> Carving:
    raw = item.get("mode")
    modes = [m.value for m in Mode if m is not Mode.UNMANAGED]
    if raw not in modes:
        raise fail(path, f"{where}.mode", f"must be one of {', '.join(modes)}", raw)
    mode = Mode(str(raw))
    vgpu_type = item.get("vgpu_type")
    if vgpu_type is not None and not isinstance(vgpu_type, str):
        raise fail(path, f"{where}.vgpu_type", "expected a vGPU type name", vgpu_type)
    layout_raw = item.get("mig_layout")
    if layout_raw is not None and (not isinstance(layout_raw, list) or
                                   not all(isinstance(e, str) for e in layout_raw)):
        raise fail(path, f"{where}.mig_layout", "expected a list like ['3g.40gb@0', '3g.40gb@4']", layout_raw)
    layout: tuple[Slot, ...] | None = None
    if model is not None:
        if mode not in supported_modes(catalog, model):
            raise fail(path, f"{where}.mode", f"{model} does not support mode {mode.value} (supported: "
                        f"{', '.join(sorted(m.value for m in supported_modes(catalog, model)))})", mode.value)
        try:
            if layout_raw is not None:
                if mode is not Mode.MIG:
                    raise InvalidInput("a mig_layout needs mode mig")
                layout = mig_slots(catalog, model, [str(e) for e in layout_raw])
            carve(catalog, model, mode, vgpu_type, layout)
        except InvalidInput as exc:
            raise fail(path, where, exc.message) from None
    elif vgpu_type is not None or layout_raw is not None:
        raise fail(path, where, "a vgpu_type or mig_layout needs a model in the selector")
    return Carving(mode, vgpu_type, layout)


def parse_changes(path: Path, catalog: Catalog, data: object) -> Changes:
    """The `changes` section of a demand file, checked against the catalog (models, modes, types, layouts)."""
    section = mapping(path, "changes", data, ("add_hosts", "set_gpus"))
    adds: list[AddHosts] = []
    raw_adds = section.get("add_hosts") or []
    if not isinstance(raw_adds, list):
        raise fail(path, "changes.add_hosts", "expected a list of host shapes", raw_adds)
    for i, raw in enumerate(raw_adds):
        where = f"changes.add_hosts[{i}]"
        h = mapping(path, where, raw, ("name", "count", "vcpus", "memory", "memory_mib", "cpu_overcommit",
                                     "memory_overcommit", "gpus"))
        name = h.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise fail(path, f"{where}.name", "expected a safe name (lower-case letters, digits, '_', '.', '-')",
                        name)
        count = whole(path, f"{where}.count", h.get("count", 1), 1, MAX_ADDED_HOSTS)
        vcpus = whole(path, f"{where}.vcpus", h.get("vcpus"), 0, 1 << 20)
        if "memory" in h:
            memory = size_mib(path, f"{where}.memory", h["memory"])
        else:
            memory = whole(path, f"{where}.memory_mib", h.get("memory_mib"), 0, 1 << 40)
        cpu_oc = ratio(path, f"{where}.cpu_overcommit", h.get("cpu_overcommit", 1.0))
        mem_oc = ratio(path, f"{where}.memory_overcommit", h.get("memory_overcommit", 1.0))
        raw_gpus = h.get("gpus")
        if not isinstance(raw_gpus, list) or not raw_gpus:
            raise fail(path, f"{where}.gpus", "expected a non-empty list of {model, count, mode, pool}", raw_gpus)
        groups = []
        for k, rg in enumerate(raw_gpus):
            gw = f"{where}.gpus[{k}]"
            g = mapping(path, gw, rg, ("model", "count", "mode", "pool", "vgpu_type", "mig_layout"))
            model = _model(path, f"{gw}.model", catalog, g.get("model"))
            g.setdefault("mode", Mode.VGPU_EQUAL.value)
            pool = g.get("pool")
            if pool is not None and not isinstance(pool, str):
                raise fail(path, f"{gw}.pool", "expected a pool name", pool)
            groups.append(GpuGroup(model, whole(path, f"{gw}.count", g.get("count", 1), 1, 64), pool,
                                   _carving(path, gw, catalog, model, g)))
        adds.append(AddHosts(name, count, vcpus * cpu_oc, memory * mem_oc, tuple(groups)))
    sets: list[SetGpus] = []
    raw_sets = section.get("set_gpus") or []
    if not isinstance(raw_sets, list):
        raise fail(path, "changes.set_gpus", "expected a list of GPU selectors with a new carving", raw_sets)
    for i, raw in enumerate(raw_sets):
        where = f"changes.set_gpus[{i}]"
        s = mapping(path, where, raw, ("host", "pci", "model", "pool", "mode", "vgpu_type", "mig_layout"))
        if not any(s.get(k) is not None for k in ("host", "pci", "model", "pool")):
            raise fail(path, where, "give at least one of host, pci, model, pool to say which GPUs")
        sel_model = _model(path, f"{where}.model", catalog, s["model"]) if s.get("model") is not None else None
        sel = {key: s.get(key) for key in ("host", "pci", "pool")}
        for key, v in sel.items():
            if v is not None and not isinstance(v, str):
                raise fail(path, f"{where}.{key}", "expected text", v)
        pci = str(sel["pci"]).lower() if sel["pci"] is not None else None
        sets.append(SetGpus(where, _opt(sel["host"]), pci, sel_model, _opt(sel["pool"]),
                            _carving(path, where, catalog, sel_model, s)))
    return Changes(tuple(adds), tuple(sets), path)


def _opt(value: object) -> str | None:
    return None if value is None else str(value)


def apply_changes(catalog: Catalog, fleet: Fleet, changes: Changes) -> Fleet:
    """The fleet with the changes made (a copy; `fleet` is a planning Fleet). InvalidInput naming the change when a
    selector matches no GPU, a GPU holds devices, or its model lacks the mode."""
    where_file = changes.path
    hosts = list(fleet.hosts)
    for s in changes.set_gpus:
        hit = 0
        for hi, h in enumerate(hosts):
            if s.host is not None and h.name != s.host:
                continue
            gpus = list(h.gpus)
            for gi, g in enumerate(gpus):
                if (s.pci is not None and g.pci != s.pci) or (s.model is not None and g.model != s.model) or \
                        (s.pool is not None and g.pool != s.pool):
                    continue
                hit += 1
                if g.in_use:
                    raise fail(where_file, s.where, f"GPU {h.name}/{g.pci} holds {len(g.occupancy.slots)} device(s): "
                                "its VMs would have to move before it is re-carved")
                if s.carving.mode not in supported_modes(catalog, g.model):
                    raise fail(where_file, f"{s.where}.mode", f"GPU {h.name}/{g.pci} is a {g.model}, which does not "
                                f"support mode {s.carving.mode.value}", s.carving.mode.value)
                try:
                    occ = carve(catalog, g.model, s.carving.mode, s.carving.vgpu_type, s.carving.mig_layout)
                except InvalidInput as exc:
                    raise fail(where_file, s.where, exc.message) from None
                gpus[gi] = PlanGpu(g.pci, g.model, g.pool, occ)
            hosts[hi] = replace(h, gpus=tuple(gpus))
        if not hit:
            raise fail(where_file, s.where, "matches no GPU of the fleet")
    names = {h.name for h in hosts}
    for a in changes.add_hosts:
        for n in range(1, a.count + 1):
            name = f"{a.name}-{n}"
            if name in names:
                raise fail(where_file, "changes.add_hosts", f"host {name!r} is already in the fleet", name)
            names.add(name)
            gpus_out: list[PlanGpu] = []
            for group in a.gpus:
                occ = carve(catalog, group.model, group.carving.mode, group.carving.vgpu_type, group.carving.mig_layout)
                for _ in range(group.count):
                    gpus_out.append(PlanGpu(f"0000:{0x10 + len(gpus_out):02x}:00.0", group.model, group.pool, occ))
            hosts.append(PlanHost(name, a.vcpus, a.memory_mib, a.vcpus, a.memory_mib, tuple(gpus_out)))
    return Fleet(tuple(hosts), fleet.source + (" + changes" if changes else ""))
