"""Keeping the GPUs' fit masks in step with the catalog they were computed from.

A fit mask (`core.geometry.fit_mask`) depends on the catalog's geometry: a new profile, or a changed one,
changes which GPUs could take it. The store records the fingerprint of the catalog the masks were computed
with; a controller opening the store with another catalog recomputes them first. A GPU's mask never has the
bits of the profiles its host lacks type ids for (`gpu.lacks`, from `gpu.lacked_types`; see service.host_types).

The host summaries (`host_fit`, migration 0009) add up the masks per host, pool, model, mode and bit. Triggers
on `gpu` keep them in each write's transaction; `vgpuctl init` recomputes them with the masks
(`rebuild_summaries`) and doctor compares them with the GPU rows (`summary_drift`).
"""

from __future__ import annotations

from collections.abc import Iterable

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import FIT_BITS, Geometry, fit_mask, geometry_for, profile_bit
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.engine import READS
from vgpu_ctl.store.fit_masks import SummaryKey
from vgpu_ctl.store.unit import StoreEngine

CATALOG_KEY = "fit_masks_catalog"
MASK_SCHEME = 2  # how bits are assigned (core.geometry.profile_bit); a new scheme recomputes every mask
ALL_BITS = (1 << FIT_BITS) - 1  # a GPU the catalog can't describe stays a candidate; placement decides


def masks_key(catalog: Catalog) -> str:
    """What the store records beside its masks: the bit scheme and the catalog they were computed with."""
    return f"{MASK_SCHEME}:{catalog.fingerprint}"


def ensure_fit_masks(engine: StoreEngine, catalog: Catalog, force: bool = False) -> int:
    """Recompute every GPU's fit mask if they were computed with another catalog (or `force`, which also
    recomputes the host summaries); how many masks changed."""
    if not force:
        with engine.connect().execution_options(**{READS: True}) as tx:  # a read: on SQLite it holds no lock
            seen = STORE.fit_masks.meta_value(tx, CATALOG_KEY)
        if seen == masks_key(catalog):
            return 0
    with engine.begin() as tx:
        changes = []
        for r in STORE.fit_masks.mask_rows(tx):
            try:
                lacks = lacks_bits(catalog, r.model, r.mode, r.lacked_types or ())
                mask = fit_mask(occupancy_of(catalog, r._asdict())) & ~lacks
            except (InvalidInput, KeyError):
                lacks, mask = r.lacks, ALL_BITS
            if mask != r.fits or lacks != r.lacks:
                changes.append((r.id, mask, lacks))
        STORE.fit_masks.set_masks(tx, changes)  # one batch: a catalog change on a large fleet touches many GPUs
        if force:
            rebuild_summaries(tx)
        STORE.fit_masks.set_meta_value(tx, CATALOG_KEY, masks_key(catalog))
    return len(changes)


def lacks_bits(catalog: Catalog, model: str, mode: str, profiles: Iterable[str]) -> int:
    """The fit-mask bits of `profiles` on a GPU of this model and mode (`gpu.lacks` for the profiles its host
    has no type id for; bits depend on the catalog, so they are recomputed with the masks). A bit another
    profile of the geometry shares (past FIT_BITS profiles) is left in: a mask only ever over-approximates."""
    return lacked_bits(geometry_for(catalog, model, mode), profiles)


def lacked_bits(geom: Geometry, profiles: Iterable[str]) -> int:
    """`lacks_bits` for a geometry at hand (the in-memory allocator's GPU views hold theirs)."""
    lacked = set(profiles)
    bits = others = 0
    for name in geom.shapes:
        if name in lacked:
            bits |= profile_bit(geom, name)
        else:
            others |= profile_bit(geom, name)
    return bits & ~others


def summary_drift(conn: Tx) -> list[tuple[SummaryKey, tuple[int, int] | None, tuple[int, int] | None]]:
    """Where `host_fit` differs from what the GPU rows give: (key, stored, expected) per differing row, None
    for a row missing on that side (stored rows with n_fit and free units 0 count as missing)."""
    want = STORE.fit_masks.summaries_from_gpus(conn)
    have = STORE.fit_masks.stored_summaries(conn)
    return [(k, have.get(k), want.get(k)) for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]


def rebuild_summaries(conn: Tx) -> int:
    """Recompute every host summary from the GPU rows (in the caller's transaction); how many rows differed."""
    drift = summary_drift(conn)
    if drift:
        STORE.fit_masks.replace_summaries(conn, STORE.fit_masks.summaries_from_gpus(conn))
    return len(drift)
