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

from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import FIT_BITS, Geometry, fit_mask, geometry_for, profile_bit
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.allocation import GPU, HOST_FIT, occupancy_of
from vgpu_ctl.store.models import FitBit, Meta

META: Table = Meta.__table__  # type: ignore[attr-defined]
CATALOG_KEY = "fit_masks_catalog"
MASK_SCHEME = 2  # how bits are assigned (core.geometry.profile_bit); a new scheme recomputes every mask
ALL_BITS = (1 << FIT_BITS) - 1  # a GPU the catalog can't describe stays a candidate; placement decides


def masks_key(catalog: Catalog) -> str:
    """What the store records beside its masks: the bit scheme and the catalog they were computed with."""
    return f"{MASK_SCHEME}:{catalog.fingerprint}"


def ensure_fit_masks(engine: Engine, catalog: Catalog, force: bool = False) -> int:
    """Recompute every GPU's fit mask if they were computed with another catalog (or `force`, which also
    recomputes the host summaries); how many masks changed."""
    if not force:
        with engine.connect() as conn:
            seen = conn.execute(select(META.c.value).where(META.c.key == CATALOG_KEY)).scalar()
        if seen == masks_key(catalog):
            return 0
    with engine.begin() as conn:
        rows = conn.execute(select(GPU.c.id, GPU.c.model, GPU.c.mode, GPU.c.mig_layout, GPU.c.layout,
                                   GPU.c.pinned_type, GPU.c.fits, GPU.c.lacks, GPU.c.lacked_types)).all()
        changes = []
        for r in rows:
            try:
                lacks = lacks_bits(catalog, r.model, r.mode, r.lacked_types or ())
                mask = fit_mask(occupancy_of(catalog, r._mapping)) & ~lacks
            except (InvalidInput, KeyError):
                lacks, mask = r.lacks, ALL_BITS
            if mask != r.fits or lacks != r.lacks:
                changes.append({"g_id": r.id, "g_fits": mask, "g_lacks": lacks})
        if changes:  # one batch: a catalog change on a large fleet touches many GPUs
            conn.execute(update(GPU).where(GPU.c.id == bindparam("g_id"))
                         .values(fits=bindparam("g_fits"), lacks=bindparam("g_lacks")), changes)
        if force:
            rebuild_summaries(conn)
        upsert = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(META)
        # An upsert: another controller opening the store at the same moment may write the row too.
        conn.execute(upsert.values(key=CATALOG_KEY, value=masks_key(catalog))
                     .on_conflict_do_update(index_elements=[META.c.key], set_={"value": masks_key(catalog)}))
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


FIT_BIT: Table = FitBit.__table__  # type: ignore[attr-defined]
SummaryKey = tuple[int, int, str, str, int]  # host_id, pool_id, model, mode, bitval


def _summaries_from_gpus(conn: Connection) -> dict[SummaryKey, tuple[int, int]]:
    """The host summaries (n_fit, free_units) that the GPU rows give now, by key; rows with n_fit 0 left out."""
    n_fit = func.count().label("n_fit")
    free = func.sum(GPU.c.free_units).label("free_units")
    q = (select(GPU.c.host_id, GPU.c.pool_id, GPU.c.model, GPU.c.mode, FIT_BIT.c.bitval, n_fit, free)
         .join(FIT_BIT, GPU.c.fits.op("&")(FIT_BIT.c.bitval) != 0).where(GPU.c.pool_id.is_not(None))
         .group_by(GPU.c.host_id, GPU.c.pool_id, GPU.c.model, GPU.c.mode, FIT_BIT.c.bitval))
    return {(r.host_id, r.pool_id, r.model, r.mode, r.bitval): (r.n_fit, int(r.free_units)) for r in conn.execute(q)}


def summary_drift(conn: Connection) -> list[tuple[SummaryKey, tuple[int, int] | None, tuple[int, int] | None]]:
    """Where `host_fit` differs from what the GPU rows give: (key, stored, expected) per differing row, None
    for a row missing on that side (stored rows with n_fit and free units 0 count as missing)."""
    want = _summaries_from_gpus(conn)
    have = {(r.host_id, r.pool_id, r.model, r.mode, r.bitval): (r.n_fit, int(r.free_units))
            for r in conn.execute(select(HOST_FIT)) if r.n_fit or r.free_units}
    return [(k, have.get(k), want.get(k)) for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]


def rebuild_summaries(conn: Connection) -> int:
    """Recompute every host summary from the GPU rows (in the caller's transaction); how many rows differed."""
    drift = summary_drift(conn)
    if drift:
        conn.execute(HOST_FIT.delete())
        rows = [{"host_id": k[0], "pool_id": k[1], "model": k[2], "mode": k[3], "bitval": k[4], "n_fit": n,
                 "free_units": free} for k, (n, free) in _summaries_from_gpus(conn).items()]
        if rows:
            conn.execute(insert(HOST_FIT), rows)
    return len(drift)
