"""Operating the fleet: status, metrics, the doctor, backup and restore.

Functions here take a `Controller` and read the store through its engine; they never change allocations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vgpu_ctl.errors import PermissionDenied

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller


def require_admin(ctl: Controller, what: str) -> None:
    """PermissionDenied unless the controller acts as the admin."""
    if not ctl.principal.is_admin:
        raise PermissionDenied(f"{what} is an admin command; tenant {ctl.principal.tenant!r} may not run it")


__all__ = ["require_admin"]
