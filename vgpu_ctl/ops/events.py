"""Reading the audit trail: time filters and tenant scoping."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import InvalidInput, NotFound
from vgpu_ctl.inventory import MAX_EVENTS, check_int

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*\Z", re.IGNORECASE)
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An aware UTC time from ISO 8601 (naive = UTC) or a span back from now: `90s`, `30m`, `1h`, `2d`."""
    now = now or datetime.now(UTC)
    m = _RELATIVE.match(text)
    if m:
        return now - timedelta(**{_UNITS[m.group(2).lower()]: float(m.group(1))})
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(f"--since {text!r} is neither an ISO time (2025-01-31T12:00) nor a span like "
                           "30m, 1h, 2d", reasons=[{"field": "since", "value": text}]) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def list_events(ctl: Controller, tenant: str | None = None, since: str | datetime | None = None,
                limit: int = 1000) -> list[dict[str, Any]]:
    """Audit events, oldest first. A tenant caller sees only its own; naming another tenant is NotFound."""
    me = ctl.principal.tenant
    if me is not None and tenant not in (None, me):
        raise NotFound(f"tenant {tenant!r} not found", reasons=[{"field": "tenant", "value": tenant}])
    when = parse_since(since) if isinstance(since, str) else since
    check_int("limit", limit, 1, MAX_EVENTS)
    return ctl.events(tenant=tenant, since=when, limit=limit)
