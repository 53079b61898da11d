"""Loading and querying the catalog: data files in the package plus the admin's own folders."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import CatalogError, did_you_mean

if TYPE_CHECKING:  # imported where a file is read: listing a cached catalog needs neither (vgpu_ctl/cli)
    from vgpu_ctl.catalog.schema import GpuModelSpec

DATA_DIR = Path(__file__).parent / "data"
CATALOG_PATH_ENV = "VGPU_CTL_CATALOG_PATH"


class ProfileKind(StrEnum):
    """What a profile is on the GPU."""

    VGPU = "vgpu"
    MIG = "mig"
    MIG_VGPU = "mig-vgpu"
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True)
class ProfileInfo:
    """One profile a model offers, flattened for listing and for the geometry engine."""

    name: str
    model: str
    kind: ProfileKind
    framebuffer_mib: int
    max_instances: int
    max_mixed: int | None = None
    compute_slices: int | None = None
    memory_slices: int | None = None
    placements: tuple[int, ...] | None = None
    mixed_placement_ids: tuple[int, ...] | None = None
    mixed_size: int | None = None
    size: int | None = None
    mig_profile: str | None = None
    profile_id: int | None = None
    confirmed: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form of the profile; keys with no value for this kind are left out."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            if value is None:
                continue
            out[key] = list(value) if isinstance(value, tuple) else str(value) if key == "kind" else value
        return out


def _line_of(loc: Sequence[int | str], data: Any) -> str:
    """Best-effort name of the entry a pydantic error location points at (e.g. `vgpu_types[3] (A100D-8C)`)."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, int) and isinstance(node, list) and key < len(node):
            node = node[key]
            name = node.get("name") if isinstance(node, dict) else None
            parts[-1] = f"{parts[-1]}[{key}]" + (f" ({name})" if name else "")
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return ".".join(parts)


def parse_model_file(path: Path) -> GpuModelSpec:
    """Read and validate one catalog file; a broken one raises CatalogError naming file, entry and field."""
    import yaml
    from pydantic import ValidationError

    from vgpu_ctl.catalog.schema import GpuModelSpec

    raw = path.read_text()
    try:
        data = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise CatalogError(f"catalog file {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"catalog file {path}: expected a mapping at the top, got {type(data).__name__}")
    try:
        return GpuModelSpec.model_validate(data)
    except ValidationError as exc:
        reasons = []
        for err in exc.errors():
            where = _line_of(err["loc"], data)
            reasons.append({"file": str(path), "field": where, "error": err["msg"],
                            "value": repr(err.get("input"))[:80]})
        first = reasons[0]
        raise CatalogError(
            f"catalog file {path}: model {data.get('model', '?')!r}: field {first['field']}: {first['error']}",
            reasons=reasons,
        ) from None


class Catalog:
    """The GPU models known to the controller, keyed by model name."""

    def __init__(self, models: Iterable[GpuModelSpec]) -> None:
        self.models: dict[str, GpuModelSpec] = {}
        for m in models:
            self.models[m.model] = m
        self._by_pci = {pid: m for m in self.models.values() for pid in m.pci_device_ids}
        self._profiles = {name: self._flatten(m) for name, m in self.models.items()}
        self._offering: dict[str, list[str]] = {}
        for name, ps in self._profiles.items():
            for p in ps:
                if name not in self._offering.setdefault(p.name, []):
                    self._offering[p.name].append(name)
        self._names = frozenset(self._offering)
        digest = hashlib.sha256()
        for name in sorted(self.models):
            digest.update(self.models[name].model_dump_json().encode())
        self.fingerprint = digest.hexdigest()  # changes whenever any model's data does

    def model(self, name: str) -> GpuModelSpec:
        """The model called `name` (in any case: `h100-80gb` is H100-80GB); CatalogError naming the closest and
        the known ones if absent."""
        found = self.models.get(name) or next((m for n, m in self.models.items() if n.lower() == name.lower()), None)
        if found is None:
            known = ", ".join(sorted(self.models))
            raise CatalogError(f"unknown GPU model {name!r}{did_you_mean(name, self.models)}; known models: {known}",
                               reasons=[{"field": "model", "value": name}])
        return found

    def by_pci_id(self, device_id: str) -> GpuModelSpec | None:
        """The model with this PCI device id (e.g. '0x20b5'), or None."""
        try:
            return self._by_pci.get(f"0x{int(device_id, 16):04x}")
        except ValueError:
            return None

    def profiles(self, model: str | None = None) -> list[ProfileInfo]:
        """Every profile of one model, or of all models."""
        if model is not None:
            return list(self._profiles[self.model(model).model])
        return [p for name in sorted(self._profiles) for p in self._profiles[name]]

    def profile(self, model: str, name: str) -> ProfileInfo | None:
        """The profile `name` of `model`, or None."""
        return next((p for p in self._profiles.get(model, ()) if p.name == name), None)

    def models_offering(self, profile: str) -> list[str]:
        """Names of the models that offer a profile called `profile`."""
        return list(self._offering.get(profile, ()))

    def profile_names(self) -> frozenset[str]:
        """Every profile name in the catalog."""
        return self._names

    @staticmethod
    def _flatten(m: GpuModelSpec) -> list[ProfileInfo]:
        out: list[ProfileInfo] = []
        for t in m.vgpu_types:
            out.append(ProfileInfo(
                name=t.name, model=m.model, kind=ProfileKind.VGPU, framebuffer_mib=t.framebuffer_mib,
                max_instances=t.max_equal, max_mixed=t.max_mixed if m.mixed_size else None,
                size=t.placement_size or t.framebuffer_mib // 1024,
                placements=tuple(i * (t.placement_size or t.framebuffer_mib // 1024) for i in range(t.max_equal)),
                mixed_placement_ids=tuple(t.placement_ids) if m.mixed_size and t.placement_ids else None,
                mixed_size=t.placement_size if m.mixed_size and t.placement_ids else None,
                confirmed=t.provenance.confirmed and m.provenance.confirmed,
                note=t.provenance.note or m.provenance.note,
            ))
        if m.mig is not None:
            gis = {p.name: p for p in m.mig.profiles}
            for p in m.mig.profiles:
                out.append(ProfileInfo(
                    name=p.name, model=m.model, kind=ProfileKind.MIG, framebuffer_mib=p.framebuffer_mib,
                    max_instances=p.max_instances, compute_slices=p.compute_slices,
                    memory_slices=p.memory_slices, placements=tuple(p.starts), size=p.memory_slices,
                    profile_id=p.profile_id,
                    confirmed=p.provenance.confirmed and m.mig.provenance.confirmed,
                    note=p.provenance.note or m.mig.provenance.note,
                ))
            for v in m.mig.vgpu_types:
                gi = gis[v.mig_profile]
                out.append(ProfileInfo(
                    name=v.name, model=m.model, kind=ProfileKind.MIG_VGPU, framebuffer_mib=v.framebuffer_mib,
                    max_instances=min(v.max_instances, gi.max_instances), compute_slices=gi.compute_slices,
                    memory_slices=gi.memory_slices, placements=tuple(gi.starts), size=gi.memory_slices,
                    mig_profile=gi.name, profile_id=gi.profile_id,
                    confirmed=v.provenance.confirmed and gi.provenance.confirmed and m.mig.provenance.confirmed,
                    note=v.provenance.note or gi.provenance.note or m.mig.provenance.note,
                ))
        if m.passthrough:
            out.append(ProfileInfo(
                name=m.model, model=m.model, kind=ProfileKind.PASSTHROUGH, framebuffer_mib=m.memory_mib,
                max_instances=1, placements=(0,), size=m.axis_gb,
                confirmed=m.provenance.confirmed, note=m.provenance.note,
            ))
        return out


def catalog_dirs() -> list[Path]:
    """The folders catalog files are read from: the package's data, then each folder in VGPU_CTL_CATALOG_PATH."""
    extra = [Path(p) for p in os.environ.get(CATALOG_PATH_ENV, "").split(os.pathsep) if p]
    return [DATA_DIR, *extra]


def load_catalog(extra_dirs: Sequence[Path] = ()) -> Catalog:
    """Load every catalog file; later folders may add models or replace a shipped one by its model name."""
    return _load(tuple(catalog_dirs()) + tuple(extra_dirs))


@lru_cache(maxsize=8)
def _load(dirs: tuple[Path, ...]) -> Catalog:
    models: list[GpuModelSpec] = []
    for d in dirs:
        if not d.is_dir():
            raise CatalogError(f"catalog folder {d} does not exist")
        models.extend(parse_model_file(f) for f in sorted(d.glob("*.yaml")))
    return Catalog(models)
