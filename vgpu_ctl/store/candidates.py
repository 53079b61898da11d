"""A claim's GPU and device rows in the store: offers of a pool, the compare-and-set of a GPU's occupancy,
and the device rows a placement inserts or frees.

Every change of a GPU's occupancy is a compare-and-set on its `version`, so concurrent claims by several
processes can never take the same space. The statements a claim runs are `Prepared` (compiled once per
process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Integer, bindparam, select, update

from vgpu_ctl.store.prepared import Prepared, insert_all, sent_together
from vgpu_ctl.store.tables import DEVICE, GPU
from vgpu_ctl.store.unit import Tx

GPU_STATE_COLUMNS = ("layout", "free_units", "active_type", "device_count", "fits")
"""The GPU row's columns that mirror its occupancy."""


class GpuStateRow(NamedTuple):
    """What a GPU's occupancy is read from, and the version its compare-and-set checks."""

    model: str
    mode: str
    mig_layout: str
    layout: str
    pinned_type: str | None
    version: int


_OFFER = Prepared(select(GPU.c.id).where(GPU.c.pool_id == bindparam("pool_id", type_=Integer),
                                         GPU.c.model == bindparam("c_model"), GPU.c.mode == bindparam("c_mode"))
                  .limit(1))


def pools_have(tx: Tx, wanted: Sequence[tuple[int, str, str]]) -> list[bool]:
    """For each (pool id, model, mode): whether the pool holds a GPU of this model in this mode (indexed
    lookups, sent together: one round trip on PostgreSQL)."""
    with sent_together(tx):
        found = [_OFFER.run(tx, {"pool_id": p, "c_model": model, "c_mode": mode}) for p, model, mode in wanted]
    return [cur.fetchone() is not None for cur in found]


def unlacked(fits: Any) -> Any:
    """SQL: a fit mask less the bits of the profiles the GPU's host lacks type ids for (`gpu.lacks`), so that
    no candidate query offers the GPU for them."""
    return fits - fits.op("&")(GPU.c.lacks)


_WRITE_GPU = Prepared(update(GPU).where(GPU.c.id == bindparam("g_id", type_=Integer),
                                         GPU.c.version == bindparam("g_version", type_=Integer)).values(
    {**{name: bindparam(f"g_{name}", type_=GPU.c[name].type) for name in GPU_STATE_COLUMNS},
     "fits": unlacked(bindparam("g_fits", type_=BigInteger)), "version": GPU.c.version + 1}))


def write_gpu(tx: Tx, gpu_id: int, version: int, state: Mapping[str, Any]) -> bool:
    """Store a GPU's state columns (GPU_STATE_COLUMNS) if nobody changed it since `version`; whether it did."""
    return write_gpu_sent(tx, gpu_id, version, state)()


def write_gpu_sent(tx: Tx, gpu_id: int, version: int, state: Mapping[str, Any]) -> Callable[[], bool]:
    """`write_gpu` sent; its answer is read by the callable it returns (after `sent_together` ends)."""
    res = _WRITE_GPU.run(tx, {"g_id": gpu_id, "g_version": version, **{f"g_{k}": v for k, v in state.items()}})
    return lambda: bool(res.rowcount == 1)


def gpu_state_row(tx: Tx, gpu_id: int) -> GpuStateRow:
    """The GPU's occupancy columns and version."""
    return GpuStateRow(*tx.execute(select(GPU.c.model, GPU.c.mode, GPU.c.mig_layout, GPU.c.layout,
                                          GPU.c.pinned_type, GPU.c.version).where(GPU.c.id == gpu_id)).one())


_INSERT_DEVICE = insert_all(DEVICE)


def insert_devices(tx: Tx, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert device rows; the unique position and the overlap trigger guard them."""
    _INSERT_DEVICE.run_many(tx, rows)


def delete_devices(tx: Tx, device_ids: Sequence[str]) -> None:
    """Delete device rows."""
    tx.execute(DEVICE.delete().where(DEVICE.c.id.in_(list(device_ids))))


__all__ = ["GPU_STATE_COLUMNS", "GpuStateRow", "delete_devices", "gpu_state_row", "insert_devices", "pools_have",
           "unlacked", "write_gpu",
           "write_gpu_sent"]
