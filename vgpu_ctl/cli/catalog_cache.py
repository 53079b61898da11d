"""The catalog's profiles for `vgpuctl profiles list`, from a cache of the validated catalog: the flattened
profiles as JSON beside a digest of what they came from (every catalog file, and the catalog's loader and
schema), so that listing them parses and validates the files (importing PyYAML and pydantic) only after one
changed. The cache lives in $XDG_CACHE_HOME/vgpu-ctl (~/.cache/vgpu-ctl), made 0700 with the file 0600; when
it can't be read or written, the catalog is loaded as without it."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from vgpu_ctl.catalog import ProfileInfo, ProfileKind, load_catalog
from vgpu_ctl.catalog import loader as _loader

CACHE_NAME = "catalog-profiles.json"
FORMAT = 1  # bumped when the cached form changes


def cache_dir() -> Path | None:
    """Where the cache is kept ($XDG_CACHE_HOME/vgpu-ctl, else ~/.cache/vgpu-ctl); None without a home."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (KeyError, RuntimeError):
            return None
    return Path(base) / "vgpu-ctl"


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


def _read(path: Path, digest: str) -> dict[str, list[ProfileInfo]] | None:
    try:
        data = json.loads(path.read_text())
        if data.get("digest") != digest:
            return None
        return {model: [_from_plain(p) for p in ps] for model, ps in data["models"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write(folder: Path, digest: str, by_model: dict[str, list[ProfileInfo]]) -> None:
    """Replace the cache file at once (a temporary file renamed), so a reader never sees half of one."""
    import tempfile  # only when the cache is written

    with suppress(OSError):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".catalog-", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"digest": digest, "models": {m: [_to_plain(p) for p in ps] for m, ps in by_model.items()}},
                          out)
            os.replace(tmp, folder / CACHE_NAME)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)


def _by_model() -> dict[str, list[ProfileInfo]]:
    """Every model's profiles, from the cache when it matches the catalog, else from the catalog (and cached)."""
    digest, folder = _digest(), cache_dir()
    if digest is not None and folder is not None:
        cached = _read(folder / CACHE_NAME, digest)
        if cached is not None:
            return cached
    catalog = load_catalog()
    by_model = {name: catalog.profiles(name) for name in catalog.models}
    if digest is not None and folder is not None:
        _write(folder, digest, by_model)
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
