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
    # The GPUs grouped by their fit mask in SQL, each mask split into its bits here: joining every GPU with the
    # 63 rows of fit_bit in SQL took 0.9 s at 100k GPUs, this 0.3 s (a fleet has few distinct masks).
    known = 0  # the bits fit_bit holds: a mask's other bits (none, or a sign) count for nothing, as in the join
    for b in tx.execute(select(FIT_BIT.c.bitval)).scalars():
        known |= int(b)
    cols = (GPU.c.host_id, GPU.c.pool_id, GPU.c.model, GPU.c.mode, GPU.c.fits)
    q = select(*cols, func.count(), func.sum(GPU.c.free_units)).where(GPU.c.pool_id.is_not(None)).group_by(*cols)
    bits_of: dict[int, list[int]] = {}
    out: dict[SummaryKey, tuple[int, int]] = {}
    for host, pool, model, mode, fits, n, free in tx.execute(q).all():
        bits = bits_of.get(fits)
        if bits is None:
            bits = bits_of[fits] = _bits(int(fits) & known)
        for b in bits:
            key = (host, pool, model, mode, b)
            had = out.get(key, (0, 0))
            out[key] = (had[0] + n, had[1] + int(free))
    return out


def _bits(mask: int) -> list[int]:
    """The value of each bit set in `mask` (not negative), lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out


def stored_summaries(tx: Tx) -> dict[SummaryKey, tuple[int, int]]:
    """The host summaries (n_fit, free_units) as stored, by key; rows with n_fit and free units 0 left out."""
    cols = HOST_FIT.c
    q = select(cols.host_id, cols.pool_id, cols.model, cols.mode, cols.bitval, cols.n_fit, cols.free_units)
    return {(h, p, model, mode, b): (n, int(free)) for h, p, model, mode, b, n, free in tx.execute(q).all()
            if n or free}


def replace_summaries(tx: Tx, rows: Mapping[SummaryKey, tuple[int, int]]) -> None:
    """Make `rows` every host summary there is."""
    tx.execute(HOST_FIT.delete())
    if rows:
        tx.execute(insert(HOST_FIT), [{"host_id": k[0], "pool_id": k[1], "model": k[2], "mode": k[3], "bitval": k[4],
                                       "n_fit": n, "free_units": free} for k, (n, free) in rows.items()])
