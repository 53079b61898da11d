"""Reading Alibaba's openb GPU traces (the format of ../shared/traces/alibaba-gpu-v2023): nodes, tasks, and the
profile a task's GPU share maps to on a GPU. Shared by the planner and scripts/bench_packing.py."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import Geometry, Mode
from vgpu_ctl.errors import InvalidInput

# Trace model -> catalog model.
MODEL_MAP: dict[str, str] = {
    "G2": "A100-80GB",
    "G3": "H100-80GB",
    "T4": "T4",
    "P100": "V100-16GB",
    "V100M16": "V100-16GB",
    "V100M32": "V100-32GB",
    "A10": "A10",
}
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
TASK_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@dataclass(frozen=True, slots=True)
class Node:
    """One trace node: CPU in milli-vCPUs, memory in MiB, GPU count, catalog model."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class Task:
    """One trace task: CPU in milli-vCPUs, memory in MiB, GPUs and the share of each, allowed catalog models."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] | None = None  # None: any model

    @property
    def gpu_request(self) -> float:
        """The task's GPU request in GPUs."""
        return self.num_gpu * self.gpu_milli / 1000


def _rows(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise InvalidInput(f"trace file {path}: missing column(s) {', '.join(missing)} (expected "
                                   f"{', '.join(columns)})", reasons=[{"file": str(path), "missing": missing}])
            return list(reader)
    except OSError as exc:
        raise InvalidInput(f"trace file {path}: cannot read: {exc.strerror}",
                           reasons=[{"file": str(path), "error": exc.strerror}]) from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InvalidInput(f"trace file {path}: not a CSV file: {exc}", reasons=[{"file": str(path)}]) from None


def _int(path: Path, line: int, column: str, text: str | None, low: int = 0) -> int:
    try:
        value = int(text or "")
    except ValueError:
        value = low - 1
    if value < low:
        raise InvalidInput(f"trace file {path}:{line}: column {column}: expected a whole number >= {low}, got "
                           f"{text!r}", reasons=[{"file": str(path), "line": line, "field": column, "value": text}])
    return value


def load_nodes(path: Path, limit: int | None = None, raw: bool = False) -> list[Node]:
    """The nodes of an openb node list (openb_node_list_gpu_node.csv) in file order (the first `limit` if given),
    with catalog models (raw: the trace's model names); InvalidInput naming line, column and value if bad."""
    nodes: list[Node] = []
    for i, row in enumerate(_rows(path, NODE_COLUMNS), start=2):
        model = row["model"]
        if model not in MODEL_MAP:
            raise InvalidInput(f"trace file {path}:{i}: node {row['sn']}: unknown GPU model {model!r} (known: "
                               f"{', '.join(MODEL_MAP)})", reasons=[{"file": str(path), "line": i, "field": "model",
                                                                     "value": model}])
        nodes.append(Node(row["sn"], _int(path, i, "cpu_milli", row["cpu_milli"]),
                          _int(path, i, "memory_mib", row["memory_mib"]), _int(path, i, "gpu", row["gpu"]),
                          model if raw else MODEL_MAP[model]))
        if limit is not None and len(nodes) >= limit:
            break
    return nodes


def load_tasks(path: Path) -> list[Task]:
    """The tasks of an openb pod list (openb_pod_list_*.csv) in file order; `gpu_spec` (models joined by '|')
    restricts a task to those models. InvalidInput naming line, column and value if bad."""
    tasks: list[Task] = []
    for i, row in enumerate(_rows(path, TASK_COLUMNS), start=2):
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(MODEL_MAP[m] for m in spec.split("|") if m in MODEL_MAP) if spec else None
        milli = _int(path, i, "gpu_milli", row["gpu_milli"])
        if milli > 1000:
            raise InvalidInput(f"trace file {path}:{i}: column gpu_milli: a GPU share is at most 1000, got {milli}",
                               reasons=[{"file": str(path), "line": i, "field": "gpu_milli", "value": milli}])
        tasks.append(Task(row["name"], _int(path, i, "cpu_milli", row["cpu_milli"]),
                          _int(path, i, "memory_mib", row["memory_mib"]), _int(path, i, "num_gpu", row["num_gpu"]),
                          milli, models))
    return tasks


def mode_of(catalog: Catalog, model: str, run_mode: str) -> Mode:
    """The mode a GPU of `model` runs in when a whole fleet is asked to run `run_mode`: models lacking the mode
    stay vgpu-equal."""
    spec = catalog.model(model)
    if run_mode == Mode.VGPU_MIXED and spec.mixed_size:
        return Mode.VGPU_MIXED
    if run_mode == Mode.MIG and spec.mig is not None:
        return Mode.MIG
    if run_mode == Mode.PASSTHROUGH and spec.passthrough:
        return Mode.PASSTHROUGH
    return Mode.VGPU_EQUAL


def profile_for(catalog: Catalog, geometry: Geometry, gpu_milli: int) -> str | None:
    """The smallest profile of `geometry` whose memory share (and MIG compute share) is >= gpu_milli / 1000
    (MIG GPUs: bare GPU instances, no media extensions; passthrough: the whole GPU)."""
    memory = catalog.model(geometry.model).memory_mib
    kind = {Mode.MIG: ProfileKind.MIG, Mode.PASSTHROUGH: ProfileKind.PASSTHROUGH}.get(geometry.mode, ProfileKind.VGPU)
    best: tuple[tuple[int, int, int, str], str] | None = None
    for shape in geometry.shapes.values():
        if shape.kind is not kind or shape.media:
            continue
        if shape.framebuffer_mib * 1000 < gpu_milli * memory:
            continue
        if geometry.compute_capacity is not None and shape.compute * 1000 < gpu_milli * geometry.compute_capacity:
            continue
        key = (shape.size, shape.compute, shape.framebuffer_mib, shape.profile)
        if best is None or key < best[0]:
            best = (key, shape.profile)
    return best[1] if best else None
