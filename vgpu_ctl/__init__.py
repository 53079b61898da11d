"""vgpu-ctl: pools of virtual GPUs on KVM hosts, handed to tenants' VMs under quotas.

The public API: `Controller` and the types it takes and returns, and the errors it raises.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from vgpu_ctl.catalog import Catalog, ProfileInfo, ProfileKind, load_catalog
from vgpu_ctl.core.geometry import Mode
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
from vgpu_ctl.service.controller import Controller
from vgpu_ctl.service.requests import DeviceInfo, PlacedDevice, Placement, VgpuRequest, VmInfo

try:
    __version__ = _version("vgpu-ctl")
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Catalog",
    "CatalogError",
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
