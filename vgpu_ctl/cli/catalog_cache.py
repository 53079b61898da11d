"""The catalog's profiles for `vgpuctl profiles list`, from a cache of the validated catalog: the flattened
profiles as JSON beside a digest of what they came from (every catalog file, and the catalog's loader and
schema), so that listing them parses and validates the files (importing PyYAML and pydantic) only after one
changed. The cache lives in $XDG_CACHE_HOME/vgpu-ctl (~/.cache/vgpu-ctl), made 0700 with the file 0600; when
it can't be read or written, the catalog is loaded as without it."""

from __future__ import annotations

import hashlib
from typing import Any

from vgpu_ctl.catalog import ProfileInfo, ProfileKind, load_catalog
from vgpu_ctl.catalog import loader as _loader
from vgpu_ctl.user_cache import read_json, write_json

CACHE_NAME = "catalog-profiles.json"
FORMAT = 2  # bumped when the cached form changes


def _digest() -> str | None:
    """The digest of the catalog files (each folder's *.yaml, as the loader reads them) and of the code that
    validates and flattens them; None when a catalog folder is missing (the loader reports it)."""
    h = hashlib.sha256(f"format {FORMAT}\n".encode())
    for code in ("loader.py", "schema.py"):
        h.update((_loader.DATA_DIR.parent / code).read_bytes())
    for d in _loader.catalog_dirs():
        if not d.is_dir():
            return None
        for f in sorted(d.glob("*.yaml")):
            h.update(f"\n{f}\n".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _to_plain(p: ProfileInfo) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else str(v) if k == "kind" else v for k, v in p.__dict__.items()}


def _from_plain(d: dict[str, Any]) -> ProfileInfo:
    tuples = {k: tuple(d[k]) for k in ("placements", "mixed_placement_ids") if d.get(k) is not None}
    return ProfileInfo(**{**d, **tuples, "kind": ProfileKind(d["kind"])})


def _read(digest: str) -> dict[str, list[ProfileInfo]] | None:
    try:
        models = read_json(CACHE_NAME, digest)
        return None if models is None else {model: [_from_plain(p) for p in ps] for model, ps in models.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _by_model() -> dict[str, list[ProfileInfo]]:
    """Every model's profiles, from the cache when it matches the catalog, else from the catalog (and cached)."""
    digest = _digest()
    if digest is not None:
        cached = _read(digest)
        if cached is not None:
            return cached
    catalog = load_catalog()
    by_model = {name: catalog.profiles(name) for name in catalog.models}
    if digest is not None:
        write_json(CACHE_NAME, digest, {m: [_to_plain(p) for p in ps] for m, ps in by_model.items()})
    return by_model


def listed_profiles(model: str | None = None) -> list[ProfileInfo]:
    """What `Catalog.profiles(model)` answers (every model's, by model name; or one model's, named in any case),
    without loading the catalog when the cache matches it. CatalogError naming the closest model when there is
    no such model."""
    by_model = _by_model()
    if model is None:
        return [p for name in sorted(by_model) for p in by_model[name]]
    found = model if model in by_model else next((n for n in by_model if n.lower() == model.lower()), None)
    if found is None:
        return load_catalog().profiles(model)  # raises the catalog's own error
    return list(by_model[found])
