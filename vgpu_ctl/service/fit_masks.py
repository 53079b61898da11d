"""Keeping the GPUs' fit masks in step with the catalog they were computed from.

A fit mask (`core.geometry.fit_mask`) depends on the catalog's geometry: a new profile, or a changed one,
changes which GPUs could take it. The store records the fingerprint of the catalog the masks were computed
with; a controller opening the store with another catalog recomputes them first.
"""

from __future__ import annotations

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import FIT_BITS, fit_mask
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.allocation import GPU, occupancy_of
from vgpu_ctl.store.models import Meta

META: Table = Meta.__table__  # type: ignore[attr-defined]
CATALOG_KEY = "fit_masks_catalog"
MASK_SCHEME = 2  # how bits are assigned (core.geometry.profile_bit); a new scheme recomputes every mask
ALL_BITS = (1 << FIT_BITS) - 1  # a GPU the catalog can't describe stays a candidate; placement decides


def masks_key(catalog: Catalog) -> str:
    """What the store records beside its masks: the bit scheme and the catalog they were computed with."""
    return f"{MASK_SCHEME}:{catalog.fingerprint}"


def ensure_fit_masks(engine: Engine, catalog: Catalog, force: bool = False) -> int:
    """Recompute every GPU's fit mask if they were computed with another catalog (or `force`); how many
    masks changed."""
    if not force:
        with engine.connect() as conn:
            seen = conn.execute(select(META.c.value).where(META.c.key == CATALOG_KEY)).scalar()
        if seen == masks_key(catalog):
            return 0
    with engine.begin() as conn:
        rows = conn.execute(select(GPU.c.id, GPU.c.model, GPU.c.mode, GPU.c.mig_layout, GPU.c.layout,
                                   GPU.c.pinned_type, GPU.c.fits)).all()
        changes = []
        for r in rows:
            try:
                mask = fit_mask(occupancy_of(catalog, r._mapping))
            except (InvalidInput, KeyError):
                mask = ALL_BITS
            if mask != r.fits:
                changes.append({"g_id": r.id, "g_fits": mask})
        if changes:  # one batch: a catalog change on a large fleet touches many GPUs
            conn.execute(update(GPU).where(GPU.c.id == bindparam("g_id")).values(fits=bindparam("g_fits")),
                         changes)
        upsert = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(META)
        # An upsert: another controller opening the store at the same moment may write the row too.
        conn.execute(upsert.values(key=CATALOG_KEY, value=masks_key(catalog))
                     .on_conflict_do_update(index_elements=[META.c.key], set_={"value": masks_key(catalog)}))
    return len(changes)
