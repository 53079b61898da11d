"""GPUs' measured loads in the store (`gpu_load`): the latest sample of each GPU."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime

from sqlalchemy import Integer, bindparam, delete, select

from vgpu_ctl.store.prepared import Prepared
from vgpu_ctl.store.tables import GPU, GPU_LOAD
from vgpu_ctl.store.unit import Tx


def known_gpus(tx: Tx, gpu_ids: Collection[int]) -> set[int]:
    """Which of `gpu_ids` are GPUs in the store."""
    return {int(r[0]) for r in tx.execute(select(GPU.c.id).where(GPU.c.id.in_(list(gpu_ids))))}


def put_loads(tx: Tx, loads: Mapping[int, float], at: datetime) -> None:
    """Make these loads (GPU id -> 0..1), sampled at `at`, the GPUs' latest."""
    tx.execute(delete(GPU_LOAD).where(GPU_LOAD.c.gpu_id.in_(list(loads))))
    tx.execute(GPU_LOAD.insert(), [{"gpu_id": g, "busy": b, "sampled_at": at} for g, b in loads.items()])


_POOL_LOADS = Prepared(select(GPU_LOAD.c.gpu_id, GPU_LOAD.c.busy).join(GPU, GPU.c.id == GPU_LOAD.c.gpu_id)
                       .where(GPU.c.pool_id == bindparam("pool_id", type_=Integer),
                              GPU_LOAD.c.sampled_at >= bindparam("since", type_=GPU_LOAD.c.sampled_at.type)))


def pool_loads(tx: Tx, pool_id: int, since: datetime) -> dict[int, float]:
    """The loads sampled since `since` of the pool's GPUs, by GPU id. A prepared statement, so that a claim reads
    them on its own connection, with its other reads, outside SQLAlchemy's transaction."""
    return {int(g): float(b) for g, b in _POOL_LOADS.rows(tx, {"pool_id": pool_id, "since": since})}
