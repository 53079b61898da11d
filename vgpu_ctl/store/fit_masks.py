"""GPUs' fit masks and the host summaries (`host_fit`) in the store: the catalog the masks were computed with, the
GPU columns a mask is computed from, and the summaries as stored and as the GPU rows give them
(service/fit_masks.py decides what changes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from vgpu_ctl.store.models import FitBit
from vgpu_ctl.store.tables import GPU, HOST_FIT, META
from vgpu_ctl.store.unit import Tx

FIT_BIT: Table = FitBit.__table__  # type: ignore[attr-defined]
SummaryKey = tuple[int, int, str, str, int]  # host_id, pool_id, model, mode, bitval


class MaskRow(NamedTuple):
    """A GPU's columns its fit mask is computed from, and the mask and lacked bits stored now."""

    id: int
    model: str
    mode: str
    mig_layout: str
    layout: str
    pinned_type: str | None
    fits: int
    lacks: int
    lacked_types: Any


def meta_value(tx: Tx, key: str) -> str | None:
    """The value stored under `key` in the store's meta table."""
    value = tx.execute(select(META.c.value).where(META.c.key == key)).scalar()
    return None if value is None else str(value)


def set_meta_value(tx: Tx, key: str, value: str) -> None:
    """Store `value` under `key` (an upsert: another controller opening the store at once may write it too)."""
    upsert = (pg_insert if tx.dialect.name == "postgresql" else sqlite_insert)(META)
    tx.execute(upsert.values(key=key, value=value).on_conflict_do_update(index_elements=[META.c.key],
                                                                          set_={"value": value}))


def mask_rows(tx: Tx) -> list[MaskRow]:
    """Every GPU as its mask is computed from."""
    return [MaskRow(*r) for r in tx.execute(select(*(GPU.c[n] for n in MaskRow._fields)))]


def set_masks(tx: Tx, changes: Sequence[tuple[int, int, int]]) -> None:
    """Set (GPU id, fit mask, lacked bits) of each GPU, in one batch."""
    if changes:
        tx.execute(update(GPU).where(GPU.c.id == bindparam("g_id")).values(fits=bindparam("g_fits"),
                                                                           lacks=bindparam("g_lacks")),
                   [{"g_id": g, "g_fits": fits, "g_lacks": lacks} for g, fits, lacks in changes])


def summaries_from_gpus(tx: Tx) -> dict[SummaryKey, tuple[int, int]]:
    """The host summaries (n_fit, free_units) that the GPU rows give now, by key; rows with n_fit 0 left out."""
    n_fit = func.count().label("n_fit")
    free = func.sum(GPU.c.free_units).label("free_units")
    q = (select(GPU.c.host_id, GPU.c.pool_id, GPU.c.model, GPU.c.mode, FIT_BIT.c.bitval, n_fit, free)
         .join(FIT_BIT, GPU.c.fits.op("&")(FIT_BIT.c.bitval) != 0).where(GPU.c.pool_id.is_not(None))
         .group_by(GPU.c.host_id, GPU.c.pool_id, GPU.c.model, GPU.c.mode, FIT_BIT.c.bitval))
    return {(r.host_id, r.pool_id, r.model, r.mode, r.bitval): (r.n_fit, int(r.free_units)) for r in tx.execute(q)}


def stored_summaries(tx: Tx) -> dict[SummaryKey, tuple[int, int]]:
    """The host summaries (n_fit, free_units) as stored, by key; rows with n_fit and free units 0 left out."""
    return {(r.host_id, r.pool_id, r.model, r.mode, r.bitval): (r.n_fit, int(r.free_units))
            for r in tx.execute(select(HOST_FIT)) if r.n_fit or r.free_units}


def replace_summaries(tx: Tx, rows: Mapping[SummaryKey, tuple[int, int]]) -> None:
    """Make `rows` every host summary there is."""
    tx.execute(HOST_FIT.delete())
    if rows:
        tx.execute(insert(HOST_FIT), [{"host_id": k[0], "pool_id": k[1], "model": k[2], "mode": k[3], "bitval": k[4],
                                       "n_fit": n, "free_units": free} for k, (n, free) in rows.items()])
