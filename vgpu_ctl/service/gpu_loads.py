"""What each GPU was last measured doing (`gpu_load`): written from NVML samples (service.utilization, by the
server's leader on an interval), read by the claim for pools whose policy weighs measured load (spread-load).
A load older than `MAX_AGE_S` is not used: a GPU no one measured lately counts as idle, as without samples."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from vgpu_ctl.core.policies.spread_load import check_loads
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.ports import STORE, Tx, utcnow

MAX_AGE_S = 600.0


def record(conn: Tx, loads: Mapping[int, float], at: datetime | None = None) -> int:
    """Keep these measured loads (store GPU id -> 0..1) as the GPUs' latest; how many. InvalidInput naming the
    GPU for a load outside 0..1 or an unknown GPU, nothing written."""
    try:
        checked = check_loads(loads)
    except ValueError as exc:
        raise InvalidInput(str(exc), reasons=[{"field": "load"}]) from None
    if not checked:
        return 0
    known = STORE.gpu_loads.known_gpus(conn, checked)
    unknown = sorted(set(checked) - known)
    if unknown:
        raise InvalidInput(f"no GPU with id {unknown[0]} in the store", reasons=[{"field": "gpu", "value": unknown[0]}])
    STORE.gpu_loads.put_loads(conn, checked, at or utcnow())
    return len(checked)


def recent(conn: Tx, pool_id: int, max_age_s: float = MAX_AGE_S) -> dict[int, float]:
    """The loads measured in the last `max_age_s` seconds of the pool's GPUs."""
    return STORE.gpu_loads.pool_loads(conn, pool_id, utcnow() - timedelta(seconds=max_age_s))
