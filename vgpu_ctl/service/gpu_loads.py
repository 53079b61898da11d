"""What each GPU was last measured doing (`gpu_load`): written from NVML samples (service.utilization, by the
server's leader on an interval), read by the claim for pools whose policy weighs measured load (spread-load).
A load older than `MAX_AGE_S` is not used: a GPU no one measured lately counts as idle, as without samples."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.engine import Connection

from vgpu_ctl.core.policies.spread_load import check_loads
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.allocation import GPU
from vgpu_ctl.store.models import GpuLoad, utcnow

GPU_LOAD = GpuLoad.__table__  # type: ignore[attr-defined]
MAX_AGE_S = 600.0


def record(conn: Connection, loads: Mapping[int, float], at: datetime | None = None) -> int:
    """Keep these measured loads (store GPU id -> 0..1) as the GPUs' latest; how many. InvalidInput naming the
    GPU for a load outside 0..1 or an unknown GPU, nothing written."""
    try:
        checked = check_loads(loads)
    except ValueError as exc:
        raise InvalidInput(str(exc), reasons=[{"field": "load"}]) from None
    if not checked:
        return 0
    known = {r[0] for r in conn.execute(select(GPU.c.id).where(GPU.c.id.in_(list(checked))))}
    unknown = sorted(set(checked) - known)
    if unknown:
        raise InvalidInput(f"no GPU with id {unknown[0]} in the store", reasons=[{"field": "gpu", "value": unknown[0]}])
    when = at or utcnow()
    conn.execute(delete(GPU_LOAD).where(GPU_LOAD.c.gpu_id.in_(list(checked))))
    conn.execute(GPU_LOAD.insert(), [{"gpu_id": g, "busy": b, "sampled_at": when} for g, b in checked.items()])
    return len(checked)


def recent(conn: Connection, pool_id: int, max_age_s: float = MAX_AGE_S) -> dict[int, float]:
    """The loads measured in the last `max_age_s` seconds of the pool's GPUs."""
    since = utcnow() - timedelta(seconds=max_age_s)
    rows = conn.execute(select(GPU_LOAD.c.gpu_id, GPU_LOAD.c.busy).join(GPU, GPU.c.id == GPU_LOAD.c.gpu_id)
                        .where(GPU.c.pool_id == pool_id, GPU_LOAD.c.sampled_at >= since))
    return {int(g): float(b) for g, b in rows}
