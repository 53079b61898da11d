"""vgpu-ctl: pools of virtual GPUs on KVM hosts, handed to tenants' VMs under quotas.

The public API: `Controller` (on the store) and `Client` (on a `vgpuctl serve` server, over HTTP), which
satisfy one protocol (`vgpu_ctl.api.VgpuApi`), the types they take and return, and the errors they raise.

Only the errors are imported with the package; every other name is imported on first use (a module
`__getattr__`), so `import vgpu_ctl` and the `vgpuctl` CLI start without loading the controller, SQLAlchemy,
pydantic, libvirt or jinja2.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import (
    CatalogError,
    Conflict,
    HostError,
    InvalidInput,
    InventoryError,
    NoCapacity,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Refused,
    VgpuCtlError,
)

if TYPE_CHECKING:
    from vgpu_ctl.catalog import Catalog, ProfileInfo, ProfileKind, load_catalog
    from vgpu_ctl.client import Client
    from vgpu_ctl.core.geometry import Mode
    from vgpu_ctl.service.controller import Controller
    from vgpu_ctl.service.requests import DeviceInfo, PlacedDevice, Placement, VgpuRequest, VmInfo

    __version__: str

# name -> the module that defines it, imported when the name is first asked for
_LAZY = {
    "Catalog": "vgpu_ctl.catalog",
    "Client": "vgpu_ctl.client",
    "ProfileInfo": "vgpu_ctl.catalog",
    "ProfileKind": "vgpu_ctl.catalog",
    "load_catalog": "vgpu_ctl.catalog",
    "Mode": "vgpu_ctl.core.geometry",
    "Controller": "vgpu_ctl.service.controller",
    "DeviceInfo": "vgpu_ctl.service.requests",
    "PlacedDevice": "vgpu_ctl.service.requests",
    "Placement": "vgpu_ctl.service.requests",
    "VgpuRequest": "vgpu_ctl.service.requests",
    "VmInfo": "vgpu_ctl.service.requests",
}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vgpu-ctl")
    except PackageNotFoundError:  # a checkout on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """Import a public name on first use (and keep it in the module, so the next use is a plain lookup)."""
    if name == "__version__":
        value: Any = _package_version()
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted({*globals(), *_LAZY, "__version__"})


__all__ = [
    "Catalog",
    "CatalogError",
    "Client",
    "Conflict",
    "Controller",
    "DeviceInfo",
    "HostError",
    "InvalidInput",
    "InventoryError",
    "Mode",
    "NoCapacity",
    "NotFound",
    "PermissionDenied",
    "PlacedDevice",
    "Placement",
    "ProfileInfo",
    "ProfileKind",
    "QuotaExceeded",
    "Refused",
    "VgpuCtlError",
    "VgpuRequest",
    "VmInfo",
    "__version__",
    "load_catalog",
]
