"""A demand to plan for: a YAML mix of request shapes with counts, or an Alibaba-format trace of tasks.

YAML form (every key but `requests` optional; see README "Planning"):

    arrival: largest-first        # or listed (file order) or shuffled (with seed)
    seed: 0
    requests:
      - profile: A100D-40C        # or profiles: [A100D-40C, H100-40C] (first one a GPU offers), or gpu_share: 0.5
        count: 4                  # VMs of this shape
        gpus: 1                   # vGPUs per VM, each on its own GPU of one host
        vcpus: 16
        memory: 64GiB             # or memory_mib: 65536
        pool: training            # only GPUs of this pool (default: any GPU)
        models: [A100-80GB]       # only GPUs of these models (default: any)
    changes: ...                  # a hypothetical fleet, see vgpu_ctl.planning.changes

A trace (a .csv file in the format of openb_pod_list_*.csv) gives one request per task asking for GPUs: its GPU
share becomes the smallest profile holding it on each GPU, its milli-vCPUs whole vCPUs; tasks without GPUs are
skipped.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.errors import InvalidInput, did_you_mean
from vgpu_ctl.planning.changes import Changes, parse_changes
from vgpu_ctl.planning.fields import fail, read_yaml, size_mib, whole
from vgpu_ctl.planning.trace import load_tasks

MAX_COUNT = 10_000_000
MAX_GPUS = 16
ARRIVALS = ("largest-first", "listed", "shuffled")


@dataclass(frozen=True, slots=True)
class Ask:
    """One request shape of a demand: named profiles (the first one a GPU offers) or a GPU share, vGPUs per VM,
    vCPUs, memory, and the pool and models it may use. `where` names it in the demand file."""

    where: str
    profiles: tuple[str, ...] = ()
    share: float | None = None
    gpus: int = 1
    vcpus: float = 0.0
    memory_mib: float = 0.0
    pool: str | None = None
    models: frozenset[str] | None = None

    @property
    def label(self) -> str:
        """A short name for tables: the profile (or share), the vGPU count, the pool."""
        what = "|".join(self.profiles) if self.profiles else f"{self.share:g} GPU"
        return f"{what} x{self.gpus}" + (f" @{self.pool}" if self.pool else "")


@dataclass(frozen=True, slots=True)
class Demand:
    """Request shapes, how many VMs of each, the order they arrive in (indexes into `asks`), declared changes."""

    asks: tuple[Ask, ...]
    counts: tuple[int, ...]
    order: tuple[int, ...]
    changes: Changes = field(default_factory=Changes)
    source: str = ""

    @property
    def vms(self) -> int:
        """The VMs asked for."""
        return len(self.order)


_ASK_KEYS = ("profile", "profiles", "gpu_share", "count", "gpus", "vcpus", "memory", "memory_mib", "pool", "models")


def _ask(path: Path, catalog: Catalog, i: int, item: object) -> tuple[Ask, int]:
    where = f"requests[{i}]"
    if not isinstance(item, dict):
        raise fail(path, where, "expected a mapping with profile (or profiles, gpu_share) and count")
    for key in item:
        if key not in _ASK_KEYS:
            raise fail(path, f"{where}.{key}", f"unknown key{did_you_mean(str(key), _ASK_KEYS)}; known: "
                        f"{', '.join(_ASK_KEYS)}")
    given = [k for k in ("profile", "profiles", "gpu_share") if k in item]
    if len(given) != 1:
        raise fail(path, where, "give exactly one of profile, profiles, gpu_share" +
                    (f" (got {', '.join(given)})" if given else ""))
    known = catalog.profile_names()
    profiles: tuple[str, ...] = ()
    share: float | None = None
    if "profile" in item or "profiles" in item:
        key = given[0]
        raw = [item[key]] if key == "profile" else item[key]
        if not isinstance(raw, list) or not raw:
            raise fail(path, f"{where}.{key}", "expected a non-empty list of profile names", item[key])
        for k, p in enumerate(raw):
            at = f"{where}.{key}" + ("" if key == "profile" else f"[{k}]")
            if not isinstance(p, str) or p not in known:
                raise fail(path, at, f"unknown profile{did_you_mean(str(p), known)} (see vgpuctl profiles list)", p)
        profiles = tuple(dict.fromkeys(raw))
    else:
        s = item["gpu_share"]
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 1:
            raise fail(path, f"{where}.gpu_share", "must be a number in (0, 1]: the share of one GPU per vGPU", s)
        share = float(s)
    count = whole(path, f"{where}.count", item.get("count", 1), 1, MAX_COUNT)
    gpus = whole(path, f"{where}.gpus", item.get("gpus", 1), 1, MAX_GPUS)
    vcpus = whole(path, f"{where}.vcpus", item.get("vcpus", 0), 0, 1 << 20)
    if "memory" in item and "memory_mib" in item:
        raise fail(path, where, "give memory or memory_mib, not both")
    memory = size_mib(path, f"{where}.memory", item["memory"]) if "memory" in item else \
        whole(path, f"{where}.memory_mib", item.get("memory_mib", 0), 0, 1 << 40)
    pool = item.get("pool")
    if pool is not None and not isinstance(pool, str):
        raise fail(path, f"{where}.pool", "expected a pool name", pool)
    models = None
    if "models" in item:
        raw_models = item["models"]
        if not isinstance(raw_models, list) or not raw_models:
            raise fail(path, f"{where}.models", "expected a non-empty list of GPU models", raw_models)
        for k, m in enumerate(raw_models):
            if not isinstance(m, str) or m not in catalog.models:
                raise fail(path, f"{where}.models[{k}]", f"unknown GPU model{did_you_mean(str(m), catalog.models)}; "
                            f"known: {', '.join(sorted(catalog.models))}", m)
        models = frozenset(raw_models)
        offered = {p for m in models for p in (x.name for x in catalog.profiles(m))}
        if profiles and not set(profiles) & offered:
            raise fail(path, f"{where}.models", f"none of {', '.join(sorted(models))} offers "
                        f"{', '.join(profiles)}", raw_models)
    return Ask(where, profiles, share, gpus, float(vcpus), float(memory), pool, models), count


def _order(asks: Sequence[Ask], counts: Sequence[int], catalog: Catalog, arrival: str, seed: int) -> tuple[int, ...]:
    seq = [i for i, n in enumerate(counts) for _ in range(n)]
    if arrival == "shuffled":
        random.Random(seed).shuffle(seq)
    elif arrival == "largest-first":
        size = [a.gpus * (a.share if a.share is not None else largest_share(catalog, a.profiles)) for a in asks]
        seq.sort(key=lambda i: (-size[i], -asks[i].vcpus, i))
    return tuple(seq)


def largest_share(catalog: Catalog, profiles: Sequence[str]) -> float:
    """The largest share of its GPU's memory that one of `profiles` takes, on any model offering it."""
    best = 0.0
    for p in profiles:
        for model in catalog.models_offering(p):
            info = catalog.profile(model, p)
            if info is not None:
                best = max(best, info.framebuffer_mib / catalog.model(model).memory_mib)
    return best


def parse_demand_yaml(path: Path, catalog: Catalog) -> Demand:
    """Read a YAML demand; InvalidInput naming the file, the field and the value on the first problem."""
    data = read_yaml(path, "demand")
    if not isinstance(data, dict):
        raise InvalidInput(f"demand file {path}: expected a mapping with 'requests' (and optionally 'changes', "
                           "'arrival', 'seed')", reasons=[{"file": str(path)}])
    for key in data:
        if key not in ("requests", "changes", "arrival", "seed"):
            raise fail(path, str(key), "unknown key; known: requests, changes, arrival, seed")
    items = data.get("requests")
    if not isinstance(items, list) or not items:
        raise fail(path, "requests", "expected a non-empty list of requests", items)
    arrival = data.get("arrival", "largest-first")
    if arrival not in ARRIVALS:
        raise fail(path, "arrival", f"must be one of {', '.join(ARRIVALS)}", arrival)
    seed = whole(path, "seed", data.get("seed", 0), 0, 2**32)
    parsed = [_ask(path, catalog, i, item) for i, item in enumerate(items)]
    asks = tuple(a for a, _ in parsed)
    counts = tuple(n for _, n in parsed)
    changes = parse_changes(path, catalog, data["changes"]) if data.get("changes") is not None else Changes()
    return Demand(asks, counts, _order(asks, counts, catalog, arrival, seed), changes, f"demand {path}")


def demand_from_trace(path: Path) -> Demand:
    """The tasks of a trace that ask for GPUs, in file order, one request shape per distinct (share, GPUs,
    vCPUs, memory, models)."""
    tasks = [t for t in load_tasks(path) if t.num_gpu > 0 and t.gpu_milli > 0]
    if not tasks:
        raise InvalidInput(f"trace file {path}: no task asks for a GPU", reasons=[{"file": str(path)}])
    index: dict[tuple[int, int, int, int, frozenset[str] | None], int] = {}
    asks: list[Ask] = []
    order: list[int] = []
    for t in tasks:
        key = (t.gpu_milli, t.num_gpu, t.cpu_milli, t.memory_mib, t.models)
        if key not in index:
            index[key] = len(asks)
            asks.append(Ask(f"task {t.name}", (), t.gpu_milli / 1000, t.num_gpu, t.cpu_milli / 1000,
                            float(t.memory_mib), None, t.models))
        order.append(index[key])
    counts = Counter(order)
    return Demand(tuple(asks), tuple(counts[i] for i in range(len(asks))), tuple(order), source=f"trace {path}")


def load_demand(path: Path, catalog: Catalog) -> Demand:
    """A demand file: a trace CSV (by its .csv suffix) or a YAML mix."""
    if path.suffix.lower() == ".csv":
        return demand_from_trace(path)
    return parse_demand_yaml(path, catalog)


def scaled(demand: Demand, factor: float, seed: int = 0) -> Demand:
    """The demand with about `factor` times the VMs: every VM repeated int(factor) times, plus a seeded random draw
    of the rest, in the same arrival order (factor < 1: a seeded sample of its VMs, order kept)."""
    if factor <= 0:
        raise InvalidInput(f"field scale: must be > 0, got {factor!r}", reasons=[{"field": "scale", "value": factor}])
    rng = random.Random(seed)
    whole_part, rest = int(factor), factor - int(factor)
    order = [i for i in demand.order for _ in range(whole_part)]
    extra = sorted(rng.sample(range(len(demand.order)), round(rest * len(demand.order))))
    if whole_part == 0:
        order = [demand.order[k] for k in extra]
    else:
        order += [demand.order[k] for k in extra]
    counts = Counter(order)
    return Demand(demand.asks, tuple(counts[i] for i in range(len(demand.asks))), tuple(order), demand.changes,
                  demand.source + f" x{factor:g}")
