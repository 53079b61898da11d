"""The profile catalog: GPU models and the profiles each can offer, shipped as validated data files."""

from vgpu_ctl.catalog.loader import Catalog, ProfileInfo, ProfileKind, load_catalog

__all__ = ["Catalog", "ProfileInfo", "ProfileKind", "load_catalog"]
