"""The audit trail in the store: one `event` row per change, written inside the change's own transaction."""

from __future__ import annotations

from typing import Any

from vgpu_ctl.store.models import utcnow
from vgpu_ctl.store.prepared import insert_all
from vgpu_ctl.store.tables import EVENT
from vgpu_ctl.store.unit import Tx

_INSERT_EVENT = insert_all(EVENT)


def add_event(tx: Tx, actor: str, action: str, target: str, tenant: str | None, params: dict[str, Any],
              result: str, error: str | None) -> None:
    """Write one audit event, stamped now."""
    _INSERT_EVENT.run(tx, {"time": utcnow(), "actor": actor, "tenant": tenant, "action": action,
                           "target": target, "params": params, "result": result, "error": error})
