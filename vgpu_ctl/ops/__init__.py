"""Operating the fleet: status, metrics, the doctor, backup and restore.

Functions here take a `Controller` and read the store through its engine; they never change allocations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller


def require_admin(ctl: Controller, what: str) -> None:
    """PermissionDenied unless the controller acts as the admin."""
    ctl.principal.require_admin(what)


def require_reader(ctl: Controller, what: str) -> None:
    """PermissionDenied unless the controller acts as the admin or a reader (dashboards, metrics)."""
    ctl.principal.require_reader(what)


__all__ = ["require_admin", "require_reader"]
